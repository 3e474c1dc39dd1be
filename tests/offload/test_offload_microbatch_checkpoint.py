"""`memory_budget` under a pipeline schedule's interleaved micro-batches (both forwards, then both backwards, with
`TensorCache.set_microbatch` hints) on a model that checkpoints its own blocks (`torch.utils.checkpoint`, as Hugging
Face's and Megatron's checkpointing do): the blocks' wrapping never changes while a micro-batch waits for its
backward, so the model's own recomputation sees the blocks as their forward did and gradients stay bit-identical.
Found by the offload fuzz (its case 67 of seed 1): the budget's timing step wrapped the blocks between the first
micro-batch's forward and its backward, whose recomputation then saved other tensors (`CheckpointError`)."""
from __future__ import annotations

import dataclasses

import pytest

from datapath.testing import make_offload_case, run_offload_case


@pytest.mark.parametrize("config", ["budget_fast", "budget_slow"])
def test_budget_with_interleaved_microbatches_and_the_models_own_checkpointing(config: str) -> None:
    case = dataclasses.replace(make_offload_case(1, 67), features=("checkpoint",), loop="interleaved", config=config)
    r = run_offload_case(case)
    assert r.ok and r.outcome == "identical", f"{r.outcome}: {r.detail[:2000]}"


def test_the_same_steps_without_hints_were_never_affected() -> None:
    case = dataclasses.replace(make_offload_case(1, 67), features=("checkpoint",), loop="accumulate")
    assert run_offload_case(case).outcome == "identical"
