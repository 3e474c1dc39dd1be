"""Recomputed blocks whose attention outputs wait in the offload store (``attention_offloaded``): gradients
bit-identical to plain checkpointing, the attention forward not run again, every byte of store room given back,
the next block's outputs fetched ahead, outputs left on the device where the store is full (CPU, HF Llama, SDPA)."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from _offload_models import (
    CountSdpa, hf_llama, layered_profile, lm_loss, long_context,
)
from datapath.offload import (
    AttentionStore, HostStore, Streams, plan_budget, set_recompute,
)
from datapath.offload.budget_planner import modelled_peak

transformers = pytest.importorskip("transformers")



def _store(budget: int = 1 << 30) -> AttentionStore:
    # small chunks and no floor: every output is split over several slots of a CPU host store
    return AttentionStore(HostStore(budget, pinned=False), streams_for=lambda d: None, chunk_bytes=40_000,
                          min_bytes=0)


def _step(model: nn.Module, ids: torch.Tensor, which: list[int], moved: list[int],
          store: AttentionStore | None = None) -> tuple[list[torch.Tensor], int]:
    """Gradients of one step, and the attention ops its backward ran."""
    blocks = list(model.model.layers)
    set_recompute(blocks, which, attention_offloaded=moved, attention_store=store)
    torch.manual_seed(123)
    loss = model(input_ids=ids, labels=ids).loss
    bwd = CountSdpa()
    with bwd:
        loss.backward()
    set_recompute(blocks, [])
    return [p.grad.clone() for p in model.parameters()], bwd.calls


@pytest.mark.parametrize("layers,moved", [(3, [0, 1, 2]), (4, [1, 3])])
def test_gradients_bit_identical_and_room_given_back(layers: int, moved: list[int]) -> None:
    model = hf_llama(layers=layers, seed=layers)
    ids = torch.randint(0, 96, (2, 160), generator=torch.Generator().manual_seed(layers))
    every = list(range(layers))
    keep_g, _ = _step(copy.deepcopy(model), ids, [], [])
    plain_g, plain_b = _step(copy.deepcopy(model), ids, every, [])
    store = _store()
    for _ in range(2):  # a second step reuses the room the first gave back
        got_g, got_b = _step(copy.deepcopy(model), ids, every, moved, store)
        assert plain_b == layers and got_b == layers - len(moved)  # no attention forward rerun where offloaded
        assert all(torch.equal(a, b) for a, b in zip(plain_g, got_g))
        assert all(torch.equal(a, b) for a, b in zip(keep_g, got_g))
        gc.collect()
        assert store.store.in_use == 0 and store.room() == 1 << 30
    # what was stored: per offloaded block its output (B, S, H, D) and log-sum-exp, in several chunks each
    heads, d, s = 2, 16, 160
    per_block = 2 * s * heads * d * 4 + 2 * heads * s * 4
    assert store.stored_bytes >= 2 * len(moved) * per_block and store.fetched_bytes == store.stored_bytes
    # each offloaded block but the forward's last was fetched ahead, as the next offloaded one was recomputed
    assert store.prefetched_bytes == store.stored_bytes * (len(moved) - 1) // len(moved)


def test_a_full_store_leaves_outputs_on_the_device() -> None:
    model = hf_llama(layers=3, seed=7)
    ids = torch.randint(0, 96, (2, 160), generator=torch.Generator().manual_seed(7))
    plain_g, _ = _step(copy.deepcopy(model), ids, [0, 1, 2], [])
    store = _store(budget=60_000)  # room for one chunk: the rest of each output stays where it is
    got_g, bwd = _step(copy.deepcopy(model), ids, [0, 1, 2], [0, 1, 2], store)
    assert bwd == 0 and all(torch.equal(a, b) for a, b in zip(plain_g, got_g))
    assert store.kept_bytes > 0 and store.stored_bytes < store.kept_bytes
    gc.collect()
    assert store.store.in_use == 0


def test_a_backward_that_never_runs_gives_the_room_back() -> None:
    model = hf_llama(layers=2, seed=8)
    ids = torch.randint(0, 96, (1, 128), generator=torch.Generator().manual_seed(8))
    store = _store()
    set_recompute(list(model.model.layers), [0, 1], attention_offloaded=[0, 1], attention_store=store)
    loss = model(input_ids=ids, labels=ids).loss
    assert store.store.in_use > 0
    del loss
    gc.collect()
    store._drain()  # what the next step's first save does
    assert store.store.in_use == 0 and store.room() == 1 << 30


def test_offloaded_blocks_must_be_recomputed_and_have_a_store() -> None:
    blocks = list(hf_llama(layers=2).model.layers)
    with pytest.raises(ValueError, match="not recomputed"):
        set_recompute(blocks, [0], attention_offloaded=[1], attention_store=_store())
    with pytest.raises(ValueError, match="needs attention_store"):
        set_recompute(blocks, [0, 1], attention_offloaded=[1])
    with pytest.raises(ValueError, match="not both"):
        set_recompute(blocks, [0, 1], attention_saved=[1], attention_offloaded=[1], attention_store=_store())



def test_planner_offloads_attention_where_the_device_has_no_room_for_it() -> None:
    prof = layered_profile(6, 50e9)
    every = list(range(6))
    base = int(modelled_peak(prof, every, 0))
    att = {b: (3 << 20, 0.004) for b in every}  # 3 MB saves 4 ms of a 10 ms block; its load takes ~0.1 ms
    one = base + (3 << 20) + 10  # room on the device for one block's outputs
    # offloading the blocks' tensors weighed out (``offload_cost``): every block recomputed
    kept = plan_budget(prof, one, attention=att, offload_cost=1e6)
    assert kept.recompute == tuple(every) and kept.attention_saved == (5,) and kept.attention_offloaded == ()
    # with store room for four blocks' outputs: the last four offloaded (one in flight fits the device) beat one kept
    moved = plan_budget(prof, one, attention=att, attention_room=4 * (3 << 20), offload_cost=1e6)
    assert moved.attention_saved == () and moved.attention_offloaded == (2, 3, 4, 5)
    assert moved.predicted_peak <= one and not moved.storeless
    net = 0.004 - (3 << 20) / (50e9 * 0.6)
    assert moved.predicted_time == pytest.approx(kept.predicted_time + 0.004 - 4 * net)
    assert moved.as_dict()["attention_offloaded"] == [2, 3, 4, 5]
    # no room on the device for the one in flight: nothing offloaded
    assert plan_budget(prof, base, attention=att, attention_room=1 << 40, offload_cost=1e6).attention_offloaded == ()
    # a load slower than the attention it saves: nothing offloaded
    slow = plan_budget(layered_profile(6, 50e6), one, attention=att, attention_room=1 << 40, offload_cost=1e6)
    assert slow.attention_offloaded == () and slow.attention_saved == (5,)


@pytest.mark.slow
def test_budget_offloads_attention_end_to_end_and_holds() -> None:
    """The long-context case in small, where checkpointing's peak is the budget: no room to keep attention
    outputs, store room to offload them; gradients bit-identical, no attention forward in a planned backward, the
    store's room back after each step, the budget held."""
    lc = long_context(layers=4, steps=7)
    model, batches, ckpt = lc.model, lc.batches, lc.ckpt
    out_bytes = 2048 * 64 * 4 + 4 * 2048 * 4  # a block's attention output (fp32) and log-sum-exp
    budget = int(ckpt + 3 * out_bytes)  # room to keep two or three blocks' outputs, or to have one in flight
    cache, got = lc.train_under(budget, host_share=0.25)
    policy, plan = cache.policy, cache.plan
    assert plan is not None and plan.recompute == (0, 1, 2, 3)
    assert not set(plan.attention_saved) & set(plan.attention_offloaded), plan
    # the plan offloading attention outputs ran and was measured against checkpointing's (one step each: on this
    # CPU its gain, a few percent, is within one step's noise, so either may be kept)
    tried = [p for r in policy.trials for p in r["plans"]]
    assert any(p["attention_offloaded"] for p in tried), policy.trials
    assert any(not p["attention_offloaded"] and not p["attention_saved"] for p in tried), policy.trials
    assert max(policy.peaks[-2:]) <= 1.03 * budget, ([round(p / budget, 3) for p in policy.peaks], budget)
    store = policy.attention_store
    assert store is not None and store.stored_bytes > 0 and store.kept_bytes == 0
    bwd = CountSdpa()
    with cache:
        loss = lm_loss(model, batches[0])
        with bwd:
            loss.backward()
    assert bwd.calls == 4 - len(plan.attention_offloaded) - len(plan.attention_saved)
    del loss
    cache.close()  # the attention store gives its room back before the host store closes
    gc.collect()
    assert store.store.in_use == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_is_bit_identical_and_prefetches() -> None:
    """On the GPU (bf16, the fused attention kernels): outputs go to pinned memory on the store stream and come back
    on the load stream, the next block's fetched ahead; gradients as plain recomputation's (bit-identical where the
    attention backward repeats bit for bit); the pool's room back after each step."""
    model = hf_llama(layers=4, h=256, heads=4, seed=9).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 96, (2, 1024), generator=torch.Generator().manual_seed(9)).cuda()
    streams: dict[torch.device, Streams] = {}
    store = AttentionStore(HostStore(1 << 30, pinned=True),
                           lambda d: streams.setdefault(d, Streams(d)), chunk_bytes=256 << 10)
    plain_g, plain_b = _step(copy.deepcopy(model), ids, [0, 1, 2, 3], [])
    # the fused attention backward may add in another order from run to run: what two plain runs differ by is
    # what an offloaded run may differ by (nothing where they agree bit for bit)
    again_g, _ = _step(copy.deepcopy(model), ids, [0, 1, 2, 3], [])
    noise = max((a.float() - b.float()).abs().max().item() for a, b in zip(plain_g, again_g))
    for _ in range(2):
        got_g, got_b = _step(copy.deepcopy(model), ids, [0, 1, 2, 3], [0, 1, 2, 3], store)
        torch.cuda.synchronize()
        assert plain_b == 4 and got_b == 0
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(plain_g, got_g))
        assert diff <= 2 * noise, (diff, noise)
        gc.collect()
        store._drain()
        assert store.store.in_use == 0
    # per block its output (B, S, H, D) in bf16 (the log-sum-exp, 32 KB, stays on the device)
    assert store.stored_bytes >= 2 * 4 * 2 * 1024 * 256 * 2 and store.fetched_bytes == store.stored_bytes
    assert store.prefetched_bytes == store.stored_bytes * 3 // 4 and store.kept_bytes == 0


