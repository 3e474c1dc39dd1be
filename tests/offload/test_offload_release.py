"""A reloaded activation's memory goes back as soon as autograd lets go of it, not at the next hook call.

Each block below is one autograd node that saves three tensors and unpacks them together (the shape of a
``torch.compile``'d layer).  When the backward reaches block ``k - 1``, the storages autograd was given for
block ``k`` must be freed already: a step's peak is then one block's activations lower (the next block's loads
are allocated while they would still be held).  The gradients stay those of the plain model, also through a
graph kept for a second backward (``retain_graph=True``), where the same handles are unpacked twice.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from datapath.offload import offload


class _Block(torch.autograd.Function):
    """``y = relu(x @ w1) @ w2 + x`` saving ``x``, ``x @ w1`` and its relu; ``seen`` records what backward got."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, probe: "_Probe", k: int) -> torch.Tensor:
        h = x @ w1
        a = torch.relu(h)
        ctx.save_for_backward(x, h, a, w1, w2)
        ctx.probe, ctx.k = probe, k
        return a @ w2 + x

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # noqa: ANN205 - autograd's signature
        ctx.probe.entering(ctx.k)  # before this node unpacks anything
        x, h, a, w1, w2 = ctx.saved_tensors
        ctx.probe.unpacked(ctx.k, (x, h, a))
        ga = gy @ w2.t()
        gh = ga * (h > 0)
        return gy + gh @ w1.t(), x.t() @ gh, a.t() @ gy, None, None


class _Probe:
    """Weak references to the storages each block's backward was given; which were still alive later."""

    def __init__(self) -> None:
        self.refs: dict[int, list[tuple[StorageWeakRef, int]]] = {}
        self.alive_at: dict[int, int] = {}  # block k -> how many of block k+1's storages were alive on entry
        self.alive_bytes_at: dict[int, int] = {}  # ... and their bytes

    def entering(self, k: int) -> None:
        later = self.refs.get(k + 1)
        if later is not None:
            alive = [nb for r, nb in later if not r.expired()]
            self.alive_at[k], self.alive_bytes_at[k] = len(alive), sum(alive)

    def unpacked(self, k: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.refs[k] = [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()) for t in tensors]


class _Stack(nn.Module):
    def __init__(self, n: int, d: int, f: int, probe: _Probe | None) -> None:
        super().__init__()
        self.w1 = nn.ParameterList(nn.Parameter(torch.randn(d, f, dtype=torch.float64) / d ** 0.5) for _ in range(n))
        self.w2 = nn.ParameterList(nn.Parameter(torch.randn(f, d, dtype=torch.float64) / f ** 0.5) for _ in range(n))
        self.probe = probe or _Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, (w1, w2) in enumerate(zip(self.w1, self.w2)):
            x = _Block.apply(x, w1, w2, self.probe, k)
        return x.square().mean()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("stored", [True, False], ids=["reloaded", "maybe-forwarded"])
def test_a_blocks_reloaded_storages_are_freed_before_the_next_block_unpacks(stored: bool) -> None:
    torch.manual_seed(37)
    n, d, f = 5, 48, 160
    x = torch.randn(256, d, dtype=torch.float64)
    model = _Stack(n, d, f, None)
    reference = _Stack(n, d, f, None)
    reference.load_state_dict(model.state_dict())
    reference(x).backward()
    want = _grads(reference)
    with offload(model, target="host", offload_cpu_tensors=True, min_bytes=0) as cache:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model.probe = _Probe()
            forwarded = cache.stats.bytes_forwarded
            loss = model(x)
            if stored:
                cache.wait_io()  # every store done: the backward loads them back
            loss.backward()
            forwarded = cache.stats.bytes_forwarded - forwarded
            assert cache.stats.unpacks >= 3 * n
            # blocks n-1 .. 1 had handed their storages to autograd; none survives into the block before ...
            assert set(model.probe.alive_at) == set(range(n - 1)), model.probe.alive_at
            if stored or forwarded == 0:
                assert model.probe.alive_at == {k: 0 for k in range(n - 1)}, model.probe.alive_at
            else:  # ... but one handed back from memory while its store was running, until that copy stops
                assert all(nb <= forwarded for nb in model.probe.alive_bytes_at.values()), \
                    (model.probe.alive_bytes_at, forwarded)
            for g, w in zip(_grads(model), want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
    if stored:
        assert cache.stats.bytes_loaded > 0


def test_a_retained_graph_backpropagates_twice_through_the_same_handles() -> None:
    torch.manual_seed(38)
    n, d, f = 4, 32, 96
    x = torch.randn(128, d, dtype=torch.float64)
    model = _Stack(n, d, f, None)
    reference = _Stack(n, d, f, None)
    reference.load_state_dict(model.state_dict())
    loss = reference(x)
    loss.backward(retain_graph=True)
    loss.backward()
    want = _grads(reference)
    with offload(model, target="host", offload_cpu_tensors=True, min_bytes=0) as cache:
        loss = model(x)
        cache.wait_io()
        loss.backward(retain_graph=True)
        loss.backward()
    assert cache.stats.bytes_loaded > 0
    for g, w in zip(_grads(model), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
