"""The documented `accelerate` one-liner: `offload(accelerator.unwrap_model(model), ...)` around the loop gives the
same weights as the loop without it, and the activations really went through the cache (CPU)."""
from __future__ import annotations

import copy

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from datapath.offload import offload  # noqa: E402


def _run(model: torch.nn.Module, batches: list[torch.Tensor], offloaded: bool) -> tuple[dict, object]:
    accelerator = accelerate.Accelerator(cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    stats = None

    def loop() -> None:
        for i, ids in enumerate(batches):
            torch.manual_seed(100 + i)  # dropout
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()

    if offloaded:
        with offload(accelerator.unwrap_model(model), min_bytes=1024, offload_cpu_tensors=True) as cache:
            loop()
        stats = cache.stats
    else:
        loop()
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, stats


@pytest.mark.slow
def test_accelerate_loop_inside_offload_is_bit_identical() -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, use_cache=False)
    base = transformers.GPT2LMHeadModel(cfg)
    batches = [torch.randint(0, 128, (4, 32)) for _ in range(3)]
    ref, _ = _run(copy.deepcopy(base), batches, offloaded=False)
    got, stats = _run(base, batches, offloaded=True)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    # every stored storage came back: read from the store, or handed back from memory while its store was
    # still finishing (forwarding; which one depends on timing)
    assert 0 < stats.bytes_loaded <= stats.bytes_offloaded <= stats.bytes_loaded + stats.bytes_forwarded
