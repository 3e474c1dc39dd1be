"""Pinned (page-locked, GPU-mapped) host memory.

- `pinned_empty` allocates from PyTorch's caching host allocator (cudaHostAlloc
  blocks, reused after free like PyTorch's own pinned tensors) after checking the
  request against what the machine can pin; without CUDA it returns ordinary
  host memory, so the same code runs on CPU-only machines.
- `register_in_place` pins existing memory (numpy arrays, mmaps) with
  ``cudaHostRegister`` and unpins it when the returned handle is released.
- `cuda_alias` gives a CUDA tensor over pinned host memory (zero copy: GPU kernels
  read it over PCIe).  With unified virtual addressing, which every 64-bit CUDA
  platform has, the device pointer equals the host pointer.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import psutil
import torch

from datapath._runtime.errors import PinnedMemoryError

log = logging.getLogger("datapath.runtime.pinned")

# cudaHostRegisterDefault | cudaHostRegisterPortable | cudaHostRegisterMapped
_HOST_REGISTER_FLAGS = 0x01 | 0x02
# cudaHostRegisterReadOnly: the GPU only reads the range (pins read-only mappings, e.g. of files on disk)
_HOST_REGISTER_READ_ONLY = 0x08


def pin_limit_bytes() -> int:
    """How many more bytes this process can plausibly pin: 90% of available RAM.

    CUDA pins through its driver, which does not go by ``ulimit -l``; pinning
    nearly all RAM starves the page cache and the OS, hence the 90%.
    """
    return int(psutil.virtual_memory().available * 0.9)


_SMALL_PIN_BYTES = 1 << 20


def _check_size(nbytes: int, what: str) -> None:
    if nbytes <= _SMALL_PIN_BYTES:  # reading /proc/meminfo costs ~0.1 ms: not for the loaders' small buffers
        return
    limit = pin_limit_bytes()
    if nbytes > limit:
        raise PinnedMemoryError(
            f"{what}: {nbytes / 2**30:.2f} GiB requested but only {limit / 2**30:.2f} GiB can be "
            f"pinned on this machine (90% of available RAM). Free host memory, shrink the table, "
            f"or keep it in a memory-mapped file and pin a part of it."
        )


_pinned_large = 0  # pinned allocations of _SMALL_PIN_BYTES or more made so far (`large_pins`)


def large_pins() -> int:
    """How many pinned allocations of 1 MiB or more `pinned_empty` has made in this process: each may have been a
    cudaHostAlloc, which stalls the launches of every thread behind it (a profiled step that made one is measured
    again: `datapath.offload.budget_profile.one_off_work`)."""
    return _pinned_large


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor of ``shape``/``dtype``, pinned and GPU-mapped when CUDA is present."""
    global _pinned_large
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not torch.cuda.is_available():
        return torch.empty(tuple(shape), dtype=dtype)
    _check_size(nbytes, "pinned allocation")
    if nbytes >= _SMALL_PIN_BYTES:
        _pinned_large += 1
    try:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
    except RuntimeError as exc:
        raise PinnedMemoryError(
            f"cudaHostAlloc of {nbytes / 2**30:.2f} GiB failed ({exc}); the machine cannot pin that much "
            f"(limit estimate {pin_limit_bytes() / 2**30:.2f} GiB)."
        ) from exc


def mapping_of(addr: int) -> tuple[str, str | None] | None:
    """``(permissions, file)`` of the mapping holding ``addr`` from /proc/self/maps (``"r--p"``, ``"rw-s"``...;
    file None for anonymous memory), or None when no mapping holds it."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    path = parts[5].strip() if len(parts) == 6 else ""
                    return parts[1], (path if path.startswith("/") else None)
    except (OSError, ValueError, IndexError):
        return None
    return None


def mapping_file(addr: int) -> str | None:
    """The file behind the mapping that holds ``addr`` (None for anonymous memory)."""
    m = mapping_of(addr)
    return None if m is None else m[1]


def mount_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (longest matching mount point in /proc/mounts)."""
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/")):
                    if len(fields[1]) > len(best):
                        best, fstype = fields[1], fields[2]
    except OSError:
        pass
    return fstype


