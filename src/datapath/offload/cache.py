"""`TensorCache`: saved activations leave device memory in forward and come back before backward.

A saved tensor flows one way through parts that each live in their own module::

    hooks (SavedTensorHooks: pack/unpack; ScopeTracker: module hooks, records, pacing, prefetch)
      -> decide (a policy: AllPolicy, AdaptivePolicy, BudgetPolicy -- keep or offload, backpressure)
      -> move (Transfers: entries, store/load jobs, forwarding) -> a Store (host, files, tiered)

Each part is built here with the collaborators it uses, passed in; none of them knows the
cache.  The cache assembles them, owns the counters (`OffloadStats`), the lock that guards
all their state, and the life cycle (attach/detach, context, close, release of the
handles autograd lets go of).
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from datapath._runtime import pin_limit_bytes
from datapath.offload.attention_offload import AttentionStore
from datapath.offload.bandwidth import StoreBandwidth
from datapath.offload.budget import BudgetPolicy
from datapath.offload.cheap_recompute import set_cheap_recompute
from datapath.offload.config import OffloadConfig, parse_memory_budget
from datapath.offload.entry import Entry, Releases
from datapath.offload.errors import OffloadConfigError, OffloadError
from datapath.offload.file_store import FileStore
from datapath.offload.hooks import SavedTensorHooks
from datapath.offload.host_store import HostStore
from datapath.offload.memory_meter import CpuMeter, MemoryMeter, meter_for
from datapath.offload.models import AttachedModels, auto_blocks, resolve_units
from datapath.offload.policy import AdaptivePolicy, AllPolicy, Policy
from datapath.offload.recompute import clear_recompute
from datapath.offload.records import Clock
from datapath.offload.regional_compile import compile_blocks, uncompile_blocks
from datapath.offload.scopes import ScopeTracker
from datapath.offload.stats import OffloadStats
from datapath.offload.store import Store
from datapath.offload.tiered_store import TieredStore
from datapath.offload.transfers import Transfers

log = logging.getLogger("datapath.offload.cache")

PROBE_BYTES_CUDA = 64 << 20   # the store bandwidth probe at construction (tens of ms on a GPU machine)
PROBE_BYTES_CPU = 1 << 20
FINAL_JOIN_S = 10.0  # how long an unclosed cache's clean-up waits for each of its worker threads


def make_store(config: OffloadConfig) -> Store:
    """The store ``config.target`` names, sized by ``config.store``."""
    so = config.store
    host = files = None
    if config.target in ("host", "tiered"):
        budget = so.host_budget_bytes
        if budget is None:
            budget = int(pin_limit_bytes() * (0.8 if config.target == "host" else 0.5))
        host = HostStore(budget, slab_bytes=so.host_slab_bytes, verify=so.verify)
    if config.target in ("ssd", "tiered"):
        assert config.path is not None
        files = FileStore(config.path, engine=so.engine, threads=so.io_threads, chunk_bytes=so.io_chunk_bytes,
                          max_disk_bytes=so.max_disk_bytes, verify=so.verify)
    if host is not None and files is not None:
        return TieredStore(host, files)
    store = host if host is not None else files
    assert store is not None
    return store


class TensorCache:
    """Offloads the activations autograd saves to pinned host memory, files, or both.

    ``target``: ``"host"``, ``"ssd"`` (files under ``path``) or ``"tiered"`` (host memory
    up to ``host_budget_bytes``, then files).  ``policy``: ``"all"`` (everything, admitted as
    fast as the store drains it), ``"adaptive"`` (what the measured bandwidth hides) or
    ``"budget"``.  ``memory_budget``: the step's peak device memory (bytes, ``"10GB"``, or a
    fraction of device memory): keep, offload and recompute are planned to fit it.
    ``on_error``: ``"raise"`` (a failed store raises `OffloadError` in the step) or
    ``"keep"`` (the tensor stays in memory, a warning is logged); a failed load always raises.
    ``config``: an `OffloadConfig`; or keyword options of `SelectOptions`, `StoreOptions`
    and `FlowOptions` (``min_bytes=``, ``host_budget_bytes=``, ``io_chunk_bytes=``...).
    """

    def __init__(self, target: str = "host", path: str | None = None, *, policy: str | None = None,
                 memory_budget: int | float | str | None = None, on_error: str = "raise",
                 config: OffloadConfig | None = None, **options: Any) -> None:
        if config is None:
            config = OffloadConfig.build(target, path, policy=policy, memory_budget=memory_budget,
                                         on_error=on_error, **options)
        elif options:
            raise TypeError(f"options {sorted(options)} given with config=; put them in the config")
        self.config = config
        self.stats = OffloadStats()
        self.lock = threading.RLock()
        self.releases = Releases(self.drop_handle)  # dead handles, released in the main flow
        self._hook_ctx: list[Any] = []
        self._closed = False
        self._shut = False
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        # the parts, from the bottom of the flow up: each gets what it uses
        self.store = make_store(config)
        self.transfers = Transfers(self.store, self.lock, self.stats, config.on_error)
        self.store_bandwidth = StoreBandwidth(self.stats)
        self.models = AttachedModels()
        self.clock = Clock(self.models.cuda_model)
        self.meter: MemoryMeter = meter_for(device)
        self.policy = self._make_policy(config)
        self.scopes = ScopeTracker(self.lock, config, self.policy, self.transfers, self.stats, self.meter,
                                   self.clock, self.models, self.releases)
        self.saved = SavedTensorHooks(self.lock, config.select, self.stats, self.models, self.scopes, self.policy,
                                      self.transfers, self.store, self.clock, self.releases)
        self._start_probe(device)
        self._finalizer = weakref.finalize(self, TensorCache._final_cleanup, self.store, self.transfers)

    def _make_policy(self, config: OffloadConfig) -> Policy:
        parts = (config, self.transfers, self.store_bandwidth, self.stats)
        if config.policy == "adaptive":
            return AdaptivePolicy(*parts)
        if config.policy == "budget":
            assert config.memory_budget is not None
            host = self.store.host if isinstance(self.store, TieredStore) else self.store
            attention = AttentionStore(host, self.transfers.streams_for) if isinstance(host, HostStore) else None
            return BudgetPolicy(*parts, budget=parse_memory_budget(config.memory_budget, self.meter.total()),
                                meter=self.meter, models=self.models, clock=self.clock, room=self.store.room,
                                attention_store=attention)
        return AllPolicy(*parts)

    def _use_meter(self, meter: MemoryMeter) -> None:
        """Measure device memory with ``meter`` from now on (the parts that read it are given it)."""
        self.meter = self.scopes.meter = meter
        if isinstance(self.policy, BudgetPolicy):
            self.policy.meter = meter

    def _start_probe(self, device: torch.device) -> None:
        """Measure the store's bandwidth once, in the store thread, before any activation is queued."""
        nbytes = PROBE_BYTES_CUDA if device.type == "cuda" else PROBE_BYTES_CPU
        files = self.file_store
        if files is not None:  # a few chunks: the probe queues ahead of the first step's stores
            chunk = self.config.store.io_chunk_bytes
            nbytes = min(nbytes, 8 * chunk, files.max_disk_bytes // 4) // 4096 * 4096
        store = self.store.host if isinstance(self.store, TieredStore) else self.store
        self.store_bandwidth.start_probe(store, nbytes, device, self.transfers.streams_for,
                                         self.transfers.run_in_store_worker)

    # ------------------------------------------------------------------ info
    @property
    def file_store(self) -> FileStore | None:
        """The `FileStore` (``"ssd"``, ``"tiered"``), else None."""
        if isinstance(self.store, FileStore):
            return self.store
        if isinstance(self.store, TieredStore):
            return self.store.file
        return None

    @property
    def directory(self) -> str | None:
        """The private directory holding the files (``"ssd"``/``"tiered"``), else None."""
        fs = self.file_store
        return str(fs.spill.path) if fs is not None else None

    @property
    def engine(self) -> str | None:
        """``"kvikio"`` or ``"posix"`` for file targets, None for ``"host"``."""
        fs = self.file_store
        return fs.engine_name if fs is not None else None

    @property
    def direct_io(self) -> bool | None:
        """Whether the POSIX engine uses O_DIRECT (None for ``"host"``)."""
        fs = self.file_store
        return fs.direct if fs is not None else None

    def files(self) -> list[str]:
        """Names of the activation files that exist now."""
        return [f for f in self.store.files() if f.endswith(".act")]

    @property
    def live_storages(self) -> int:
        """Storages the cache tracks now (offloaded, loading, or held for autograd)."""
        with self.lock:
            return len(self.transfers.entries)

    @property
    def plan(self) -> Any:
        """The policy's current plan (`OffloadPlan` or `BudgetPlan`), None before one is made."""
        return self.policy.plan

    @plan.setter
    def plan(self, value: Any) -> None:
        self.policy.plan = value

    @property
    def profile(self) -> Any:
        """The profile the current plan was made from (None before one)."""
        return getattr(self.policy, "profile", None)

    @property
    def memory_budget(self) -> int | None:
        """The budget in bytes (``memory_budget=``), else None."""
        return self.policy.budget if isinstance(self.policy, BudgetPolicy) else None

    @property
    def bandwidth(self) -> Callable[[], tuple[float, float]]:
        """``cache.bandwidth()``: (write, read) bytes/s of the store, measured transfers once there are some, else
        the probe.  ``cache.bandwidth = fn``: the planners use ``fn()`` instead (a known disk, a test)."""
        return self.store_bandwidth.now

    @bandwidth.setter
    def bandwidth(self, fn: Callable[[], tuple[float, float]]) -> None:
        self.store_bandwidth.source = fn

    def probed_bandwidth(self, wait: float = 0.0) -> tuple[float | None, float | None]:
        """The store's bandwidth probe (None when it did not run or failed); waits up to ``wait`` s for it."""
        return self.store_bandwidth.probed(wait)

    def reset_stats(self) -> OffloadStats:
        """Start new counters (`stats` is zeroed in place); return the old ones."""
        with self.lock:
            old = self.stats.reset()
            self.store.reset_peak()
            return old

    # ------------------------------------------------------------- attaching
    def attach(self, model: nn.Module, units: Iterable[nn.Module] | str | None = None) -> "TensorCache":
        """Install the module hooks on ``model`` (root) and its ``units``; record its parameters and buffers.

        ``units``: the modules whose calls are the scopes of offloading, prefetching and pacing.
        ``"blocks"``: the blocks of the model's largest ``ModuleList``/``Sequential`` (transformer
        layers); ``"leaves"``: every module that owns parameters (Linear, LayerNorm, ...), finer
        scopes that keep less in memory; or a list.  None: ``"leaves"`` for the ``"all"`` and
        budget policies, ``"blocks"`` for ``"adaptive"`` and with ``compile=True`` (which compiles
        each block's forward here: `datapath.offload.regional_compile`).
        """
        if self._closed:
            raise OffloadConfigError("this TensorCache is closed; build a new one")
        compile_options = self.config.select.compile_options
        if units is None:
            units = "blocks" if self.config.policy == "adaptive" or compile_options is not None else "leaves"
        unit_list = resolve_units(model, units)
        blocks = auto_blocks(model)
        if compile_options is not None:
            inside = {id(m) for b in blocks for m in b.modules() if m is not b}
            if any(id(u) in inside for u in unit_list):
                raise OffloadConfigError("compile=True compiles each block whole: units inside the blocks would "
                                         "break its graph; pass units='blocks' (the default with compile)")
            compile_blocks(model, compile_options)
        with self.lock:
            hooks = self.scopes.attach(model, unit_list, blocks) + self.saved.attach(model)
            if self.config.select.recompute_cheap and compile_options is None:  # compiled: the compiler's job
                set_cheap_recompute(model, True)
            self.models.add(model, hooks, blocks)
            p = next(model.parameters(), None)
            if p is not None and isinstance(self.meter, CpuMeter) != (p.device.type != "cuda"):
                self._use_meter(meter_for(p.device))
            if isinstance(self.meter, CpuMeter):
                self.meter.base = self.static_bytes()
        if isinstance(self.policy, BudgetPolicy) and self.static_bytes() > self.policy.budget:
            raise OffloadConfigError(
                f"memory_budget={self.policy.budget / 1e9:.2f} GB is below the model's parameters and buffers "
                f"alone ({self.static_bytes() / 1e9:.2f} GB measured); raise the budget")
        log.debug("attached to %s with %d units, %d blocks", model.__class__.__name__, len(unit_list), len(blocks))
        return self

    def detach(self, model: nn.Module | None = None) -> None:
        """Remove the module hooks (of ``model``, or of every attached model); undo block recomputation."""
        with self.lock:
            for m, hooks in self.models.remove(model):
                for h in hooks:
                    h.remove()
                if m is not None:
                    clear_recompute(auto_blocks(m))
                    uncompile_blocks(m)
                    set_cheap_recompute(m, False)

    def register_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Never offload these tensors (nor views of their storage): weights held outside an attached model."""
        with self.lock:
            self.models.register_parameters(params)

    def params_may_have_moved(self) -> None:
        """A forward begins: parameters may live in new storages (FSDP2 gathers them per step); read again when
        a saved tensor is next checked."""
        self.models.params_may_have_moved()

    def refresh_params(self) -> None:
        """Read the storages of the attached models' parameters and buffers again."""
        self.models.refresh_params()

    def is_parameter(self, t: torch.Tensor, storage: Any) -> bool:
        """``t`` is a parameter, a buffer, or a view of one (never offloaded)."""
        return self.models.is_parameter(t, storage)

    def static_bytes(self) -> int:
        """Bytes of the attached models' parameters, buffers and gradients (what no policy can free)."""
        return self.models.static_bytes()

    def cuda_model(self) -> bool:
        """Whether the attached model runs on CUDA (True with none attached)."""
        return self.models.cuda_model()

    # ---------------------------------------------------------- autograd hooks
    def hooks(self) -> Any:
        """The ``saved_tensors_hooks`` context that routes saved tensors through this cache."""
        return self.saved.context()

    def __enter__(self) -> "TensorCache":
        if self._closed:
            raise OffloadConfigError("this TensorCache is closed; build a new one")
        ctx = self.hooks()
        ctx.__enter__()
        self._hook_ctx.append(ctx)
        if isinstance(self.meter, CpuMeter) and isinstance(self.policy, BudgetPolicy):
            self.meter.__enter__()
            self._hook_ctx.append(self.meter)
        return self

    def __exit__(self, *exc: Any) -> None:
        top = self._hook_ctx.pop()
        if top is self.meter:
            top.__exit__(*exc)
            top = self._hook_ctx.pop()
        top.__exit__(*exc)

    def drop_handle(self, e: Entry) -> None:
        """Autograd let go of a handle of ``e``."""
        with self.lock:
            e.handles -= 1
            if e.handles > 0 or e.released:
                return
            self.transfers.release(e)
            rec = e.record
            rec.live -= 1
            if rec.live == 0:
                self.scopes.record_done(rec)
            if self._closed and not self.transfers.entries:
                self._shutdown(join=False)

    # ------------------------------------------------------------------ hints
    def set_microbatch(self, index: int) -> None:
        """Hint: the next forward (or backward) is for micro-batch ``index`` (pipeline schedules)."""
        with self.lock:
            self.stats.microbatch_hints += 1
            self.scopes.set_microbatch(index)

    def begin_backward(self) -> None:
        """Hint: the backward of the current micro-batch starts now (start loading its last units)."""
        with self.lock:
            rec = self.scopes.record
            if rec is not None and not rec.backward_started:
                self.scopes.begin_backward(rec)

    def prefetch_last_module(self) -> None:
        """Hint: start loading the last offloaded unit(s) of the current micro-batch ahead of its backward."""
        with self.lock:
            rec = self.scopes.record
            if rec is not None and rec.segments:
                self.scopes.prefetch_range(rec, len(rec.segments) - 1)

    def wait_io(self) -> None:
        """Block until every queued store and load has finished; raise a pending `OffloadError`."""
        self.releases.drain()
        self.transfers.wait_idle()
        with self.lock:
            self.transfers.raise_pending()

    # -------------------------------------------------------------- closing
    def close(self, raise_errors: bool = True) -> None:
        """Remove the hooks and wait for I/O; files, threads and host memory go once autograd holds nothing.

        A graph built inside the cache can still be backpropagated after `close`;
        the directory is removed when its last saved tensor is consumed (or at exit).
        """
        if self._closed:
            return
        try:
            self.policy.close()  # before detach: it reads the attached models' blocks
        finally:
            self.detach()
        try:
            self.wait_io()
        except OffloadError:
            if raise_errors:
                raise
        finally:
            with self.lock:
                self._closed = True
                idle = not self.transfers.entries
            if idle:
                self._shutdown(join=True)
            else:  # the handles autograd still holds release their entries as they die (the last one shuts down)
                self.releases.release_at_death()

    def _shutdown(self, join: bool) -> None:
        with self.lock:
            if self._shut:
                return
            self._shut = True
        self.transfers.shutdown(join=join)
        attention = getattr(self.policy, "attention_store", None)
        if attention is not None:  # its outputs' room back before the store closes
            attention.close()
        self.store.close()
        self._finalizer.detach()

    @staticmethod
    def _final_cleanup(store: Store, transfers: Transfers) -> None:
        # a cache dropped (or left open at exit) unclosed: its worker threads are joined before the store goes,
        # bounded.  Left running into the interpreter's shutdown, a daemon thread inside a torch call is ended by
        # force, and the C++ runtime aborts the process ("terminate called without an active exception", exit 134)
        try:
            transfers.shutdown(join=True, timeout=FINAL_JOIN_S)
        except Exception:  # noqa: BLE001
            pass
        try:
            store.close()
        except Exception:  # noqa: BLE001
            pass

    @property
    def closed(self) -> bool:
        return self._closed
