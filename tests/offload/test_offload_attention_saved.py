"""Recomputed blocks that keep their attention outputs (``attention_saved``): gradients bit-identical to plain
checkpointing, the attention forward not run again in the backward, the bytes and time it saves measured, the
budget planner choosing it only where the budget has room, and the budget held end to end (CPU, HF Llama, SDPA)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _offload_models import (
    CountSdpa, hf_llama, lm_loss, long_context,
)
from datapath.offload import (
    AttentionCosts, BudgetProfile, SegmentCost, plan_budget, set_recompute,
)
from datapath.offload.budget_planner import modelled_peak

transformers = pytest.importorskip("transformers")



def _step(model: nn.Module, ids: torch.Tensor, which: list[int], keep: list[int],
          costs: AttentionCosts | None = None) -> tuple[list[torch.Tensor], int, int]:
    """Gradients, attention ops in the forward, attention ops in the backward."""
    blocks = list(model.model.layers)
    set_recompute(blocks, which, keep)
    if costs is not None:
        costs.attach(blocks)
    fwd, bwd = CountSdpa(), CountSdpa()
    torch.manual_seed(123)  # dropout draws the same masks in every run
    with fwd:
        loss = lm_loss(model, ids)
    with bwd:
        loss.backward()
    set_recompute(blocks, [])
    AttentionCosts.detach(blocks)
    return [p.grad.clone() for p in model.parameters()], fwd.calls, bwd.calls


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradients_bit_identical_and_attention_not_rerun(dropout: float) -> None:
    model = hf_llama(layers=3, dropout=dropout, seed=1)
    ids = torch.randint(0, 96, (2, 96), generator=torch.Generator().manual_seed(2))
    keep_g, keep_f, keep_b = _step(copy.deepcopy(model), ids, [], [])
    plain_g, plain_f, plain_b = _step(copy.deepcopy(model), ids, [0, 1, 2], [])
    sel_g, sel_f, sel_b = _step(copy.deepcopy(model), ids, [0, 1, 2], [0, 2])
    all_g, all_f, all_b = _step(copy.deepcopy(model), ids, [0, 1, 2], [0, 1, 2])
    if dropout == 0.0:
        assert keep_f == plain_f == sel_f == all_f == 3  # SDPA on the CPU: one attention op per layer
        assert (keep_b, plain_b, sel_b, all_b) == (0, 3, 1, 0)  # a kept attention output is not recomputed
    else:  # the CPU's SDPA takes its math path with dropout (no attention op): nothing is kept, nothing breaks
        assert keep_f == plain_f == sel_f == all_f == 0 and all_b == 0
    for g in (plain_g, sel_g, all_g):
        assert all(torch.equal(a, b) for a, b in zip(keep_g, g))
    assert all(torch.equal(a, b) for a, b in zip(plain_g, all_g))


def test_attention_saved_must_be_recomputed() -> None:
    model = hf_llama(layers=2)
    with pytest.raises(ValueError, match="not recomputed"):
        set_recompute(list(model.model.layers), [0], [1])


def test_probe_measures_the_attention_outputs_and_time() -> None:
    model = hf_llama(layers=3, h=32, heads=2)
    b, s = 2, 128
    ids = torch.randint(0, 96, (b, s), generator=torch.Generator().manual_seed(3))
    costs = AttentionCosts()
    plain_g, _, bwd = _step(copy.deepcopy(model), ids, [0, 2], [])
    probed_g, _, bwd_probed = _step(copy.deepcopy(model), ids, [0, 2], [], costs)
    assert bwd == bwd_probed == 2  # a probed block recomputes as plain checkpointing does
    assert all(torch.equal(x, y) for x, y in zip(plain_g, probed_g))
    # what the attention op returns for these shapes: its output (B, S, H, D) and log-sum-exp (B, H, S) in fp32
    heads, d = 2, 16
    q = torch.randn(b, heads, s, d)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, is_causal=True)
    want = sum(t.untyped_storage().nbytes() for t in out if isinstance(t, torch.Tensor))
    assert want >= b * s * heads * d * 4 + b * heads * s * 4
    assert set(costs.saved_bytes) == {0, 2}  # only the recomputed blocks ran under the probe
    assert costs.saved_bytes == {0: want, 2: want}
    assert all(costs.seconds(k) > 0 for k in (0, 2)) and costs.calls == {0: 1, 2: 1}
    gains = costs.gains()
    assert set(gains) == {0, 2} and all(gains[k][0] == want for k in gains)


def _profile(layers: int, recomputable: bool = True) -> BudgetProfile:
    """Per layer a unit (8 MB saved, 10 ms) and the code after it; loads slow enough that recomputing wins."""
    segs = [SegmentCost(False, -1, 0.0, 100, None)]
    storages = []
    mb = 8 << 20
    for b in range(layers):
        segs.append(SegmentCost(True, b, 0.010, 100 + mb, 100 + mb))
        if recomputable:
            storages.append((len(segs) - 1, mb))
        segs.append(SegmentCost(False, b, 0.0, 100, None))
    return BudgetProfile(segs, storages, 100 + mb, {b: 1 << 20 for b in range(layers)}, 50e6, 50e6,
                         recomputable=list(range(layers)) if recomputable else [])


def test_planner_keeps_attention_where_the_budget_has_room() -> None:
    prof = _profile(6)
    every = list(range(6))
    base = int(modelled_peak(prof, every, 0))
    att = {b: (3 << 20, 0.004) for b in every}  # 3 MB kept saves 4 ms of a 10 ms block
    plain = plan_budget(prof, base)
    assert plain.recompute == tuple(every)
    # no room above plain recomputation: it stays plain
    assert plan_budget(prof, base, attention=att).attention_saved == ()
    # room for two blocks' attention outputs: the last two keep theirs (their bytes are freed first)
    two = plan_budget(prof, base + 2 * (3 << 20) + 10, attention=att)
    assert two.recompute == tuple(every) and two.attention_saved == (4, 5)
    assert two.predicted_peak <= base + 2 * (3 << 20) + 10
    assert two.predicted_peak == int(modelled_peak(prof, every, 0, {4: 3 << 20, 5: 3 << 20}))
    assert two.predicted_time == pytest.approx(plain.predicted_time - 2 * 0.004)
    # a block whose measured saving is not positive (dispatch costs more than its attention) is never chosen
    slow = {b: (3 << 20, -1e-4) for b in every}
    assert plan_budget(prof, base * 4, attention=slow).attention_saved == ()
    # blocks the profile ran recomputed (a store too small) keep their attention outputs too
    full = _profile(6, recomputable=False)
    base_full = int(modelled_peak(full, [], 0))
    p = plan_budget(full, base_full + 6 * (3 << 20), attention=att, recomputed=every)
    assert p.attention_saved == tuple(every) and p.predicted_peak <= base_full + 6 * (3 << 20)


@pytest.mark.slow
def test_budget_keeps_attention_with_a_store_too_small_and_holds() -> None:
    """The long-context LoRA case in small: attention dominates the block (sequence 2048, width 32), the host
    store holds a quarter of the activations (every block is recomputed), the budget has room above
    checkpointing's peak: the plan keeps attention outputs, the backward runs no attention forward,
    gradients stay bit-identical, and the budget holds."""
    lc = long_context(layers=4, steps=7)
    model, batches, keep, ckpt = lc.model, lc.batches, lc.keep, lc.ckpt
    budget = int(ckpt + 0.5 * (keep - ckpt))
    cache, got = lc.train_under(budget, host_share=0.25)
    policy = cache.policy
    plan = cache.plan
    assert policy.store_full and plan is not None and plan.recompute == (0, 1, 2, 3)
    gains = policy.attention.gains()
    assert set(gains) <= {0, 1, 2, 3} and gains and all(nb > 0 for nb, _ in gains.values())
    assert plan.attention_saved == (0, 1, 2, 3), (plan.as_dict(), gains)
    assert max(policy.peaks[-2:]) <= 1.03 * budget, ([round(p / budget, 3) for p in policy.peaks], budget)
    # a planned step: the backward runs no attention forward
    blocks = list(model.model.layers)
    bwd = CountSdpa()
    with cache:
        loss = lm_loss(model, batches[0])
        with bwd:
            loss.backward()
    assert bwd.calls == 0 and all(b.__dict__.get("_datapath_recompute_attention_saved") for b in blocks)
    cache.close()


def test_compiled_blocks_are_not_probed() -> None:
    """A dispatch mode around a compiled region would run it eagerly: compiled blocks are never probed (so the
    planner never keeps their attention outputs), the others are."""
    from datapath.offload import compile_blocks, uncompile_blocks
    from datapath.offload.attention_saved import probe_of
    from datapath.offload.regional_compile import is_compiled  # what memory_budget's policy passes as skip

    model = hf_llama(layers=3)
    blocks = list(model.model.layers)
    compile_blocks(blocks[:2])
    costs = AttentionCosts()
    costs.attach(blocks, skip=is_compiled)
    assert probe_of(blocks[0]) is None and probe_of(blocks[1]) is None and probe_of(blocks[2]) == (costs, 2)
    AttentionCosts.detach(blocks)
    uncompile_blocks(blocks[:2])
    assert all(probe_of(b) is None for b in blocks)



class _SdpaBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        return self.o(F.scaled_dot_product_attention(q, q, q)) + x


def test_whole_model_compile_traces_recomputed_probed_blocks() -> None:
    """torch.compile(model) (one graph) over recomputed blocks that are probed or keep their attention outputs:
    TorchDynamo's checkpoint takes no context function (the step crashed with ``checkpoint not implemented for
    ... context_fn``), so traced blocks are recomputed plainly; gradients match the uncompiled model's."""
    torch.manual_seed(4)
    blocks = [_SdpaBlock() for _ in range(3)]
    model = nn.Sequential(*blocks)
    x = torch.randn(2, 4, 32, 16)
    ref = copy.deepcopy(model)
    ref(x).square().mean().backward()
    costs = AttentionCosts()
    costs.attach(blocks)
    set_recompute(blocks, [0, 1, 2], attention_saved=[2])
    torch._dynamo.reset()
    try:
        torch.compile(model, backend="eager", fullgraph=True)(x).square().mean().backward()
    finally:
        set_recompute(blocks, [])
        costs.detach(blocks)
        torch._dynamo.reset()
    assert costs.gains() == {}  # not probed while traced
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
