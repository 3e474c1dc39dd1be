"""GPU: a real `transformers.Trainer` and a real `lightning.Trainer` with a memory budget halfway between what
the model's state needs and what the step peaks at without offloading: the budget holds (peak allocated of every
planned step, the first one included, <= budget x 1.03) and the weights after N steps are bit-identical to the run
without the callback."""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

STEPS = 8


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                                   vocab_size=1024, max_position_embeddings=1024, attn_implementation="eager",
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _peaks_callback(peaks: list[int], static: list[int]) -> object:
    class _Peaks(transformers.TrainerCallback):
        def on_step_begin(self, *a: object, **k: object) -> None:
            torch.cuda.synchronize()
            static.append(torch.cuda.memory_allocated())
            torch.cuda.reset_peak_memory_stats()

        def on_pre_optimizer_step(self, *a: object, **k: object) -> None:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
    return _Peaks()


def _hf_train(model: torch.nn.Module, out: str, callbacks: list) -> dict[str, torch.Tensor]:
    args = transformers.TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=8,
                                          learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
                                          seed=7, disable_tqdm=True, dataloader_num_workers=0)
    transformers.Trainer(model=model, args=args, train_dataset=_Tokens(64, 1024, 1024), callbacks=callbacks).train()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _assert_same(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k}: max diff {(ref[k] - got[k]).abs().max().item()}"


def test_hf_trainer_budget_held_and_weights_identical(tmp_path) -> None:
    _require_cuda()
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    from datapath.integrations import HFOffloadCallback
    base = _llama()
    keep: list[int] = []
    static: list[int] = []
    ref = _hf_train(copy.deepcopy(base), str(tmp_path / "ref"), [_peaks_callback(keep, static)])
    state = max(static[1:])  # from the second step: parameters, gradients and optimizer state
    budget = int(state + 0.5 * (max(keep) - state))
    peaks: list[int] = []
    cb = HFOffloadCallback(memory_budget=budget)
    got = _hf_train(base, str(tmp_path / "off"), [cb, _peaks_callback(peaks, [])])
    _assert_same(ref, got)
    planned_at = cb.cache.policy.planned_at
    print(f"keep peak {max(keep) / 1e9:.3f} GB, state {state / 1e9:.3f} GB, budget {budget / 1e9:.3f} GB, "
          f"peaks {[round(p / 1e9, 3) for p in peaks]}, first planned step {planned_at}, plan {cb.cache.plan}, "
          f"calibration {cb.cache.policy.calibration / 1e6:.1f} MB")
    assert cb.cache.plan is not None and planned_at is not None and planned_at < STEPS
    # every planned step holds the budget, the first one too (one forward per step: record index = step index)
    assert max(peaks[planned_at:]) <= 1.03 * budget, (peaks[planned_at:], budget)
    assert cb.cache.stats.bytes_offloaded > 0 or cb.cache.plan.recompute


def test_lightning_budget_held_and_weights_identical(tmp_path) -> None:
    _require_cuda()
    pl = pytest.importorskip("lightning.pytorch")
    from datapath.integrations import LightningOffloadCallback

    class _LM(pl.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class _Peaks(pl.Callback):
        def __init__(self) -> None:
            self.peaks: list[int] = []
            self.static: list[int] = []

        def on_train_batch_start(self, *a: object) -> None:
            torch.cuda.synchronize()
            self.static.append(torch.cuda.memory_allocated())
            torch.cuda.reset_peak_memory_stats()

        def on_before_optimizer_step(self, *a: object) -> None:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated())

    def fit(model: torch.nn.Module, callbacks: list) -> dict[str, torch.Tensor]:
        pl.seed_everything(3, verbose=False)
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                             default_root_dir=str(tmp_path))
        trainer.fit(_LM(model), torch.utils.data.DataLoader(_Tokens(64, 1024, 1024), batch_size=8))
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    base = _llama()
    probe = _Peaks()
    ref = fit(copy.deepcopy(base), [probe])
    state = max(probe.static[1:])
    budget = int(state + 0.5 * (max(probe.peaks) - state))
    cb, rec = LightningOffloadCallback(memory_budget=budget), _Peaks()
    got = fit(base, [cb, rec])
    _assert_same(ref, got)
    planned_at = cb.cache.policy.planned_at
    print(f"keep peak {max(probe.peaks) / 1e9:.3f} GB, budget {budget / 1e9:.3f} GB, "
          f"peaks {[round(p / 1e9, 3) for p in rec.peaks]}, first planned step {planned_at}, plan {cb.cache.plan}, "
          f"calibration {cb.cache.policy.calibration / 1e6:.1f} MB")
    assert cb.cache.plan is not None and planned_at is not None and planned_at < STEPS
    assert max(rec.peaks[planned_at:]) <= 1.03 * budget, (rec.peaks[planned_at:], budget)


def test_hf_trainer_everything_offloaded_is_identical_and_lower(tmp_path) -> None:
    """policy="all": every activation through the pinned host store and back; weights bit-identical, peak lower."""
    _require_cuda()
    pytest.importorskip("accelerate")
    from datapath.integrations import HFOffloadCallback
    base = _llama()
    keep: list[int] = []
    ref = _hf_train(copy.deepcopy(base), str(tmp_path / "ref"), [_peaks_callback(keep, [])])
    peaks: list[int] = []
    cb = HFOffloadCallback(policy="all")
    got = _hf_train(base, str(tmp_path / "off"), [cb, _peaks_callback(peaks, [])])
    _assert_same(ref, got)
    st = cb.cache.stats
    print(f"keep peak {max(keep[1:]) / 1e9:.3f} GB, offloaded peak {max(peaks[1:]) / 1e9:.3f} GB, "
          f"{st.bytes_offloaded / 1e9:.2f} GB offloaded over {STEPS} steps, {st.bytes_loaded / 1e9:.2f} GB loaded, "
          f"{st.bytes_forwarded / 1e9:.2f} GB forwarded from memory")
    # on a GPU, what is still being stored when the backward needs it comes back from memory (forwarded)
    assert st.bytes_offloaded > 0 and st.bytes_loaded > 0.5 * st.bytes_offloaded
    assert max(peaks[1:]) < 0.8 * max(keep[1:])
