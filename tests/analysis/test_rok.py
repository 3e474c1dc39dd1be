"""ROK sweeps: keep and recompute points, the memory measure, FLOPs, OOM handling, frontier, CLI."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from datapath.cli import main
from datapath.analysis.presets import PRESETS, Workload, build_workload, get_preset
from datapath.analysis.rok import (
    RokError,
    RokPoint,
    RokResult,
    recompute_layers,
    load_model_factory,
    measure_flops_per_step,
    sweep,
)


def _grads(w: Workload, batch: tuple, seed: int) -> list[torch.Tensor]:
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    w.model(*batch).backward()
    return [p.grad.clone() for p in w.model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-tiny", "gpt-tiny", "t5-tiny"])
def test_recompute_gives_the_same_gradients(name: str) -> None:
    w = build_workload(get_preset(name), "cpu", torch.float32, seed=3)
    batch = w.make_batch(2)
    ref = _grads(w, batch, seed=11)  # dropout is on: recomputation must replay the same masks
    layers_before = [list(lst) for lst in w.layer_lists]
    with recompute_layers(w, "checkpoint"):
        assert all(type(m).__name__ == "_Checkpointed" for lst in w.layer_lists for m in lst)
        got = _grads(w, batch, seed=11)
    assert [list(lst) for lst in w.layer_lists] == layers_before  # layers restored
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_sweep_keep_recompute_cpu() -> None:
    res = sweep("bert-tiny", ["keep", "recompute"], [1, 4], steps=1, warmup=1, device="cpu")
    assert [(p.strategy, p.micro_batch, p.status) for p in res.points] == [
        ("keep", 1, "ok"), ("keep", 4, "ok"), ("recompute", 1, "ok"), ("recompute", 4, "ok")]
    keep1, keep4, rec1, rec4 = res.points
    for p in res.points:
        assert p.step_time_s > 0 and p.throughput_flops > 0 and p.activation_peak_bytes > 0
        assert p.throughput_flops == pytest.approx(p.flops_per_step / p.step_time_s)
    # the peak grows with the micro-batch; recomputation keeps less than keeping everything
    assert keep4.activation_peak_bytes > 3 * keep1.activation_peak_bytes
    assert rec4.activation_peak_bytes < 0.75 * keep4.activation_peak_bytes
    # keep holds at least what autograd saves (the estimate), plus temporaries; not wildly more
    assert keep4.activation_estimate_bytes < keep4.activation_peak_bytes < 2 * keep4.activation_estimate_bytes
    # same algorithmic FLOPs whatever the strategy
    assert keep4.flops_per_step == rec4.flops_per_step == PRESETS["bert-tiny"].flops_per_step(4)


@pytest.mark.parametrize("name", ["bert-tiny", "gpt-tiny", "t5-tiny"])
def test_analytic_flops_match_flop_counter(name: str) -> None:
    cfg = get_preset(name)
    w = build_workload(cfg, "cpu", torch.float32)
    w.flops_per_step = None
    assert measure_flops_per_step(w, 3) == pytest.approx(cfg.flops_per_step(3), rel=1e-9)


def _mlp_workload(device: torch.device | str, dtype: torch.dtype, oom_from: int | None = None) -> Workload:
    """A 3-layer MLP; from micro-batch ``oom_from`` on, forward asks for an impossible buffer."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(96, 96), nn.GELU()) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if oom_from is not None and x.shape[0] >= 8 * oom_from:
                torch.empty(1 << 50, dtype=torch.uint8, device=x.device)  # 1 PiB: the real allocator refuses
            for layer in self.layers:
                x = layer(x)
            return x.pow(2).mean()

    model = Net().to(device=device, dtype=dtype)
    return Workload(model=model, make_batch=lambda mb: (torch.randn(8 * mb, 96, device=device, dtype=dtype),),
                    name="mlp")


