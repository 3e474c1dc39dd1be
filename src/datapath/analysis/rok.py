"""Recompute-offload-keep (ROK) curves: where each activation strategy lands in memory and speed.

`sweep` runs a model for a few training steps under each strategy and
micro-batch size and records, per run (a *point*):

- the activation memory peak: on CUDA, ``max_memory_allocated`` during the
  measured steps minus what was allocated when they began (parameters,
  gradients, which are kept allocated between steps, and optimizer state), so
  saved activations plus the temporaries of forward and backward; on a CPU,
  the same quantity counted by a dispatch mode that adds up the bytes of every
  storage created by a torch op on this thread while it is alive (a CPU has no
  allocator statistics; storages made in other threads or outside torch ops are
  not seen);
- the step time (median of the measured steps) and the model throughput:
  algorithmic FLOPs of a step (3 x forward, recomputation not counted) per
  second, the FLOPs from the workload's analytic count or, for a user model,
  3 x the forward FLOPs counted by `torch.utils.flop_counter`;
- for offload strategies, the offloader's statistics (bytes written...).

A point that runs out of memory is recorded as ``"oom"`` and the larger
micro-batches of that strategy are skipped. The result gives the efficient
frontier, the best point under a memory budget, a JSON document and a PNG.

Strategies: ``keep``; ``recompute`` (layerwise ``torch.utils.checkpoint``,
non-reentrant); ``offload-host``/``offload-ssd``/``offload-tiered`` (policy
"all") and ``offload-host-adaptive``/``offload-ssd-adaptive`` (`datapath.offload`);
``recompute+offload-host``/``recompute+offload-ssd`` (reentrant checkpointing,
so the layer inputs it saves go through the offloader); ``save-on-cpu``
(`torch.autograd.graph.save_on_cpu`, PyTorch's own host offload, for reference).
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from datapath._runtime.errors import DatapathError
from datapath.analysis.presets import TransformerConfig, Workload, build_workload, get_preset
from datapath.analysis.rok_result import RokPoint, RokResult, format_rows
from datapath.offload.memory_meter import CpuMeter

__all__ = [
    "DEFAULT_STRATEGIES", "STRATEGIES", "RokError", "RokPoint", "RokResult", "Strategy", "Workload",
    "format_rows", "load_model_factory", "recompute_layers", "sweep",
]

log = logging.getLogger("datapath.analysis.rok")


class RokError(DatapathError, ValueError):
    """A ROK sweep was asked for something it cannot do (unknown strategy, bad factory, no layers)."""


@dataclass(frozen=True)
class Strategy:
    """How activations are handled in a run.

    ``recompute``: None, "checkpoint" (non-reentrant) or "reentrant" (its saved layer
    inputs pass through saved-tensor hooks, so an offloader can move them);
    ``offload``: keyword arguments for `datapath.offload.offload`, or None;
    ``save_on_cpu``: PyTorch's `save_on_cpu(pin_memory=True)`.
    """

    name: str
    recompute: str | None = None
    offload: dict[str, Any] | None = None
    save_on_cpu: bool = False
    min_warmup: int = 1


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("keep"),
    Strategy("recompute", recompute="checkpoint"),
    Strategy("offload-host", offload={"target": "host", "policy": "all"}),
    Strategy("offload-host-adaptive", offload={"target": "host", "policy": "adaptive"}, min_warmup=2),
    Strategy("offload-ssd", offload={"target": "ssd", "policy": "all"}),
    Strategy("offload-ssd-adaptive", offload={"target": "ssd", "policy": "adaptive"}, min_warmup=2),
    Strategy("offload-tiered", offload={"target": "tiered", "policy": "all"}),
    Strategy("recompute+offload-host", recompute="reentrant", offload={"target": "host", "policy": "all"}),
    Strategy("recompute+offload-ssd", recompute="reentrant", offload={"target": "ssd", "policy": "all"}),
    Strategy("save-on-cpu", save_on_cpu=True),
)}
DEFAULT_STRATEGIES: tuple[str, ...] = (
    "keep", "recompute", "offload-host", "offload-ssd-adaptive", "recompute+offload-host",
)


class _Checkpointed(nn.Module):
    """Runs ``inner`` under `torch.utils.checkpoint` (layerwise full recomputation)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=self.reentrant)


