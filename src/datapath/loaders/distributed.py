"""`DistributedNeighborLoader`: one rank's part of every global batch of a data-parallel job.

How the seeds are split: ``batch_size`` is the **per-rank** batch (as in PyTorch's
DistributedSampler and the DGL/PyG multi-GPU examples): every step the ranks shuffle
the seeds identically, cut the same global batch of ``world_size * batch_size`` seeds,
and rank ``r`` takes part ``r`` of it.  Step ``i`` draws the random stream of global
batch ``i``, so a run on N ranks with per-rank batch ``b`` trains on exactly the
batches of a one-process `NeighborLoader` with batch ``N * b``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from datapath._deprecated import forward
from datapath.graph import Graph
from datapath.loaders.batch import Batch
from datapath.loaders.errors import LoaderError
from datapath.loaders.loader import NeighborLoader, Table
from datapath.sampling import NeighborSampler


@dataclass
class RankBatch(Batch):
    """A `Batch` holding one rank's part of global batch number ``step`` (``global_batch_size`` seeds in all)."""

    step: int = 0
    global_batch_size: int = 0


class DistributedNeighborLoader(NeighborLoader):
    """This rank's part of every global batch: same batches, same random streams as one big loader.

    Args (beyond `NeighborLoader`'s):
        batch_size: seeds per rank per step; the global batch is ``world_size * batch_size``.
        rank, world_size: this process's place in the job.
        max_steps: steps per epoch at most.  Every rank makes exactly these steps (its producer
            thread prepares no batch beyond them), which a collective feature store needs
            (`datapath.features.sharded_store`: every rank's gathers pair up in its exchange);
            stopping a loop early (``break``) would leave a rank's prefetched exchanges unpaired.

    Over a collective store the exchange of batch ``k + prefetch`` is submitted when the loop asks
    for batch ``k`` (the iterator waits for it), and no exchange is submitted while the loop runs a
    step: the loop's own collectives (DDP's all-reduce) and the exchanges come in the same order on
    every rank, which NCCL needs of two communicators (`datapath.loaders.collective_order`).  A loop may issue
    collectives anywhere between two requests for a batch.

    Every rank shuffles all seeds with the same generator (``seed``, epoch), cuts
    global batch ``i`` as a one-process loader with batch ``world_size * batch_size``
    would, and takes the ``rank``-th of its ``world_size`` near-equal parts; the
    sampler draws from the stream of step ``i`` (so a node's sampled neighbours do
    not depend on how the batch was split).  Every rank makes the same number of
    steps: a last global batch with fewer than ``world_size`` seeds is dropped.
    """

    def __init__(self, graph: Graph, seeds: torch.Tensor, sampler: NeighborSampler | list[int],
                 batch_size: int = 1024, shuffle: bool = False, drop_last: bool = False, *, rank: int,
                 world_size: int, features: Table | None = None, labels: Table | None = None,
                 device: str | torch.device | None = None, seed: int = 0, prefetch: int = 1,
                 prepare: Any = None, max_steps: int | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise LoaderError(f"rank {rank} must lie in [0, world_size={world_size})")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise LoaderError(f"max_steps must be an integer >= 1 (or None for whole epochs), got {max_steps!r}")
        super().__init__(graph, seeds, sampler, batch_size * world_size, shuffle, drop_last, features=features,
                         labels=labels, device=device, seed=seed, prefetch=prefetch, prepare=prepare)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.rank_batch_size = int(batch_size)
        self.max_steps = max_steps

    def _global_batches(self) -> int:
        return NeighborLoader.__len__(self)

    def global_batch_size(self, i: int) -> int:
        """Seeds in global batch ``i`` (all ranks together)."""
        n = self.seeds.numel()
        return max(0, min(self.batch_size, n - i * self.batch_size))

    def __len__(self) -> int:
        g = self._global_batches()
        if g and self.global_batch_size(g - 1) < self.world_size:
            g -= 1
        return g if self.max_steps is None else min(g, self.max_steps)

    def rank_batch(self, i: int) -> tuple[int, int]:
        """(offset, count) of this rank's part within global batch ``i``."""
        size = self.global_batch_size(i)
        base, extra = divmod(size, self.world_size)
        off = self.rank * base + min(self.rank, extra)
        return off, base + (self.rank < extra)

    def seeds_in(self, num_batches: int) -> int:
        """Seeds this rank trains on in the first ``num_batches`` steps of an epoch."""
        return sum(self.rank_batch(i)[1] for i in range(min(num_batches, len(self))))

    def _collect(self, st: Any, gather_stream: torch.cuda.Stream | None, schedule: Any = None,
                 defer: bool = False) -> "RankBatch":
        # every path that makes a batch (prefetch 0, the threads, the pipelined GPU producer) goes through here
        b = super()._collect(st, gather_stream, schedule, defer)
        fields = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
        step = st.step
        return RankBatch(**fields, step=step, global_batch_size=self.global_batch_size(step % self._global_batches()))

    def __iter__(self) -> Iterator[Batch]:
        epoch = self.epoch
        self.epoch += 1
        order = self.seeds
        if self.shuffle:  # the same permutation as NeighborLoader's, on every rank
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = self.seeds[torch.randperm(self.seeds.numel(), generator=gen)]
        g = self._global_batches()
        work = []
        for i in range(len(self)):
            off, cnt = self.rank_batch(i)
            start = i * self.batch_size + off
            work.append((order[start:start + cnt], epoch * g + i))
        self._capture_graphs([b.numel() for b, _ in work])
        if self.prefetch == 0:
            return (self._make(b, s) for b, s in work)
        return self._prefetched(work)


__getattr__ = forward(__name__)  # the training job moved to datapath.apps; old paths for one more release