@pytest.mark.slow
def test_out_of_memory_stops_the_point_cleanly() -> None:
    w = _mlp_workload("cpu", torch.float32, oom_from=2)
    res = sweep(w, ["keep", "recompute"], [1, 2, 4], steps=1, warmup=0, device="cpu")
    status = {(p.strategy, p.micro_batch): p.status for p in res.points}
    assert status == {("keep", 1): "ok", ("keep", 2): "oom", ("keep", 4): "skipped",
                      ("recompute", 1): "ok", ("recompute", 2): "oom", ("recompute", 4): "skipped"}
    oom = res.point("keep", 2)
    assert oom.throughput_flops is None and "allocate" in oom.error
    # a measured model: 3 x forward FLOPs of the three (8mb x 96) @ (96 x 96) GEMMs
    assert res.point("keep", 1).flops_per_step == pytest.approx(3 * 3 * 2 * 8 * 96 * 96)
    json.dumps(res.to_dict(1e9))


def _pt(strategy: str, mb: int, peak: float, tput: float, status: str = "ok") -> RokPoint:
    return RokPoint(strategy, mb, status, step_time_s=1.0, activation_peak_bytes=int(peak), throughput_flops=tput)


def test_frontier_and_best_under_budget() -> None:
    pts = [
        _pt("keep", 1, 4e9, 100e12), _pt("keep", 2, 8e9, 150e12), _pt("recompute", 1, 2e9, 70e12),
        _pt("recompute", 2, 3e9, 90e12), _pt("offload-host", 1, 2.5e9, 100e12), _pt("offload-host", 2, 5e9, 149e12),
        _pt("keep", 4, 0, 0, status="oom"),
    ]
    res = RokResult({"name": "t"}, "cpu", "float32", pts)
    front = [(p.strategy, p.micro_batch) for p in res.frontier()]
    assert front == [("recompute", 1), ("offload-host", 1), ("offload-host", 2), ("keep", 2)]
    assert res.best_under(5e9).strategy == "offload-host"
    assert res.best_under(5e9).micro_batch == 2
    assert res.best_under(2.2e9).strategy == "recompute"
    assert res.best_under(1e9) is None
    text = res.format_table(5e9)
    assert "best under 5 GB: offload-host at micro-batch 2" in text
    assert "no point fits" in res.format_table(1e9)


def test_bad_requests_raise() -> None:
    with pytest.raises(RokError, match="unknown strategies"):
        sweep("bert-tiny", ["keep", "teleport"])
    with pytest.raises(RokError):
        sweep("bert-tiny", ["keep"], [0])
    with pytest.raises(RokError, match="module:function"):
        load_model_factory("no_colon")
    with pytest.raises(RokError, match="cannot import"):
        load_model_factory("surely_not_a_module_xyz:f")