def pinnable_in_place(t: torch.Tensor) -> bool:
    """False when ``t``'s memory is a mapping of a file on a disk filesystem.

    Linux lets a device pin page-cache pages long-term only for RAM-backed files
    (tmpfs such as /dev/shm, hugetlbfs); ``cudaHostRegister`` of an ``np.load(...,
    mmap_mode=...)`` of a file on ext4/xfs fails with an invalid-value error.
    """
    path = mapping_file(t.untyped_storage().data_ptr())
    return path is None or mount_type(path) in ("tmpfs", "hugetlbfs", "ramfs")


def _clear_cuda_error() -> None:
    """Reset CUDA's last-error state after a failed runtime call (else PyTorch reports it at its next launch)."""
    import ctypes  # noqa: PLC0415

    for lib in _cudart_paths():
        try:
            ctypes.CDLL(lib).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _cudart_paths() -> list[str]:
    """Paths of the CUDA runtime libraries loaded in this process."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.rsplit(maxsplit=1)[-1]
                if "libcudart" in p and p not in paths:
                    paths.append(p)
    except OSError:
        pass
    return paths or ["libcudart.so"]


class HostRegisterError(PinnedMemoryError):
    """``cudaHostRegister`` refused a range; ``code`` is the CUDA error number."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class HostRegistration:
    """Keeps a range of existing host memory registered with CUDA; unregisters on `release` or GC."""

    _lock = threading.Lock()
    _active: dict[int, int] = {}  # base pointer -> reference count

    def __init__(self, base: int, nbytes: int, read_only: bool = False) -> None:
        self.base = base
        self.nbytes = nbytes
        flags = _HOST_REGISTER_FLAGS | (_HOST_REGISTER_READ_ONLY if read_only else 0)
        with self._lock:
            count = self._active.get(base, 0)
            if count == 0:
                _check_size(nbytes, "pinning memory in place")
                err = torch.cuda.cudart().cudaHostRegister(base, nbytes, flags)
                code = int(getattr(err, "value", err))
                if code != 0:
                    _clear_cuda_error()
                    raise HostRegisterError(
                        code,
                        f"cudaHostRegister of {nbytes / 2**30:.2f} GiB at {base:#x} failed with CUDA error "
                        f"{code}; the memory may already be registered, be a file-backed mapping (Linux pins "
                        f"page-cache pages of regular files for no device), or be more than the machine can pin.",
                    )
            self._active[base] = count + 1
        self._finalizer = weakref.finalize(self, HostRegistration._unregister, base)

    @classmethod
    def _unregister(cls, base: int) -> None:
        with cls._lock:
            count = cls._active.get(base, 0) - 1
            if count > 0:
                cls._active[base] = count
                return
            cls._active.pop(base, None)
        try:
            torch.cuda.cudart().cudaHostUnregister(base)
        except Exception:  # noqa: BLE001 - at interpreter exit the CUDA context may be gone
            log.debug("cudaHostUnregister(%#x) failed", base)

    def release(self) -> None:
        """Unregister now (idempotent)."""
        self._finalizer()


