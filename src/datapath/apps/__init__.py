"""The applications behind the ``datapath`` command: GNN training (one loop for one or many GPUs), the
multi-process launcher, the shared dataset copy, and machine facts.

    from datapath.apps import TrainConfig, run_training
    run_training(TrainConfig(dataset="products", epochs=2))          # what `datapath train-gnn` runs

`train_epoch` / `evaluate` are the building blocks for a training loop of your own over a
`datapath.loaders.NeighborLoader`; `launch` / `init_distributed` start one process per GPU;
`shared_dataset` holds one copy of a dataset in shared memory for every rank.

The rest lives in documented submodules, imported from there: `training` (EpochStats,
profile_batches, check_cuda_autograd), `train_gnn` (wrap_ddp, make_optimizer, global_mean_loss),
`launch` (DistContext, shutdown_distributed, all_gather_objects, stop_requested, ...),
`shared_data` (SharedDataset, share_dataset, attach_dataset, memory_footprint), `machine`
(cuda_available, device_label, require_cuda, use_blocking_sync, machine_info), `errors`.
"""
from datapath._deprecated import forward
from datapath.apps.errors import DistributedError
from datapath.apps.launch import init_distributed, launch
from datapath.apps.machine import machine_info
from datapath.apps.shared_data import shared_dataset
from datapath.apps.train_gnn import TrainConfig, run_training, train
from datapath.apps.training import evaluate, train_epoch

__all__ = [
    "DistributedError", "TrainConfig", "evaluate", "init_distributed", "launch", "machine_info", "run_training",
    "shared_dataset", "train", "train_epoch",
]

__getattr__ = forward(__name__)  # the wider face of 0.1: names from their submodules, one more release
