"""Compiled blocks recomputed by their compiled region's partitioner (``set_recompute(..., partitioned=...)``, CPU
inductor and CUDA): no checkpoint around the region, the compiler saving a share of what the plain compiled block
saves; gradients those of the compiled model to rounding; a block drawing random numbers refused."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _offload_models import run_steps
from datapath.offload import OffloadConfigError, TensorCache, compile_blocks, set_recompute, uncompile_blocks
from datapath.offload.recompute import is_partitioned

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 3, seed: int = 11) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
                                   num_attention_heads=4, vocab_size=128, max_position_embeddings=128,
                                   attention_dropout=0.0, attn_implementation="sdpa", use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def _loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, labels=ids).loss


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the tensors one forward saves for its backward (through the saved-tensor hooks)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, ids)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_partitioned_compiled_blocks_train_as_the_compiled_model_saving_less(device: str) -> None:
    """Every block partitioned: losses and gradients of the compiled model to float32 rounding (another compiled
    graph), over steps of random lengths; the forward saves less than the plain compiled blocks and more than
    checkpointing them (the partitioner keeps the outputs worth keeping)."""
    torch._dynamo.reset()  # graphs earlier tests compiled for this block class (other shapes) are not reused
    model = _llama().to(device)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, n), generator=gen).to(device) for n in (48, 80, 48)]
    ref_model = copy.deepcopy(model)
    compile_blocks(ref_model)
    ref = run_steps(ref_model, batches, _loss)
    kept = _saved_bytes(ref_model, batches[0])
    uncompile_blocks(ref_model)

    compile_blocks(model)
    blocks = list(model.model.layers)
    set_recompute(blocks, [0, 1, 2])
    checkpointed = _saved_bytes(model, batches[0])
    set_recompute(blocks, [0, 1, 2], partitioned=[0, 1, 2])
    assert all(is_partitioned(b) for b in blocks)
    got = run_steps(model, batches, _loss)
    split = _saved_bytes(model, batches[0])
    for (l0, g0), (l1, g1) in zip(ref, got, strict=True):
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        for a, b in zip(g0, g1, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert checkpointed < split < kept, (checkpointed, split, kept)
    set_recompute(blocks, [])
    assert not any(is_partitioned(b) for b in blocks)
    uncompile_blocks(model)
    compile_blocks(model, {"mode": "max-autotune"})  # a backend of ours would drop the mode
    with pytest.raises(ValueError, match=r"blocks \[0\] have no partitioned forward"):
        set_recompute(blocks, [0], partitioned=[0])
    uncompile_blocks(model)


class _DropoutBlock(nn.Module):
    """A dropout whose mask the gradient of ``w`` shows: for ``y = dropout(h) * w`` and a loss ``sum(y * g)``,
    ``w.grad == sum(g * y / w)`` exactly when the backward used the forward's mask."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.w = nn.Parameter(1.0 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.out(torch.nn.functional.gelu(self.lin(x)))
        return torch.nn.functional.dropout(h, 0.3, self.training) * self.w


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_partitioned_block_drawing_random_numbers_is_refused_before_its_step(device: str) -> None:
    """A dropout `draws_dropout` cannot see (a functional call) inside a partitioned block: under a memory budget
    torch's partitioner may recompute it in the backward with a new mask (PyTorch issue 190758, checked below
    against torch.compile with that budget), so the block is refused with `OffloadConfigError` when it compiles,
    before any parameter has a gradient."""
    import torch._functorch.config as functorch_config  # noqa: PLC0415

    torch.manual_seed(3)
    blocks = nn.Sequential(*[_DropoutBlock() for _ in range(3)]).to(device).train()
    peer = copy.deepcopy(blocks)
    compile_blocks(list(blocks))
    set_recompute(list(blocks), [0, 1, 2], partitioned=[0, 1, 2])
    with pytest.raises(OffloadConfigError, match=r"cannot be partitioned: it draws random numbers.*190758"):
        blocks(torch.randn(2, 24, 32, device=device))
    assert all(p.grad is None for p in blocks.parameters())
    uncompile_blocks(list(blocks))

    # what the refusal prevents: the same budget compiled plainly backpropagates other masks than its forward drew
    torch._dynamo.reset()
    for blk in peer:
        blk.compile()
    h = torch.randn(2, 24, 32, device=device)
    outs: list[torch.Tensor] = []
    with functorch_config.patch(activation_memory_budget=0.1):
        for blk in peer:
            h = blk(h)
            h.retain_grad()
            outs.append(h)
    (h * torch.randn_like(h)).sum().backward()
    wrong = [not torch.allclose(blk.w.grad, (y.grad * y / blk.w).sum(dim=(0, 1)), rtol=1e-4, atol=1e-5)
             for blk, y in zip(peer, outs, strict=True)]
    assert any(wrong), "torch's partitioner replays dropout masks now: partitioned blocks may keep their dropout"


