"""Probe: is random small-row gather from pinned memory limited by page translation?

Compares 256/512/1024-byte random-row gathers from tables of different sizes, allocated by
cudaHostAlloc (torch pinned) vs mmap + MADV_HUGEPAGE + cudaHostRegister.

Seen on the H200 machine (2026-11-21, before the sorted visit order): 512-byte rows reached
48 GB/s from a 1 GiB table, 17 GB/s from 8 GiB and 14.6 GB/s from 32 GiB, with naive
zero-copy the same; transparent huge pages made no difference.  That led to visiting rows in
sorted index order (`UnifiedConfig.sort_indices`).
Run: PYTHONPATH=src python scripts/probe_gather_pages.py
"""
import ctypes, mmap, os, time
import torch
import datapath
from datapath.memory import cuda_alias
from datapath.unified_tensor import as_unified, gather

print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip())
libc = ctypes.CDLL("libc.so.6", use_errno=True)
MADV_HUGEPAGE = 14

def thp_tensor(nbytes):
    buf = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    off = (-addr) % (2 << 20)
    r = libc.madvise(ctypes.c_void_p(addr + off), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=off)
    t.fill_(1)
    return t, buf, r

def bw(fn, nbytes, reps=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize(); return nbytes * reps / (time.perf_counter() - t0) / 1e9

for gb in (1, 8, 32):
    nbytes = gb << 30
    a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True); a.fill_(1)
    t0 = time.time(); b, keep, r = thp_tensor(nbytes); tb = time.time() - t0
    t0 = time.time(); ub = as_unified(b); treg = time.time() - t0
    ua = as_unified(a)
    ahp = open("/proc/meminfo").read().split("AnonHugePages:")[1].split("\n")[0].strip()
    print(f"table {gb} GiB: thp alloc+touch {tb:.1f}s madvise={r} register {treg:.1f}s AnonHugePages {ahp}")
    for rb in (256, 512, 1024, 2048):
        m = 262144
        for name, tab in (("hostalloc", ua), ("thp_reg", ub)):
            t2 = tab.view(-1, rb)
            idx = torch.randint(0, t2.shape[0], (m,), device="cuda")
            g = bw(lambda: gather(t2, idx), m * rb)
            al = cuda_alias(tab._host).view(-1, rb)
            n = bw(lambda: torch.index_select(al, 0, idx), m * rb)
            print(f"   {name:9s} row {rb:5d}: datapath {g:5.1f} GB/s  naive_zc {n:5.1f} GB/s")
    del ua, ub, a, b, keep