def _layer_lists(workload: Workload) -> list[nn.ModuleList]:
    if workload.layer_lists:
        return list(workload.layer_lists)
    lists = [m for m in workload.model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise RokError("recompute needs the model's layers: set Workload.layer_lists "
                       "(no nn.ModuleList found in the model)")
    return [max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))]


@contextlib.contextmanager
def recompute_layers(workload: Workload, mode: str) -> Iterator[None]:
    """Wrap every layer of the workload's layer lists in `_Checkpointed` for the duration."""
    lists = _layer_lists(workload)
    saved = [list(lst) for lst in lists]
    try:
        for lst in lists:
            for i, layer in enumerate(list(lst)):
                lst[i] = _Checkpointed(layer, reentrant=mode == "reentrant")
        yield
    finally:
        for lst, orig in zip(lists, saved):
            for i, layer in enumerate(orig):
                lst[i] = layer


def _loss(workload: Workload, batch: tuple[Any, ...]) -> torch.Tensor:
    if workload.loss_fn is not None:
        return workload.loss_fn(workload.model, batch)
    out = workload.model(*batch)
    if hasattr(out, "loss") and out.loss is not None:
        out = out.loss
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise RokError(f"the model returned {type(out).__name__}; give Workload.loss_fn")
    return out if out.ndim == 0 else out.float().mean()


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):  # type: ignore[no-untyped-def]
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def measure_flops_per_step(workload: Workload, micro_batch: int) -> float:
    """3 x the forward FLOPs counted by `torch.utils.flop_counter` (CPU FlashAttention included)."""
    from torch.utils.flop_counter import FlopCounterMode

    custom = {}
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        custom[op] = _sdpa_cpu_flops
    batch = workload.make_batch(micro_batch)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=custom) as fc:
        _loss(workload, batch)
    return 3.0 * float(fc.get_total_flops())


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in msg or "can't allocate memory" in msg or isinstance(exc, MemoryError))


def _stats_dict(cache: Any) -> dict[str, Any] | None:
    """The offloader's statistics as a plain dict (whatever shape its stats object has)."""
    if cache is None:
        return None
    stats = getattr(cache, "stats", None)
    if callable(stats):
        stats = stats()
    if stats is None:
        stats = cache
    if hasattr(stats, "as_dict"):
        stats = stats.as_dict()
    if isinstance(stats, dict):
        d = dict(stats)
    elif hasattr(stats, "__dataclass_fields__"):
        d = asdict(stats)
    else:
        d = {k: getattr(stats, k) for k in dir(stats)
             if not k.startswith("_") and isinstance(getattr(stats, k, None), (int, float, str, bool))}
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}


