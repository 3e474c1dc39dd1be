"""B4: activation offloading on GPT-style decoder stacks (SSDTrain Fig. 5.11/5.12).

Ways, each on the same model and input, bf16:
  keep                  no offloading (measured first and again last: "keep-repeat"; the bars use both)
  recompute             layerwise full activation checkpointing (non-reentrant)
  save_on_cpu           torch.autograd.graph.save_on_cpu(pin_memory=True)
  datapath-host         offload to pinned host memory, policy="adaptive", units="leaves" (every
                        Linear/LayerNorm a scope: fine-grained pacing and prefetch)
  datapath-host-all     the same with policy="all" (keep_last_modules=1)
  datapath-host-lowmem  policy="all", keep_last_modules=0, units="leaves", max_inflight_bytes = one MLP
                        activation, max_prefetch_bytes=0 (load only what the next op needs): the
                        lowest peak, at PCIe speed
  datapath-ssd          offload to files (kvikio if usable, else POSIX + O_DIRECT), policy="adaptive",
                        layer units (the default)
  datapath-ssd-all      offload to files, policy="all": what happens when the disk is far too slow

Per way: median step time (forward + backward + SGD step, CUDA events), peak GPU
memory, activation peak (peak minus what was allocated before the step: parameters,
gradients, optimizer state, input), bytes offloaded per step, achieved write/read
bandwidth, time autograd waited for loads, and for adaptive ways the plan (bytes
planned against bytes the measured bandwidth allows).  The activation bytes per
step are estimated (16 sbh tensors of 2 bytes per layer) and measured (storages the
offloader saw).

Run: PYTHONPATH=src:. python benchmarks/offload.py [--quick] [--ssd-dir DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks._common import RESULTS_DIR, print_table, write_result
from datapath._runtime import device_label

log = logging.getLogger("datapath.bench.offload")

WAYS = ["keep", "recompute", "save_on_cpu", "datapath-host", "datapath-host-all", "datapath-host-lowmem",
        "datapath-ssd", "datapath-ssd-all", "keep-repeat"]


class DecoderLayer(nn.Module):
    """Pre-LN GPT layer: fused qkv (q, k, v are views), causal SDPA (flash), GELU MLP."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    def __init__(self, h: int, heads: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(h, heads) for _ in range(layers))
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
        return x


def fs_of(path: str) -> dict[str, str]:
    """Filesystem type and device of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    with open("/proc/mounts") as fh:
        for line in fh:
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, fstype, dev)
    return {"path": real, "mount": best[0], "fstype": best[1], "device": best[2]}


def pick_ssd_dir(requested: str | None) -> str:
    cands = [requested] if requested else ["/var/tmp", "/tmp", os.getcwd()]
    for c in cands:
        if c and os.path.isdir(c) and os.access(c, os.W_OK) and fs_of(c)["fstype"] not in ("tmpfs", "ramfs"):
            return c
    return cands[0] or "/tmp"


def disk_probe(directory: str, nbytes: int) -> dict[str, Any]:
    """Raw file bandwidth with datapath's POSIX engine (O_DIRECT when taken), write then read ``nbytes``."""
    from datapath.offload._io_engine import PosixEngine
    from datapath.offload._host_pool import aligned_empty

    eng = PosixEngine(directory, threads=4, chunk_bytes=16 << 20)
    buf = aligned_empty(eng.chunk_bytes, pinned=False)
    buf.random_(0, 255)
    path = os.path.join(directory, f"datapath-bench-probe-{os.getpid()}")
    fd = eng.open_write(path)
    t0 = time.perf_counter()
    futs = [eng.submit(eng.write_chunk, fd, buf, eng.chunk_bytes, off, path)
            for off in range(0, nbytes, eng.chunk_bytes)]
    for f in futs:
        f.result()
    os.fsync(fd)
    tw = time.perf_counter() - t0
    os.close(fd)
    fd = eng.open_read(path)
    rbufs = [aligned_empty(eng.chunk_bytes, pinned=False) for _ in range(4)]
    t0 = time.perf_counter()
    futs = [eng.submit(eng.read_chunk, fd, rbufs[i % 4], eng.chunk_bytes, off, path)
            for i, off in enumerate(range(0, nbytes, eng.chunk_bytes))]
    for f in futs:
        f.result()
    tr = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    eng.close()
    return {"bytes": nbytes, "write_GBps": nbytes / tw / 1e9, "read_GBps": nbytes / tr / 1e9, "o_direct": eng.direct}