def test_attention_calls_with_dropout_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call with dropout draws from the RNG: skipping it in the recomputation would shift every later random op
    of the block.  Such calls are not saved and run again (here every call is taken for one: the CPU's fused
    attention has no dropout), so the step is plain recomputation's, bit for bit."""
    from datapath.offload import attention_offload
    from datapath.offload.attention_saved import draws_random

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 2, 8, 4)
    assert not draws_random(op, (q, q, q), {}) and not draws_random(op, (q, q, q, 0.0), {})
    assert draws_random(op, (q, q, q, 0.1), {}) and draws_random(op, (q, q, q), {"dropout_p": 0.2})
    eff = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention").default  # dropout_p 6th
    assert draws_random(eff, (q, q, q, None, True, 0.1), {}) and not draws_random(eff, (q, q, q, None, True), {})
    monkeypatch.setattr(attention_offload, "draws_random", lambda *a: True)
    model = hf_llama(layers=3, seed=11)
    ids = torch.randint(0, 96, (2, 128), generator=torch.Generator().manual_seed(11))
    plain_g, plain_b = _step(copy.deepcopy(model), ids, [0, 1, 2], [])
    store = _store()
    got_g, got_b = _step(copy.deepcopy(model), ids, [0, 1, 2], [0, 1, 2], store)
    assert got_b == plain_b == 3 and store.stored_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(plain_g, got_g))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["saved", "offloaded"])