@contextlib.contextmanager
def _strategy_context(workload: Workload, strat: Strategy, ssd_path: str | None,
                      offload_options: dict[str, Any], device: torch.device) -> Iterator[Any]:
    with contextlib.ExitStack() as stack:
        if strat.recompute:
            stack.enter_context(recompute_layers(workload, strat.recompute))
        cache = None
        if strat.offload is not None:
            from datapath.offload import offload  # noqa: PLC0415 - analysis sits above offload

            kwargs = {**offload_options, **strat.offload}
            if strat.offload["target"] in ("ssd", "tiered"):
                kwargs["path"] = ssd_path
            if device.type == "cpu":
                kwargs.setdefault("offload_cpu_tensors", True)  # on a CPU-only machine, activations are CPU tensors
            kwargs.setdefault("schedule_hints", False)  # plain training loop: no pipeline schedule to patch
            kwargs.setdefault("units", "leaves")  # every Linear/LayerNorm a scope: fine-grained pacing and prefetch
            cache = stack.enter_context(offload(workload.model, **kwargs))
        if strat.save_on_cpu:
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()))
        yield cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_point(workload: Workload, opt: torch.optim.Optimizer, strat: Strategy, micro_batch: int, *,
               device: torch.device, steps: int, warmup: int, ssd_path: str | None,
               offload_options: dict[str, Any]) -> RokPoint:
    point = RokPoint(strat.name, micro_batch, "ok")
    batch = workload.make_batch(micro_batch)
    warmup = max(warmup, strat.min_warmup)

    def step() -> None:
        loss = _loss(workload, batch)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline

    with _strategy_context(workload, strat, ssd_path, offload_options, device) as cache:
        for _ in range(warmup):
            step()
        _sync(device)
        before = _stats_dict(cache) or {}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            point.baseline_bytes = torch.cuda.memory_allocated(device)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            point.peak_allocated_bytes = peak
            point.activation_peak_bytes = peak - (point.baseline_bytes or 0)
            point.memory_measure = "cuda max_memory_allocated - allocated at step start"
        else:  # one more step, counted (not timed)
            meter = CpuMeter(0)
            meter.lap()
            with meter:
                step()
            point.activation_peak_bytes = meter.lap()
            point.memory_measure = "cpu: peak live bytes of storages created by torch ops in the step"
        after = _stats_dict(cache)
    point.step_times_s = times
    point.step_time_s = statistics.median(times)
    point.samples_per_s = micro_batch / point.step_time_s
    if after is not None:
        point.offload_stats = after
        n_steps = steps + (0 if device.type == "cuda" else 1)
        point.offload_stats_per_step = {
            k: (v - before.get(k, 0)) / n_steps for k, v in after.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(before.get(k, 0), (int, float))
            and (k.startswith(("bytes_", "storages_", "stores_", "loads_")) or k.endswith("_seconds"))
        }
        key = next((k for k in ("bytes_offloaded", "bytes_written", "offloaded_bytes") if k in after), None)
        if key is not None:
            point.bytes_offloaded_per_step = point.offload_stats_per_step.get(key)
    return point


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _check_cuda_autograd() -> None:
    """Fail fast when CUDA backward cannot work in this process.

    Once a PrivateUse1 backend is registered, ``at::getAccelerator()`` names it
    instead of CUDA and autograd nodes on CUDA get no stream: every CUDA backward
    then trips ``opt_ready_stream && opt_parent_stream`` (pytorch#161129).
    """
    acc = getattr(torch, "accelerator", None)
    cur = acc.current_accelerator() if acc is not None and hasattr(acc, "current_accelerator") else None
    if cur is not None and cur.type != "cuda":
        raise RokError(
            f"PyTorch's accelerator in this process is {cur.type!r}, not 'cuda' (a PrivateUse1 backend was "
            "registered), and with it every CUDA backward fails inside PyTorch (pytorch#161129). Run the sweep "
            "in a process where that backend is not registered.")