def test_blocks_with_dropout_are_refused_partitioning() -> None:
    """A block whose dropout `draws_dropout` sees is refused, when partitioned and when its dropout is turned on
    later (the check runs again at its forward)."""
    model = _llama(2)
    model.model.layers[1].self_attn.attention_dropout = 0.1
    compile_blocks(model)
    blocks = list(model.model.layers)
    with pytest.raises(OffloadConfigError, match=r"blocks \[1\] are partitioned with dropout on.*190758"):
        set_recompute(blocks, [0, 1], partitioned=[0, 1])
    set_recompute(blocks, [0, 1], partitioned=[0])
    model.model.layers[0].self_attn.attention_dropout = 0.1
    with pytest.raises(OffloadConfigError, match="a LlamaDecoderLayer block is partitioned with dropout on"):
        _loss(model, torch.randint(0, 128, (2, 16)))
    set_recompute(blocks, [])
    uncompile_blocks(model)


def test_set_recompute_names_blocks_it_cannot_partition() -> None:
    model = _llama(2)
    blocks = list(model.model.layers)
    with pytest.raises(ValueError, match=r"blocks \[0\] have no partitioned forward"):
        set_recompute(blocks, [0], partitioned=[0])
    compile_blocks(model)
    with pytest.raises(ValueError, match=r"partitioned blocks \[1\] are not recomputed"):
        set_recompute(blocks, [0], partitioned=[1])
    with pytest.raises(ValueError, match=r"blocks \[0\] are both partitioned and keep their attention"):
        set_recompute(blocks, [0], partitioned=[0], attention_saved=[0])
    assert not any(is_partitioned(b) for b in blocks)
    uncompile_blocks(model)


def test_partition_compiled_is_a_yes_or_no() -> None:
    with pytest.raises(OffloadConfigError, match="partition_compiled must be True or False, got 'yes'"):
        TensorCache("host", memory_budget=1 << 30, compile=True, partition_compiled="yes")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("asked", [False, True], ids=["default", "partition_compiled"])
def test_a_gpu_budget_partitions_compiled_blocks_only_when_asked(asked: bool) -> None:
    """On a GPU, a budget over compiled blocks whose trial runs a plan storing nothing tries it partitioned only
    with ``partition_compiled=True`` (its gradients are the compiled model's to rounding); by default every plan
    gives the compiled model's gradients bit for bit, and none is partitioned."""
    model = _llama(4).cuda()
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (32, 128), generator=gen).cuda() for _ in range(14)]

    def peak(checkpointing: bool) -> int:
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _loss(model, batches[0]).backward()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_disable()
        return torch.cuda.max_memory_allocated()
    keep, ckpt = peak(False), peak(True)
    budget = ckpt + (keep - ckpt) // 2  # some blocks recomputed, even compiled; checkpointing's plan fits
    cache = TensorCache("host", memory_budget=budget, compile=True, partition_compiled=asked)
    cache.attach(model)
    run_steps(model, batches, _loss, ctx=cache)
    tried = [p for r in cache.policy.trials for p in r["plans"]]
    cache.close()
    split = [p for p in tried if p["partitioned"]]
    if not asked:
        assert split == [], tried
        return
    assert split, tried
    for p in split:
        assert p["partitioned"] == p["recompute"] and p["offload_bytes"] == 0, p

    def kept(p: dict) -> int:
        return len(blocks) - len(p["recompute"])
    blocks = list(model.model.layers)
    most = max((kept(p) for p in tried if not p["partitioned"] and p["offload_bytes"] == 0), default=0)
    if most >= 2:  # a plan keeping blocks is also tried keeping fewer, the rest partitioned
        assert any(0 < kept(p) < most for p in split), tried
