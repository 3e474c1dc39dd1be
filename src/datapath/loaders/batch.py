"""`Batch`: one mini-batch of a loader (blocks, features, labels) and its pending GPU work."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from datapath.loaders.errors import LoaderError
from datapath.sampling import Block


@dataclass
class Batch:
    """One mini-batch.

    Attributes:
        blocks: one `Block` per layer, input layer first, on the loader's device.
        x: (blocks[0].num_src_nodes, F) input features, or None without ``features``.
        y: (B,) labels of the seeds, or None without ``labels``.
        seeds: (B,) int64 global ids of the seed nodes (``blocks[-1].dst_nodes``).
        producer_cpu_s / producer_gpu_wait_s: CPU time of the thread that made the batch while making it,
            and the part of its wall time it slept waiting for the GPU (host synchronisations); the rest
            of ``sample_s + gather_s`` it waited for the interpreter lock.
        sample_s / gather_s: wall seconds the producer spent sampling, and gathering plus the loader's
            ``prepare`` hook.  In the prefetching threads of the GPU path the gather is only launched (it
            runs on its own stream while the producer goes on), so ``gather_s`` is mostly ``prepare``.
    """

    blocks: list[Block]
    x: torch.Tensor | None
    y: torch.Tensor | None
    seeds: torch.Tensor
    sample_s: float = 0.0
    gather_s: float = 0.0
    producer_cpu_s: float = 0.0
    producer_gpu_wait_s: float = 0.0
    _events: list[torch.cuda.Event] = field(default_factory=list, repr=False)
    _check: "GatherCheck | None" = field(default=None, repr=False)
    _sampled: torch.cuda.Event | None = field(default=None, repr=False)
    _prepared: list[torch.Tensor] = field(default_factory=list, repr=False)
    _pending: Any = field(default=None, repr=False)  # a collective store's gather still to finish (`PendingGather`)
    _inputs: torch.cuda.Event | None = field(default=None, repr=False)  # x and y complete (after an exchange)

    def tensors(self) -> list[torch.Tensor]:
        out = [t for b in self.blocks for t in b.tensors()] + [self.seeds] + self._prepared
        return out + [t for t in (self.x, self.y) if t is not None]

    def wait_for_inputs(self) -> None:
        """Make the current CUDA stream wait until ``x`` and ``y`` are gathered.

        Only needed inside a loader's ``prepare`` hook that launches GPU work reading ``x`` or
        ``y``: in the prefetching threads they are gathered on a stream of their own, concurrently
        with the hook (the consumer's stream waits for everything before it gets the batch).
        """
        event = self._inputs if self._inputs is not None else (self._check.event if self._check is not None else None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    @property
    def input_nodes(self) -> torch.Tensor:
        """(N_in,) int64 ids of the nodes whose features form ``x``."""
        return self.blocks[0].src_nodes


@dataclass
class GatherCheck:
    """A batch's deferred bounds check: its gather's event and the flag the kernels write to."""

    event: torch.cuda.Event
    flag: Any
    step: int

    def done(self) -> bool:
        return self.event.query()

    def raise_if_bad(self) -> None:
        """Wait for the gather (without the GIL) and raise `LoaderError` if it saw a bad index."""
        self.event.synchronize()
        try:
            self.flag.raise_if_set()
        except IndexError as exc:
            raise LoaderError(f"batch {self.step}: the feature/label gather read an out-of-range node id "
                              f"({exc}); the graph's indices do not match the tables' rows") from exc
