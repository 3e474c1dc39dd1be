"""`UnifiedTensor`: a tensor on the ``"unified"`` device, backed by pinned host memory.

The wrapper holds ``_host``, a CPU tensor whose memory is pinned and mapped into
the GPU's address space (ordinary host memory on machines without CUDA), and an
affinity, ``"host"`` or ``"gpu"``.  Its ``__torch_dispatch__`` applies the
placement rules of PyTorch-Direct:

==========================================  =========================================
operands                                    where it runs, what comes back
==========================================  =========================================
any CUDA tensor                             GPU, reading unified operands in place
                                            (zero copy); CUDA result
unified (and CPU) only, all affinity "gpu"  GPU; CUDA result
unified (and CPU) only, otherwise           CPU; unified result (host affinity)
``u[cuda_idx]``, ``index_select``           the zero-copy gather kernel; CUDA result
``u[cuda_idx] = rows``, ``index_copy_``     the zero-copy scatter kernel, into host memory
in-place ops on ``u``                       write ``u``'s host memory (on the GPU when an
                                            operand is on CUDA, else on the CPU)
==========================================  =========================================

Views (slices, ``view``, ``transpose``...) share memory and keep the affinity.

A unified tensor made from read-only memory (`as_unified` of ``np.load(path,
mmap_mode="r")`` or of a non-writable array) is read-only: every op that would write it
raises `datapath.memory.ReadOnlyTableError` before touching memory; reads work as usual.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from datapath._runtime.pinned import HostRegistration, cuda_alias, in_flight, pinned_empty
from datapath.memory.host_record import HostRecord

Affinity = str  # "host" | "gpu"
_AFFINITIES = ("host", "gpu")

aten = torch.ops.aten

# In-place ops that would need atomics on the mutated tensor: over PCIe, atomics on
# host memory are not supported on most platforms, so these always run on the CPU.
_ATOMIC_INPLACE = {
    aten.index_add_.default, aten.scatter_add_.default, aten.scatter_reduce_.two,
    aten.index_reduce_.default, aten.put_.default,
}


class UnifiedTensor(torch.Tensor, HostRecord):
    """A tensor in pinned host memory that GPU kernels read directly (device ``"unified"``).

    Make one with ``t.to("unified")``, ``torch.empty(..., device="unified")`` or
    ``datapath.unified_tensor.as_unified(t)``; see the module docstring for where
    its operations run.  The memory (host buffer, read-only flag, device view) is a
    `datapath.memory.HostRecord`; this type adds the affinity and the placement rules.
    """

    _affinity: str

    @staticmethod
    def __new__(cls, host: torch.Tensor, affinity: Affinity = "host",
                keep: tuple[Any, ...] = (), readonly: bool = False) -> "UnifiedTensor":
        if host.device.type != "cpu":
            raise ValueError(f"a unified tensor wraps host memory, got a tensor on {host.device}")
        if affinity not in _AFFINITIES:
            raise ValueError(f"affinity must be 'host' or 'gpu', got {affinity!r}")
        r = torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), storage_offset=host.storage_offset(),
            dtype=host.dtype, device=_unified_device(), requires_grad=False,
        )
        r._host = host
        r._affinity = affinity
        r._keep = keep
        r._readonly = bool(readonly)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, index: Any) -> Any:
        """``u[cuda_idx]`` goes straight to the row gather (no indexing machinery); anything else as usual."""
        if type(index) is torch.Tensor:
            rows = (_GATHER[0] if _GATHER else _row_gather())(self, index)  # None: not CUDA integer indices
            if rows is not None:
                return rows
        return super().__getitem__(index)

    # --- affinity -----------------------------------------------------------------
    @property
    def affinity(self) -> Affinity:
        """``"host"`` (ops on it alone run on the CPU) or ``"gpu"`` (they run on the GPU)."""
        return self._affinity

    @affinity.setter
    def affinity(self, value: Affinity) -> None:
        if value not in _AFFINITIES:
            raise ValueError(f"affinity must be 'host' or 'gpu', got {value!r}")
        self._affinity = value

    def with_affinity(self, value: Affinity) -> "UnifiedTensor":
        """A new unified tensor over the same memory with affinity ``value`` (no data moves)."""
        return UnifiedTensor(self._host, value, self._keep, self._readonly)

    # --- conversions PyTorch users expect ---------------------------------------------
    def numpy(self, *, force: bool = False) -> Any:
        """``torch.Tensor.numpy``: an array over the same memory, not writeable when the tensor is read-only."""
        return self.host_array(force=force)

    def tolist(self) -> Any:  # noqa: D102 - same as torch.Tensor.tolist
        return self._host.tolist()

    def cpu(self, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
        """A plain CPU tensor with a copy of the data (as ``cuda_t.cpu()`` gives)."""
        return self._host.clone(memory_format=memory_format)

    def to(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - torch.Tensor.to, with the unified rules
        dev = args[0] if args else kwargs.get("device")
        if dev.__class__ is str:
            dev = torch.device(dev) if not dev.startswith("unified") else dev
        if isinstance(dev, torch.device) and dev.type == "cpu":
            # PyTorch would hand back this very tensor (its device reads cpu): give a plain CPU copy
            return self.cpu().to(*args, **kwargs)
        return torch.Tensor.to(self, *args, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        body = repr(self._host)
        where = f"device='{self.device}'" if self.device.type == "unified" else "unified"
        return f"{body[:-1]}, {where}, affinity='{self._affinity}')"

    def __reduce_ex__(self, protocol: int) -> Any:
        return (_rebuild, (self._host.clone(), self._affinity))

    def __deepcopy__(self, memo: dict[int, Any]) -> "UnifiedTensor":
        return _wrap_new(self._host.clone(), self._affinity)

    # --- dispatch ---------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            _refuse_read_only_write(func, args, kwargs)
        special = _SPECIAL.get(func)
        if special is not None:
            out = special(args, kwargs)
            if out is not NotImplemented:
                return out
        return _run(func, args, kwargs)


_GATHER: list[Callable[..., torch.Tensor | None]] = []


def _row_gather() -> Callable[..., torch.Tensor | None]:
    """`datapath.memory.rows.take_rows` (imported on first use: memory imports this module lazily)."""
    if not _GATHER:
        from datapath.memory.rows import take_rows  # noqa: PLC0415

        _GATHER.append(take_rows)
    return _GATHER[0]


_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def _refuse_read_only_write(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise `ReadOnlyTableError` if ``func`` would write into a read-only unified tensor."""
    written = _WRITTEN.get(func)
    if written is None:
        written = _WRITTEN[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    for i, name in written:
        v = args[i] if i < len(args) else kwargs.get(name)
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(x, UnifiedTensor) and x._readonly:
                x.refuse_write(str(func))


def _rebuild(host: torch.Tensor, affinity: str) -> UnifiedTensor:
    return _wrap_new(host, affinity)


_DEVICE = [torch.device("cpu")]  # what a unified tensor reports as its device


def _unified_device() -> torch.device:
    """``unified:0`` once `_device.register` has named the device (it calls `use_unified_device`), else ``cpu``."""
    return _DEVICE[0]


def use_unified_device() -> None:
    """Make new unified tensors report ``unified:0`` (called once the PrivateUse1 device is named)."""
    _DEVICE[0] = torch.device("unified", 0)


def to_unified(t: torch.Tensor, dtype: torch.dtype | None = None,
               affinity: Affinity = "host") -> "UnifiedTensor":
    """A unified copy of ``t`` (any device), optionally converted to ``dtype``; ``t`` itself if nothing changes.

    Unified tensors carry no autograd history: the copy is detached.
    """
    if isinstance(t, UnifiedTensor):
        if dtype is None or dtype == t.dtype:
            return t
        return _wrap_new(t._host.to(dtype), t._affinity)
    src = t.detach()
    host = pinned_empty(tuple(src.shape), dtype or src.dtype)
    host.copy_(src)
    return UnifiedTensor(host, affinity)


def _wrap_new(t: torch.Tensor, affinity: Affinity = "host") -> UnifiedTensor:
    """Wrap a freshly computed CPU tensor, moving it into pinned memory when CUDA is present."""
    if torch.cuda.is_available() and not t.is_pinned():
        pinned = pinned_empty(t.shape, t.dtype)
        pinned.copy_(t)
        t = pinned
    return UnifiedTensor(t, affinity)


def _is_cuda(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, UnifiedTensor) and x.device.type == "cuda"


def _has_cuda(args: Any, kwargs: Any) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    return any(_is_cuda(x) for x in flat)


def _unified_args(args: Any, kwargs: Any) -> list[UnifiedTensor]:
    flat, _ = tree_flatten((args, kwargs))
    return [x for x in flat if isinstance(x, UnifiedTensor)]


def _gpu_mode(args: Any, kwargs: Any) -> torch.device | None:
    """The CUDA device to run on under the placement rules, or None for the CPU."""
    flat, _ = tree_flatten((args, kwargs))
    for x in flat:
        if _is_cuda(x):
            return x.device
    us = [x for x in flat if isinstance(x, UnifiedTensor)]
    if us and torch.cuda.is_available() and all(u._affinity == "gpu" for u in us):
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _replace_device_kwargs(kwargs: dict[str, Any], target: torch.device) -> dict[str, Any]:
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "unified":
        kwargs = {**kwargs, "device": target}
    return kwargs


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The generic placement rule for ``func``."""
    unified = _unified_args(args, kwargs)
    mutates = func._schema.is_mutable
    if (mutates and func in _ATOMIC_INPLACE) or (func.is_view and not _has_cuda(args, kwargs)):
        gpu = None  # views of unified tensors stay unified views, whatever the affinity
    else:
        gpu = _gpu_mode(args, kwargs)
    if gpu is not None:
        aliases: dict[int, UnifiedTensor] = {}

        def to_gpu(x: Any) -> Any:
            if isinstance(x, UnifiedTensor):
                if x._host.is_pinned():
                    a = cuda_alias(x._host)
                elif mutates:  # a GPU copy would take the write, and the host memory would never see it
                    raise RuntimeError(
                        f"{func} would write a unified tensor whose host memory is not pinned; "
                        f"make it with t.to('unified') or as_unified(t) on a machine with CUDA"
                    )
                else:
                    a = x._host.to(gpu)
                aliases[id(a)] = x
                return a
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
                return x.to(gpu)
            return x

        with torch.cuda.device(gpu):
            g_args, g_kwargs = tree_map(to_gpu, (args, _replace_device_kwargs(kwargs, gpu)))
            out = func(*g_args, **g_kwargs)
            in_flight.hold(torch.cuda.current_stream(gpu), *[u._host for u in unified])
        # an op that returns (one of) its mutated inputs gives back the unified tensor itself
        return tree_map(lambda x: aliases.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)

    hosts: dict[int, UnifiedTensor] = {}

    def to_cpu(x: Any) -> Any:
        if isinstance(x, UnifiedTensor):
            hosts[id(x._host)] = x
            return x._host
        if _is_cuda(x):  # cannot happen: CUDA operands select the GPU path
            raise AssertionError("CUDA operand on the CPU path")
        return x

    c_args, c_kwargs = tree_map(to_cpu, (args, _replace_device_kwargs(kwargs, torch.device("cpu"))))
    out = func(*c_args, **c_kwargs)
    storages = {
        u._host.untyped_storage().data_ptr(): u for u in unified if u._host.untyped_storage().nbytes()
    }
    affinity = unified[0]._affinity if unified else "host"

    def wrap(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, UnifiedTensor):
            return x
        if id(x) in hosts:  # in-place op returning its input
            return hosts[id(x)]
        if x.untyped_storage().nbytes():
            src = storages.get(x.untyped_storage().data_ptr())
            if src is not None:  # a view of a unified tensor: same memory, same affinity
                return UnifiedTensor(x, src._affinity, src._keep, src._readonly)
        return _wrap_new(x, affinity)

    return tree_map(wrap, out)


# --- ops with their own rule ------------------------------------------------------------

def _index_target(self: Any, idx: Any) -> torch.device | None:
    """CUDA device for a gather of ``self`` rows by ``idx`` (None: CPU)."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
        return None
    if idx.device.type == "cuda":
        return idx.device
    if self._affinity == "gpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, indices = args[0], args[1]
    if not isinstance(self, UnifiedTensor) or len(indices) != 1 or indices[0] is None:
        return NotImplemented
    from datapath.memory import gather_rows  # noqa: PLC0415 - memory imports this module lazily

    idx = indices[0]
    dev = _index_target(self, idx)
    if dev is None:
        if isinstance(idx, torch.Tensor) and idx.device.type == "cpu" and idx.dtype in (torch.int32, torch.int64):
            return _wrap_new(gather_rows(self._host, idx), self._affinity)
        return NotImplemented
    return gather_rows(self, idx.to(dev))


def _index_select(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, dim, idx = args[0], args[1], args[2]
    if not isinstance(self, UnifiedTensor) or self.dim() == 0 or dim not in (0, -self.dim()):
        return NotImplemented
    if idx.dim() > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    return _index(((self, [idx])), kwargs)


def _scatter_rows(self: Any, idx: Any, values: Any) -> Any:
    from datapath.memory import scatter_rows  # noqa: PLC0415

    dev = _index_target(self, idx)
    if dev is None:
        return NotImplemented
    if isinstance(values, UnifiedTensor):
        values = values._host
    values = values.to(device=dev, dtype=self.dtype)
    scatter_rows(self, idx.to(dev), values)
    return self


def _index_put(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, indices, values = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if not isinstance(self, UnifiedTensor) or len(indices) != 1 or indices[0] is None:
        return NotImplemented
    if accumulate:  # needs atomics on host memory: run on the CPU
        idx = indices[0].to("cpu") if isinstance(indices[0], torch.Tensor) else indices[0]
        vals = values._host if isinstance(values, UnifiedTensor) else values.to("cpu")
        self._host.index_put_((idx,), vals, accumulate=True)
        return self
    return _scatter_rows(self, indices[0], values)


def _index_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, dim, idx, src = args[0], args[1], args[2], args[3]
    if not isinstance(self, UnifiedTensor) or dim not in (0, -self.dim()) or idx.dim() > 1:
        return NotImplemented
    return _scatter_rows(self, idx, src)


def _to_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    dev = kwargs.get("device")
    if not isinstance(self, UnifiedTensor) or dev is None:
        return NotImplemented
    dev = torch.device(dev)
    rest = {k: v for k, v in kwargs.items() if k != "device"}
    if dev.type == "unified":
        return _wrap_new(self._host._to_copy(**rest) if rest else self._host.clone(), self._affinity)
    out = torch.ops.aten._to_copy.default(self._host, device=dev, **rest)
    if dev.type == "cuda":
        in_flight.hold(torch.cuda.current_stream(dev), self._host)
    return out


def _copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    s = src._host if isinstance(src, UnifiedTensor) else src
    d = dst._host if isinstance(dst, UnifiedTensor) else dst
    d.copy_(s, non_blocking=non_blocking)
    cuda_side = d if d.device.type == "cuda" else s if isinstance(s, torch.Tensor) and s.device.type == "cuda" else None
    if cuda_side is not None:
        in_flight.hold(torch.cuda.current_stream(cuda_side.device), d, s)
    return dst


def _local_scalar(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0]._host.item()


_SPECIAL: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {
    aten.index.Tensor: _index,
    aten.index_select.default: _index_select,
    aten.index_put_.default: _index_put,
    aten.index_put.default: lambda a, k: NotImplemented,
    aten.index_copy_.default: _index_copy,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy,
    aten._local_scalar_dense.default: _local_scalar,
}


def as_unified_view(host: torch.Tensor, affinity: Affinity = "host",
                    registration: HostRegistration | None = None, readonly: bool = False) -> UnifiedTensor:
    """Wrap pinned (or, without CUDA, plain) host tensor ``host`` without copying."""
    return UnifiedTensor(host, affinity, (registration,) if registration is not None else (), readonly)
