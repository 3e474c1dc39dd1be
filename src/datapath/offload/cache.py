"""The tensor cache: saved activations leave device memory in forward and come back before backward.

How it works (SSDTrain §5.3, with the gaps of the existing systems closed):

- ``saved_tensors_hooks``: the pack hook gets every tensor autograd saves.
  Parameters, buffers and their views, CPU tensors, small storages and
  tensors saved during backward (checkpoint recomputation) are returned as
  they are.  Any other tensor is replaced by a small handle naming its
  *storage* and its view (offset, shape, stride, dtype): one write per storage,
  whatever number of views of it are saved; every view is rebuilt on reload.
- Module hooks keep a scope: each call of a *unit* module (by default the
  blocks of the model's largest ``ModuleList``/``Sequential``) opens a segment
  of the current forward record; code between units gets its own segments.
  One record per forward pass (per micro-batch with `TensorCache.set_microbatch`).
- A store pool (one thread per target kind; CUDA: its own stream) copies the
  storage out once the kernel that produced it has finished (the event recorded
  at pack time) and releases the device memory when the copy is complete.
- When the backward reaches a unit (a pre-hook on the grad_fn of the unit's
  output), the storages of the unit(s) before it are prefetched on the load
  stream into memory allocated on the consumer's stream; unpack makes the
  consumer's stream wait for the load's event.
- Forwarding: a storage whose store is queued or running when it is needed is
  handed back from memory (a queued store is cancelled, a running one stops).
- Policy ``"all"`` offloads everything except the last ``keep_last_modules``
  units (and what follows them); ``"adaptive"`` profiles the first forward and
  backward, then offloads the longest prefix of storages whose stores and loads
  fit the measured bandwidth (`datapath.offload.planner`), re-planning when the
  bandwidth it achieves moves away from the plan's.
- Nothing lost: a failed store raises `OffloadError` in the step
  (``on_error="raise"``) or keeps the tensor in memory (``on_error="keep"``); a
  failed load always raises.  Files are deleted as soon as their storage is back
  in memory or no longer needed.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from datapath._runtime import pin_limit_bytes
from datapath.offload._host_pool import HostPool
from datapath.offload._spill_dir import SpillDir
from datapath.offload._targets import HostTarget, SsdTarget, Streams
from datapath.offload._views import ViewSpec, is_plain_strided, rebuild, storage_bytes
from datapath.offload._workers import Worker
from datapath.offload.errors import OffloadConfigError, OffloadError
from datapath.offload.planner import OffloadPlan, SegmentProfile, StepProfile, TensorProfile, plan_offload
from datapath.offload.stats import OffloadStats

log = logging.getLogger("datapath.offload.cache")

# entry states
PENDING, STORING, STORED, LOADING, RESIDENT, FAILED = "pending", "storing", "stored", "loading", "resident", "failed"

TARGETS = ("host", "ssd", "tiered")
POLICIES = ("all", "adaptive")
ON_ERROR = ("raise", "keep")


def _in_backward() -> bool:
    """True while the autograd engine is running a backward pass (on any thread)."""
    return torch._C._current_graph_task_id() != -1


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a module output (tensor, tuple/list, dict, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


class _Entry:
    """One offloaded storage and where its bytes are."""

    __slots__ = ("sid", "nbytes", "device", "record", "segment", "target", "state", "src", "tensor", "version",
                 "pack_event", "pack_stream", "gpu", "loc", "crc", "ready", "ready_event", "alloc_stream",
                 "handles", "released", "forwarded", "cancelled", "modified", "error", "name", "counted", "ahead",
                 "__weakref__")

    def __init__(self, sid: int, nbytes: int, device: torch.device, record: "_Record", segment: int,
                 target: Any, src: torch.Tensor, tensor: torch.Tensor) -> None:
        self.sid = sid
        self.nbytes = nbytes
        self.device = device
        self.record = record
        self.segment = segment
        self.target = target
        self.state = PENDING
        self.src: torch.Tensor | None = src        # uint8 alias of the storage, held until stored
        self.tensor: torch.Tensor | None = tensor  # the packed tensor (its version counter), held as long
        self.version = tensor._version
        self.pack_event: Any = None
        self.pack_stream: Any = None
        self.gpu: torch.Tensor | None = None       # the bytes in device memory (forwarded or reloaded)
        self.loc: Any = None                       # HostBlock or file path
        self.crc: list[int] = []
        self.ready = threading.Event()
        self.ready_event: Any = None
        self.alloc_stream: Any = None
        self.handles = 0
        self.released = False
        self.forwarded = False
        self.cancelled = False
        self.modified = False
        self.error: BaseException | None = None
        self.name = f"{sid}.act"
        self.counted = True  # its bytes count against max_inflight_bytes until its store ends
        self.ahead = False   # loaded by a prefetch and not yet handed to autograd


class _Handle:
    """What autograd keeps instead of an offloaded tensor: the entry and the view to rebuild."""

    __slots__ = ("cache", "entry", "spec", "tref", "version")

    def __init__(self, cache: "TensorCache", entry: _Entry, t: torch.Tensor) -> None:
        self.cache = cache
        self.entry = entry
        self.spec = ViewSpec.of(t)
        self.tref = weakref.ref(t)
        self.version = t._version
        entry.handles += 1

    def __del__(self) -> None:
        try:
            self.cache._drop_handle(self.entry)
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
            pass


class _Segment:
    __slots__ = ("index", "is_unit", "unit_pos", "name", "entries", "t_start", "t_end", "t_bwd", "bwd_fired",
                 "prefetched")

    def __init__(self, index: int, is_unit: bool, unit_pos: int, name: str) -> None:
        self.index = index
        self.is_unit = is_unit
        self.unit_pos = unit_pos
        self.name = name
        self.entries: list[_Entry] = []
        self.t_start: Any = None
        self.t_end: Any = None
        self.t_bwd: Any = None
        self.bwd_fired = False
        self.prefetched = False


class _Record:
    """The saved tensors of one forward pass (one micro-batch)."""

    def __init__(self, rid: int, profiling: bool, cutoff: int | None, distance: int,
                 expected_units: int | None, microbatch: int | None) -> None:
        self.rid = rid
        self.profiling = profiling
        self.cutoff = cutoff
        self.distance = distance
        self.expected_units = expected_units
        self.microbatch = microbatch
        self.segments: list[_Segment] = []
        self.units = 0
        self.depth = 0
        self.first_packs = 0
        self.live = 0
        self.entries_made = 0
        self.backward_started = False
        self.complete = False
        self.t0: Any = None
        self.t_bwd0: Any = None
        self.tensors: list[tuple[int, int, Any]] = []  # profiling: (segment, nbytes, ready mark)
        self.pace = -1             # pace the CPU to the GPU at unit boundaries (CUDA models): units of lead, -1 off
        self.pace_fwd: collections.deque[Any] = collections.deque()  # events at the starts of the last units' forward
        self.pace_bwd: collections.deque[Any] = collections.deque()  # ... and backward
        self.bwd_paced = False     # the first backward unit (waits for the whole forward) has been seen
        self.bytes_written = 0
        self.write_s = 0.0
        self.bytes_read = 0
        self.read_s = 0.0
        self.wait_s = 0.0  # time autograd waited in unpack for this record's loads


class TensorCache:
    """Offloads the activations autograd saves to pinned host memory, files, or both.

    Args:
        target: ``"host"`` (pinned host memory), ``"ssd"`` (files under ``path``) or
            ``"tiered"`` (host memory up to ``host_budget_bytes``, then files).
        path: base directory for ``"ssd"``/``"tiered"``; a private subdirectory (0700) is made in it.
        policy: ``"all"`` or ``"adaptive"`` (profile the first step, then offload what the bandwidth allows).
        min_bytes: storages smaller than this stay where they are.
        keep_last_modules: with ``policy="all"``, the last units of the forward are not offloaded
            (their backward comes first).
        prefetch_distance: how many units ahead of the backward loads are started (``"adaptive"`` chooses).
        on_error: ``"raise"`` (a failed store raises `OffloadError` in the step) or ``"keep"``
            (the tensor stays in memory, a warning is logged).  A failed load always raises.
        offload_cpu_tensors: also offload CPU tensors (normally kept; lets CPU-only runs exercise every path).
        host_budget_bytes: bytes of pinned host memory the cache may use (default 80% of what the
            machine can pin for ``"host"``, half of it for ``"tiered"``).
        max_disk_bytes: bytes of files the cache may have at once (default 90% of the free space).
        engine: ``"auto"`` (kvikio when it works with the GPU through GPUDirect Storage, else the POSIX
            engine, which beats kvikio's compatibility mode), ``"kvikio"`` (even in compatibility mode), ``"posix"``.
        io_threads, io_chunk_bytes: the POSIX engine's thread count and transfer size.
        verify: checksum every stored storage (CRC32 on the host side) and check it on reload.
        max_inflight_bytes: bound on the device bytes waiting to be stored; a pack hook that would
            exceed it waits for stores to finish (forward slows to the target's bandwidth, the
            memory peak stays low).  None: no bound.
        max_prefetch_bytes: bound on the bytes one backward step starts loading ahead of need (the
            segment needed now is always loaded); later segments load when reached.  None: no bound
            (``prefetch_distance`` units).  With ``max_inflight_bytes``, the lowest-memory setting.
        pace: on CUDA, keep the CPU at most a few units ahead of the GPU (wait at unit boundaries,
            and for the end of the forward before the backward starts).  True: one unit ahead
            (measured best for memory, at no measurable cost, with both block and leaf units on B4);
            an int: that many units (0: launch a unit once the GPU has finished the previous one);
            False: no pacing.  The allocator counts
            memory in CPU order: without pacing the CPU can launch the whole backward before the
            GPU has stored anything, and the stores free nothing in time.
        profile_after: forward passes run with ``policy="all"`` before the adaptive policy profiles
            one (the first pays one-time costs: pinning the host pool, library initialisation).
        units: modules whose calls form the scopes (default: the blocks of the largest ModuleList/Sequential).
    """

    def __init__(self, target: str = "host", path: str | None = None, *, policy: str = "all",
                 min_bytes: int = 1 << 20, keep_last_modules: int = 1, prefetch_distance: int = 1,
                 on_error: str = "raise", offload_cpu_tensors: bool = False,
                 host_budget_bytes: int | None = None, max_disk_bytes: int | None = None,
                 engine: str = "auto", io_threads: int = 4, io_chunk_bytes: int = 16 << 20,
                 host_slab_bytes: int = 256 << 20, verify: bool = False, stall_tolerance: float = 0.02,
                 replan_threshold: float = 0.25, max_inflight_bytes: int | None = None,
                 max_prefetch_bytes: int | None = None,
                 pace: bool | int = True, profile_after: int = 1) -> None:
        if target not in TARGETS:
            raise OffloadConfigError(f"target must be one of {TARGETS}, got {target!r}")
        if policy not in POLICIES:
            raise OffloadConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
        if on_error not in ON_ERROR:
            raise OffloadConfigError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if min_bytes < 0 or keep_last_modules < 0 or prefetch_distance < 1:
            raise OffloadConfigError("min_bytes and keep_last_modules must be >= 0 and prefetch_distance >= 1")
        if target in ("ssd", "tiered") and not path:
            raise OffloadConfigError(
                f"target={target!r} needs path=, a directory on the disk to write activations to "
                f"(a private subdirectory is created in it and removed afterwards)")
        self.target = target
        self.policy = policy
        self.min_bytes = int(min_bytes)
        self.keep_last_modules = int(keep_last_modules)
        self.prefetch_distance = int(prefetch_distance)
        self.on_error = on_error
        self.offload_cpu_tensors = offload_cpu_tensors
        self.verify = verify
        self.stall_tolerance = stall_tolerance
        self.replan_threshold = replan_threshold
        self.stats = OffloadStats()
        self.plan: OffloadPlan | None = None
        self.profile: StepProfile | None = None

        self._lock = threading.RLock()
        self._space = threading.Condition(self._lock)
        self.max_inflight_bytes = max_inflight_bytes
        self.max_prefetch_bytes = max_prefetch_bytes
        if not isinstance(pace, bool) and (not isinstance(pace, int) or pace < 0):
            raise OffloadConfigError(f"pace must be True, False or a number of units >= 0, got {pace!r}")
        self.pace = pace
        self.profile_after = int(profile_after)
        self._records_total = 0
        self._profile_retries = 0
        self._inflight_bytes = 0
        self._ahead_bytes = 0
        self._attr = f"_datapath_sid_{uuid.uuid4().hex[:10]}"
        self._ids = itertools.count(1)
        self._rids = itertools.count(1)
        self._entries: dict[int, _Entry] = {}
        self._record: _Record | None = None
        self._by_mb: dict[int, _Record] = {}
        self._mb: int | None = None
        self._profiling_record: _Record | None = None
        self._expected_units: int | None = None
        self._pending_error: BaseException | None = None
        self._param_keys: set[tuple[str, int, int]] = set()
        self._extra_params: list[weakref.ref[torch.Tensor]] = []
        self._models: list[tuple[weakref.ref[nn.Module], list[Any]]] = []
        self._hook_ctx: list[Any] = []
        self._closed = False
        self._shut = False
        self._streams: dict[torch.device, Streams] = {}
        self._store_workers: dict[str, Worker] = {}
        self._load_workers: dict[str, Worker] = {}
        self._patches: list[Any] = []

        # targets
        self._placement: list[Any] = []
        self.host: HostTarget | None = None
        self.ssd: SsdTarget | None = None
        if target in ("host", "tiered"):
            if host_budget_bytes is None:
                host_budget_bytes = int(pin_limit_bytes() * (0.8 if target == "host" else 0.5))
            self.host = HostTarget(HostPool(host_budget_bytes, slab_bytes=host_slab_bytes), verify=verify)
            self._placement.append(self.host)
        if target in ("ssd", "tiered"):
            assert path is not None
            self._spill = SpillDir(path)
            self.ssd = SsdTarget(self._spill, engine=engine, threads=io_threads, chunk_bytes=io_chunk_bytes,
                                 max_disk_bytes=max_disk_bytes, verify=verify)
            self._placement.append(self.ssd)
        self._finalizer = weakref.finalize(self, TensorCache._final_cleanup, self.ssd, self._store_workers,
                                           self._load_workers)

    # ------------------------------------------------------------------ info
    @property
    def directory(self) -> str | None:
        """The private directory holding the files (``"ssd"``/``"tiered"``), else None."""
        return str(self.ssd.spill.path) if self.ssd is not None else None

    @property
    def engine(self) -> str | None:
        """``"kvikio"`` or ``"posix"`` for file targets, None for ``"host"``."""
        return self.ssd.engine_name if self.ssd is not None else None

    @property
    def direct_io(self) -> bool | None:
        """Whether the POSIX engine uses O_DIRECT (None for ``"host"``)."""
        return self.ssd.direct if self.ssd is not None else None

    def files(self) -> list[str]:
        """Names of the activation files that exist now."""
        return [f for f in self.ssd.files() if f.endswith(".act")] if self.ssd is not None else []

    @property
    def live_storages(self) -> int:
        """Storages the cache tracks now (offloaded, loading, or held for autograd)."""
        with self._lock:
            return len(self._entries)

    def reset_stats(self) -> OffloadStats:
        """Start new counters; return the old ones."""
        with self._lock:
            old, self.stats = self.stats, OffloadStats()
            if self.host is not None:
                self.host.pool.peak_in_use = self.host.pool.in_use
            if self.ssd is not None:
                self.ssd.peak_reserved = self.ssd.reserved
            return old

    # ------------------------------------------------------------- attaching
    def attach(self, model: nn.Module, units: Iterable[nn.Module] | str | None = None) -> "TensorCache":
        """Install the module hooks on ``model`` (root) and its ``units``; record its parameters and buffers.

        ``units``: the modules whose calls are the scopes of offloading, prefetching and pacing.
        ``None`` or ``"blocks"``: the blocks of the model's largest ``ModuleList``/``Sequential``
        (transformer layers); ``"leaves"``: every module that owns parameters (Linear, LayerNorm, ...),
        finer scopes that keep less in memory while the backward prefetches; or an explicit list.
        """
        if self._closed:
            raise OffloadConfigError("this TensorCache is closed; build a new one")
        if isinstance(units, str):
            if units not in ("blocks", "leaves"):
                raise OffloadConfigError(f"units must be 'blocks', 'leaves' or a list of modules, got {units!r}")
            unit_list = _auto_units(model) if units == "blocks" else _leaf_units(model)
        else:
            unit_list = list(units) if units is not None else _auto_units(model)
        names = {id(m): n for n, m in model.named_modules()}
        hooks = [model.register_forward_pre_hook(self._on_root_forward),
                 model.register_forward_hook(self._on_root_exit)]
        for u in unit_list:
            name = names.get(id(u), u.__class__.__name__)
            hooks.append(u.register_forward_pre_hook(functools.partial(self._on_unit_enter, name)))
            hooks.append(u.register_forward_hook(functools.partial(self._on_unit_exit, name)))
        with self._lock:
            self._models.append((weakref.ref(model), hooks))
            self._refresh_params()
        log.debug("attached to %s with %d units", model.__class__.__name__, len(unit_list))
        return self

    def detach(self, model: nn.Module | None = None) -> None:
        """Remove the module hooks (of ``model``, or of every attached model)."""
        with self._lock:
            keep = []
            for ref, hooks in self._models:
                if model is None or ref() is model:
                    for h in hooks:
                        h.remove()
                else:
                    keep.append((ref, hooks))
            self._models = keep
            self._refresh_params()

    def register_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Never offload these tensors (nor views of their storage): weights held outside an attached model."""
        with self._lock:
            for p in params:
                self._extra_params.append(weakref.ref(p))
            self._refresh_params()

    def _refresh_params(self) -> None:
        keys: set[tuple[str, int, int]] = set()

        def add(t: torch.Tensor) -> None:
            to_local = getattr(t, "to_local", None)
            if to_local is not None:  # a DTensor (FSDP2's sharded parameters): its local shard's storage
                t = to_local()
            if t.device.type != "meta":
                keys.add((t.device.type, t.device.index or 0, t.untyped_storage().data_ptr()))

        for ref, _ in self._models:
            m = ref()
            if m is None:
                continue
            for p in m.parameters():
                add(p)
            for b in m.buffers():
                add(b)
        for r in self._extra_params:
            t = r()
            if t is not None:
                add(t)
        self._param_keys = keys

    # ---------------------------------------------------------- autograd hooks
    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The ``saved_tensors_hooks`` context that routes saved tensors through this cache."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "TensorCache":
        if self._closed:
            raise OffloadConfigError("this TensorCache is closed; build a new one")
        ctx = self.hooks()
        ctx.__enter__()
        self._hook_ctx.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hook_ctx.pop().__exit__(*exc)

    def _raise_pending(self) -> None:
        err = self._pending_error
        if err is not None:
            self._pending_error = None
            raise err

    def _pack(self, t: torch.Tensor) -> Any:
        st = self.stats
        with self._lock:
            self._raise_pending()
            st.packs += 1
            if not is_plain_strided(t):
                st.bytes_kept_other += t.numel() * t.element_size() if t.layout == torch.strided else 0
                return t
            view_bytes = t.numel() * t.element_size()
            if t.device.type == "cpu" and not self.offload_cpu_tensors:
                st.bytes_kept_cpu += view_bytes
                return t.detach()
            storage = t.untyped_storage()
            if (t.device.type, t.device.index or 0, storage.data_ptr()) in self._param_keys or (
                    t.requires_grad and t.is_leaf) or (
                    t._base is not None and t._base.is_leaf and t._base.requires_grad):
                st.bytes_kept_param += view_bytes
                return t
            sid = getattr(storage, self._attr, None)
            if sid is not None and sid < 0:
                if self._record is not None and -sid == self._record.rid and not _in_backward():
                    # a storage this forward already chose to keep: saved again, kept again (not a new one)
                    st.bytes_kept_policy += view_bytes
                    return t.detach()
                sid = None
            if sid is not None:
                e = self._entries.get(sid)
                if e is not None and not e.released:
                    st.bytes_deduplicated += view_bytes
                    st.dedup_hits += 1
                    rec = e.record
                    if not _in_backward() and rec is self._record and not rec.backward_started:
                        seg = self._current_segment(rec)
                        if e not in seg.entries:
                            seg.entries.append(e)
                    return _Handle(self, e, t)
            nbytes = storage.nbytes()
            if nbytes < self.min_bytes:
                st.bytes_kept_small += view_bytes
                return t.detach()
            if _in_backward():
                st.bytes_kept_backward += view_bytes
                return t.detach()
            rec = self._record
            if rec is None or rec.backward_started:
                rec = self._start_record()
            seg = self._current_segment(rec)
            idx = rec.first_packs
            rec.first_packs += 1
            if rec.profiling:
                rec.tensors.append((seg.index, nbytes, self._mark(t.device)))
            if not self._decide(rec, seg, idx):
                st.bytes_kept_policy += view_bytes
                setattr(storage, self._attr, -rec.rid)  # later saves of it in this forward are not new storages
                return t.detach()
            if self.max_inflight_bytes is not None and self._inflight_bytes + nbytes > self.max_inflight_bytes:
                t0 = time.perf_counter()
                self._space.wait_for(lambda: self._inflight_bytes == 0 or self._pending_error is not None or
                                     self._inflight_bytes + nbytes <= self.max_inflight_bytes)  # type: ignore[operator]
                self.stats.store_wait_seconds += time.perf_counter() - t0
                self._raise_pending()
            target = next((p for p in self._placement if p.reserve(nbytes)), None)
            if target is None:
                st.bytes_kept_budget += view_bytes
                setattr(storage, self._attr, -rec.rid)
                return t.detach()
            e = _Entry(next(self._ids), nbytes, t.device, rec, seg.index, target, storage_bytes(t), t.detach())
            if t.is_cuda:
                stream = torch.cuda.current_stream(t.device)
                e.pack_event = torch.cuda.Event()
                e.pack_event.record(stream)
                e.pack_stream = stream
            setattr(storage, self._attr, e.sid)
            self._entries[e.sid] = e
            self._inflight_bytes += nbytes
            st.peak_inflight_bytes = max(st.peak_inflight_bytes, self._inflight_bytes)
            seg.entries.append(e)
            rec.live += 1
            rec.entries_made += 1
            st.storages_offloaded += 1
            st.bytes_queued += nbytes
            self._store_worker(target).submit(functools.partial(self._store_job, e))
            return _Handle(self, e, t)

    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        h: _Handle = obj
        t = h.tref()
        if t is not None and t._version != h.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a saved tensor of shape {list(h.spec.shape)} is at version {t._version}; "
                f"expected version {h.version} instead (datapath.offload checks this in autograd's place).")
        data = self._acquire(h.entry)
        with self._lock:
            self.stats.unpacks += 1
        return rebuild(data, h.spec)

    def _acquire(self, e: _Entry) -> torch.Tensor:
        """The bytes of ``e`` in memory, usable on the current stream (waits for a load in flight)."""
        with self._lock:
            self._raise_pending()
            if e.modified:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    "operation after it was saved (seen by datapath.offload while storing it).")
            rec = e.record
            if _in_backward() and not rec.backward_started:
                self._begin_backward(rec)
            self._bring_back(e, prefetch=False)
            self._not_ahead(e)
            if rec.segments and not rec.segments[e.segment].prefetched:
                self._prefetch_range(rec, e.segment)  # no module hooks fired: prefetch from here on
            forwarded = e.state == STORING or (e.state == RESIDENT and e.alloc_stream is None)
            data = (e.src if e.state == STORING else e.gpu) if forwarded else None
        if forwarded:
            assert data is not None
            if data.is_cuda:
                cur = torch.cuda.current_stream(data.device)
                if e.pack_stream is not None and e.pack_stream != cur:
                    cur.wait_event(e.pack_event)
                    data.record_stream(cur)
            return data
        t0 = time.perf_counter()
        e.ready.wait()
        waited = time.perf_counter() - t0
        with self._lock:
            self.stats.unpack_wait_seconds += waited
            e.record.wait_s += waited
            if e.error is not None:
                raise _fresh(e.error)
            data, ev, stream = e.gpu, e.ready_event, e.alloc_stream
        assert data is not None, f"offloaded storage {e.sid} has no data in state {e.state}"
        if data.is_cuda:
            cur = torch.cuda.current_stream(data.device)
            if ev is not None:
                cur.wait_event(ev)
            if stream is not None and stream != cur:
                data.record_stream(cur)
        return data

    # ------------------------------------------------------------ scope hooks
    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        if _in_backward():
            return
        with self._lock:
            self._raise_pending()
            self._refresh_params()
            rec = self._record
            if rec is not None and rec.microbatch is not None and not rec.segments and not rec.backward_started:
                return
            self._start_record()

    def _on_root_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        """Pacing: what follows the forward (loss, the first backward ops) is launched once the GPU has
        finished the forward, so its memory is counted after the stores made during the forward."""
        if _in_backward():
            return
        with self._lock:
            rec = self._record
            if rec is None or rec.pace < 0 or rec.backward_started or rec.live == 0:
                return
            ev = torch.cuda.Event()
            ev.record()
        ev.synchronize()

    def _on_unit_enter(self, name: str, module: nn.Module, args: Any) -> None:
        if _in_backward():
            return
        wait_ev = None
        with self._lock:
            rec = self._record
            if rec is None or rec.backward_started:
                rec = self._start_record()
            rec.depth += 1
            if rec.depth == 1:
                self._close_segment(rec)
                rec.units += 1
                seg = _Segment(len(rec.segments), True, rec.units, name)
                if rec.profiling:
                    seg.t_start = self._mark(None)
                rec.segments.append(seg)
                if rec.pace >= 0:
                    ev = torch.cuda.Event()
                    ev.record()
                    rec.pace_fwd.append(ev)
                    lead = rec.pace
                    n = rec.expected_units
                    if n and rec.units > n - max(1, n // 8):
                        # the last eighth of the forward, where the peak forms: launch a unit only once
                        # the GPU has finished the one before (its stores have had that much more time)
                        lead = 0
                    while len(rec.pace_fwd) > lead:  # lead 0: the event just recorded
                        wait_ev = rec.pace_fwd.popleft()
        if wait_ev is not None:
            # pacing: launch unit k only once the GPU has started unit k-lead, so that "now" on the CPU
            # is "now" on the GPU within a few units (stores have had their time, memory is freed in order)
            wait_ev.synchronize()

    def _on_unit_exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if _in_backward():
            return
        with self._lock:
            rec = self._record
            if rec is None or rec.depth == 0:
                return
            rec.depth -= 1
            if rec.depth:
                return
            seg = rec.segments[-1]
            if rec.profiling:
                seg.t_end = self._mark(None)
            seen: set[int] = set()
            for t in _tensors(output):
                fn = t.grad_fn
                if fn is not None and id(fn) not in seen:
                    seen.add(id(fn))
                    fn.register_prehook(functools.partial(self._on_unit_backward, rec, seg.index))

    def _on_unit_backward(self, rec: _Record, j: int, grad_outputs: Any) -> None:
        wait_ev = None
        with self._lock:
            seg = rec.segments[j]
            if seg.bwd_fired:
                return
            seg.bwd_fired = True
            if rec.pace >= 0:
                ev = torch.cuda.Event()
                ev.record()
                # the first backward unit waits for the whole forward (the memory peak forms here);
                # later ones for the GPU to reach the backward of the unit ``lead`` units before
                first = not rec.bwd_paced
                rec.bwd_paced = True
                rec.pace_bwd.append(ev)
                if first:
                    wait_ev = ev
                while len(rec.pace_bwd) > rec.pace:  # lead 0: the event just recorded
                    wait_ev = rec.pace_bwd.popleft()
        if wait_ev is not None:
            wait_ev.synchronize()
        with self._lock:
            if rec.profiling:
                seg.t_bwd = self._mark(None)
            if not rec.backward_started:
                self._begin_backward(rec)
            for e in seg.entries:
                if e.state == PENDING:
                    self._forward_pending(e)
            self._prefetch_range(rec, j)

    def _current_segment(self, rec: _Record) -> _Segment:
        if rec.depth == 0 and (not rec.segments or rec.segments[-1].is_unit):
            self._close_segment(rec)
            seg = _Segment(len(rec.segments), False, rec.units, "(between units)")
            if rec.profiling:
                seg.t_start = self._mark(None)
            rec.segments.append(seg)
        return rec.segments[-1]

    def _close_segment(self, rec: _Record) -> None:
        if rec.segments and not rec.segments[-1].is_unit and rec.profiling and rec.segments[-1].t_end is None:
            rec.segments[-1].t_end = self._mark(None)

    # ---------------------------------------------------------------- records
    def _start_record(self, microbatch: int | None = None) -> _Record:
        self._maybe_plan()
        self._drop_idle_record(self._record)
        profiling = (self.policy == "adaptive" and self.plan is None and self._profiling_record is None
                     and self._records_total >= self.profile_after)
        self._records_total += 1
        adaptive_ready = self.policy == "adaptive" and self.plan is not None
        rec = _Record(next(self._rids), profiling,
                      self.plan.cutoff if adaptive_ready else None,
                      self.plan.prefetch_distance if adaptive_ready else self.prefetch_distance,
                      self._expected_units, microbatch if microbatch is not None else self._mb)
        rec.pace = (self._pace_lead() if self.pace is not False and torch.cuda.is_available()
                    and bool(self._models) and self._cuda_model() else -1)
        if profiling:
            self._profiling_record = rec
            rec.t0 = self._mark(None)
        if rec.microbatch is not None:
            self._by_mb[rec.microbatch] = rec
        self._record = rec
        self.stats.records += 1
        return rec

    def _drop_idle_record(self, rec: _Record | None) -> None:
        """Forget a record that saved nothing offloadable (no-grad forward) so it cannot block profiling."""
        if rec is not None and rec.first_packs == 0 and not rec.backward_started:
            if self._profiling_record is rec:
                self._profiling_record = None
            if rec.microbatch is not None and self._by_mb.get(rec.microbatch) is rec:
                del self._by_mb[rec.microbatch]

    def _decide(self, rec: _Record, seg: _Segment, idx: int) -> bool:
        if rec.cutoff is not None:
            return idx < rec.cutoff
        n = rec.expected_units
        return not (n is not None and seg.unit_pos > n - self.keep_last_modules)

    def _begin_backward(self, rec: _Record) -> None:
        rec.backward_started = True
        if rec.profiling:
            rec.t_bwd0 = self._mark(None)
            self._close_segment(rec)
        self._expected_units = rec.units
        if rec.cutoff is None and rec.expected_units is None:
            # the first forward did not know which units are last: drop their queued stores now
            for seg in rec.segments:
                if seg.unit_pos > rec.units - self.keep_last_modules:
                    for e in seg.entries:
                        if e.state == PENDING:
                            self._forward_pending(e)
        if rec.segments:
            self._prefetch_range(rec, len(rec.segments) - 1)

    def _record_done(self, rec: _Record) -> None:
        rec.complete = True
        if rec.microbatch is not None and self._by_mb.get(rec.microbatch) is rec:
            del self._by_mb[rec.microbatch]
        if self._profiling_record is rec and not rec.backward_started:
            self._profiling_record = None  # its graph was dropped without a backward: profile again
        if self.policy == "adaptive" and self.plan is not None and self.profile is not None and not rec.profiling:
            w = rec.bytes_written / rec.write_s if rec.bytes_written >= 32 << 20 and rec.write_s > 0 else None
            planned = self.plan.write_bandwidth / 0.9
            if w is not None and abs(w / planned - 1) > self.replan_threshold:
                r = rec.bytes_read / rec.read_s if rec.read_s > 0 else None
                log.info("write bandwidth %.2f GB/s differs from the plan's %.2f GB/s: re-planning",
                         w / 1e9, planned / 1e9)
                self.plan = plan_offload(self.profile, stall_tolerance=self.stall_tolerance,
                                         write_bandwidth=w, read_bandwidth=r, shared_channel=self._shared_channel)
            else:
                self._back_off(rec)
        if (self.policy == "adaptive" and self.profile is not None and not rec.profiling
                and rec.first_packs and abs(rec.first_packs - len(self.profile.tensors)) > 0.1 * rec.first_packs):
            log.info("the forward changed (%d offloadable storages, profile had %d): profiling again",
                     rec.first_packs, len(self.profile.tensors))
            self.plan = None
            self.profile = None

    def _back_off(self, rec: _Record) -> None:
        """The backward waited for loads longer than the plan allows: offload less from the next step.

        The profile can overrate the time loads have (its own step was slowed by offloading
        everything); the bytes that arrived late (wait x read bandwidth, at least one storage)
        come off the end of the planned prefix.
        """
        plan, prof = self.plan, self.profile
        assert plan is not None and prof is not None
        if plan.cutoff == 0 or rec.wait_s <= max(self.stall_tolerance * plan.step_time, 1e-3):
            return
        late = rec.wait_s * (rec.bytes_read / rec.read_s if rec.read_s > 0 else plan.read_bandwidth)
        cutoff, cut = plan.cutoff, 0.0
        while cutoff > 0 and (cut < late or cutoff == plan.cutoff):
            cutoff -= 1
            cut += prof.tensors[cutoff].nbytes
        log.info("the backward waited %.1f ms for loads (plan allows %.1f ms): offloading %d instead of %d "
                 "storages", rec.wait_s * 1e3, self.stall_tolerance * plan.step_time * 1e3, cutoff, plan.cutoff)
        self.stats.plan_backoffs += 1
        self.plan = dataclasses.replace(plan, cutoff=cutoff, bytes_planned=sum(
            tp.nbytes for tp in prof.tensors[:cutoff]))

    def _maybe_plan(self) -> None:
        rec = self._profiling_record
        if rec is None or not rec.complete or not rec.backward_started:
            return
        self._profiling_record = None
        prof = self._build_profile(rec)
        w = r = None
        if self.target == "ssd" and self.ssd is not None:
            # the profiled step's stores were cut short by forwarding; a direct probe of the disk is steadier
            cuda = self._cuda_model() and torch.cuda.is_available()
            try:
                w, r = self.ssd.probe(128 << 20 if cuda else 8 << 20,
                                      self._streams_for(torch.device("cuda", torch.cuda.current_device()))
                                      if cuda else None)
                log.info("disk probe: write %.2f GB/s, read %.2f GB/s (profiled step: write %.2f GB/s)",
                         w / 1e9, r / 1e9, prof.write_bandwidth / 1e9)
            except (OffloadError, OSError) as exc:  # a full disk must not fail the step: plan on the profile
                log.warning("disk probe failed (%s); planning with the profiled bandwidth", exc)
                w = r = None
        if w is None and prof.write_bandwidth <= 0 and self._profile_retries < 3:
            # no bandwidth known: no store finished during the profiled step (and no probe): measure again
            self._profile_retries += 1
            log.info("adaptive offload: no store finished in the profiled step; profiling the next one")
            return
        self.profile = prof
        self.plan = plan_offload(prof, stall_tolerance=self.stall_tolerance, shared_channel=self._shared_channel,
                                 write_bandwidth=w, read_bandwidth=r)
        if self.plan.cutoff == 0:
            log.info("adaptive offload: nothing can be offloaded in time at %.2f GB/s write, %.2f GB/s read",
                     prof.write_bandwidth / 1e9, prof.read_bandwidth / 1e9)
        log.info("adaptive offload plan: %d of %d storages (%.2f of %.2f GB), prefetch %d unit(s) ahead; "
                 "planned at write %.2f GB/s, read %.2f GB/s (with a safety margin), predicted stall %.1f ms",
                 self.plan.cutoff, len(prof.tensors), self.plan.bytes_planned / 1e9, self.plan.bytes_total / 1e9,
                 self.plan.prefetch_distance, self.plan.write_bandwidth / 1e9, self.plan.read_bandwidth / 1e9,
                 self.plan.predicted_stall * 1e3)

    def _build_profile(self, rec: _Record) -> StepProfile:
        sec = self._seconds
        t0 = rec.t0
        segs = []
        for i, s in enumerate(rec.segments):
            start = sec(t0, s.t_start) if s.t_start is not None else 0.0
            if s.t_end is not None:
                end = sec(t0, s.t_end)
            elif i + 1 < len(rec.segments) and rec.segments[i + 1].t_start is not None:
                end = sec(t0, rec.segments[i + 1].t_start)
            else:
                end = sec(t0, rec.t_bwd0) if rec.t_bwd0 is not None else start
            # the backward of the profiled step ran with everything offloaded (slowed by its loads):
            # the planner estimates each segment's backward from its forward time instead
            segs.append(SegmentProfile(s.is_unit, start, end, None))
        tensors = [TensorProfile(si, nb, sec(t0, m)) for si, nb, m in rec.tensors]
        w = rec.bytes_written / rec.write_s if rec.write_s > 0 else self.stats.write_bandwidth
        r = rec.bytes_read / rec.read_s if rec.read_s > 0 else self.stats.read_bandwidth
        bwd0 = sec(t0, rec.t_bwd0) if rec.t_bwd0 is not None else (segs[-1].forward_end if segs else 0.0)
        return StepProfile(segs, tensors, bwd0, w, r or w)

    def _mark(self, device: torch.device | None) -> Any:
        if (device is None and torch.cuda.is_available() and self._cuda_model()) or (
                device is not None and device.type == "cuda"):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @property
    def _shared_channel(self) -> bool:
        """Stores and loads share one device (files on a disk), so the planner serialises them."""
        return self.target == "ssd"

    def _pace_lead(self) -> int:
        """How many units the CPU may run ahead of the GPU."""
        return 1 if isinstance(self.pace, bool) else int(self.pace)

    def _cuda_model(self) -> bool:
        for ref, _ in self._models:
            m = ref()
            if m is not None:
                p = next(m.parameters(), None)
                return p is not None and p.is_cuda
        return True

    @staticmethod
    def _seconds(a: Any, b: Any) -> float:
        if isinstance(a, float) and isinstance(b, float):
            return b - a
        if isinstance(a, float) or isinstance(b, float):
            return 0.0  # a CPU mark and a GPU mark do not compare
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    # ------------------------------------------------------------ prefetching
    def _prefetch_range(self, rec: _Record, j: int) -> None:
        """Prefetch segment ``j`` and those before it, down to the ``distance``-th unit before ``j``
        (and, with ``max_prefetch_bytes``, only while the loads started here stay under it)."""
        d = rec.distance
        units_before = [i for i in range(j - 1, -1, -1) if rec.segments[i].is_unit]
        lo = units_before[d - 1] if len(units_before) >= d else 0
        limit = self.max_prefetch_bytes
        started = 0
        for s in range(j, lo - 1, -1):
            if limit is not None and s != j:
                need = sum(e.nbytes for e in rec.segments[s].entries if e.state == STORED and not e.released)
                if started + need > limit:
                    break
            started += self._prefetch_segment(rec, s)

    def _prefetch_segment(self, rec: _Record, s: int) -> int:
        """Start bringing back the storages of segment ``s``; the bytes of the loads started."""
        seg = rec.segments[s]
        if seg.prefetched:
            return 0
        seg.prefetched = True
        live = [e for e in seg.entries if not e.released]
        if not live:
            return 0
        self.stats.prefetch_order.append((rec.rid, s))
        started = 0
        for e in live:
            if e.state == STORED:
                started += e.nbytes
            self._bring_back(e, prefetch=True)
        return started

    def _bring_back(self, e: _Entry, prefetch: bool) -> None:
        """Start getting ``e`` back into GPU memory (lock held): cancel a pending store, forward a running
        one from memory, or load a stored one."""
        if e.state == PENDING:
            self._forward_pending(e)
        elif e.state == STORING and not e.forwarded:
            e.forwarded = True
            self.stats.bytes_forwarded += e.nbytes
        elif e.state == STORED:
            self._submit_load(e)
            if prefetch:
                self.stats.loads_prefetched += 1
                e.ahead = True
                self._ahead_bytes += e.nbytes
                self.stats.peak_prefetch_bytes = max(self.stats.peak_prefetch_bytes, self._ahead_bytes)
            else:
                self.stats.loads_on_demand += 1

    def _not_ahead(self, e: _Entry) -> None:
        """``e`` was handed to autograd (or dropped): its prefetched bytes no longer count as ahead."""
        if e.ahead:
            e.ahead = False
            self._ahead_bytes -= e.nbytes

    def _uncount(self, e: _Entry) -> None:
        """The store of ``e`` is over (done, failed or cancelled): free its share of max_inflight_bytes."""
        if e.counted:
            e.counted = False
            self._inflight_bytes -= e.nbytes
            self._space.notify_all()

    def _forward_pending(self, e: _Entry) -> None:
        """Cancel the queued store of ``e``: its bytes stay in memory (lock held)."""
        self._uncount(e)
        e.cancelled = True
        e.forwarded = True
        e.target.unreserve(e.nbytes)
        e.gpu, e.src, e.tensor = e.src, None, None
        e.state = RESIDENT
        e.ready.set()
        self.stats.stores_cancelled += 1
        self.stats.bytes_forwarded += e.nbytes

    def _submit_load(self, e: _Entry) -> None:
        """Allocate the destination on the current stream and queue the load of ``e`` (lock held)."""
        dst = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
        alloc_ev = None
        if dst.is_cuda:
            cur = torch.cuda.current_stream(e.device)
            alloc_ev = torch.cuda.Event()
            alloc_ev.record(cur)
            e.alloc_stream = cur
            dst.record_stream(self._streams_for(e.device).load)
        e.gpu = dst
        e.state = LOADING
        e.ready.clear()
        self._load_worker(e.target).submit(functools.partial(self._load_job, e, alloc_ev))

    # ---------------------------------------------------------------- workers
    def _streams_for(self, device: torch.device) -> Streams:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = Streams(device)
        return s

    def _store_worker(self, target: Any) -> Worker:
        w = self._store_workers.get(target.kind)
        if w is None:
            w = self._store_workers[target.kind] = Worker(f"datapath-store-{target.kind}")
        return w

    def _load_worker(self, target: Any) -> Worker:
        w = self._load_workers.get(target.kind)
        if w is None:
            # loads are issued in the order the backward needs them; a small window would stall the
            # issuing of later loads on the completion of earlier ones (autograd then waits)
            w = self._load_workers[target.kind] = Worker(f"datapath-load-{target.kind}", window=64)
        return w

    def _store_job(self, e: _Entry) -> Any:
        with self._lock:
            if e.state != PENDING or e.cancelled or e.released:
                return None
            e.state = STORING
            src, pev = e.src, e.pack_event
        assert src is not None
        streams = self._streams_for(e.device) if src.is_cuda else None
        if src.is_cuda:
            torch.cuda.set_device(e.device)
        target = e.target
        try:
            if target.kind == "host":
                res = target.store(src, pev, streams)
            else:
                res = target.store(src, pev, streams, e.name, lambda: e.forwarded or e.released)
        except BaseException as exc:  # noqa: BLE001 - reported in the step, never swallowed
            self._store_failed(e, exc)
            return None
        del src

        def finish() -> None:
            with self._lock:
                try:
                    if res.cleanup is not None:
                        res.cleanup()
                except BaseException as exc:  # noqa: BLE001
                    self._store_failed(e, exc, loc=res.loc)
                    return
                secs = res.timing[0].elapsed_time(res.timing[1]) / 1e3 if res.timing else res.seconds
                self._finish_store(e, res, secs)

        if res.event is not None:
            return res.event, finish
        finish()
        return None

    def _finish_store(self, e: _Entry, res: Any, secs: float) -> None:
        self._uncount(e)
        st = self.stats
        rec = e.record
        done = e.nbytes if res.complete else min(res.bytes_done, e.nbytes)
        if done:  # a store stopped early still measured the bandwidth with the bytes it wrote
            st.write_seconds += secs
            st.bytes_written_partial += 0 if res.complete else done
            rec.write_s += secs
            rec.bytes_written += done
        if res.complete:
            st.bytes_offloaded += e.nbytes
        e.loc = res.loc
        e.crc = res.crc
        if e.target.kind == "ssd":
            st.files_created += 1
            st.peak_disk_bytes = max(st.peak_disk_bytes, self.ssd.peak_reserved if self.ssd else 0)
        else:
            st.peak_host_bytes = max(st.peak_host_bytes, e.target.pool.peak_in_use)
        if e.tensor is not None and e.tensor._version != e.version:
            e.modified = True
        e.tensor = None
        if e.released:
            e.src = None
            self._free_loc(e)
            return
        if e.forwarded or not res.complete:
            e.gpu, e.src = e.src, None
            e.state = RESIDENT
            e.ready.set()
            self._free_loc(e)
            return
        e.src = None  # the device memory goes back to the allocator now
        e.state = STORED

    def _store_failed(self, e: _Entry, exc: BaseException, loc: Any = None) -> None:
        err = exc if isinstance(exc, OffloadError) else OffloadError(
            f"storing an activation of {e.nbytes} bytes to {e.target.kind} failed: "
            f"{exc.__class__.__name__}: {exc}")
        if err is not exc:
            err.__cause__ = exc
        with self._lock:
            self._uncount(e)
            self.stats.store_errors += 1
            if loc is not None:
                e.loc = loc
                self._free_loc(e)
            else:
                e.target.unreserve(e.nbytes)
            e.tensor = None
            if e.released:
                e.src = None
                return
            e.gpu, e.src = e.src, None
            e.state = RESIDENT
            e.ready.set()
            self.stats.bytes_kept_error += e.nbytes
            if self.on_error == "raise":
                if self._pending_error is None:
                    self._pending_error = err
            else:
                log.warning("%s; keeping the tensor in memory (on_error='keep')", err)

    def _free_loc(self, e: _Entry) -> None:
        """Release the target copy of ``e`` (lock held)."""
        loc, e.loc = e.loc, None
        if loc is None:
            return
        if e.target.kind == "host":
            e.target.free(loc)
        else:
            if e.target.free(loc):
                self.stats.files_removed += 1
            e.target.unreserve(e.nbytes)

    def _load_job(self, e: _Entry, alloc_ev: Any) -> Any:
        with self._lock:
            if e.released or e.state != LOADING:
                if e.state == LOADING:
                    self._free_loc(e)
                    e.gpu = None
                    e.ready.set()
                return None
            loc, dst = e.loc, e.gpu
        assert dst is not None
        streams = self._streams_for(e.device) if dst.is_cuda else None
        if dst.is_cuda:
            torch.cuda.set_device(e.device)
        target = e.target
        try:
            if loc is None:
                raise OffloadError(f"offloaded storage {e.sid} has no stored copy to load")
            res = target.load(loc, dst, alloc_ev, streams, e.crc, e.name)
        except BaseException as exc:  # noqa: BLE001
            err = exc if isinstance(exc, OffloadError) else OffloadError(
                f"loading an activation of {e.nbytes} bytes from {target.kind} failed: "
                f"{exc.__class__.__name__}: {exc}")
            if err is not exc:
                err.__cause__ = exc
            err.__traceback__ = None  # kept in the entry: no frames (and no reference cycle through them)
            with self._lock:
                self.stats.load_errors += 1
                e.error = err
                e.state = FAILED
                e.gpu = None
                if target.kind == "host":
                    self._free_loc(e)
                else:
                    self._free_loc(e)
                e.ready.set()
            return None
        del dst

        with self._lock:
            e.ready_event = res.event
            e.state = RESIDENT
            if target.kind == "ssd":
                self._free_loc(e)  # consumed: the file goes now
            else:
                e.loc = None  # the host block is freed by res.cleanup once the copy is done
            if e.released:
                e.gpu = None
            e.ready.set()

        def finish() -> None:
            with self._lock:
                secs = res.timing[0].elapsed_time(res.timing[1]) / 1e3 if res.timing else res.seconds
                self.stats.read_seconds += secs
                self.stats.bytes_loaded += e.nbytes
                e.record.read_s += secs
                e.record.bytes_read += e.nbytes
                if res.cleanup is not None:
                    res.cleanup()

        if res.event is not None and (res.timing is not None or res.cleanup is not None):
            return res.event, finish
        finish()
        return None

    # ------------------------------------------------------------ lifetimes
    def _drop_handle(self, e: _Entry) -> None:
        with self._lock:
            e.handles -= 1
            if e.handles > 0 or e.released:
                return
            e.released = True
            self._not_ahead(e)
            self._entries.pop(e.sid, None)
            rec = e.record
            rec.live -= 1
            if e.state == PENDING:
                self._uncount(e)
                e.cancelled = True
                e.target.unreserve(e.nbytes)
                e.src = e.tensor = None
                self.stats.stores_cancelled += 1
            elif e.state == STORED:
                self._free_loc(e)
            elif e.state in (RESIDENT, FAILED):
                e.gpu = e.src = None
            # STORING / LOADING: the worker frees what it holds when it finishes
            if rec.live == 0:
                self._record_done(rec)
            if self._closed and not self._entries:
                self._shutdown(join=False)

    # ------------------------------------------------------------------ hints
    def set_microbatch(self, index: int) -> None:
        """Hint: the next forward (or backward) is for micro-batch ``index`` (pipeline schedules)."""
        with self._lock:
            self.stats.microbatch_hints += 1
            self._mb = index
            rec = self._by_mb.get(index)
            if rec is None or rec.complete:
                rec = self._start_record(microbatch=index)
            self._record = rec

    def begin_backward(self) -> None:
        """Hint: the backward of the current micro-batch starts now (start loading its last units)."""
        with self._lock:
            rec = self._record
            if rec is not None and not rec.backward_started:
                self._begin_backward(rec)

    def prefetch_last_module(self) -> None:
        """Hint: start loading the last offloaded unit(s) of the current micro-batch ahead of its backward."""
        with self._lock:
            rec = self._record
            if rec is not None and rec.segments:
                self._prefetch_range(rec, len(rec.segments) - 1)

    def wait_io(self) -> None:
        """Block until every queued store and load has finished; raise a pending `OffloadError`."""
        for w in list(self._store_workers.values()) + list(self._load_workers.values()):
            w.wait_idle()
        with self._lock:
            self._raise_pending()

    # -------------------------------------------------------- schedule hints
    def patch_schedules(self) -> list[str]:
        """Patch Megatron-core's and DeepSpeed's pipeline schedules (when importable) to give this cache hints."""
        from datapath.offload.integrations import patch_schedules  # noqa: PLC0415

        patched = patch_schedules(self)
        self._patches.extend(patched)
        return [p.name for p in patched]

    def unpatch_schedules(self) -> None:
        while self._patches:
            self._patches.pop().restore()

    # -------------------------------------------------------------- closing
    def close(self, raise_errors: bool = True) -> None:
        """Remove the hooks and wait for I/O; files, threads and host memory go once autograd holds nothing.

        A graph built inside the cache can still be backpropagated after `close`;
        the directory is removed when its last saved tensor is consumed (or at exit).
        """
        if self._closed:
            return
        self.unpatch_schedules()
        self.detach()
        try:
            self.wait_io()
        except OffloadError:
            if raise_errors:
                raise
        finally:
            with self._lock:
                self._closed = True
                idle = not self._entries
            if idle:
                self._shutdown(join=True)

    def _shutdown(self, join: bool) -> None:
        with self._lock:
            if self._shut:
                return
            self._shut = True
        for w in list(self._store_workers.values()) + list(self._load_workers.values()):
            w.stop(join=join)
        if self.ssd is not None:
            self.ssd.close()
        if self.host is not None:
            self.host.close()
        self._finalizer.detach()

    @staticmethod
    def _final_cleanup(ssd: SsdTarget | None, stores: dict[str, Worker], loads: dict[str, Worker]) -> None:
        for w in list(stores.values()) + list(loads.values()):
            try:
                w.stop(join=False)
            except Exception:  # noqa: BLE001
                pass
        if ssd is not None:
            try:
                ssd.close()
            except Exception:  # noqa: BLE001
                pass

    @property
    def closed(self) -> bool:
        return self._closed


def _fresh(err: BaseException) -> BaseException:
    """A new exception like ``err`` to raise (the stored one stays free of this thread's frames)."""
    if isinstance(err, OffloadError):
        new = OffloadError(err.message, errno=err.errno, filename=err.filename)
        new.__cause__ = err.__cause__
        return new
    return err


def _leaf_units(model: nn.Module) -> list[nn.Module]:
    """Every module below ``model`` that owns parameters itself (Linear, LayerNorm, Embedding, ...)."""
    out = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
    return out or _auto_units(model)


def _auto_units(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model``: children of its largest (by parameters) ModuleList/Sequential, else its children."""
    best: nn.Module | None = None
    best_size = -1
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = m, size
    if best is not None:
        return list(best)
    return [c for c in model.children() if any(True for _ in c.parameters())]

