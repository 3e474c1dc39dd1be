"""Probe (GPU): random wide rows from a large pinned table by the copy engines (``cuMemcpyBatchAsync``).

B1's wide rows (4-16 KiB) from a 16 GiB pinned table reach ~0.87-0.9x the pinned memcpy when SMs
read them (datapath's gather and the naive zero-copy kernel alike: address translation of
random pages).  This times, for the same rows, one batched copy-engine call (CUDA 12.8+ driver
API, one copy per row, source access in stream order) beside datapath's gather
(``unified[idx]``, the default path) and a contiguous memcpy of the same bytes, checks that the rows match, and prints GB/s, the
host time of the batch call and the ratio to memcpy.

Seen on an H100 (2026-11-23, driver 580, ``cuMemcpyBatchAsync_v2`` on a side stream -- the legacy
default stream is refused with CUDA_ERROR_INVALID_VALUE): the batch is no way to gather rows.  The
driver spends ~1.5-3.7 us of host time per copy (262,144 copies: 0.44-0.97 s), and the copies run
at 0.6 / 2 / 4.4-5 GB/s for 1 / 4 / 16 KiB rows (0.01-0.09x the pinned memcpy's 53.6 GB/s), in
random or address order alike; the SM gather read the same rows at 0.83-0.94x.

    PYTHONPATH=src:. python scripts/gpu_ce_gather_probe.py [--gib 16] [--row-bytes 4096,16384] [--rows 65536,262144]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch

import datapath  # noqa: F401  (registers the unified device)
from benchmarks._common import cuda_time_ms
from datapath.unified_tensor import as_unified


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attr(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Loc), ("dstLocHint", _Loc),
                ("flags", ctypes.c_uint)]


def batch_fn():
    lib = ctypes.CDLL("libcuda.so.1")
    for name, fail_idx in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return fn, fail_idx, name
    raise SystemExit("this driver has no cuMemcpyBatchAsync")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--row-bytes", default="4096,16384")
    ap.add_argument("--rows", default="65536,262144")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    fn, fail_idx, name = batch_fn()
    total = args.gib << 30
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    buf.view(torch.int64)[:: 4096 // 8].random_()  # touch every page
    print(f"{name}; table {args.gib} GiB pinned; {torch.cuda.get_device_name()}", flush=True)
    dev = torch.device("cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    s = torch.cuda.Stream()  # batched copies refuse the legacy default stream
    torch.cuda.set_stream(s)

    def ev_ms(f) -> float:
        return cuda_time_ms(f, warmup=1, repeat=args.repeat)

    memcpy_ms = ev_ms(lambda: big.copy_(buf[: 1 << 30], non_blocking=True))
    memcpy_gbps = (1 << 30) / memcpy_ms / 1e6
    print(f"pinned memcpy 1 GiB: {memcpy_gbps:.1f} GB/s", flush=True)
    attr = _Attr(1, _Loc(2, 0), _Loc(1, dev.index or 0), 0)  # in stream order; host -> device hints
    idx0 = ctypes.c_size_t(0)
    fail = ctypes.c_size_t(0)
    for rb in (int(x) for x in args.row_bytes.split(",")):
        n_table = total // rb
        table = buf.view(torch.float32).view(n_table, rb // 4)
        ut = as_unified(table)
        for n in (int(x) for x in args.rows.split(",")):
            if n * rb > (4 << 30):
                continue
            g = torch.Generator().manual_seed(n + rb)
            idx = torch.randint(0, n_table, (n,), generator=g)
            out = torch.empty(n, rb // 4, dtype=torch.float32, device=dev)
            srcs = (np.uint64(buf.data_ptr()) + idx.numpy().astype(np.uint64) * np.uint64(rb)).astype(np.uint64)
            sidx = np.sort(srcs)
            dsts = np.uint64(out.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(rb)
            sizes = np.full(n, rb, dtype=np.uint64)
            host_us: list[float] = []

            def ce(srcs=srcs, dsts=dsts, sizes=sizes, n=n) -> None:
                t0 = time.perf_counter()
                args_ = [dsts.ctypes.data_as(ctypes.c_void_p), srcs.ctypes.data_as(ctypes.c_void_p),
                         sizes.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(n), ctypes.byref(attr),
                         ctypes.byref(idx0), ctypes.c_size_t(1)]
                if fail_idx:
                    args_.append(ctypes.byref(fail))
                args_.append(ctypes.c_void_p(s.cuda_stream))
                rc = fn(*args_)
                host_us.append((time.perf_counter() - t0) * 1e6)
                if rc != 0:
                    raise RuntimeError(f"{name} returned CUresult {rc} (failIdx {fail.value})")

            try:
                t_ce = ev_ms(ce)
            except RuntimeError as exc:
                print(f"  {rb} B x {n}: {exc}", flush=True)
                continue
            ok = bool(torch.equal(out[:: max(1, n // 512)].cpu(), table[idx[:: max(1, n // 512)]]))
            t_ces = ev_ms(lambda: ce(srcs=sidx))  # the same rows in address order (destinations permuted)
            idx_d = idx.to(dev)
            t_dp = ev_ms(lambda: ut[idx_d])
            byt = n * rb
            print(f"  {rb:>6} B x {n:>7}: memcpy-equivalent {byt / memcpy_gbps / 1e6:.3f} ms | CE batch "
                  f"{t_ce:.3f} ms {byt / t_ce / 1e6:.1f} GB/s ({byt / t_ce / 1e6 / memcpy_gbps:.3f}x memcpy; "
                  f"host {statistics.median(host_us):.0f} us; rows match {ok}) | CE address order "
                  f"{byt / t_ces / 1e6:.1f} GB/s | datapath gather {t_dp:.3f} ms {byt / t_dp / 1e6:.1f} GB/s "
                  f"({byt / t_dp / 1e6 / memcpy_gbps:.3f}x)", flush=True)
            del out
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
