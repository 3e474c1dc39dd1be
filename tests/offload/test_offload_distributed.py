"""Offloading in data-parallel jobs: per-rank directories, clean-up after a dead rank, DDP/FSDP gradients unchanged."""
from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from datapath.loaders.distributed import init_distributed, launch
from datapath.offload.distributed import clean_stale_ranks, offload_rank, rank_path

VOCAB = 96


def _model(device: torch.device) -> nn.Module:
    from _offload_models import GPT  # tests/offload, on sys.path in the spawned ranks too

    torch.manual_seed(0)
    return GPT(vocab=VOCAB, h=64, heads=4, layers=3, dropout=0.0, tied=False).to(device)


def _wrap(kind: str, model: nn.Module, device: torch.device) -> nn.Module:
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:
            fully_shard(blk)
        return fully_shard(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=device)
    raise ValueError(kind)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        g = p.grad
        out.append((g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone())
    return out


def _step(kind: str, device: torch.device, rank: int, target: str | None, base: str) -> tuple[list, dict]:
    model = _wrap(kind, _model(device), device)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    ids = torch.randint(0, VOCAB, (4, 48), generator=g).to(device)
    info: dict[str, Any] = {}
    if target is None:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        return _grads(model), info
    with offload_rank(model, target=target, path=base if target != "host" else None, min_bytes=0,
                      keep_last_modules=0, offload_cpu_tensors=device.type == "cpu") as cache:
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        cache.wait_io()
        info["files_during"] = len(cache.files())
        info["directory"] = cache.directory
        loss.backward()
    info["offloaded"] = cache.stats.storages_offloaded
    info["bytes_offloaded"] = cache.stats.bytes_offloaded
    info["directory_left"] = cache.directory is not None and os.path.exists(cache.directory)
    return _grads(model), info


def _grads_worker(kinds: list[str], base: str, device: str) -> dict:
    ctx = init_distributed(device)
    torch.set_num_threads(1)
    out = {}
    for kind in kinds:
        ref, _ = _step(kind, ctx.device, ctx.rank, None, base)
        for target in ("host", "ssd"):
            got, info = _step(kind, ctx.device, ctx.rank, target, base)
            info["equal"] = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
            info["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
            info["grad_norm"] = float(sum(a.double().norm() ** 2 for a in ref) ** 0.5)
            out[f"{kind}/{target}"] = info
    return out


def _check(results: list[dict], base: Path, kinds: list[str], exact: bool) -> None:
    for rank, res in enumerate(results):
        for kind in kinds:
            for target in ("host", "ssd"):
                info = res[f"{kind}/{target}"]
                assert info["offloaded"] > 0 and info["bytes_offloaded"] > 0, (kind, target, info)
                assert info["grad_norm"] > 0
                if exact:
                    assert info["equal"], (rank, kind, target, info["max_diff"])
                else:
                    assert info["max_diff"] <= 1e-5 * max(info["grad_norm"], 1.0), (rank, kind, target, info)
                if target == "ssd":  # this rank's files, in its own directory, gone after the step
                    assert info["files_during"] > 0
                    assert Path(info["directory"]).parent == base / f"rank{rank}"
                    assert not info["directory_left"]
    assert sorted(p.name for p in base.iterdir()) == ["rank0", "rank1"]
    assert all(list((base / r).iterdir()) == [] for r in ("rank0", "rank1"))


@pytest.mark.slow
def test_ddp_and_fsdp2_gradients_unchanged_by_per_rank_offloading(tmp_path: Path) -> None:
    kinds = ["ddp", "fsdp2"]  # FSDP (v1) needs an accelerator: tested on the GPUs below
    results = launch(_grads_worker, 2, (kinds, str(tmp_path), "cpu"))
    _check(results, tmp_path, kinds, exact=True)


def _crash_mid_step(base: str) -> None:
    os.environ["RANK"] = "1"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    with offload_rank(model, "ssd", base, min_bytes=0, keep_last_modules=0, offload_cpu_tensors=True) as cache:
        loss = model(torch.randn(128, 64)).sum()  # noqa: F841 - keeps the saved activations alive
        cache.wait_io()
        assert cache.files() and Path(cache.directory).parent == Path(base) / "rank1"
        os._exit(0)  # the rank dies: no clean-up runs


@pytest.mark.slow
def test_a_dead_rank_leaves_no_files_after_the_restart(tmp_path: Path) -> None:
    p = mp.get_context("spawn").Process(target=_crash_mid_step, args=(str(tmp_path),))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    left = list((tmp_path / "rank1").iterdir())
    assert len(left) == 1 and list(left[0].iterdir())  # its private directory, with activation files
    # the job restarts with ONE rank: rank 0 removes what the dead rank 1 left
    model = nn.Sequential(nn.Linear(8, 8))
    with offload_rank(model, "ssd", tmp_path, rank=0, min_bytes=0, offload_cpu_tensors=True) as cache:
        assert Path(cache.directory).parent == rank_path(tmp_path, 0)
    assert list((tmp_path / "rank1").iterdir()) == []
    assert clean_stale_ranks(tmp_path) == []


def test_rank_path_and_host_budget_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert rank_path("/x") == Path("/x/rank3") and rank_path("/x", 0) == Path("/x/rank0")
    import psutil

    with offload_rank(None, "host", min_bytes=0, offload_cpu_tensors=True) as cache:
        budget = cache.store.budget
    assert budget <= psutil.virtual_memory().available * 0.9 * 0.8 / 4 * 1.05


@pytest.mark.gpu
def test_gpu_ddp_fsdp_fsdp2_gradients_unchanged_by_per_rank_offloading(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    kinds = ["ddp", "fsdp2", "fsdp1"]
    results = launch(_grads_worker, 2, (kinds, str(tmp_path), "cuda"))
    _check(results, tmp_path, kinds, exact=False)
