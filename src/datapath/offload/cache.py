"""`TensorCache`: saved activations leave device memory in forward and come back before backward.

The cache composes five parts, each in its own module:

- `hooks.SavedTensorHooks`: the saved-tensor hooks (what is kept, what becomes a handle);
- `scopes.ScopeTracker`: module hooks, forward records and segments, pacing, prefetching;
- a policy (`policy.AllPolicy`, `policy.AdaptivePolicy`, `budget.BudgetPolicy`): what leaves
  memory and how fast bytes may be in flight;
- `transfers.Transfers`: entries, store/load jobs, forwarding, backpressure;
- a store (`HostStore`, `FileStore`, `TieredStore`): where the bytes live meanwhile.

All their state is guarded by one lock, the cache's.
"""
from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from datapath._runtime import pin_limit_bytes
from datapath.offload.budget import BudgetPolicy
from datapath.offload.cheap_recompute import set_cheap_recompute
from datapath.offload.config import OffloadConfig, parse_memory_budget
from datapath.offload.entry import Entry, Releases
from datapath.offload.errors import OffloadConfigError, OffloadError, OffloadWarning
from datapath.offload.file_store import FileStore
from datapath.offload.hooks import SavedTensorHooks
from datapath.offload.host_store import HostStore
from datapath.offload.memory_meter import CpuMeter, MemoryMeter, meter_for
from datapath.offload.policy import AdaptivePolicy, AllPolicy, Policy
from datapath.offload.recompute import clear_recompute
from datapath.offload.regional_compile import compile_blocks, uncompile_blocks
from datapath.offload.models import auto_blocks, resolve_units
from datapath.offload.scopes import ScopeTracker
from datapath.offload.stats import OffloadStats
from datapath.offload.store import Store
from datapath.offload.tiered_store import TieredStore
from datapath.offload.transfers import Transfers

log = logging.getLogger("datapath.offload.cache")