def register_in_place(t: torch.Tensor, read_only: bool = False) -> HostRegistration | None:
    """Pin the memory of CPU tensor ``t`` (its whole storage) without copying.

    ``read_only``: register it for GPU reads only (``cudaHostRegisterReadOnly``), which
    read-only mappings need.  Returns a handle that keeps the registration alive, or
    None when CUDA is absent or the memory is already pinned (nothing to do).
    """
    if t.device.type != "cpu":
        raise ValueError(f"register_in_place needs a CPU tensor, got one on {t.device}")
    if not torch.cuda.is_available():
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    with HostRegistration._lock:
        ours = storage.data_ptr() in HostRegistration._active
    if t.is_pinned() and not ours:  # pinned by its allocator (pin_memory(), cudaHostAlloc): nothing to do
        return None
    # not pinned, or registered here by an earlier call: a new handle (a reference on the registration), so
    # that the memory stays pinned while any tensor made from it lives
    return HostRegistration(storage.data_ptr(), storage.nbytes(), read_only)


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` provider that also keeps ``owner`` alive."""

    def __init__(self, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 typestr: str, owner: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "strides": strides, "typestr": typestr,
            "data": (data_ptr, False), "version": 3, "stream": None,
        }
        self._owner = owner


_TYPESTR = {
    torch.float16: "<f2", torch.bfloat16: "<V2", torch.float32: "<f4", torch.float64: "<f8",
    torch.int8: "|i1", torch.uint8: "|u1", torch.bool: "|b1", torch.int16: "<i2",
    torch.int32: "<i4", torch.int64: "<i8",
}


def cuda_alias(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor sharing the memory of pinned CPU tensor ``host`` (same shape, strides, dtype).

    Reads and writes go over PCIe.  ``host`` is kept alive as long as the alias is.
    Raises ``PinnedMemoryError`` if ``host`` is not pinned.
    """
    if host.device.type != "cpu":
        raise ValueError(f"cuda_alias needs a CPU tensor, got one on {host.device}")
    if not host.is_pinned():
        raise PinnedMemoryError("cuda_alias needs pinned memory; pin it with datapath.unified_tensor.as_unified")
    dtype = host.dtype
    view = host
    if dtype == torch.bfloat16:  # the array interface has no bfloat16: alias as int16, view back
        view = host.view(torch.int16)
    es = view.element_size()
    arr = _CudaArray(view.data_ptr(), tuple(view.shape), tuple(s * es for s in view.stride()),
                     _TYPESTR[view.dtype], host)
    dev = torch.cuda.current_device()
    out = torch.as_tensor(arr, device=torch.device("cuda", dev))
    return out.view(torch.bfloat16) if dtype == torch.bfloat16 else out


class _InFlight:
    """Keeps host objects alive until the GPU work that reads them has finished.

    A kernel that reads pinned host memory runs asynchronously; if the tensor that
    owns the memory were freed right after the launch, the block could return to
    the host allocator (or be unregistered) while the GPU still reads it.  Each
    launch records an event on its stream and parks the owners here; completed
    entries are dropped on the next call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, tuple[Any, ...]]] = []

    def hold(self, stream: torch.cuda.Stream, *owners: Any) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            self._pending = [(e, o) for e, o in self._pending if not e.query()]
            self._pending.append((event, owners))

    def __len__(self) -> int:
        with self._lock:
            self._pending = [(e, o) for e, o in self._pending if not e.query()]
            return len(self._pending)


in_flight = _InFlight()


def pending_host_reads() -> int:
    """How many launches that read or write host memory may still be running (their owners kept alive)."""
    return len(in_flight)


def fetch_to_host(t: torch.Tensor) -> list:
    """A small CUDA tensor's values as a Python list, waited for without holding the GIL.

    ``.item()``/``.tolist()`` and ops that size their output on the host (``nonzero``,
    ``bincount``) wait for the GPU inside the call; in a process whose other thread is
    launching a training step, a wait that holds the interpreter lock stalls that thread
    for as long as the GPU is busy.  Here the values are copied into pinned memory on the
    current stream and the thread sleeps on a blocking CUDA event with the lock released.
    """
    if t.device.type != "cuda":
        return t.tolist()
    host = pinned_empty(tuple(t.shape), t.dtype)
    host.copy_(t, non_blocking=True)
    ev = torch.cuda.Event(blocking=True)
    ev.record()
    t0 = time.perf_counter()
    ev.synchronize()
    _waits.seconds = getattr(_waits, "seconds", 0.0) + time.perf_counter() - t0
    return host.tolist()


_waits = threading.local()


def gpu_wait_seconds() -> float:
    """Seconds this thread has spent in `fetch_to_host` waiting for the GPU (a running total)."""
    return getattr(_waits, "seconds", 0.0)
