"""Pinned host memory backed by 2 MiB pages: `huge_pinned_empty`, `huge_page_bytes`.

A GPU kernel reading random rows of a table in host memory needs one address
translation per page it touches; with 4 KiB pages a multi-GB table misses the GPU's (and
the IOMMU's) translation caches on nearly every row.  2 MiB pages cut the translations
512-fold.  Two ways, tried in this order by ``how="auto"``:

- ``"hugetlb"``: ``mmap(MAP_HUGETLB)``: guaranteed 2 MiB pages, only where the system has
  reserved enough of them (``/proc/sys/vm/nr_hugepages``; nothing here changes it);
- ``"thp"``: an anonymous mapping aligned to 2 MiB and ``madvise(MADV_HUGEPAGE)``
  (transparent huge pages, per mapping; works where
  ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``).

Either way the range is then pinned and mapped for the GPU with ``cudaHostRegister``; it is
unpinned and unmapped when the last tensor over it is freed.  ``huge_pinned_empty``
returns None where neither way works (no CUDA, not Linux, THP off): the caller falls
back to ordinary pinned memory.

Measured, they read random rows no faster than ordinary pinned memory: the translation cost
of random rows lies on the GPU's side of the mapping, which host pages do not change (the
figures are in the CHANGELOG).  So no allocator of datapath uses these by default;
``benchmarks/gather.py --huge-tables`` measures them again.
"""
from __future__ import annotations

import ctypes
import logging
import os
import weakref
from typing import Literal

import torch

from datapath._runtime.pinned import HostRegistration, _check_size

log = logging.getLogger("datapath.memory.huge_pages")

HUGE = 2 << 20
_PROT_RW = 0x1 | 0x2
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE, _MAP_HUGETLB = 0x02, 0x20, 0x4000, 0x40000
_MADV_HUGEPAGE = 14
_MAP_FAILED = ctypes.c_void_p(-1).value
HowHuge = Literal["auto", "hugetlb", "thp"]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def thp_mode() -> str:
    """The system's transparent-huge-page setting (``always``/``madvise``/``never``), or ``""`` if unknown."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def free_hugetlb_pages() -> int:
    """Free 2 MiB pages in the system's hugetlb pool (``HugePages_Free``), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        if int(fields.get("Hugepagesize", "0 kB").split()[0]) != HUGE >> 10:
            return 0
        return int(fields.get("HugePages_Free", "0").split()[0])
    except (OSError, ValueError):
        return 0


class _Mapping:
    """One mmap'd range; unpinned and unmapped when the buffer over it is freed."""

    def __init__(self, libc: ctypes.CDLL, base: int, length: int, addr: int, nbytes: int, how: str) -> None:
        self.libc, self.base, self.length, self.addr, self.nbytes, self.how = libc, base, length, addr, nbytes, how
        self.registration: HostRegistration | None = None

    def release(self) -> None:
        if self.registration is not None:
            self.registration.release()
            self.registration = None
        self.libc.munmap(self.base, self.length)


def _map(libc: ctypes.CDLL, nbytes: int, how: str) -> _Mapping | None:
    size = -(-nbytes // HUGE) * HUGE
    if how == "hugetlb":
        if free_hugetlb_pages() < size // HUGE:
            return None
        p = libc.mmap(None, size, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_HUGETLB, -1, 0)
        if p in (None, _MAP_FAILED):
            return None
        return _Mapping(libc, p, size, p, nbytes, how)
    if thp_mode() not in ("always", "madvise"):
        return None
    length = size + HUGE
    p = libc.mmap(None, length, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if p in (None, _MAP_FAILED):
        return None
    addr = p + (-p) % HUGE
    if libc.madvise(addr, size, _MADV_HUGEPAGE) != 0:
        libc.munmap(p, length)
        return None
    return _Mapping(libc, p, length, addr, nbytes, how)


def huge_pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                      how: HowHuge = "auto") -> torch.Tensor | None:
    """An uninitialised, pinned, GPU-mapped host tensor on 2 MiB pages, or None where none can be had.

    Args:
        shape: of the tensor (a CPU tensor; wrap it with ``as_unified`` for the unified device).
        dtype: of the tensor.
        how: ``"hugetlb"``, ``"thp"`` or ``"auto"`` (hugetlb where enough pages are reserved, else THP).

    Raises:
        PinnedMemoryError: more than the machine can pin.
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if how not in ("auto", "hugetlb", "thp"):
        raise ValueError(f"how must be 'auto', 'hugetlb' or 'thp', got {how!r}")
    if nbytes == 0 or not torch.cuda.is_available() or os.name != "posix":
        return None
    libc = _libc()
    if libc is None:
        return None
    _check_size(nbytes, "pinned allocation on huge pages")
    mapping = None
    for way in (("hugetlb", "thp") if how == "auto" else (how,)):
        mapping = _map(libc, nbytes, way)
        if mapping is not None:
            break
    if mapping is None:
        return None
    try:
        mapping.registration = HostRegistration(mapping.addr, nbytes)
    except Exception:
        mapping.release()
        raise
    buf_type = type("_HugeBuffer", (ctypes.c_char * nbytes,), {})
    buf = buf_type.from_address(mapping.addr)
    buf.mapping = mapping  # the buffer (kept by the tensor's storage) keeps the mapping
    weakref.finalize(buf, mapping.release).atexit = False
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    log.debug("%.2f GiB pinned on 2 MiB pages (%s)", nbytes / 2**30, mapping.how)
    return t.view(dtype).view(tuple(int(s) for s in shape))


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding ``t``'s memory that lie on huge pages (``/proc/self/smaps``; 0 if none)."""
    addr = t.untyped_storage().data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                    size = hi - lo
                elif inside:
                    if head == "AnonHugePages:" and int(line.split()[1]) > 0:
                        return int(line.split()[1]) << 10
                    if head == "KernelPageSize:" and int(line.split()[1]) >= HUGE >> 10:
                        return size
    except (OSError, ValueError):
        return 0
    return 0
