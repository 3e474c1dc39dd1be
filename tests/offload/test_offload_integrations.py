"""Schedule hints: Megatron-core's forward_step/backward_step patched to drive micro-batch records."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from _offload_models import mlp
from datapath.offload import TensorCache
from datapath.offload import patch_schedules, restore_patches


def test_nothing_patched_without_the_packages(monkeypatch) -> None:
    import datapath.offload.integrations as integ

    monkeypatch.setattr(integ, "_import", lambda name: None)
    assert patch_schedules(TensorCache("host")) == []


def _megatron():
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig

    return schedules, ModelType, ModelParallelConfig


class _Stage(nn.Module):
    """A pipeline stage as Megatron expects one (config, model_type, set_input_tensor)."""

    def __init__(self, body: nn.Module, config: object, model_type: object) -> None:
        super().__init__()
        self.body = body
        self.config = config
        self.model_type = model_type

    def set_input_tensor(self, t: object) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_megatron_1f1b_order_with_hints() -> None:
    schedules, ModelType, ModelParallelConfig = _megatron()
    original_f, original_b = schedules.forward_step, schedules.backward_step
    torch.manual_seed(0)
    config = ModelParallelConfig()
    body = mlp(64, 3)
    ref = copy.deepcopy(body)
    data = [torch.randn(32, 64) for _ in range(3)]
    for x in data:
        (ref(x).pow(2).mean() / len(data)).backward()
    stage = _Stage(body, config, ModelType.encoder_or_decoder)
    cache = TensorCache("host", min_bytes=0, offload_cpu_tensors=True, keep_last_modules=1)
    cache.attach(stage, units=list(body))
    patches = patch_schedules(cache)
    assert {"megatron.forward_step", "megatron.backward_step"} <= {p.name for p in patches}
    assert schedules.forward_step is not original_f

    def step_func(it, model):
        out = model(next(it))
        return out, lambda o: (o.pow(2).mean(), {"loss": o.pow(2).mean().detach()})

    it = iter(data)
    store: list = []

    def fwd(i: int):
        try:
            out = schedules.forward_step(step_func, it, stage, len(data), None, store, config, 1,
                                         current_microbatch=i)
        except TypeError:  # older signature without cp_group_size
            out = schedules.forward_step(step_func, it, stage, len(data), None, store, config)
        return out[0] if isinstance(out, tuple) else out

    def bwd(out: torch.Tensor) -> None:
        schedules.backward_step(None, out, None, ModelType.encoder_or_decoder, config)

    with cache:  # Megatron's 1F1B order for one stage: F0 F1 B0 F2 B1 B2
        o0 = fwd(0)
        o1 = fwd(1)
        cache.wait_io()
        bwd(o0)
        o2 = fwd(2)
        cache.wait_io()
        bwd(o1)
        bwd(o2)
    for a, b in zip(ref.parameters(), body.parameters()):
        assert torch.equal(a.grad, b.grad)
    st = cache.stats
    assert st.records == 3                  # one record per micro-batch
    assert st.microbatch_hints == 6         # each forward_step and backward_step named its micro-batch
    assert st.bytes_loaded > 0 and st.loads_on_demand == 0
    restore_patches(patches)
    cache.close()
    assert schedules.forward_step is original_f and schedules.backward_step is original_b
