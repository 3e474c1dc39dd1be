#!/usr/bin/env bash
# Development run of the features helper (issue 16, B1): GPU tests of memory/ and unified_tensor/, the host cost
# per gather call, device time per call at 8K rows, grid size and visit order at 262K rows, 2 MiB pages for a
# 16 GiB table (cudaHostAlloc vs THP vs hugetlbfs), then a subset of benchmarks/gather.py.
#   OUT=/tmp/out scripts/gpu_features.sh            (results and logs under $OUT)
#   PROBE=2 ...: after the tests, only the launch path (host cost per call by launcher, 8K-row calls end to end)
# The hugetlb pool is reserved only for the probe and given back at its end (nr_hugepages restored).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DATAPATH_RESULTS="$OUT"
T0=$SECONDS
echo "thp: $(cat /sys/kernel/mm/transparent_hugepage/enabled) defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
grep -E "HugePages_(Total|Free)|Hugepagesize" /proc/meminfo | tr '\n' ' '; echo

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${T_TESTS:-150}" python3 -m pytest tests/memory tests/unified_tensor -m gpu -q -rfE -p no:cacheprovider \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? ($((SECONDS - T0)) s)"; tail -n 3 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
fi

if [ "${PROBE:-1}" = 2 ]; then  # the launch path alone: host cost per call by launcher, 8K-row calls end to end
timeout "${T_PROBE:-90}" python3 - > "$OUT/probe2.log" 2>&1 <<'EOF'
import json, os, statistics, time
import torch
import datapath  # noqa: F401
from datapath.memory import _plans, cuda_alias, gather_rows, pinned_empty, check_errors
from datapath.unified_tensor import as_unified

dev = torch.device("cuda")
def host_us(fn, n=300):
    torch.cuda.synchronize(); fn(); fn(); torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6
