"""Bit-identical losses and gradients with and without offloading, on the CPU (every target, both policies)."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from _offload_models import GPT, GPTBlock, assert_identical, mlp, run_steps
from datapath.offload import TensorCache, offload

TARGETS = ["host", "ssd", "tiered"]


def _cache(target: str, tmp_path: os.PathLike[str], **kw: object) -> TensorCache:
    opts: dict[str, object] = dict(min_bytes=0, offload_cpu_tensors=True, verify=True, io_chunk_bytes=8192,
                                   host_slab_bytes=1 << 20)
    if target == "tiered":
        opts["host_budget_bytes"] = 96 << 10  # spill to files early
    opts.update(kw)
    return TensorCache(target=target, path=str(tmp_path) if target != "host" else None, **opts)


def _check(model: nn.Module, batches: list, loss_fn, target: str, tmp_path, units=None, steps_between=None,
           **kw: object) -> TensorCache:
    ref_model = copy.deepcopy(model)
    ref = run_steps(ref_model, batches, loss_fn)
    cache = _cache(target, tmp_path, **kw)
    cache.attach(model, units=units)
    got = run_steps(model, batches, loss_fn, ctx=cache, between=steps_between)
    cache.wait_io()
    assert_identical(ref, got)
    assert cache.files() == []
    assert cache.stats.storages_offloaded > 0
    cache.close()
    if cache.directory is not None:
        assert not os.path.exists(cache.directory)
    return cache


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("policy", ["all", "adaptive"])
def test_mlp(target: str, policy: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = mlp(64, 4)
    batches = [torch.randn(48, 64) for _ in range(4)]
    cache = _check(model, batches, lambda m, x: m(x).pow(2).mean(), target, tmp_path, policy=policy,
                   steps_between=None)
    assert cache.stats.bytes_kept_param > 0


@pytest.mark.parametrize("target", TARGETS)
def test_gpt_block_fused_qkv_views(target: str, tmp_path) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(*[GPTBlock(32, 4, dropout=0.1) for _ in range(3)])
    batches = [torch.randn(4, 16, 32) for _ in range(3)]
    waits: list[TensorCache] = []
    cache = _check(model, batches, lambda m, x: m(x).square().mean(), target, tmp_path)
    # q, k and v are saved as views of one qkv storage: written once, the other views deduplicated
    assert cache.stats.dedup_hits > 0
    assert not waits


@pytest.mark.slow
@pytest.mark.parametrize("units", ["leaves", "blocks"])
def test_gpt_blocks_leaf_units_and_bounded_prefetch(units: str, tmp_path) -> None:
    """Scopes at every Linear/LayerNorm (and the lowest-memory options): still bit-identical."""
    torch.manual_seed(11)
    model = nn.Sequential(*[GPTBlock(32, 4, dropout=0.1) for _ in range(3)])
    batches = [torch.randn(4, 16, 32) for _ in range(3)]
    cache = _check(model, batches, lambda m, x: m(x).square().mean(), "host", tmp_path, units=units,
                   max_inflight_bytes=8192, max_prefetch_bytes=0, keep_last_modules=0)
    assert cache.stats.bytes_offloaded > 0 and cache.stats.bytes_loaded > 0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["host", "ssd"])
def test_tied_weights_gpt(target: str, tmp_path) -> None:
    torch.manual_seed(2)
    model = GPT(vocab=96, h=32, heads=4, layers=3, dropout=0.1, tied=True)
    assert model.head.weight is model.emb.weight
    batches = [torch.randint(0, 96, (4, 16)) for _ in range(3)]
    cache = _check(model, batches, _lm_loss, target, tmp_path)
    assert cache.stats.bytes_kept_param > 0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["host", "tiered"])
def test_transformer_encoder(target: str, tmp_path) -> None:
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    batches = [torch.randn(4, 12, 32) for _ in range(3)]
    _check(model, batches, lambda m, x: m(x).square().mean(), target, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("target", ["host", "ssd"])
def test_checkpoint_inside(mode: str, target: str, tmp_path) -> None:
    torch.manual_seed(4)
    model = GPT(vocab=64, h=32, heads=4, layers=3, dropout=0.0, tied=False, use_checkpoint=mode)
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(3)]
    cache = _check(model, batches, _lm_loss, target, tmp_path)
    if mode == "reentrant":  # recomputation in backward saves tensors again: kept, not offloaded again
        assert cache.stats.bytes_kept_backward > 0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["host", "ssd"])
def test_huggingface_gpt2(target: str, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=3, n_head=4,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    batches = [torch.randint(0, 128, (3, 16)) for _ in range(3)]
    cache = _check(model, batches, lambda m, ids: m(input_ids=ids, labels=ids).loss, target, tmp_path)
    assert len(cache.stats.prefetch_order) > 0


def test_offload_context_manager_whole_loop(tmp_path) -> None:
    torch.manual_seed(6)
    model = mlp(64, 3)
    batches = [torch.randn(32, 64) for _ in range(3)]
    ref = run_steps(copy.deepcopy(model), batches, lambda m, x: m(x).pow(2).mean())
    with offload(model, target="ssd", path=str(tmp_path), policy="adaptive", min_bytes=0,
                 offload_cpu_tensors=True, io_chunk_bytes=8192) as cache:
        got = run_steps(model, batches, lambda m, x: m(x).pow(2).mean())
        directory = cache.directory
        assert directory is not None and os.path.isdir(directory)
        assert oct(os.stat(directory).st_mode & 0o777) == oct(0o700)
    assert_identical(ref, got)
    assert cache.closed
    assert not os.path.exists(directory)
    assert cache.plan is not None  # the first step was profiled, the next ones planned