def test_cuda_attention_dropout_leaves_later_dropout_masks_alone(where: str) -> None:
    """GPT-2 with attention and residual dropout on the GPU (the fused attention applies its own dropout): a block
    keeping or offloading its attention outputs gives the gradients plain recomputation gives (the residual
    dropout draws the forward's masks again)."""
    cfg = transformers.GPT2Config(n_embd=256, n_layer=3, n_head=4, vocab_size=96, n_positions=1024,
                                  attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.0, attn_implementation="sdpa")
    torch.manual_seed(12)
    model = transformers.GPT2LMHeadModel(cfg).train().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 96, (2, 512), generator=torch.Generator().manual_seed(12)).cuda()
    streams: dict[torch.device, Streams] = {}
    store = AttentionStore(HostStore(1 << 30, pinned=True), lambda d: streams.setdefault(d, Streams(d)))

    def step(moved: bool) -> list[torch.Tensor]:
        m = copy.deepcopy(model)
        blocks = list(m.transformer.h)
        if moved:
            set_recompute(blocks, [0, 1, 2], *(([0, 1, 2],) if where == "saved" else ((), [0, 1, 2], store)))
        else:
            set_recompute(blocks, [0, 1, 2])
        torch.manual_seed(123)
        m(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.float() for p in m.parameters()]

    plain, again, got = step(False), step(False), step(True)
    noise = max((a - b).abs().max().item() for a, b in zip(plain, again))
    scale = max(a.abs().max().item() for a in plain)
    diff = max((a - b).abs().max().item() for a, b in zip(plain, got))
    assert diff <= max(2 * noise, 1e-3 * scale), (diff, noise, scale)