def med_ms(fns, reps=15):
    names = list(fns); t = {k: [] for k in names}
    for f in fns.values():
        f(); f()
    for r in range(reps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fns[k](); e.record(); e.synchronize(); t[k].append(s.elapsed_time(e))
    return {k: statistics.median(v) for k, v in t.items()}
big = pinned_empty((1 << 30,), torch.float32)  # 4 GiB
big.view(torch.int32)[:: 1 << 10].fill_(7)
res = {"device": torch.cuda.get_device_name()}
table = big[: (4 << 20) * 64].view(4 << 20, 64)
u, alias = as_unified(table), cuda_alias(table)
i = torch.randint(0, 4 << 20, (8192,), device=dev)
f = 64
h = {"torch.empty": host_us(lambda: torch.empty((8192, f), dtype=torch.float32, device=dev)),
     "new_empty": host_us(lambda: i.new_empty((8192, f), dtype=torch.float32)),
     "naive": host_us(lambda: torch.index_select(alias, 0, i))}
for L in ("ctypes", "cupy"):
    _plans.LAUNCHER = L
    h[f"gather_rows[{L}]"] = host_us(lambda: gather_rows(u, i))
    h[f"u[idx][{L}]"] = host_us(lambda: u[i])
_plans.LAUNCHER = "ctypes"
import cProfile, pstats, io
pr = cProfile.Profile(); pr.enable()
for _ in range(2000):
    gather_rows(u, i)
pr.disable(); torch.cuda.synchronize()
sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(14); print(sio.getvalue()[-2600:])
print("host us per call, 8192 rows of 256 B: " + ", ".join(f"{k} {v:.1f}" for k, v in h.items()), flush=True)
res["host_us"] = h
rows = []
for rb in (256, 1024, 2048, 4096, 16384):
    w = rb // 4; n = min(4 << 20, big.numel() // w)
    t = big[: n * w].view(n, w); u2, al2 = as_unified(t), cuda_alias(t)
    sets = [torch.randint(0, n, (8192,), device=dev) for _ in range(4)]; k = [0]
    def nxt():
        k[0] = (k[0] + 1) % 4; return sets[k[0]]
    fns = {"naive": lambda: torch.index_select(al2, 0, nxt())}
    for L in ("ctypes", "cupy"):
        def g(L=L):
            _plans.LAUNCHER = L
            return u2[nxt()]
        fns[L] = g
    ms = med_ms(fns)
    assert torch.equal(u2[sets[0][:500]].cpu().view(torch.int32), t[sets[0][:500].cpu()].view(torch.int32))
    rows.append({"row_bytes": rb, **ms})
    print(f"8K x {rb:5d} B ms: " + ", ".join(f"{k} {v:.4f}" for k, v in ms.items())
          + f"  naive/ctypes {ms['naive'] / ms['ctypes']:.3f} naive/cupy {ms['naive'] / ms['cupy']:.3f}", flush=True)
res["rows8k"] = rows
check_errors()
json.dump(res, open(os.path.join(os.environ["DATAPATH_RESULTS"], "probe2.json"), "w"), indent=1)
print("probe2 done")
EOF
echo "probe2 rc=$? ($((SECONDS - T0)) s)"; grep -v "^\s*$" "$OUT/probe2.log" | tail -n 45
echo "total $((SECONDS - T0)) s"; exit 0
fi

old_pool=$(cat /proc/sys/vm/nr_hugepages)
restore() { echo "$old_pool" > /proc/sys/vm/nr_hugepages 2>/dev/null; }
trap restore EXIT
if [ "${HUGETLB:-1}" = 1 ]; then
  echo 8200 > /proc/sys/vm/nr_hugepages 2>/dev/null || echo "cannot reserve hugetlb pages"
  echo "hugetlb pool: $(grep HugePages_Free /proc/meminfo)"
fi
timeout "${T_PROBE:-200}" python3 - > "$OUT/probe.log" 2>&1 <<'EOF'
import json, os, statistics, time
import torch
import datapath  # noqa: F401
from datapath.memory import (cuda_alias, free_hugetlb_pages, gather_config, gather_rows, huge_page_bytes,
                             huge_pinned_empty, pinned_empty, check_errors)
from datapath.unified_tensor import as_unified

out = {"device": torch.cuda.get_device_name(), "thp_free_hugetlb": free_hugetlb_pages()}
dev = torch.device("cuda")

def fill(buf):
    flat = buf.view(torch.uint8).view(-1); step = 1 << 28
    block = torch.randint(0, 256, (min(flat.numel(), step),), dtype=torch.uint8, device="cuda")
    for s in range(0, flat.numel(), step):
        n = min(step, flat.numel() - s); flat[s:s + n].copy_(block[:n], non_blocking=True); block = block.roll(4099)
    torch.cuda.synchronize()

def host_us(fn, n=300):
    torch.cuda.synchronize(); fn(); torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time: the calls below only queue
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6

def device_us(fn, n=50):
    """Per-call GPU time with the launches queued back to back (host cost hidden)."""
    fn(); torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / n * 1e3

def med_ms(fns, reps=7):
    names = list(fns); t = {k: [] for k in names}
    for f in fns.values():
        f(); f()
    for r in range(reps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fns[k](); e.record(); e.synchronize(); t[k].append(s.elapsed_time(e))
    return {k: statistics.median(v) for k, v in t.items()}

t0 = time.time()
big = pinned_empty((4 << 30,), torch.float32)  # 16 GiB, as the benchmark
fill(big)
print(f"16 GiB cudaHostAlloc buffer in {time.time() - t0:.1f} s", flush=True)

# 1. host cost per call (256 B rows, 4M-row table, 1 and 8192 rows)
table = big[: (4 << 20) * 64].view(4 << 20, 64)
u, alias, cud = as_unified(table), cuda_alias(table), table[: 1 << 16].cuda()
ic = {}
host = {}
for m in (1, 8192):
    i = torch.randint(0, 4 << 20, (m,), device=dev)
    i32 = i.int()
    ic = i % (1 << 16)
    host[m] = {
        "empty": host_us(lambda: torch.empty((m, 64), device=dev)),
        "naive_index_select": host_us(lambda: torch.index_select(alias, 0, i)),
        "u[idx]": host_us(lambda: u[i]),
        "gather_rows(u)": host_us(lambda: gather_rows(u, i)),
        "gather_rows(u,i32)": host_us(lambda: gather_rows(u, i32)),
        "gather_rows(pinned)": host_us(lambda: gather_rows(table, i)),
        "gather_rows(cuda)": host_us(lambda: gather_rows(cud, ic)),
        "naive(cuda)": host_us(lambda: torch.index_select(cud, 0, ic)),
        "gather_rows(u,sort)": host_us(lambda: gather_rows(u, i, sort=True)),
    }
    print(f"host us per call, {m} rows: " + ", ".join(f"{k} {v:.1f}" for k, v in host[m].items()), flush=True)
out["host_us"] = host
check_errors()

# 2. 8192 rows per call at every row size: end to end (as B1) and device time back to back
rows8k = []
for rb in (256, 512, 1024, 2048, 4096, 8192, 16384):
    w = rb // 4
    n = min(4 << 20, big.numel() // w)
    t = big[: n * w].view(n, w)
    u, alias = as_unified(t), cuda_alias(t)
    sets = [torch.randint(0, n, (8192,), device=dev) for _ in range(4)]
    k = [0]
    def nxt():
        k[0] = (k[0] + 1) % 4; return sets[k[0]]
    e2e = med_ms({"dp": lambda: u[nxt()], "naive": lambda: torch.index_select(alias, 0, nxt())}, reps=9)
    dv = {"dp": device_us(lambda: u[nxt()]), "naive": device_us(lambda: torch.index_select(alias, 0, nxt()))}
    rec = {"row_bytes": rb, "dp_ms": e2e["dp"], "naive_ms": e2e["naive"], "dp_dev_us": dv["dp"], "naive_dev_us": dv["naive"]}
    rows8k.append(rec)
    print(f"8K rows x {rb:5d} B: e2e dp {e2e['dp']:.3f} naive {e2e['naive']:.3f} ms (x{e2e['naive'] / e2e['dp']:.2f}); "
          f"device dp {dv['dp']:.1f} naive {dv['naive']:.1f} us", flush=True)
out["rows8k"] = rows8k

# 3. 262K rows: grid (blocks per SM) x visit order; sort cost
grid = []
for rb in (512, 1024, 2048):
    w = rb // 4
    n = 4 << 20
    t = big[: n * w].view(n, w)
    u, alias = as_unified(t), cuda_alias(t)
    sets = [torch.randint(0, n, (262144,), device=dev) for _ in range(3)]
    k = [0]
    def nxt():
        k[0] = (k[0] + 1) % 3; return sets[k[0]]
    fns = {"naive": lambda: torch.index_select(alias, 0, nxt())}
    for bps in (2, 4, 8):
        for srt in (True, False):
            def f(bps=bps, srt=srt):
                gather_config.blocks_per_sm = bps
                return gather_rows(u, nxt(), sort=srt)
            fns[f"b{bps}_{'sort' if srt else 'nosort'}"] = f
    ms = med_ms(fns, reps=5)
    gather_config.blocks_per_sm = 2
    peak = 54.7
    grid.append({"row_bytes": rb, **ms})
    print(f"262K x {rb} B (GB/s): " + ", ".join(f"{k} {262144 * rb / v / 1e6:.1f}" for k, v in ms.items()), flush=True)
idx = torch.randint(0, 4 << 20, (262144,), device=dev)
sort_us = med_ms({"i64": lambda: torch.sort(idx), "i32": lambda: torch.sort(idx.int()),
                  "i32_keys_only": lambda: torch.sort(idx.int(), stable=False)}, reps=9)
print("sort 262K us: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sort_us.items()), flush=True)
out["grid262k"] = grid
out["sort_ms"] = sort_us

# 4. 16 GiB table on 4 KiB (cudaHostAlloc) vs 2 MiB pages (THP, hugetlbfs): 262K random rows
pages = []
bufs = {"cudaHostAlloc": big}
for how in ("thp", "hugetlb"):
    t0 = time.time()
    try:
        b = huge_pinned_empty((4 << 30,), torch.float32, how=how)
    except Exception as exc:  # noqa: BLE001
        print(f"{how}: {exc!r}"); b = None
    if b is None:
        print(f"{how}: not available", flush=True)
        continue
    fill(b)
    print(f"{how}: {huge_page_bytes(b) / 2**30:.2f} GiB on huge pages, made in {time.time() - t0:.1f} s", flush=True)
    bufs[how] = b
for name, b in bufs.items():
    for rb in (256, 512, 1024, 4096):
        w = rb // 4
        n = b.numel() // w
        t = b[: n * w].view(n, w)
        u, alias = as_unified(t), cuda_alias(t)
        sets = [torch.randint(0, n, (262144,), device=dev) for _ in range(3)]
        k = [0]
        def nxt():
            k[0] = (k[0] + 1) % 3; return sets[k[0]]
        ms = med_ms({"naive": lambda: torch.index_select(alias, 0, nxt()), "dp_sort": lambda: gather_rows(u, nxt(), sort=True),
                     "dp_nosort": lambda: gather_rows(u, nxt(), sort=False)}, reps=5)
        got = gather_rows(u, sets[0][:1000]).cpu()
        assert torch.equal(got.view(torch.int32), t[sets[0][:1000].cpu()].view(torch.int32))
        pages.append({"alloc": name, "row_bytes": rb, **{k2: 262144 * rb / v / 1e6 for k2, v in ms.items()}})
        print(f"16 GiB {name:13s} {rb:5d} B x 262K (GB/s): " + ", ".join(f"{k2} {262144 * rb / v / 1e6:.1f}" for k2, v in ms.items()), flush=True)
out["pages16g"] = pages
check_errors()
json.dump(out, open(os.path.join(os.environ["DATAPATH_RESULTS"], "probe.json"), "w"), indent=1)
print("probe done")
EOF
echo "probe rc=$? ($((SECONDS - T0)) s)"
restore
cat "$OUT/probe.log" | grep -v "^\s*$" | tail -n 60

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${T_BENCH:-150}" python3 benchmarks/gather.py --counts 8192,262144 --no-align --no-py --table-gib none \
    --name gather_dev > "$OUT/gather_dev.log" 2>&1
  echo "gather subset rc=$? ($((SECONDS - T0)) s)"; tail -n 22 "$OUT/gather_dev.log"
fi
echo "total $((SECONDS - T0)) s"