PROBE_BYTES_CUDA = 64 << 20   # the store bandwidth probe at construction (tens of ms on a GPU machine)
PROBE_BYTES_CPU = 1 << 20


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
        self.max_storage_bytes = 0
        self._param_keys: set[tuple[str, int, int]] = set()
        self._params_stale = False  # a forward began: refresh the keys before the next check (`is_parameter`)
        self._extra_params: list[weakref.ref[torch.Tensor]] = []
        self._hook_ctx: list[Any] = []
        self._closed = False
        self._shut = False
        self._warned_full = False
        self._probe: tuple[float, float] | None = None
        self._probe_done = threading.Event()
        self.store = make_store(config)
        self.transfers = Transfers(self.store, self.lock, self.stats, config.on_error)
        self.scopes = ScopeTracker(self)
        self.saved = SavedTensorHooks(self)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.meter: MemoryMeter = meter_for(device)
        self.policy = self._make_policy(config)
        self._start_probe(device)
        self._finalizer = weakref.finalize(self, TensorCache._final_cleanup, self.store, self.transfers)

    def _make_policy(self, config: OffloadConfig) -> Policy:
        if config.policy == "adaptive":
            return AdaptivePolicy(self)
        if config.policy == "budget":
            assert config.memory_budget is not None
            return BudgetPolicy(self, parse_memory_budget(config.memory_budget, self.meter.total()))
        return AllPolicy(self)

    def _start_probe(self, device: torch.device) -> None:
        """Measure the store's bandwidth once, in the store thread, before any activation is queued."""
        cuda = device.type == "cuda"
        nbytes = PROBE_BYTES_CUDA if cuda else PROBE_BYTES_CPU
        files = self.file_store
        if files is not None:  # a few chunks: the probe queues ahead of the first step's stores
            chunk = self.config.store.io_chunk_bytes
            nbytes = min(nbytes, 8 * chunk, files.max_disk_bytes // 4) // 4096 * 4096
        if nbytes <= 0:
            self._probe_done.set()
            return
        store = self.store.host if isinstance(self.store, TieredStore) else self.store

        def job() -> None:
            try:
                if cuda:
                    torch.cuda.set_device(device)
                streams = self.transfers.streams_for(device) if cuda else None
                self._probe = store.probe(nbytes, streams)
                log.debug("%s store probe: write %.2f GB/s, read %.2f GB/s", store.kind,
                          self._probe[0] / 1e9, self._probe[1] / 1e9)
            except (OSError, RuntimeError) as exc:  # a full disk must not fail training: plan on measurements
                log.info("%s store bandwidth probe failed (%s); using measured transfers", store.kind, exc)
            finally:
                self._probe_done.set()
        self.transfers._worker(self.transfers.store_workers, store.kind, "store", 4).submit(job)

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

    def bandwidth(self) -> tuple[float, float]:
        """(write, read) bytes/s of the store: measured transfers once there are some, else the probe."""
        st = self.stats
        w, r = st.write_bandwidth, st.read_bandwidth
        pw, pr = self._probe if self._probe is not None else (0.0, 0.0)
        if st.bytes_offloaded + st.bytes_written_partial < (256 << 20):
            w = pw or w
        if st.bytes_loaded < (256 << 20):
            r = pr or r
        return (w or 1e9, r or w or 1e9)

    def probed_bandwidth(self, wait: float = 0.0) -> tuple[float | None, float | None]:
        """The store's bandwidth probe (None when it did not run or failed); waits up to ``wait`` s for it."""
        if wait > 0:
            self._probe_done.wait(wait)
        return self._probe if self._probe is not None else (None, None)

    def reset_stats(self) -> OffloadStats:
        """Start new counters; return the old ones."""
        with self.lock:
            old = self.stats
            self.stats = self.transfers.stats = OffloadStats()
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
            hooks = self.scopes.attach(model, unit_list, blocks)
            if self.config.select.recompute_cheap and compile_options is None:  # compiled: the compiler's job
                set_cheap_recompute(model, True)
            self.scopes.models.append((weakref.ref(model), hooks))
            self.refresh_params()
            p = next(model.parameters(), None)
            if p is not None and isinstance(self.meter, CpuMeter) != (p.device.type != "cuda"):
                self.meter = meter_for(p.device)
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
            keep = []
            for ref, hooks in self.scopes.models:
                if model is None or ref() is model:
                    for h in hooks:
                        h.remove()
                    m = ref()
                    if m is not None:
                        clear_recompute(auto_blocks(m))
                        uncompile_blocks(m)
                        set_cheap_recompute(m, False)
                else:
                    keep.append((ref, hooks))
            self.scopes.models = keep
            self.refresh_params()

    def register_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Never offload these tensors (nor views of their storage): weights held outside an attached model."""
        with self.lock:
            for p in params:
                self._extra_params.append(weakref.ref(p))
            self.refresh_params()

    def params_may_have_moved(self) -> None:
        """A forward begins: parameters may live in new storages (FSDP2 gathers them per step); the keys are
        read again when a saved tensor is next checked, not now (a step that checks none pays nothing)."""
        self._params_stale = True

    def refresh_params(self) -> None:
        self._params_stale = False
        keys: set[tuple[str, int, int]] = set()

        def add(t: torch.Tensor) -> None:
            to_local = getattr(t, "to_local", None)
            if to_local is not None:  # a DTensor (FSDP2's sharded parameters): its local shard's storage
                t = to_local()
            if t.device.type != "meta":
                keys.add((t.device.type, t.device.index or 0, t.untyped_storage().data_ptr()))

        for m in self._models():
            for p in m.parameters():
                add(p)
            for b in m.buffers():
                add(b)
        for r in self._extra_params:
            t = r()
            if t is not None:
                add(t)
        self._param_keys = keys

    def _models(self) -> list[nn.Module]:
        return [m for m in (ref() for ref, _ in self.scopes.models) if m is not None]

    def is_parameter(self, t: torch.Tensor, storage: Any) -> bool:
        """``t`` is a parameter, a buffer, or a view of one (never offloaded)."""
        if self._params_stale:
            self.refresh_params()
        return (t.device.type, t.device.index or 0, storage.data_ptr()) in self._param_keys or (
            t.requires_grad and t.is_leaf) or (
            t._base is not None and t._base.is_leaf and t._base.requires_grad)

    def static_bytes(self) -> int:
        """Bytes of the attached models' parameters, buffers and gradients (what no policy can free)."""
        seen: set[int] = set()
        total = 0
        for m in self._models():
            for t in list(m.parameters()) + list(m.buffers()):
                for x in (t, getattr(t, "grad", None)):
                    if x is None:
                        continue
                    local = x.to_local() if hasattr(x, "to_local") else x
                    if local.device.type == "meta":
                        continue
                    st = local.untyped_storage()
                    if st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        total += st.nbytes()
        return total

    def cuda_model(self) -> bool:
        for m in self._models():
            p = next(m.parameters(), None)
            return p is not None and p.is_cuda
        return True

    def pace_lead(self) -> int:
        """How many units the CPU may run ahead of the GPU."""
        pace = self.config.flow.pace
        return 1 if isinstance(pace, bool) else int(pace)

    def wants_pacing(self, rec: Any) -> bool:
        return (self.config.flow.pace is not False and torch.cuda.is_available() and bool(self.scopes.models)
                and self.cuda_model() and self.policy.paces(rec))

    def store_full(self, nbytes: int) -> None:
        """The store refused ``nbytes`` (lock held): say so once, the tensor stays in device memory."""
        if self._warned_full:
            return
        self._warned_full = True
        fs = self.file_store
        where = (f"the disk at {fs.spill.base} (max_disk_bytes={fs.max_disk_bytes / 1e9:.3g} GB, "
                 f"{fs.free_bytes / 1e9:.3g} GB free when the cache was made)" if fs is not None and
                 self.config.target == "ssd" else f"the {self.store.kind} store (its budget is full)")
        warnings.warn(f"datapath.offload: no room in {where} for an activation of {nbytes / 1e6:.3g} MB; it stays "
                      f"in device memory, as will every activation that does not fit. Free space, raise "
                      f"max_disk_bytes/host_budget_bytes, or offload elsewhere.", OffloadWarning, stacklevel=4)

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
            sc = self.scopes
            sc.mb = index
            rec = sc.by_mb.get(index)
            if rec is None or rec.complete:
                rec = sc.start_record(microbatch=index)
            sc.record = rec

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

    def _shutdown(self, join: bool) -> None:
        with self.lock:
            if self._shut:
                return
            self._shut = True
        self.transfers.shutdown(join=join)
        self.store.close()
        self._finalizer.detach()

    @staticmethod
    def _final_cleanup(store: Store, transfers: Transfers) -> None:
        try:
            transfers.shutdown(join=False)
        except Exception:  # noqa: BLE001
            pass
        try:
            store.close()
        except Exception:  # noqa: BLE001
            pass

    @property
    def closed(self) -> bool:
        return self._closed
