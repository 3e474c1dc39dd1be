"""The applications behind the ``datapath`` command: GNN training (one loop for one or many GPUs), the
multi-process launcher, the shared dataset copy, and machine facts.

    from datapath.apps import TrainConfig, run_training
    run_training(TrainConfig(dataset="products", epochs=2))          # what `datapath train-gnn` runs

`train_epoch` / `evaluate` are the building blocks for a training loop of your own over a
`datapath.loaders.NeighborLoader`.
"""
from datapath._runtime.cuda_sched import use_blocking_sync
from datapath._runtime.device import cuda_available, device_label, machine_info, require_cuda
from datapath.apps.errors import CudaAutogradUnavailableError, DistributedError
from datapath.apps.launch import (
    DistContext, all_gather_objects, exit_if_stopped, in_launched_job, init_distributed, launch, new_prefix,
    shutdown_distributed, stop_requested,
)
from datapath.apps.shared_data import (
    SharedDataset, attach_dataset, memory_footprint, segment_bytes, share_dataset, shared_dataset,
)
from datapath.apps.train_gnn import TrainConfig, global_mean_loss, make_optimizer, run_training, train, wrap_ddp
from datapath.apps.training import EpochStats, check_cuda_autograd, evaluate, profile_batches, train_epoch

__all__ = [
    "CudaAutogradUnavailableError", "DistContext", "DistributedError", "EpochStats", "SharedDataset", "TrainConfig",
    "all_gather_objects", "attach_dataset", "check_cuda_autograd", "cuda_available", "device_label", "evaluate", "exit_if_stopped",
    "global_mean_loss",
    "in_launched_job", "init_distributed", "launch", "machine_info", "make_optimizer", "memory_footprint",
    "new_prefix", "profile_batches", "require_cuda", "run_training", "segment_bytes", "share_dataset", "shared_dataset",
    "shutdown_distributed", "stop_requested", "train", "train_epoch", "use_blocking_sync", "wrap_ddp",
]
