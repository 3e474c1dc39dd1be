"""`train_epoch`'s report: the mean loss and the training accuracy it gives are those of the batches it trained on
(kept on the device per batch and reduced once at the end), on the CPU and on a GPU."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from datapath.apps import train_epoch
from datapath.graph import Graph
from datapath.loaders import NeighborLoader
from datapath.nn.models import build_model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_train_epoch_reports_the_loss_and_accuracy_of_its_batches(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(3)
    n = 1500
    graph = Graph.from_edge_index(torch.randint(0, n, (2, 15000), generator=g), n)
    feats, labels = torch.randn(n, 10, generator=g), torch.randint(0, 5, (n,), generator=g)
    if device == "cuda":
        graph, feats, labels = graph.to("unified"), feats.pin_memory(), labels.pin_memory()
    loader = NeighborLoader(graph, torch.randperm(n, generator=g)[:1100], [4, 3], 64, shuffle=True, features=feats,
                            labels=labels, device=device)
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
