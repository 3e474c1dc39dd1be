"""The SSD planning model (SSDTrain §5.3.6) against hand-computed cases and the paper's Table 5.4."""
from __future__ import annotations

import json
import math
import random

import pytest

from datapath.analysis.ssd_plan import (
    DRIVES,
    GPUS,
    Drive,
    GpuSpec,
    Parallelism,
    PlanError,
    TransformerShape,
    activation_breakdown,
    activation_bytes_per_step,
    model_flops_per_step,
    paper_table_5_4,
    plan,
    sweep_plan,
)

YEAR = 365.25 * 86400


def _random_shape(rng: random.Random, **kw) -> TransformerShape:
    heads = rng.choice([2, 4, 8, 16])
    base = dict(layers=rng.randint(1, 6), hidden=heads * rng.choice([32, 64, 128]), heads=heads,
                seq=rng.choice([128, 256, 1024]), micro_batch=rng.randint(1, 9))
    base.update(kw)
    return TransformerShape(**base)


def test_layer_bytes_hand_computed() -> None:
    # s=1024, b=2, h=1024, a=8, bf16, dropout, FlashAttention, no parallelism:
    # 34*s*b*h (Korthikanti) + LN mean/rstd 2*2*4*s*b + log-sum-exp 4*a*s*b
    shape = TransformerShape(layers=3, hidden=1024, heads=8, seq=1024, micro_batch=2)
    sbh = 1024 * 2 * 1024
    per_layer = 34 * sbh + 16 * 1024 * 2 + 4 * 8 * 1024 * 2
    assert per_layer == 71_401_472
    br = activation_breakdown(shape)
    assert br["per_encoder_layer"] == per_layer
    assert br["layers"] == 3 * per_layer
    assert br["embedding"] == 0 and br["head"] == 0  # vocab=0: layers only
    assert activation_bytes_per_step(shape) == 3 * per_layer
    assert activation_bytes_per_step(shape, Parallelism(microbatches=5)) == 15 * per_layer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tensor_and_sequence_parallel_split(seed: int) -> None:
    rng = random.Random(seed)
    shape = _random_shape(rng)
    s, b, h, a = shape.seq, shape.micro_batch, shape.hidden, shape.heads
    for t in (1, 2, 4):
        if a % t:
            continue
        # Korthikanti et al.: 10sbh replicated + 24sbh/t split (no SP); 34sbh/t with SP
        small = 16 * s * b + 4 * a * s * b / t
        no_sp = activation_breakdown(shape, Parallelism(tp=t))["per_encoder_layer"]
        assert no_sp == pytest.approx(10 * s * b * h + 24 * s * b * h / t + small, rel=1e-12)
        sp = activation_breakdown(shape, Parallelism(tp=t, sequence_parallel=True))["per_encoder_layer"]
        assert sp == pytest.approx((34 * s * b * h + 16 * s * b) / t + 4 * a * s * b / t, rel=1e-12)


def test_without_flash_attention_adds_5as2b() -> None:
    shape = TransformerShape(layers=1, hidden=512, heads=4, seq=256, micro_batch=3, flash_attention=False)
    s, b, h, a = 256, 3, 512, 4
    assert activation_breakdown(shape)["per_encoder_layer"] == 34 * s * b * h + 5 * a * s * s * b + 16 * s * b
    no_drop = shape.replace(dropout=False)  # 2 masks and the dropout of the scores go: 32sbh + 2as^2b
    assert activation_breakdown(no_drop)["per_encoder_layer"] == 32 * s * b * h + 2 * a * s * s * b + 16 * s * b


@pytest.mark.parametrize("seed", [3, 4])
def test_recomputed_gelu_outputs_are_not_counted(seed: int) -> None:
    """With ``recompute_elementwise`` (datapath's offloader default) the fc2 input, the GELU output, is not stored:
    each layer counts p*s*b*ffn/t bytes less (8sbh/t of Korthikanti's 34sbh in 16-bit with ffn = 4h)."""
    rng = random.Random(seed)
    shape = _random_shape(rng, vocab=rng.choice([0, 1000]))
    s, b, h = shape.seq, shape.micro_batch, shape.hidden
    for par in (Parallelism(), Parallelism(tp=2), Parallelism(tp=2, sequence_parallel=True, pp=2)):
        if shape.heads % par.tp:
            continue
        full = activation_breakdown(shape, par)
        less = activation_breakdown(shape.replace(recompute_elementwise=True), par)
        assert full["per_encoder_layer"] - less["per_encoder_layer"] == pytest.approx(8 * s * b * h / par.tp)
        assert full["total"] - less["total"] == pytest.approx(8 * s * b * h / par.tp * shape.layers / par.pp)
        assert less["head"] == full["head"] and less["embedding"] == full["embedding"]


def test_t5_counts_decoder_cross_attention() -> None:
    s, b, h, a = 128, 2, 256, 2
    t5 = TransformerShape(layers=4, hidden=h, heads=a, seq=s, micro_batch=b, family="t5")
    gpt = t5.replace(family="gpt")
    assert (t5.encoder_layers, t5.decoder_layers) == (2, 2)
    enc = activation_breakdown(gpt)["per_encoder_layer"]
    # cross block: LN in 2 + stats + LN out 2 + q 2 + kv 4 + lse + out 2 + mask 1  (x sbh, bf16)
    cross = 13 * s * b * h + 8 * s * b + 4 * a * s * b
    br = activation_breakdown(t5)
    assert br["per_decoder_layer"] == enc + cross
    assert br["layers"] == 2 * enc + 2 * (enc + cross) + 2 * s * b * h  # + encoder output, once


