"""The saved-tensor hooks: what autograd saves is kept, or replaced by a handle to an offloaded storage.

The pack hook gets every tensor autograd saves.  Kept as they are: tensor
subclasses and sparse/quantized tensors, CPU tensors (unless asked), parameters,
buffers and views of them, storages under ``min_bytes``, tensors saved during
backward (reentrant checkpoint recomputation, double backward) and what the
policy keeps.  Any other tensor is replaced by a `Handle` naming its *storage*
and its view: one store per storage whatever number of views of it autograd
saves; every view is rebuilt on unpack (bit-identical).  The output of an elementwise
op whose inputs were saved is replaced by a `Recipe` and recomputed on unpack
(`datapath.offload.op_recompute`).  The unpack hook waits
for the storage's load (or takes it from memory when its store has not finished)
and rebuilds the view on the consumer's stream.

A forward whose plan stores nothing (a memory budget met by keeping and recomputing
alone) and makes no elementwise recipe runs without the hooks: at the root module's
forward, `SavedTensorHooks.suspend` takes them off the thread's hook stack (they would
keep every tensor as it is anyway, at a Python call per saved tensor) and the next root
forward puts them back where they were (`resume`).

The hooks are the top of the flow: each saved tensor goes hooks -> policy (keep or
offload, backpressure) -> transfers (store, load) -> store.  They are built with those
parts, the scope tracker (which record and segment a tensor belongs to) and the attached
models (parameters are kept), never with the cache that assembles them.
"""
from __future__ import annotations

import threading
import uuid
import warnings
from typing import Any

import torch
from torch import nn

from datapath.offload.config import SelectOptions
from datapath.offload.entry import Entry, Handle, Releases
from datapath.offload.errors import OffloadWarning
from datapath.offload.models import AttachedModels
from datapath.offload.op_recompute import OpRecipes, Recipe
from datapath.offload.policy import Policy
from datapath.offload.records import Clock
from datapath.offload.scopes import ScopeTracker, in_backward
from datapath.offload.stats import OffloadStats
from datapath.offload.store import Store
from datapath.offload.transfers import Transfers
from datapath.offload.views import check_version, is_plain_strided, rebuild, storage_bytes


