"""`datapath ssd-plan`, and the estimate of activation bytes against what autograd really saves."""
from __future__ import annotations

import json

import pytest
import torch

from datapath.cli import main
from datapath.analysis.presets import build_workload, get_preset
from datapath.analysis.ssd_plan import activation_breakdown


def _saved_bytes(model: torch.nn.Module, batch: tuple) -> int:
    """Bytes of distinct storages autograd saves for backward in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("name", ["bert-tiny", "gpt-tiny", "t5-tiny"])
@pytest.mark.parametrize("micro_batch", [2, 3])
def test_estimate_matches_saved_tensors_cpu(name: str, micro_batch: int) -> None:
    cfg = get_preset(name)
    w = build_workload(cfg, "cpu", torch.float32, seed=micro_batch)
    saved = _saved_bytes(w.model, w.make_batch(micro_batch))
    est = activation_breakdown(cfg.shape(micro_batch, torch.float32, "cpu"))["total"]
    assert saved == pytest.approx(est, rel=0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bert-tiny", "gpt-tiny", "t5-tiny"])
def test_estimate_matches_saved_tensors_cuda(name: str) -> None:
    cfg = get_preset(name)
    w = build_workload(cfg, "cuda", torch.bfloat16)
    saved = _saved_bytes(w.model, w.make_batch(4))
    est = activation_breakdown(cfg.shape(4, torch.bfloat16, "cuda"))["total"]
    assert saved == pytest.approx(est, rel=0.01)


def test_cli_ssd_plan_table_and_json(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    png = tmp_path / "sweep.png"
    rc = main(["ssd-plan", "--preset", "bert-h8192-l4", "--micro-batch", "16", "--tp", "2",
               "--gpu", "a100", "--efficiency", "0.5", "--drives", "2", "--sweep", "hidden=8192,16384",
               "--json", str(out), "--png", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "write bandwidth needed (GB/s)" in text and "projected SSD lifespan (years)" in text
    doc = json.loads(out.read_text())
    s, b, h = 1024, 16, 8192
    # layers only (as SSDTrain), TP=2: 4 x (22sbh + 16sb + 4asb/2)
    assert doc["plan"]["activation_bytes_per_step"] == pytest.approx(4 * (22 * s * b * h + 16 * s * b + 2 * 64 * s * b))
    assert doc["plan"]["drives_per_gpu"] == 2
    bws = [p["write_bandwidth_gbps"] for p in doc["sweep"]["plans"]]
    assert bws[0] > bws[1]
    assert png.stat().st_size > 1000
    # what datapath's offloader writes by default: the GELU outputs (8sbh/2 a layer at TP=2) recomputed, not written
    rc = main(["ssd-plan", "--preset", "bert-h8192-l4", "--micro-batch", "16", "--tp", "2", "--recompute-elementwise",
               "--gpu", "a100", "--efficiency", "0.5", "--json", str(out)])
    assert rc == 0
    less = json.loads(out.read_text())["plan"]
    assert less["activation_bytes_per_step"] == pytest.approx(4 * (18 * s * b * h + 16 * s * b + 2 * 64 * s * b))
    assert less["write_bandwidth_gbps"] == pytest.approx(doc["plan"]["write_bandwidth_gbps"] * 18 / 22, rel=0.01)


def test_cli_paper_table(capsys) -> None:
    assert main(["ssd-plan", "--paper-table"]) == 0
    text = capsys.readouterr().out
    assert "H12288 L3" in text and "paper_bandwidth_gbps" in text


def test_cli_custom_drive_and_errors(capsys) -> None:
    assert main(["ssd-plan", "--preset", "gpt:h=2048,l=8,s=2048", "--capacity-tb", "1", "--dwpd", "1",
                 "--gpu-tflops", "989", "--efficiency", "0.4"]) == 0
    assert "4 x custom (PB)" in capsys.readouterr().out
    assert main(["ssd-plan", "--drive", "floppy"]) == 2
    assert "unknown --drive" in capsys.readouterr().out
    assert main(["ssd-plan", "--preset", "gpt:h=2048"]) == 2