def test_flops_match_megatron_formula() -> None:
    rng = random.Random(7)
    for _ in range(5):
        shape = _random_shape(rng, vocab=rng.choice([0, 1000, 30522]))
        b, s, L, h, V = shape.micro_batch, shape.seq, shape.layers, shape.hidden, shape.vocab
        megatron = 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
        assert model_flops_per_step(shape) == pytest.approx(megatron, rel=1e-12)
        assert model_flops_per_step(shape, Parallelism(tp=2, pp=2, microbatches=3)) == pytest.approx(
            megatron * 3 / 4, rel=1e-12)


def test_plan_bandwidth_and_lifespan_hand_computed() -> None:
    shape = TransformerShape(layers=4, hidden=8192, heads=64, seq=1024, micro_batch=8)
    gpu = GpuSpec(peak_tflops=500.0, efficiency=0.5)
    drive = Drive(capacity_tb=3.2, pbw=10.0, name="test")
    p = plan(shape, Parallelism(), gpu, drive, drives_per_gpu=2, waf_rating=2.0, waf_workload=1.0)
    s, b, h, a, L = 1024, 8, 8192, 64, 4
    act = L * (34 * s * b * h + 16 * s * b + 4 * a * s * b)
    flops = 72 * b * s * L * h * h * (1 + s / (6 * h))
    t_fwd = flops / 3 / 250e12
    t_step = 3 * t_fwd
    assert p.activation_bytes_per_step == act
    assert p.forward_time_s == pytest.approx(t_fwd, rel=1e-12)
    assert p.step_time_s == pytest.approx(t_step, rel=1e-12)
    assert p.write_bandwidth_gbps == pytest.approx(act / (t_step / 2) / 1e9, rel=1e-12)
    endurance = 2 * 10e15 * 2.0
    assert p.endurance_bytes == endurance
    assert p.lifespan_years == pytest.approx(endurance * t_step / act / YEAR, rel=1e-12)
    d = p.as_dict()
    json.dumps(d)  # JSON-able
    assert d["write_bandwidth_gbps"] == p.write_bandwidth_gbps


def test_measured_step_time_replaces_model() -> None:
    shape = TransformerShape(layers=2, hidden=4096, heads=32, seq=2048, micro_batch=4)
    p = plan(shape, step_time_s=2.0)
    assert p.step_time_s == 2.0 and p.forward_time_s == pytest.approx(2.0 / 3)
    assert p.write_bandwidth_gbps == pytest.approx(p.activation_bytes_per_step / 1.0 / 1e9)


def test_drive_endurance() -> None:
    assert Drive(2.0, dwpd=1.0, warranty_years=5).rated_pbw == pytest.approx(2.0 * 365 * 5 / 1000)
    assert Drive(2.0, dwpd=1.0, pbw=3.0).rated_pbw == 3.0  # the PBW rating wins
    assert DRIVES["solidigm-d7-p5620-12.8tb"].rated_pbw == 65.4
    # the paper's setting: four D7-P5620 per GPU, WAF 2.5 in the rating, 1 for sequential writes
    shape = TransformerShape(layers=1, hidden=1024, heads=8, seq=1024)
    p = plan(shape)
    assert p.endurance_bytes == pytest.approx(4 * 65.4e15 * 2.5)


def test_table_5_4_reproduced_within_15_percent() -> None:
    rows = paper_table_5_4()
    assert [r["config"] for r in rows] == ["H8192 L4", "H12288 L3", "H16384 L2"]
    for r in rows:
        assert abs(r["err_vs_estimate"]) < 0.15, r
        assert abs(r["err_bandwidth"]) < 0.15, r
    bw = [r["ours_bandwidth_gbps"] for r in rows]
    assert bw[0] > bw[1] > bw[2]  # the needed bandwidth falls as the hidden size grows


def test_sweep_hidden_bandwidth_falls_lifespan_grows() -> None:
    shape = TransformerShape(layers=4, hidden=4096, heads=32, seq=1024, micro_batch=4)
    plans = sweep_plan(shape, "hidden", [2048, 4096, 8192, 16384], gpu=GpuSpec(GPUS["h200"], 0.5))
    assert [q.shape.heads for q in plans] == [16, 32, 64, 128]
    bws = [q.write_bandwidth_gbps for q in plans]
    lives = [q.lifespan_years for q in plans]
    assert all(x > y for x, y in zip(bws, bws[1:]))
    assert all(x < y for x, y in zip(lives, lives[1:]))
    tps = sweep_plan(shape, "tp", [1, 2, 4])
    assert [q.parallelism.tp for q in tps] == [1, 2, 4]
    with pytest.raises(PlanError):
        sweep_plan(shape, "colour", [1])


@pytest.mark.parametrize("bad", [
    dict(layers=0), dict(hidden=-8), dict(heads=3), dict(family="rnn"), dict(micro_batch=0), dict(vocab=-1),
])
def test_bad_shapes_raise(bad: dict) -> None:
    args = dict(layers=2, hidden=256, heads=4, seq=128)
    args.update(bad)
    with pytest.raises(PlanError) as info:
        TransformerShape(**args)
    assert isinstance(info.value, ValueError)


def test_bad_plan_inputs_raise() -> None:
    shape = TransformerShape(layers=2, hidden=256, heads=4, seq=128)
    with pytest.raises(PlanError, match="tp"):
        plan(shape, Parallelism(tp=3))
    with pytest.raises(PlanError):
        Parallelism(pp=0)
    with pytest.raises(PlanError):
        GpuSpec(100.0, efficiency=1.5)
    with pytest.raises(PlanError, match="dwpd or pbw"):
        Drive(1.0)
    with pytest.raises(PlanError):
        plan(shape, step_time_s=0.0)
    assert math.isfinite(plan(shape).lifespan_years)