class SavedTensorHooks:
    """``pack``/``unpack`` for `torch.autograd.graph.saved_tensors_hooks`.

    Built with what they use: the cache's ``lock`` and ``stats``, ``select`` (which tensors are
    candidates), the attached ``models`` (parameters), the ``scopes`` (records and segments), the
    ``policy`` (keep or offload, backpressure), the ``transfers`` (stores, loads), the ``store``
    (room for a storage), the ``clock`` (profiling marks) and the ``releases`` (the `Handle` s
    autograd let go of: drained at each pack and unpack).
    """

    def __init__(self, lock: threading.RLock, select: SelectOptions, stats: OffloadStats, models: AttachedModels,
                 scopes: ScopeTracker, policy: Policy, transfers: Transfers, store: Store, clock: Clock,
                 releases: Releases) -> None:
        self.lock = lock
        self.select = select
        self.stats = stats
        self.models = models
        self.scopes = scopes
        self.policy = policy
        self.transfers = transfers
        self.store = store
        self.clock = clock
        self.releases = releases
        self._warned_full = False
        # compiled blocks save what their graph's partitioner chose (it recomputes elementwise ops itself)
        self.ops = OpRecipes() if select.recompute_elementwise and select.compile_options is None else None
        self.attr = f"_datapath_sid_{uuid.uuid4().hex[:10]}"  # storage -> entry id (negative: kept by record)
        self._ids = iter(range(1, 1 << 62))
        self._pack = torch.compiler.disable(self.pack)
        self._unpack = torch.compiler.disable(self.unpack)
        self._suspended_on: int | None = None  # the thread whose hook stack lacks ours (see `suspend`)
        self._below: Any = None                # the top of that stack once ours were taken off

    def context(self) -> "_HookContext":
        # run as plain Python, never traced: under torch.compile(model) autograd calls the hooks from ops
        # that run eagerly (around a graph break), where TorchDynamo would otherwise compile the hooks and
        # everything they call (as it does the module hooks: see `scopes`)
        return _HookContext(self)

    def attach(self, model: nn.Module) -> list[Any]:
        """A pre-hook on ``model``'s forward (after the scope tracker's) that takes the hooks off for a step
        that stores nothing, and puts them back for the next; its handle."""
        return [model.register_forward_pre_hook(torch.compiler.disable(self._on_root_forward))]

    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        if in_backward():
            return
        with self.lock:
            self.resume()
            # a step whose plan stores nothing (and no elementwise recipe to make): no pack call per saved tensor
            rec = self.scopes.record
            if (self.ops is None and not self.transfers.inflight_bytes and rec is not None
                    and self.policy.stores_nothing(rec) and self.suspend()):
                self.stats.records_unhooked += 1

    def suspend(self) -> bool:
        """Take this cache's hooks off the calling thread's saved-tensor hook stack for the forward that starts
        now (a planned step that stores nothing: without them autograd keeps every tensor as the hooks would,
        with no Python call per saved tensor).  Only when they are on top of the stack; False otherwise.  The
        next root forward puts them back (`resume`), where they were."""
        if self._suspended_on is not None:
            return False
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)  # noqa: SLF001
        if top is None or top[0] is not self._pack:
            return False
        torch._C._autograd._pop_saved_tensors_default_hooks()  # noqa: SLF001
        self._below = torch._C._autograd._top_saved_tensors_default_hooks(False)  # noqa: SLF001
        self._suspended_on = threading.get_ident()
        return True

    def resume(self) -> None:
        """Put the hooks `suspend` took off back on the stack, on the thread that took them off, when that stack is
        as `suspend` left it.  Where another pair was pushed since, it is left alone: only the top pair of the
        stack acts, so ours, under it, would not act either; a later call puts them back."""
        if self._suspended_on is None or self._suspended_on != threading.get_ident():
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)  # noqa: SLF001
        below = self._below
        if (top is None) != (below is None) or (top is not None and top[0] is not below[0]):
            return
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)  # noqa: SLF001
        self._suspended_on = self._below = None

    def leave(self) -> bool:
        """The cache's context ends: True when its hooks are on the stack (to be taken off as usual), False when a
        step took them off (nothing to take off; they stay off)."""
        if self._suspended_on is not None and self._suspended_on == threading.get_ident():
            self._suspended_on = self._below = None
            return False
        return True

    # ------------------------------------------------------------------ pack
    def pack(self, t: torch.Tensor) -> Any:
        self.releases.drain()
        ops = self.ops
        if ops is None or in_backward():
            return self._pack_one(t)
        recipe = ops.recipe(t)
        if recipe is not None:  # an elementwise op's output, its inputs saved: recomputed in backward
            with self.lock:
                st = self.stats
                st.packs += 1
                st.packs_recomputed += 1
                st.bytes_recomputed_ops += recipe.nbytes
            ops.remember(t, recipe)
            return recipe
        packed = self._pack_one(t)
        ops.remember(t, packed)
        return packed

    def _pack_one(self, t: torch.Tensor) -> Any:
        st = self.stats
        scopes, policy, transfers = self.scopes, self.policy, self.transfers
        if scopes.quiet and not transfers.inflight_bytes and is_plain_strided(t):
            # past what the plan offloads, with no store in flight to wait for: kept, nothing else to do --
            # unless the storage is one offloaded earlier in this step (a view of it saved again: deduplicated)
            sid = getattr(t.untyped_storage(), self.attr, None)
            if sid is None or sid < 0:
                st.packs += 1
                st.packs_quiet += 1
                return t.detach()
        with self.lock:
            transfers.raise_pending()
            st.packs += 1
            if not is_plain_strided(t):
                st.bytes_kept_other += t.numel() * t.element_size() if t.layout == torch.strided else 0
                return t
            view_bytes = t.numel() * t.element_size()
            if t.device.type == "cpu" and not self.select.offload_cpu_tensors:
                st.bytes_kept_cpu += view_bytes
                return t.detach()
            storage = t.untyped_storage()
            if self.models.is_parameter(t, storage):
                st.bytes_kept_param += view_bytes
                return t
            sid = getattr(storage, self.attr, None)
            if sid is not None and sid < 0:
                rec = scopes.record
                if rec is not None and -sid == rec.rid and not in_backward():
                    # a storage this forward already chose to keep: saved again, kept again (not a new one)
                    st.bytes_kept_policy += view_bytes
                    return t.detach()
                sid = None
            if sid is not None:
                e = transfers.entries.get(sid)
                if e is not None and not e.released:
                    st.bytes_deduplicated += view_bytes
                    st.dedup_hits += 1
                    rec = e.record
                    if not in_backward() and rec is scopes.record and not rec.backward_started:
                        seg = scopes.current_segment(rec)
                        if e not in seg.entries:
                            seg.entries.append(e)
                    return Handle(self.releases, e, t)
            nbytes = storage.nbytes()
            if nbytes < self.select.min_bytes:
                st.bytes_kept_small += view_bytes
                return t.detach()
            if in_backward():
                st.bytes_kept_backward += view_bytes
                return t.detach()
            rec = scopes.current()
            seg = scopes.current_segment(rec)
            idx = rec.first_packs
            rec.first_packs += 1
            if rec.profiling:
                rec.tensors.append((seg.index, nbytes, self.clock.mark(t.device)))
                rec.input_of.append(rec.input_ptrs.get(storage.data_ptr(), -1))
            if not policy.decide(rec, seg, idx, nbytes):
                st.bytes_kept_policy += view_bytes
                seg.wait_s += policy.admit_kept(rec, nbytes)
                setattr(storage, self.attr, -rec.rid)  # later saves of it in this forward are not new storages
                return t.detach()
            seg.wait_s += policy.admit(rec, nbytes)
            slot = self.store.reserve(nbytes)
            if slot is None:
                self._store_full(nbytes)
                st.bytes_kept_budget += view_bytes
                setattr(storage, self.attr, -rec.rid)
                return t.detach()
            seg.offloaded_bytes += nbytes
            e = Entry(next(self._ids), nbytes, t.device, rec, seg.index, slot, storage_bytes(t), t.detach())
            setattr(storage, self.attr, e.sid)
            seg.entries.append(e)
            rec.live += 1
            rec.entries_made += 1
            transfers.submit_store(e)
            return Handle(self.releases, e, t)

    def _store_full(self, nbytes: int) -> None:
        """The store refused ``nbytes`` (lock held): say so once, the tensor stays in device memory."""
        if self._warned_full:
            return
        self._warned_full = True
        warnings.warn(f"datapath.offload: no room in {self.store.where_full()} for an activation of {nbytes / 1e6:.3g} "
                      f"MB; it stays in device memory, as will every activation that does not fit. Free space, raise "
                      f"max_disk_bytes/host_budget_bytes, or offload elsewhere.", OffloadWarning, stacklevel=4)

    # ---------------------------------------------------------------- unpack
    def unpack(self, obj: Any) -> torch.Tensor:
        self.releases.drain()
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, Recipe):
            return obj.run(self.unpack)
        h: Handle = obj
        check_version(h.tref(), h.version, h.spec)
        e = h.entry
        scopes, transfers = self.scopes, self.transfers
        with self.lock:
            transfers.raise_pending()
            if e.modified:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    "operation after it was saved (seen by datapath.offload while storing it).")
            rec = e.record
            if in_backward():
                scopes.watch_backward_end(rec)
                if not rec.backward_started:
                    scopes.begin_backward(rec)
            transfers.bring_back(e, prefetch=False)
            transfers.not_ahead(e)
            if rec.segments and not rec.segments[e.segment].prefetched:
                scopes.prefetch_range(rec, e.segment)  # no module hooks fired: prefetch from here on
            data = transfers.acquire(e)
            e.hand_over()  # autograd's handles own the bytes now: they go with the last one, not at a drain
            self.stats.unpacks += 1
        return rebuild(data, h.spec)


class _HookContext:
    """``saved_tensors_hooks(pack, unpack)`` of a `SavedTensorHooks`, aware that a step may have taken the pair off
    the stack (`SavedTensorHooks.suspend`): then leaving takes nothing off."""

    def __init__(self, hooks: SavedTensorHooks) -> None:
        self.hooks = hooks

    def __enter__(self) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks(self.hooks._pack, self.hooks._unpack)  # noqa: SLF001

    def __exit__(self, *exc: object) -> None:
        if self.hooks.leave():
            torch._C._autograd._pop_saved_tensors_default_hooks()  # noqa: SLF001
