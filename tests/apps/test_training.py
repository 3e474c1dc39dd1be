"""`train_epoch` on the CPU and on a GPU: the mean loss and the training accuracy it reports are those of the batches it
trained on (kept on the device per batch, reduced once at the end), and a NaN loss stops the epoch naming its batch
however late the host reads the device's flag."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from datapath.apps import train_epoch
from datapath.apps.errors import NonFiniteLossError
from datapath.graph import Graph
from datapath.loaders import NeighborLoader
from datapath.nn.models import build_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _loader(device: str, seed: int, n: int, width: int, classes: int, seeds: int, batch: int) -> NeighborLoader:
    """A random graph of ``n`` nodes (10 edges a node), ``width`` features, ``classes`` labels; batches of ``batch``
    of the first ``seeds`` nodes of a random order (graph and tables unified on a GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(seed)
    graph = Graph.from_edge_index(torch.randint(0, n, (2, 10 * n), generator=g), n)
    feats, labels = torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g)
    if device == "cuda":
        graph, feats, labels = graph.to("unified"), feats.pin_memory(), labels.pin_memory()
    return NeighborLoader(graph, torch.randperm(n, generator=g)[:seeds], [5, 3], batch, shuffle=True, features=feats,
                          labels=labels, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_train_epoch_reports_the_loss_and_accuracy_of_its_batches(device: str) -> None:
    loader = _loader(device, seed=3, n=1500, width=10, classes=5, seeds=1100, batch=64)
    torch.manual_seed(0)
    model = build_model("sage", 10, 16, 5, 2, dropout=0.0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[tuple[float, int, int]] = []  # per batch, as the step saw it: loss, correct, seeds

    def loss_fn(out: torch.Tensor, batch) -> torch.Tensor:
        loss = F.cross_entropy(out, batch.y)
        seen.append((float(loss.detach()), int((out.argmax(1) == batch.y).sum()), batch.y.numel()))
        return loss

    stats = train_epoch(model, loader, opt, loss_fn=loss_fn, max_batches=15)
    assert stats.batches == len(seen) == 15
    assert stats.losses == pytest.approx([s[0] for s in seen], rel=0, abs=0)
    assert stats.loss == pytest.approx(math.fsum(s[0] for s in seen) / 15, rel=1e-12)
    assert stats.train_acc == sum(s[1] for s in seen) / sum(s[2] for s in seen)
    assert 0 < stats.train_acc < 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [0, 5, 17, 49])
def test_a_nan_loss_stops_the_epoch_naming_its_batch(device: str, bad: int) -> None:
    """The first batch whose loss is NaN is named (1-based): on a GPU the host reads a copy of the device's flag a few
    batches later without waiting, or the losses at the epoch's end (batch 50 is the last)."""
    loader = _loader(device, seed=9, n=2000, width=12, classes=4, seeds=2000, batch=40)
    assert len(loader) == 50
    model = build_model("sage", 12, 16, 4, 2, dropout=0.0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []

    def loss_fn(out: torch.Tensor, batch) -> torch.Tensor:
        loss = F.cross_entropy(out, batch.y)
        seen.append(len(seen))
        return loss * float("nan") if len(seen) - 1 >= bad else loss

    with pytest.raises(NonFiniteLossError, match=rf"^epoch 3, batch {bad + 1}: the loss is nan \(not finite\)"):
        train_epoch(model, loader, opt, loss_fn=loss_fn, epoch=2)
    # the CPU stops at the bad batch; a GPU within a few batches of it (never before)
    assert len(seen) == bad + 1 if device == "cpu" else bad + 1 <= len(seen) <= min(50, bad + 1 + 3 * 8)
