"""The kernels' preconditions: shape checks on every call, value checks (and ``-DDP_DEBUG`` kernels) in debug mode;
and the caches keyed by a tensor that dies (the fused push's visit order)."""
from __future__ import annotations

import gc

import pytest
import torch

from datapath.graph import CSRGraph
from datapath.ops import (
    FeatureShapeError,
    GraphFormatError,
    GraphIndexError,
    aggregate,
    cached_keys,
    debug_checks,
    debug_checks_enabled,
    plan_aggregation,
    set_debug_checks,
    transposed_aggregator,
)
from datapath.ops.tolerance import assert_close, tolerance
from datapath.testing import power_law_csr, reference_aggregate

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_the_switch() -> None:
    before = debug_checks_enabled()
    with debug_checks():
        assert debug_checks_enabled()
        with debug_checks(False):
            assert not debug_checks_enabled()
        assert debug_checks_enabled()
    assert debug_checks_enabled() == before
    prev = set_debug_checks(True)
    assert set_debug_checks(prev) is True


@pytest.mark.parametrize("device", DEVICES)
def test_debug_mode_checks_what_a_trusted_graph_vouches_for(device: str) -> None:
    """A trusted graph's values are not checked (a host synchronisation) -- except in debug mode, where an index out
    of range or a row longer than its ``max_degree`` bound (the kernels would sum it in part) is an error."""
    g = power_law_csr(50, 70, 400, seed=1)
    longest = int((g.indptr[1:] - g.indptr[:-1]).max())
    x = torch.randn(70, 4, device=device)

    class Trusted(CSRGraph):
        max_degree: int | None = None

    lying = Trusted(g.indptr.to(device), g.indices.to(device), 70, 50, trusted=True)
    lying.max_degree = longest - 1
    with debug_checks(), pytest.raises(GraphFormatError, match=f"max_degree={longest - 1}.*{longest} edges"):
        aggregate(lying, x)
    bad = g.indices.clone()
    bad[5] = 70
    out_of_range = CSRGraph(g.indptr.to(device), bad.to(device), 70, 50, trusted=True)
    with debug_checks(), pytest.raises(GraphIndexError, match=r"\[0, 69\]|70"):
        aggregate(out_of_range, x)
    honest = Trusted(g.indptr.to(device), g.indices.to(device), 70, 50, trusted=True)
    honest.max_degree = longest
    with debug_checks():
        assert_close(aggregate(honest, x, "mean"), reference_aggregate(g, x.cpu().double(), "mean"),
                     tolerance(torch.float32, longest))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_debug_build_of_every_kernel_runs_and_matches(dtype: torch.dtype) -> None:
    """In debug mode the kernels are built with ``-DDP_DEBUG`` (each checks its rows and edges) and every launch
    checks the values it reads first: each kernel, forward and backward, still matches the reference."""
    g = power_law_csr(200, 180, 6000, alpha=2.0, seed=3, device="cuda")  # long rows: the tail pieces too
    longest = max(int((g.indptr[1:] - g.indptr[:-1]).max()), int(torch.bincount(g.indices.long()).max()))
    with debug_checks():
        for kernel, kw in (("rows", {"cut": 8}), ("rows", {"rows_per_team": 4}), ("rows", {}), ("groups", {}),
                           ("cusparse", {}), ("tensor_core", {})):
            if kernel == "tensor_core" and dtype == torch.float32:
                continue
            plan = plan_aggregation(g, 24, dtype, kernel=kernel, **kw)
            x = torch.randn(180, 24, device="cuda").to(dtype).requires_grad_()
            out = aggregate(g, x, "mean", plan=plan)
            gy = torch.randn_like(out)
            out.backward(gy)
            x64 = x.detach().double().cpu().requires_grad_()
            ref = reference_aggregate(g, x64, "mean")
            ref.backward(gy.double().cpu())
            tol = tolerance(dtype, longest, kernel)
            assert_close(out, ref, tol, f"debug {kernel} {kw} forward")
            assert_close(x.grad, x64.grad, tol, f"debug {kernel} {kw} grad")
        table = torch.randn(500, 24, device="cuda").to(dtype)
        ids = torch.randint(0, 500, (180,), device="cuda")
        assert_close(aggregate(g, table, "sum", src_ids=ids), reference_aggregate(g, table[ids].double().cpu()),
                     tolerance(dtype, longest), "debug fused pull")
        with pytest.raises(GraphIndexError, match="src_ids"):  # checked by the op itself, debug or not
            aggregate(g, table, "sum", src_ids=torch.full((180,), 500, device="cuda"))
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_kernels_refuse_rows_they_were_not_planned_for() -> None:
    """A launch is made for (num_src, F) rows of one dtype: other rows are refused before anything is launched."""
    g = power_law_csr(100, 120, 800, seed=6, device="cuda")
    for kernel in ("rows", "groups", "cusparse"):
        plan_aggregation(g, 16, torch.float32, "mean", probe=True, kernels=(kernel,))
        run = transposed_aggregator(g, 16, torch.float32, "mean")
        with pytest.raises(FeatureShapeError, match=r"\(100, 16\)"):
            run(torch.randn(99, 16, device="cuda"))
        assert run(torch.randn(100, 16, device="cuda")).shape == (120, 16)


@pytest.mark.gpu
def test_fused_push_order_is_kept_per_ids_tensor_not_per_address() -> None:
    """The push over a host table visits rows in the order of ``src_ids``, kept per ids tensor: new ids tensors
    (landing at freed ids' addresses: checked) get their own order, and the kept orders go with their tensors."""
    g = power_law_csr(300, 400, 3000, seed=8, device="cuda")
    table = torch.randn(5000, 16).pin_memory()
    longest = int((g.indptr[1:] - g.indptr[:-1]).max())
    addresses: list[int] = []
    plan = plan_aggregation(g, 16, torch.float32, fused="push")
    for i in range(12):
        ids = torch.randperm(5000, generator=torch.Generator().manual_seed(i))[:400].cuda()
        addresses.append(ids.data_ptr())
        got = aggregate(g, table, "mean", src_ids=ids, plan=plan)
        assert_close(got, reference_aggregate(g, table[ids.cpu()].double(), "mean"), tolerance(torch.float32, longest),
                     f"push {i}")
        del ids
        gc.collect()
    assert len(set(addresses)) < len(addresses), "no ids tensor reused an address: the test proved nothing"
    kept = [k for k in cached_keys(g) if isinstance(k, tuple) and k[0] == "transposed" and "push" in str(k[1])]
    assert len(kept) <= 1, f"one weak-keyed table of push orders, not an entry per address: {kept}"
