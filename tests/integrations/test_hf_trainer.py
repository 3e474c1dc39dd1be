"""A real `transformers.Trainer` with `HFOffloadCallback` (tiny Llama from a config, random tokens, CPU):
weights after N steps bit-identical to the run without the callback, activations really stored and reloaded,
and a memory budget planned from the steps before (one cache across steps) and held."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from datapath.integrations import HFOffloadCallback  # noqa: E402

STEPS = 6


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=3, num_attention_heads=4,
                                   vocab_size=128, max_position_embeddings=64, attention_dropout=0.1,
                                   attn_implementation="eager", use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _train(model: torch.nn.Module, out: str, callbacks: list, evaluate: bool = False, accumulate: int = 1,
           steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list[float]]:
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=accumulate,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=7,
        dataloader_num_workers=0, disable_tqdm=True,
        eval_strategy="steps" if evaluate else "no", eval_steps=2 if evaluate else None,
        per_device_eval_batch_size=4)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(64, 32, 128, 1),
                                   eval_dataset=_Tokens(8, 32, 128, 2) if evaluate else None, callbacks=callbacks)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _assert_same(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k}: max diff {(ref[k] - got[k]).abs().max().item()}"


@pytest.mark.slow
def test_trainer_with_offload_callback_is_bit_identical(tmp_path) -> None:
    """Two micro-batches a step (gradient accumulation): both go through the one cache."""
    accumulate = 2
    base = _model()
    ref, ref_losses = _train(copy.deepcopy(base), str(tmp_path / "ref"), [], accumulate=accumulate, steps=3)
    cb = HFOffloadCallback(min_bytes=1024, offload_cpu_tensors=True)
    got, losses = _train(base, str(tmp_path / "off"), [cb], accumulate=accumulate, steps=3)
    _assert_same(ref, got)
    assert losses == ref_losses and len(losses) == 3
    st = cb.cache.stats
    # every step's activations went to the host store and came back (one cache for all the steps)
    assert cb.session.steps == 3 and st.records == 3 * accumulate
    # every stored storage came back: read from the store, or handed back from memory while its store was
    # still finishing (forwarding; which one depends on timing)
    assert 0 < st.bytes_loaded <= st.bytes_offloaded <= st.bytes_loaded + st.bytes_forwarded
    assert cb.cache.closed and not cb.session.active
    # training over: the model carries no offload hooks (a plain forward saves nothing through the cache)
    before = st.bytes_offloaded
    base(input_ids=torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16))).loss.backward()
    assert cb.cache.stats.bytes_offloaded == before


@pytest.mark.slow
def test_trainer_memory_budget_plans_across_steps_and_holds(tmp_path) -> None:
    """Evaluation between steps (no_grad forwards on the hooked model) must not disturb the plan."""
    base = _model()
    ref, ref_losses = _train(copy.deepcopy(base), str(tmp_path / "ref"), [], evaluate=True)
    # the keep-everything peak, as the budget's CPU meter counts it: a budget nothing needs to meet
    probe = HFOffloadCallback(memory_budget=10**12, min_bytes=1024, offload_cpu_tensors=True)
    _train(copy.deepcopy(base), str(tmp_path / "probe"), [probe])
    keep = max(probe.cache.policy.peaks)
    budget = int(0.8 * keep)
    cb = HFOffloadCallback(memory_budget=budget, min_bytes=1024, offload_cpu_tensors=True)
    got, losses = _train(base, str(tmp_path / "off"), [cb], evaluate=True)
    _assert_same(ref, got)
    assert losses == ref_losses
    policy = cb.cache.policy
    assert cb.cache.plan is not None, "no plan after the profiled steps: the cache did not persist across steps"
    assert cb.cache.plan.offload_bytes > 0 or cb.cache.plan.recompute
    assert len(policy.peaks) >= 3 and policy.peaks[-1] <= 1.03 * budget, (policy.peaks, budget)


def test_missing_model_is_named() -> None:
    cb = HFOffloadCallback()
    with pytest.raises(RuntimeError, match="no model"):
        cb.on_train_begin(None, None, None)
