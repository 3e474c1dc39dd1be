"""Settings of a `TensorCache`, checked once, in three small frozen groups, and the memory budget parser.

- `SelectOptions`: which saved tensors are candidates (size threshold, last units, CPU tensors).
- `StoreOptions`: where their bytes go (host budget, disk budget, file engine, checksums).
- `FlowOptions`: how fast they move (bytes in flight, bytes loaded ahead, pacing, planner tolerances).

`OffloadConfig.build(target, path, policy, memory_budget, **options)` routes flat
keyword options (``min_bytes=``, ``io_chunk_bytes=``...) to their group and raises
`OffloadConfigError` (a ``ValueError``) naming any argument that is wrong.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from datapath.offload.errors import OffloadConfigError
from datapath.offload.regional_compile import check_compile_options
from datapath._runtime.sizes import SizeError, parse_size

TARGETS = ("host", "ssd", "tiered")
POLICIES = ("all", "adaptive", "budget")
ON_ERROR = ("raise", "keep")
UNITS = ("blocks", "leaves")

@dataclass(frozen=True)
class SelectOptions:
    """Which saved tensors may leave device memory.

    ``min_bytes``: storages smaller than this stay.  ``keep_last_modules``: the last units of
    the forward stay (their backward comes first).  ``offload_cpu_tensors``: CPU tensors
    are candidates too (normally kept; lets CPU-only runs exercise every path).
    ``recompute_cheap``: multi-kernel activations and Hugging Face RMSNorms save only their
    input and run again in backward (`datapath.offload.cheap_recompute`): fewer bytes to move.
    ``recompute_elementwise``: a saved output of GELU, SiLU or an elementwise product whose
    inputs are saved anyway is not kept: the op runs again in backward
    (`datapath.offload.op_recompute`; bit-identical).  Off under ``compile``: a compiled
    block's partitioner recomputes elementwise ops itself.
    ``compile``: True or a dict of `torch.compile` options: compile each block's forward
    (regional compilation, `datapath.offload.regional_compile`); the plan works on what the
    compiled blocks still save, and the units are the blocks.
    """

    min_bytes: int = 1 << 20
    keep_last_modules: int = 1
    offload_cpu_tensors: bool = False
    recompute_cheap: bool = True
    recompute_elementwise: bool = True
    compile: Any = False

    def __post_init__(self) -> None:
        _int_at_least("min_bytes", self.min_bytes, 0)
        _int_at_least("keep_last_modules", self.keep_last_modules, 0)
        check_compile_options(self.compile)

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """``compile`` as `torch.compile` keyword arguments; None when off."""
        return check_compile_options(self.compile)


@dataclass(frozen=True)
class StoreOptions:
    """Where the bytes go.

    ``host_budget_bytes``: pinned host memory the store may use (default 80% of what the
    machine can pin for ``"host"``, half of it for ``"tiered"``).  ``max_disk_bytes``: bytes
    of files at once (default 90% of the free space).  ``engine``: ``"auto"``, ``"kvikio"`` or
    ``"posix"``; ``io_threads``/``io_chunk_bytes``: the POSIX engine's threads and transfer size.
    ``verify``: checksum every stored storage and check it on reload.
    """

    host_budget_bytes: int | None = None
    max_disk_bytes: int | None = None
    engine: str = "auto"
    io_threads: int = 4
    io_chunk_bytes: int = 16 << 20
    host_slab_bytes: int = 256 << 20
    verify: bool = False

    def __post_init__(self) -> None:
        for name in ("host_budget_bytes", "max_disk_bytes"):
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name), 0)
        if self.engine not in ("auto", "kvikio", "posix"):
            raise OffloadConfigError(f"engine must be 'auto', 'kvikio' or 'posix', got {self.engine!r}")
        _int_at_least("io_threads", self.io_threads, 1)
        _int_at_least("io_chunk_bytes", self.io_chunk_bytes, 4096)
        if self.io_chunk_bytes % 4096:
            raise OffloadConfigError(f"io_chunk_bytes must be a multiple of 4096, got {self.io_chunk_bytes}")
        _int_at_least("host_slab_bytes", self.host_slab_bytes, 4096)


@dataclass(frozen=True)
class FlowOptions:
    """How fast bytes move, and how the policies plan.

    ``max_inflight_bytes``: device bytes waiting to be stored before a saving op waits for
    stores to finish (backpressure); None: derived from the measured bandwidth (and the
    memory budget) for ``"all"``/``"budget"``, no bound for ``"adaptive"``; ``math.inf``: no bound.
    ``max_prefetch_bytes``: bytes one backward step loads ahead of need (None: derived the
    same way).  ``prefetch_distance``: units ahead of the backward that loads start.
    ``pace``: on CUDA keep the CPU at most this many units ahead of the GPU (True: 1).
    ``stall_tolerance``, ``replan_threshold``, ``profile_after``: the adaptive planner's.
    ``agree_across_ranks``: a ``memory_budget`` plans on the largest peaks and times of the ranks of a
    collective-synchronous job (FSDP, DDP, TP), so every rank runs the same plan
    (`datapath.offload.rank_agreement`): None (on where ``torch.distributed`` is initialised with more
    than one rank: the default group where it is gloo, else a gloo group of every rank made for it), False
    (off: each rank plans alone), True (the same as None), or a gloo ``ProcessGroup`` (its ranks).
    ``trial_steps``: measured steps a ``memory_budget`` trial runs each plan for, one after another, its fastest
    counting (a plan's first step may hold one-off costs, e.g. the caching allocator reserving memory for what
    the plan keeps): None (2 where the ranks agree, where a step is as slow as the slowest rank and one step
    each leaves plans a few percent apart to noise; else 1), or a number >= 1.
    ``partition_compiled``: a ``memory_budget`` under ``compile`` also tries, on a GPU, its compiled blocks
    recomputed by their compiled region's partitioner (`datapath.offload.regional_compile.PARTITION_BUDGET`);
    the gradients of such a plan match the compiled model's to float32 rounding, not bit for bit, so it is off
    by default (every plan then gives the compiled model's gradients exactly).
    """

    max_inflight_bytes: float | None = None
    max_prefetch_bytes: float | None = None
    prefetch_distance: int = 1
    pace: bool | int = True
    stall_tolerance: float = 0.02
    replan_threshold: float = 0.25
    profile_after: int = 1
    agree_across_ranks: Any = None
    trial_steps: int | None = None
    partition_compiled: bool = False

    def __post_init__(self) -> None:
        check_agreement(self.agree_across_ranks)
        if not isinstance(self.partition_compiled, bool):
            raise OffloadConfigError(f"partition_compiled must be True or False, got {self.partition_compiled!r}")
        if self.trial_steps is not None:
            _int_at_least("trial_steps", self.trial_steps, 1)
        for name in ("max_inflight_bytes", "max_prefetch_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
                                  or math.isnan(v)):
                raise OffloadConfigError(f"{name} must be None (derived), a number of bytes >= 0 or math.inf, "
                                         f"got {v!r}")
        _int_at_least("prefetch_distance", self.prefetch_distance, 1)
        if not isinstance(self.pace, bool) and (not isinstance(self.pace, int) or self.pace < 0):
            raise OffloadConfigError(f"pace must be True, False or a number of units >= 0, got {self.pace!r}")
        if not 0 <= self.stall_tolerance < 1:
            raise OffloadConfigError(f"stall_tolerance must be in [0, 1), got {self.stall_tolerance!r}")
        _int_at_least("profile_after", self.profile_after, 0)


@dataclass(frozen=True)
class OffloadConfig:
    """Everything a `TensorCache` is built from (see `OffloadConfig.build`)."""

    target: str = "host"
    path: str | None = None
    policy: str = "all"
    memory_budget: int | float | str | None = None
    on_error: str = "raise"
    select: SelectOptions = field(default_factory=SelectOptions)
    store: StoreOptions = field(default_factory=StoreOptions)
    flow: FlowOptions = field(default_factory=FlowOptions)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise OffloadConfigError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.policy not in POLICIES:
            raise OffloadConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.on_error not in ON_ERROR:
            raise OffloadConfigError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.target in ("ssd", "tiered") and not self.path:
            raise OffloadConfigError(
                f"target={self.target!r} needs path=, a directory on the disk to write activations to "
                f"(a private subdirectory is created in it and removed afterwards)")
        if self.policy == "budget" and self.memory_budget is None:
            raise OffloadConfigError("policy='budget' needs memory_budget= (bytes, a string like '10GB', "
                                     "or a fraction of device memory)")
        if self.memory_budget is not None:
            check_memory_budget(self.memory_budget)

    @staticmethod
    def build(target: str = "host", path: str | None = None, *, policy: str | None = None,
              memory_budget: int | float | str | None = None, on_error: str = "raise",
              **options: Any) -> "OffloadConfig":
        """A config from flat keyword options; a name that is no option raises ``TypeError``."""
        groups: dict[str, dict[str, Any]] = {"select": {}, "store": {}, "flow": {}}
        owners = {f.name: g for g, cls in (("select", SelectOptions), ("store", StoreOptions),
                                           ("flow", FlowOptions)) for f in dataclasses.fields(cls)}
        for name, value in options.items():
            if name not in owners:
                raise TypeError(f"unknown offload option {name!r}; known: {', '.join(sorted(owners))}")
            groups[owners[name]][name] = value
        if policy is None:
            policy = "budget" if memory_budget is not None else "all"
        elif memory_budget is not None and policy != "budget":
            raise OffloadConfigError(f"memory_budget= plans its own policy; policy={policy!r} cannot be combined "
                                     f"with it (leave policy out, or pass policy='budget')")
        return OffloadConfig(target=target, path=None if path is None else str(path), policy=policy,
                             memory_budget=memory_budget, on_error=on_error,
                             select=SelectOptions(**groups["select"]), store=StoreOptions(**groups["store"]),
                             flow=FlowOptions(**groups["flow"]))


def check_agreement(value: Any) -> None:
    """Raise `OffloadConfigError` unless ``value`` is None, a bool or a ``torch.distributed`` process group."""
    if value is None or isinstance(value, bool):
        return
    import torch.distributed as dist  # noqa: PLC0415

    if not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        raise OffloadConfigError(f"agree_across_ranks must be None (on where torch.distributed is initialised "
                                 f"with more than one rank), True, False or a torch.distributed ProcessGroup, "
                                 f"got {value!r}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OffloadConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def check_memory_budget(value: Any) -> None:
    """Raise `OffloadConfigError` when ``value`` cannot be a memory budget (see `parse_memory_budget`)."""
    parse_memory_budget(value, total_bytes=1 << 40)


def parse_memory_budget(value: int | float | str, total_bytes: int) -> int:
    """The budget in bytes (`datapath._runtime.sizes`, one meaning everywhere).

    ``value``: an int (bytes); a float in (0, 1] or ``"0.8"`` (that share of ``total_bytes``, the
    device's memory); ``"80%"``; a size ``"10GB"`` (decimal: kB, MB, GB, TB) or ``"10GiB"``
    (binary: KiB, MiB, GiB, TiB; also bare K, M, G, T).  ``1.5`` is an error, not 1 byte.
    """
    try:
        return parse_size(value, total_bytes, "memory_budget", minimum=1)
    except SizeError as exc:
        raise OffloadConfigError(f"{exc} (a budget of device memory)") from None