class _Dev:
    """CUDA timing and memory counters; on the CPU (``--cpu-smoke``) wall clock and no memory numbers."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def empty(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()  # pinned blocks cached by save_on_cpu

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_ms(self, t0: Any) -> float:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
            return t0.elapsed_time(ev)
        return (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def _way_context(way: str, model: Stack, ssd_dir: str, cpu: bool, big_tensor: int) -> Iterator[Any]:
    """Per-way setup; yields a function giving the per-step context manager, and the cache (or None)."""
    from datapath.offload import TensorCache

    cache = None
    if way == "recompute":
        model.recompute = True
    if way.startswith("datapath-"):
        target = "host" if "host" in way else "ssd"
        policy = "adaptive" if way in ("datapath-host", "datapath-ssd") else "all"
        lowmem = way.endswith("-lowmem")
        cache = TensorCache(target, ssd_dir if target == "ssd" else None,
                            policy="all" if lowmem else policy, keep_last_modules=0 if lowmem else 1,
                            offload_cpu_tensors=cpu, min_bytes=(1 << 20) if not cpu else 4096,
                            max_inflight_bytes=big_tensor if lowmem else None,
                            max_prefetch_bytes=0 if lowmem else None)
        cache.attach(model, units="leaves" if target == "host" else "blocks")
    try:
        if way == "save_on_cpu":
            yield (lambda: torch.autograd.graph.save_on_cpu(pin_memory=not cpu)), None
        elif cache is not None:
            yield (lambda: cache), cache
        else:
            yield contextlib.nullcontext, None
    finally:
        model.recompute = False
        if cache is not None:
            cache.close()


def run_way(way: str, model: Stack, x: torch.Tensor, warmup: int, steps: int, ssd_dir: str) -> dict[str, Any]:
    dev = _Dev(x.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    times, act_peaks, peaks = [], [], []
    out: dict[str, Any] = {"way": way}
    big = 4 * x.numel() * x.element_size()  # the MLP's hidden activation
    with _way_context(way, model, ssd_dir, not dev.cuda, big) as (make_ctx, cache):
        for i in range(warmup + steps):
            if cache is not None and i == warmup:
                cache.reset_stats()
            dev.sync()
            base = dev.allocated()
            dev.reset_peak()
            t0 = dev.start()
            with make_ctx():
                # a fresh input each step, held by nobody else: like an embedding output, it is an activation
                loss = model(x.clone()).square().mean()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            ms = dev.elapsed_ms(t0)
            del loss
            peak = dev.peak()
            if i >= warmup:
                times.append(ms)
                peaks.append(peak)
                act_peaks.append(peak - base)
            log.info("%s step %d: %.1f ms, activation peak %.2f GB", way, i, ms, (peak - base) / 1e9)
        out.update(step_ms=statistics.median(times), step_ms_all=times, activation_peak_bytes=max(act_peaks),
                   peak_bytes=max(peaks), steps=steps, warmup=warmup)
        if cache is not None:
            cache.wait_io()
            st = cache.stats
            out.update(
                bytes_offloaded_per_step=st.bytes_offloaded / steps,
                bytes_loaded_per_step=st.bytes_loaded / steps,
                bytes_forwarded_per_step=st.bytes_forwarded / steps,
                write_GBps=st.write_bandwidth / 1e9, read_GBps=st.read_bandwidth / 1e9,
                unpack_wait_ms_per_step=st.unpack_wait_seconds * 1e3 / steps,
                store_wait_ms_per_step=st.store_wait_seconds * 1e3 / steps,
                bytes_queued_per_step=st.bytes_queued / steps,
                loads_on_demand=st.loads_on_demand, stats=st.as_dict(), engine=cache.engine,
                o_direct=cache.direct_io,
            )
            if cache.plan is not None:
                out["plan"] = cache.plan.as_dict()
                out["offloadable_bytes_per_step"] = cache.plan.bytes_total
            if cache.profile is not None:
                out["profile_write_GBps"] = cache.profile.write_bandwidth / 1e9
                out["profile_read_GBps"] = cache.profile.read_bandwidth / 1e9
    for p in model.parameters():
        p.grad = None
    del opt
    dev.empty()
    return out


def run_config(cfg: dict[str, Any], ways: list[str], ssd_dir: str, deadline: float) -> dict[str, Any]:
    h, heads, layers, seq, mb = cfg["hidden"], cfg["heads"], cfg["layers"], cfg["seq"], cfg["micro_batch"]
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):  # initialise on the GPU: billions of parameters
        model = Stack(h, heads, layers).to(dtype)
    x = torch.randn(mb, seq, h, device=device, dtype=dtype)
    sbh = mb * seq * h
    est = layers * 16 * sbh * 2 + sbh * 2  # 16 sbh-sized bf16 storages per layer (flash attention), + loss input
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    res: dict[str, Any] = {"config": cfg, "param_bytes": params, "activation_estimate_bytes": est,
                           "fwd_flop_per_step": layers * 24 * sbh * h + layers * 4 * mb * seq * seq * h // 2,
                           "ways": {}}
    for way in ways:
        if time.perf_counter() > deadline:
            res["ways"][way] = {"way": way, "skipped": "time budget"}
            continue
        steps = cfg["steps_slow"] if way in ("save_on_cpu", "datapath-ssd-all") else cfg["steps"]
        warmup = cfg["warmup"] + (2 if way in ("datapath-host", "datapath-ssd") else 0)  # profile, plan, settle
        try:
            res["ways"][way] = run_way(way, model, x, warmup, steps, ssd_dir)
        except torch.cuda.OutOfMemoryError as exc:
            res["ways"][way] = {"way": way, "error": f"out of memory: {exc}"[:300]}
            _Dev(device).empty()
        except Exception as exc:  # noqa: BLE001 - one broken way must not lose the others' numbers
            import traceback

            res["ways"][way] = {"way": way, "error": f"{exc.__class__.__name__}: {exc}"[:500],
                                "traceback": traceback.format_exc()[-3000:]}
            print(traceback.format_exc(), flush=True)
            _Dev(device).empty()
        print(f"  {cfg['name']} {way}: {res['ways'][way].get('step_ms', float('nan')):.1f} ms", flush=True)
    del model, x
    _Dev(device).empty()
    return res


def bars(res: dict[str, Any]) -> dict[str, Any]:
    w = res["ways"]

    def get(way: str, key: str) -> float | None:
        v = w.get(way, {}).get(key)
        return float(v) if v is not None else None

    keep_t, keep_a = get("keep", "step_ms"), get("keep", "activation_peak_bytes")
    out: dict[str, Any] = {}
    rep = w.get("keep-repeat", {})
    if keep_t and rep.get("step_ms_all") and w["keep"].get("step_ms_all"):
        keep_t = statistics.median(w["keep"]["step_ms_all"] + rep["step_ms_all"])  # both runs of keep pooled
        out["keep_step_ms_pooled"] = keep_t
    host_t, host_a = get("datapath-host", "step_ms"), get("datapath-host", "activation_peak_bytes")
    soc_t, soc_a = get("save_on_cpu", "step_ms"), get("save_on_cpu", "activation_peak_bytes")
    ssd_t = get("datapath-ssd", "step_ms")
    low_t, low_a = get("datapath-host-lowmem", "step_ms"), get("datapath-host-lowmem", "activation_peak_bytes")
    if low_t and low_a and soc_t and soc_a:
        out["host_lowmem_faster_than_save_on_cpu"] = low_t < soc_t
        out["host_lowmem_peak_le_save_on_cpu"] = low_a <= soc_a
        out["host_lowmem_time_vs_save_on_cpu"] = low_t / soc_t
        out["host_lowmem_peak_vs_save_on_cpu"] = low_a / soc_a
    if keep_t and keep_a and host_t and host_a:
        out["host_activation_peak_reduction"] = 1 - host_a / keep_a
        out["host_peak_ge_40pct_below_keep"] = 1 - host_a / keep_a >= 0.40
        out["host_time_vs_keep"] = host_t / keep_t
        out["host_time_le_1.05x_keep"] = host_t / keep_t <= 1.05
        if soc_t and soc_a:
            out["host_faster_than_save_on_cpu"] = host_t < soc_t
            out["host_peak_le_save_on_cpu"] = host_a <= soc_a
    if keep_t and ssd_t:
        out["ssd_adaptive_time_vs_keep"] = ssd_t / keep_t
        out["ssd_adaptive_time_le_1.05x_keep"] = ssd_t / keep_t <= 1.05
        plan = w["datapath-ssd"].get("plan")
        if plan:
            out["ssd_bytes_planned"] = plan["bytes_planned"]
            out["ssd_bytes_allowed_by_bandwidth"] = plan["bytes_allowed"]
            out["ssd_bytes_offloaded_per_step"] = w["datapath-ssd"].get("bytes_offloaded_per_step")
            if plan["bytes_allowed"]:
                out["ssd_offloaded_vs_allowed"] = out["ssd_bytes_offloaded_per_step"] / plan["bytes_allowed"]
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 5), squeeze=False)
    for ax, res in zip(axes[0], results):
        for way, r in res["ways"].items():
            if "step_ms" not in r:
                continue
            ax.scatter(r["activation_peak_bytes"] / 1e9, r["step_ms"], s=40)
            ax.annotate(way, (r["activation_peak_bytes"] / 1e9, r["step_ms"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        c = res["config"]
        ax.set_title(f"{c['name']}: H={c['hidden']} L={c['layers']} s={c['seq']} mb={c['micro_batch']} bf16")
        ax.set_xlabel("activation peak (GB)")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"B4 activation offloading on {device_label()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, < 1 minute")
    ap.add_argument("--ssd-dir", default=None, help="directory on the disk to offload to (default: /var/tmp, /tmp)")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--time-budget", type=float, default=200.0, help="seconds; later ways are skipped past it")
    ap.add_argument("--probe-bytes", type=int, default=2 << 30)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes on the CPU (offloading CPU tensors): checks the script, measures nothing")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("datapath.offload.cache").setLevel(logging.INFO)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("B4 needs a CUDA GPU; nothing to do on this machine (try --cpu-smoke to check the script).")
        return 0
    deadline = time.perf_counter() + args.time_budget
    ways = [w for w in args.ways.split(",") if w]
    if args.cpu_smoke:
        configs = [dict(name="cpu-smoke", hidden=128, heads=4, layers=3, seq=64, micro_batch=4,
                        warmup=2, steps=2, steps_slow=2)]
        probe = 64 << 20
    elif args.quick:
        configs = [dict(name="quick", hidden=2048, heads=16, layers=4, seq=1024, micro_batch=4,
                        warmup=2, steps=3, steps_slow=2)]
        probe = 256 << 20
    else:
        configs = [
            dict(name="H8192-mb8", hidden=8192, heads=64, layers=4, seq=1024, micro_batch=8,
                 warmup=2, steps=8, steps_slow=2),
            dict(name="H4096-mb16", hidden=4096, heads=32, layers=4, seq=1024, micro_batch=16,
                 warmup=2, steps=8, steps_slow=2),
            dict(name="H8192-mb16", hidden=8192, heads=64, layers=4, seq=1024, micro_batch=16,
                 warmup=2, steps=5, steps_slow=2),
        ]
        probe = args.probe_bytes
    ssd_dir = pick_ssd_dir(args.ssd_dir)
    fs = fs_of(ssd_dir)
    print(f"ssd directory {ssd_dir}: {fs}", flush=True)
    disk = disk_probe(ssd_dir, probe)
    print(f"disk probe: write {disk['write_GBps']:.2f} GB/s, read {disk['read_GBps']:.2f} GB/s, "
          f"O_DIRECT {disk['o_direct']}", flush=True)
    results = []
    for cfg in configs:
        if time.perf_counter() > deadline:
            results.append({"config": cfg, "skipped": "time budget", "ways": {}})
            continue
        print(f"config {cfg['name']}", flush=True)
        res = run_config(cfg, ways, ssd_dir, deadline)
        res["bars"] = bars(res)
        results.append(res)
        write_result("offload", {"ssd_dir": fs, "disk_probe": disk, "results": results})  # partial, in case
    payload = {"ssd_dir": fs, "disk_probe": disk, "results": results}
    path = write_result("offload", payload)
    done = [r for r in results if r.get("ways")]
    if done:
        plot(done, RESULTS_DIR / "offload.png")
    rows = []
    for res in done:
        keep = res["ways"].get("keep", {})
        for way, r in res["ways"].items():
            if "step_ms" not in r:
                rows.append({"config": res["config"]["name"], "way": way, "step_ms": r.get("error") or r.get("skipped")})
                continue
            rows.append({
                "config": res["config"]["name"], "way": way, "step_ms": r["step_ms"],
                "x_keep": r["step_ms"] / keep["step_ms"] if keep.get("step_ms") else float("nan"),
                "act_GB": r["activation_peak_bytes"] / 1e9,
                "act_vs_keep": r["activation_peak_bytes"] / keep["activation_peak_bytes"]
                if keep.get("activation_peak_bytes") else float("nan"),
                "peak_GB": r["peak_bytes"] / 1e9,
                "off_GB": r.get("bytes_offloaded_per_step", 0) / 1e9,
                "wr_GBps": r.get("write_GBps", 0.0), "rd_GBps": r.get("read_GBps", 0.0),
                "wait_ms": r.get("unpack_wait_ms_per_step", 0.0),
            })
    print(f"\nresults: {path}")
    for res in done:
        est = res["activation_estimate_bytes"] / 1e9
        seen = next((r.get("offloadable_bytes_per_step") for r in res["ways"].values()
                     if r.get("offloadable_bytes_per_step")), None)
        print(f"{res['config']['name']}: activation estimate {est:.2f} GB/step, offloadable seen "
              f"{(seen or 0) / 1e9:.2f} GB/step; bars {res.get('bars')}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