def load_model_factory(spec: str) -> Callable[..., Any]:
    """Import ``'package.module:function'`` and return the function."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise RokError(f"--model-factory wants 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise RokError(f"cannot import {mod_name!r} for the model factory: {exc}; "
                       "is it on PYTHONPATH?") from exc
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise RokError(f"{mod_name!r} has no callable {fn_name!r}")
    return fn


def _as_workload(obj: Any) -> Workload:
    if isinstance(obj, Workload):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], nn.Module) and callable(obj[1]):
        return Workload(model=obj[0], make_batch=obj[1])
    raise RokError("a model factory must return a datapath.analysis.rok.Workload or a tuple "
                   f"(model, make_batch); got {type(obj).__name__}")


def sweep(model: Workload | TransformerConfig | str | Callable[..., Any],
          strategies: Sequence[str] = DEFAULT_STRATEGIES,
          micro_batches: Sequence[int] = (1, 2, 4), *,
          steps: int = 3, warmup: int = 1, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None, ssd_path: str | Path | None = None,
          offload_options: dict[str, Any] | None = None, lr: float = 1e-5,
          progress: Callable[[RokPoint], None] | None = None) -> RokResult:
    """Run every (strategy, micro-batch) point and return a `RokResult`.

    ``model``: a `Workload`; a `presets.TransformerConfig` or preset name (built
    here with random weights); or a factory ``f(device, dtype)`` returning a
    `Workload` or ``(model, make_batch)``. Each point runs ``warmup`` steps then
    ``steps`` timed steps of forward, backward and SGD. ``device`` defaults to CUDA
    when available; ``dtype`` to bfloat16 on CUDA and float32 on a CPU.
    ``ssd_path``: directory for the ssd/tiered targets (default: a temporary
    directory, removed afterwards). ``offload_options`` go to every offload
    strategy (e.g. ``min_bytes``, ``keep_last_modules``). ``progress(point)`` is
    called after each point.
    """
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise RokError(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    mbs = sorted({int(m) for m in micro_batches})
    if not mbs or mbs[0] <= 0 or steps <= 0 or warmup < 0:
        raise RokError("micro_batches must be positive integers, steps > 0, warmup >= 0")
    try:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError as exc:
        raise RokError(f"device={device!r} is not a device: {exc}; use 'cuda', 'cuda:1' or 'cpu'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RokError(f"device={device!r} asks for a GPU but no CUDA device is available here "
                       f"(torch {torch.__version__}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RokError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if dev.type == "cuda":
        _check_cuda_autograd()

    if isinstance(model, str):
        model = get_preset(model)
    if isinstance(model, TransformerConfig):
        workload = build_workload(model, dev, dtype)
    elif isinstance(model, Workload):
        workload = model
    elif callable(model):
        workload = _as_workload(model(dev, dtype))
    else:
        raise RokError(f"cannot sweep a {type(model).__name__}")

    opt = torch.optim.SGD([p for p in workload.model.parameters() if p.requires_grad], lr=lr)
    flops_cache: dict[int, float] = {}

    def flops(mb: int) -> float:
        if mb not in flops_cache:
            flops_cache[mb] = (workload.flops_per_step(mb) if workload.flops_per_step
                               else measure_flops_per_step(workload, mb))
        return flops_cache[mb]

    tmp = None
    if ssd_path is None and any((STRATEGIES[s].offload or {}).get("target") in ("ssd", "tiered")
                                for s in strategies):
        tmp = tempfile.TemporaryDirectory(prefix="datapath-rok-")
        ssd_path = tmp.name
    points: list[RokPoint] = []
    try:
        for name in strategies:
            strat = STRATEGIES[name]
            blocked = False
            for mb in mbs:
                if blocked:
                    points.append(RokPoint(name, mb, "skipped", error="out of memory at a smaller micro-batch"))
                    continue
                try:
                    point = _run_point(workload, opt, strat, mb, device=dev, steps=steps, warmup=warmup,
                                       ssd_path=None if ssd_path is None else str(ssd_path),
                                       offload_options=dict(offload_options or {}))
                except RokError:
                    raise
                except Exception as exc:  # noqa: BLE001 - recorded in the point, the sweep goes on
                    oom = _is_oom(exc)
                    point = RokPoint(name, mb, "oom" if oom else "error", error=f"{type(exc).__name__}: {exc}"[:500])
                    blocked = oom
                    (log.info if oom else log.warning)("%s at micro-batch %d: %s", name, mb, point.error)
                    del exc
                finally:
                    opt.zero_grad(set_to_none=False)
                    _cleanup(dev)
                if point.ok and point.step_time_s:
                    point.flops_per_step = flops(mb)
                    point.throughput_flops = point.flops_per_step / point.step_time_s
                if workload.activation_estimate is not None:
                    point.activation_estimate_bytes = workload.activation_estimate(mb)
                if workload.stored_estimate is not None and strat.offload is not None:
                    rec = {**(offload_options or {}), **strat.offload}.get("recompute_elementwise", True)
                    point.stored_estimate_bytes = workload.stored_estimate(mb, bool(rec))
                points.append(point)
                if progress is not None:
                    progress(point)
    finally:
        if tmp is not None:
            tmp.cleanup()

    return RokResult(
        workload={"name": workload.name, **workload.info},
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        dtype=str(dtype).replace("torch.", ""),
        points=points,
        settings={"strategies": list(strategies), "micro_batches": mbs, "steps": steps, "warmup": warmup,
                  "offload_options": {k: v for k, v in (offload_options or {}).items()}, "optimizer": f"SGD(lr={lr})"},
    )
