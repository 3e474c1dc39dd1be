"""A real `lightning.Trainer` with `LightningOffloadCallback` (tiny GPT-2 from a config, random tokens, CPU):
weights after N steps bit-identical to the run without the callback, activations stored and reloaded, a
memory budget planned across steps and held, validation in between."""
from __future__ import annotations

import copy

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from datapath.integrations import LightningOffloadCallback  # noqa: E402

STEPS = 6


class _LM(pl.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _loader(n: int, seed: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 128, (n, 32), generator=g)),
                                       batch_size=4)


def _fit(model: torch.nn.Module, callbacks: list, root: str, validate: bool = False) -> dict[str, torch.Tensor]:
    pl.seed_everything(3, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=root, num_sanity_val_steps=0,
                         val_check_interval=2 if validate else None, limit_val_batches=2 if validate else 0)
    module = _LM(model)
    trainer.fit(module, _loader(64, 1), _loader(8, 2) if validate else None)
    assert trainer.global_step == STEPS
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k}: max diff {(ref[k] - got[k]).abs().max().item()}"


@pytest.mark.slow
def test_lightning_with_offload_callback_is_bit_identical(tmp_path) -> None:
    base = _gpt2()
    ref = _fit(copy.deepcopy(base), [], str(tmp_path))
    cb = LightningOffloadCallback(min_bytes=1024, offload_cpu_tensors=True)
    got = _fit(base, [cb], str(tmp_path))
    _assert_same(ref, got)  # dropout on: every mask the same
    st = cb.cache.stats
    assert cb.session.steps == STEPS
    # every stored storage came back: read from the store, or handed back from memory while its store was
    # still finishing (forwarding; which one depends on timing)
    assert 0 < st.bytes_loaded <= st.bytes_offloaded <= st.bytes_loaded + st.bytes_forwarded
    assert cb.cache.closed and not cb.session.active


@pytest.mark.slow
def test_lightning_memory_budget_plans_across_steps_and_holds(tmp_path) -> None:
    base = _gpt2()
    ref = _fit(copy.deepcopy(base), [], str(tmp_path), validate=True)
    probe = LightningOffloadCallback(memory_budget=10**12, min_bytes=1024, offload_cpu_tensors=True)
    _fit(copy.deepcopy(base), [probe], str(tmp_path))
    budget = int(0.8 * max(probe.cache.policy.peaks))
    cb = LightningOffloadCallback(memory_budget=budget, min_bytes=1024, offload_cpu_tensors=True)
    got = _fit(base, [cb], str(tmp_path), validate=True)
    _assert_same(ref, got)
    assert cb.cache.plan is not None, "no plan after the profiled steps: the cache did not persist across steps"
    assert cb.cache.plan.offload_bytes > 0 or cb.cache.plan.recompute
    peaks = cb.cache.policy.peaks
    assert len(peaks) >= 3 and peaks[-1] <= 1.03 * budget, (peaks, budget)


def test_a_failed_fit_leaves_no_hook(tmp_path) -> None:
    """The fit raises mid-step: on_exception ends the session; later autograd is not routed to the cache."""
    class _Boom(_LM):
        def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            if batch_idx == 2:
                raise ValueError("boom")
            return loss

    model = _gpt2()
    cb = LightningOffloadCallback(min_bytes=1024, offload_cpu_tensors=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(_Boom(model), _loader(64, 1))
    assert cb.cache.closed and not cb.session.active
    before = cb.cache.stats.bytes_offloaded
    x = torch.randn(4, 64, requires_grad=True)
    (x.exp() * 2).sum().backward()  # a saved tensor: kept by autograd, not by the closed cache
    assert cb.cache.stats.bytes_offloaded == before


def test_the_watched_module_is_found_or_named() -> None:
    gpt = _gpt2()
    assert LightningOffloadCallback().watched(_LM(gpt)) is gpt  # no forward of its own: its one child

    class _WithForward(_LM):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits

    m = _WithForward(gpt)
    assert LightningOffloadCallback().watched(m) is m
    assert LightningOffloadCallback(module="model.transformer").watched(m) is gpt.transformer

    class _Two(_LM):
        def __init__(self) -> None:
            super().__init__(gpt)
            self.other = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="module="):
        LightningOffloadCallback().watched(_Two())
    with pytest.raises(ValueError, match="no submodule"):
        LightningOffloadCallback(module="nope").watched(m)