@pytest.mark.slow
def test_cli_rok_tiny_preset(tmp_path, capsys) -> None:
    js, png = tmp_path / "rok.json", tmp_path / "rok.png"
    rc = main(["rok", "--preset", "gpt-tiny", "--strategies", "keep,recompute", "--micro-batches", "1,2",
               "--steps", "1", "--device", "cpu", "--budget-gb", "1", "--json", str(js), "--png", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "best under 1 GB:" in out
    doc = json.loads(js.read_text())
    assert len(doc["points"]) == 4 and doc["best_under_budget"]["status"] == "ok"
    assert doc["workload"]["name"] == "gpt-tiny" and doc["machine"]["torch"] == torch.__version__
    assert doc["frontier"]
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_cli_rok_model_factory(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "my_rok_model.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make(device, dtype):
            model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(device, dtype)
            return model, lambda mb: (torch.randn(mb, 32, device=device, dtype=dtype),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    js = tmp_path / "f.json"
    rc = main(["rok", "--model-factory", "my_rok_model:make", "--strategies", "keep", "--micro-batches", "2,4",
               "--steps", "1", "--device", "cpu", "--json", str(js)])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads(js.read_text())
    flops = [p["flops_per_step"] for p in doc["points"]]
    assert flops == [pytest.approx(3 * 2 * mb * (32 * 64 + 64 * 32)) for mb in (2, 4)]
    sys.modules.pop("my_rok_model", None)
    assert main(["rok", "--model-factory", "my_rok_model:nothing", "--device", "cpu"]) == 2


@pytest.mark.gpu
def test_gpu_keep_recompute_and_oom() -> None:
    res = sweep("bert:h=1024,l=4,s=512,v=1024", ["keep", "recompute"], [1, 4], steps=2, device="cuda")
    keep4, rec4 = res.point("keep", 4), res.point("recompute", 4)
    assert keep4.ok and rec4.ok
    assert rec4.activation_peak_bytes < 0.6 * keep4.activation_peak_bytes
    # on CUDA the peak covers at least what autograd saves
    assert keep4.activation_peak_bytes >= 0.95 * keep4.activation_estimate_bytes
    w = _mlp_workload("cuda", torch.bfloat16, oom_from=2)
    res = sweep(w, ["keep"], [1, 2, 4], steps=1, device="cuda")
    assert [p.status for p in res.points] == ["ok", "oom", "skipped"]
    assert "OutOfMemoryError" in res.points[1].error
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < 1e9  # nothing leaked by the failed point


@pytest.mark.slow
def test_offload_strategies_cpu(tmp_path) -> None:
    """The offload strategies through `datapath.offload` on CPU tensors (offload_cpu_tensors)."""
    cfg = get_preset("bert:h=128,l=3,s=64,v=1024")
    res = sweep(cfg, ["keep", "offload-host", "offload-ssd", "recompute+offload-host"], [2], steps=1,
                device="cpu", ssd_path=tmp_path,
                offload_options={"min_bytes": 0, "keep_last_modules": 0})
    keep, host, ssd, rec = (res.point(s, 2) for s in ("keep", "offload-host", "offload-ssd",
                                                       "recompute+offload-host"))
    assert all(p.ok for p in (keep, host, ssd, rec)), [p.error for p in res.points]
    # every saved activation but the recomputed GELU outputs is handed to the host target: what it queued is what
    # ssd-plan estimates the offloader stores.  How much of it was written before backward wanted it back (the rest
    # is forwarded from memory) depends on thread timing, so the peak is checked only when most of it was written.
    st = host.offload_stats_per_step
    assert host.stored_estimate_bytes < 0.85 * host.activation_estimate_bytes
    assert st["bytes_queued"] == pytest.approx(host.stored_estimate_bytes, rel=0.01)
    assert keep.stored_estimate_bytes is None
    assert 0 < host.bytes_offloaded_per_step <= st["bytes_queued"]
    assert st["bytes_loaded"] + st["bytes_forwarded"] > 0
    if host.bytes_offloaded_per_step > 0.9 * st["bytes_queued"]:
        assert host.activation_peak_bytes < 0.8 * keep.activation_peak_bytes
    # the disk target wrote files (some stores may be forwarded instead) and removed them
    assert 0 < ssd.bytes_offloaded_per_step <= 1.01 * ssd.stored_estimate_bytes
    assert list(tmp_path.iterdir()) == []
    # with reentrant recomputation only the layer inputs (and the head's tensors) are saved and offloaded
    assert 0 < rec.bytes_offloaded_per_step < 0.6 * host.bytes_offloaded_per_step
    assert keep.offload_stats is None and keep.bytes_offloaded_per_step is None


@pytest.mark.gpu
def test_gpu_offload_host_point() -> None:
    cfg = get_preset("bert:h=1024,l=4,s=512,v=1024")
    res = sweep(cfg, ["keep", "offload-host"], [4], steps=2, device="cuda",
                offload_options={"min_bytes": 0, "keep_last_modules": 0})
    keep, host = res.point("keep", 4), res.point("offload-host", 4)
    assert keep.ok and host.ok, [p.error for p in res.points]
    # a model this small computes faster than PCIe moves its activations, so the peak need not drop;
    # it must not grow, and everything autograd saved must have gone to the host (but the recomputed GELU outputs)
    assert host.activation_peak_bytes <= 1.05 * keep.activation_peak_bytes
    assert host.bytes_offloaded_per_step == pytest.approx(host.stored_estimate_bytes, rel=0.05)
    assert host.offload_stats_per_step["bytes_loaded"] > 0
