"""Data-parallel GNN training over one shared copy of the data: 2 gloo processes == 1 process with the global batch."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from datapath.apps import DistributedError, init_distributed, launch, shared_dataset, train, train_epoch, TrainConfig
from datapath.apps.launch import DistContext
from datapath.apps.train_gnn import global_mean_loss, make_optimizer
from datapath.graph import SyntheticSpec, generate, load_dataset
from datapath.loaders import DistributedNeighborLoader, LoaderError, NeighborLoader, RankBatch
from datapath.memory import to_placement
from datapath.sampling import NeighborSampler
from datapath.nn.models import build_model
from datapath.unified_tensor import shared_tables

N_TRAIN = 357  # global batches of 128, 128 and 101 seeds: the last one splits 51 / 50
RANK_BATCH = 64


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = SyntheticSpec("dist-test", 3000, 24_000, 24, 5, homophily=0.7, signal=0.3, train_frac=0.3,
                         val_frac=0.1, test_frac=0.1, seed=5)
    ds = generate(spec, device="cpu", progress=False)
    ds = dataclasses.replace(ds, train_idx=ds.train_idx[:N_TRAIN])
    return ds.save(tmp_path_factory.mktemp("ds") / "dist-test")


@pytest.fixture(scope="module")
def shm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private table directory on tmpfs (/dev/shm) when there is one: a disk-file mapping cannot be pinned."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="datapath-test-", dir="/dev/shm")) if os.path.isdir("/dev/shm") else \
        tmp_path_factory.mktemp("shm")
    old = os.environ.get("DATAPATH_SHM_DIR")
    os.environ["DATAPATH_SHM_DIR"] = str(d)  # inherited by the spawned ranks
    yield d
    if old is None:
        os.environ.pop("DATAPATH_SHM_DIR", None)
    else:
        os.environ["DATAPATH_SHM_DIR"] = old
    shutil.rmtree(d, ignore_errors=True)


def _cfg(dataset_dir: Path) -> TrainConfig:
    return TrainConfig(dataset=str(dataset_dir), model="sage", epochs=2, batch_size=RANK_BATCH, fanouts=(6, 4),
                       hidden=32, dropout=0.0, lr=0.2, optimizer="sgd", device="cpu", seed=3, prefetch=1,
                       return_state=True, eval_nodes=200)


@pytest.fixture(scope="module")
def two_rank_run(dataset_dir: Path, shm: Path) -> list[dict]:
    t0 = time.perf_counter()
    res = launch(train, 2, (_cfg(dataset_dir),))
    assert time.perf_counter() - t0 < 60
    return res


def _reference(dataset_dir: Path, cfg: TrainConfig, device: str = "cpu") -> tuple[dict, list[float]]:
    """One process, same model and seeds, batch = 2 x RANK_BATCH, plain NeighborLoader and mean loss."""

    ds = load_dataset(dataset_dir)
    where = "unified" if device == "cuda" else "cpu"
    loader = NeighborLoader(ds.graph.to(where), ds.train_idx, NeighborSampler(list(cfg.fanouts), seed=cfg.seed),
                            2 * RANK_BATCH, shuffle=True, features=to_placement(ds.features, where),
                            labels=to_placement(ds.labels, where), device=device, seed=cfg.seed, prefetch=0)
    torch.manual_seed(cfg.seed)
    net = build_model("sage", ds.num_features, cfg.hidden, ds.num_classes, len(cfg.fanouts), dropout=0.0).to(device)
    opt = make_optimizer(cfg.optimizer, net.parameters(), cfg.lr)
    losses = []
    for _ in range(cfg.epochs):
        losses += train_epoch(net, loader, opt).losses
    return {k: v.cpu() for k, v in net.state_dict().items()}, losses


@pytest.mark.slow
def test_two_ranks_train_like_one_process_with_the_global_batch(two_rank_run: list[dict], dataset_dir: Path) -> None:
    cfg = _cfg(dataset_dir)
    ref_state, ref_losses = _reference(dataset_dir, cfg)
    r0, r1 = two_rank_run
    assert (r0["world_size"], r0["backend"], r1["rank"]) == (2, "gloo", 1)
    hist0 = r0["history"]
    assert r1["history"] == hist0  # every rank gathered the same per-rank rows
    assert [h["ranks"][0]["batches"] for h in hist0] == [3, 3]
    # each rank trained on its part of each global batch: 64+64+51 and 64+64+50 seeds
    assert [h["ranks"][0]["seeds"] for h in hist0] == [179, 179]
    assert [h["ranks"][1]["seeds"] for h in hist0] == [178, 178]
    # the ranks' losses (world * sum / global batch) average to the one-process mean loss, step by step
    got = [(a + b) / 2 for h in hist0 for a, b in zip(h["ranks"][0]["losses"], h["ranks"][1]["losses"])]
    np.testing.assert_allclose(got, ref_losses, rtol=1e-5, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0]
    # and after 6 SGD steps the parameters are those of the one-process run
    assert set(r0["state"]) == set(ref_state)
    for k, v in ref_state.items():
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    assert r0["test_acc"] is not None and 0.0 <= r0["test_acc"] <= 1.0
    assert r0["history"][-1]["aggregate"]["seeds"] == N_TRAIN


@pytest.mark.slow
def test_one_shared_copy_of_the_data_and_removed_after_the_job(two_rank_run: list[dict], dataset_dir: Path,
                                                                 shm: Path) -> None:
    ds = load_dataset(dataset_dir)
    one_copy = sum(t.numel() * t.element_size() for t in (
        ds.graph.indptr, ds.graph.indices, ds.features, ds.labels, ds.train_idx, ds.val_idx, ds.test_idx))
    for r in two_rank_run:
        mem = r["memory"]
        assert mem["segment"]["tables"] == 7 and mem["segment"]["nbytes"] == one_copy
        # every rank maps each table exactly once: its arrays ARE the shared pages, no private copy
        assert mem["shared_mappings"] == 7
        assert one_copy <= mem["shared_mapped"] <= one_copy + 7 * 4096
        assert mem["rss"] > 0 and mem["uss"] > 0 and mem["shared_pss"] <= mem["shared_rss"]
    # the pages both ranks touched are counted half in each rank's PSS
    total_pss = sum(r["memory"]["shared_pss"] for r in two_rank_run)
    assert total_pss <= max(r["memory"]["shared_rss"] for r in two_rank_run) + 4096
    assert list(shm.iterdir()) == [] and shared_tables() == {}


def test_loader_splits_every_global_batch(dataset_dir: Path) -> None:
    ds = load_dataset(dataset_dir)
    kw = dict(features=ds.features, labels=ds.labels, device="cpu", seed=1, prefetch=0)
    ref = NeighborLoader(ds.graph, ds.train_idx, [5, 3], 3 * 40, shuffle=True, **kw)
    parts = [DistributedNeighborLoader(ds.graph, ds.train_idx, [5, 3], 40, shuffle=True, rank=r, world_size=3,
                                       **kw) for r in range(3)]
    assert len(ref) == len(parts[0]) == 3
    for epoch in range(2):
        for full, *split in zip(ref, *parts, strict=True):
            assert torch.equal(torch.cat([b.seeds for b in split]), full.seeds)
            assert {b.global_batch_size for b in split} == {full.seeds.numel()}
            for b in split:  # a node's sampled neighbours do not depend on how the batch was split
                pos = {int(v): i for i, v in enumerate(full.blocks[-1].src_nodes)}
                assert torch.equal(b.y, ds.labels[b.seeds])
                assert torch.equal(b.x, ds.features[b.input_nodes])
                blk, fb = b.blocks[-1], full.blocks[-1]
                for j, s in enumerate(b.seeds.tolist()):
                    fj = int((full.seeds == s).nonzero())
                    mine = blk.src_nodes[blk.indices[blk.indptr[j]:blk.indptr[j + 1]].long()]
                    theirs = fb.src_nodes[fb.indices[fb.indptr[fj]:fb.indptr[fj + 1]].long()]
                    assert torch.equal(mine, theirs) and all(int(v) in pos for v in mine)
    # a last global batch smaller than the number of ranks is dropped on every rank
    small = DistributedNeighborLoader(ds.graph, ds.train_idx[:81], [2], 40, rank=1, world_size=2, **kw)
    assert len(small) == 1 and small.seeds_in(5) == 40
    with pytest.raises(LoaderError, match="rank"):
        DistributedNeighborLoader(ds.graph, ds.train_idx, [2], 4, rank=2, world_size=2, **kw)


@pytest.mark.gpu
def test_gpu_prefetching_rank_loader_gives_rank_batches(dataset_dir: Path) -> None:
    """The pipelined GPU producer makes `RankBatch`es too (the same as the CPU rank loader's)."""

    ds = load_dataset(dataset_dir)
    cpu = DistributedNeighborLoader(ds.graph, ds.train_idx, [5, 3], 40, shuffle=True, rank=1, world_size=3,
                                    features=ds.features, labels=ds.labels, device="cpu", seed=1, prefetch=0)
    gpu = DistributedNeighborLoader(ds.graph.to("unified"), ds.train_idx, [5, 3], 40, shuffle=True, rank=1,
                                    world_size=3, features=to_placement(ds.features, "unified"),
                                    labels=to_placement(ds.labels, "unified"), device="cuda", seed=1, prefetch=1)
    for a, b in zip(cpu, gpu, strict=True):
        assert isinstance(b, RankBatch) and (b.step, b.global_batch_size) == (a.step, a.global_batch_size)
        assert torch.equal(a.seeds, b.seeds.cpu()) and torch.equal(a.x, b.x.cpu()) and torch.equal(a.y, b.y.cpu())


def test_global_mean_loss_needs_rank_batches(dataset_dir: Path) -> None:
    ds = load_dataset(dataset_dir)
    b = next(iter(NeighborLoader(ds.graph, ds.train_idx, [2], 8, features=ds.features, labels=ds.labels,
                                 device="cpu", prefetch=0)))
    with pytest.raises(DistributedError, match="DistributedNeighborLoader"):
        global_mean_loss(2)(torch.randn(8, 5), b)


def _fail_after_sharing(dataset_dir: str) -> None:
    ctx = init_distributed("cpu")
    shared_dataset(ctx, lambda: load_dataset(dataset_dir))
    if ctx.rank == 1:
        raise RuntimeError("rank 1 breaks down")
    torch.distributed.barrier()  # rank 0 waits for a rank that never comes


@pytest.mark.slow
def test_a_failed_rank_stops_the_job_and_leaves_no_shared_files(dataset_dir: Path, shm: Path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(DistributedError, match="(?s)rank [01] of 2 failed.*-- rank 1:.*rank 1 breaks down"):
        launch(_fail_after_sharing, 2, (str(dataset_dir),), grace_period=1.0)
    assert time.perf_counter() - t0 < 45
    assert list(shm.iterdir()) == []


def _share_and_die(dataset_dir: str) -> None:
    ctx = DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo")
    shared_dataset(ctx, lambda: load_dataset(dataset_dir), prefix="killed")
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up runs (as for a rank killed under torchrun)


@pytest.mark.slow
def test_tables_of_a_killed_owner_are_removed_by_the_next_job(dataset_dir: Path, shm: Path) -> None:
    p = mp.get_context("spawn").Process(target=_share_and_die, args=(str(dataset_dir),))
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL
    # the owner's watchdog removes them at once (tests/apps/test_leftovers.py); the next job sweeps any left
    deadline = time.monotonic() + 5
    while any(f.name.startswith("datapath-killed.") for f in shm.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    ctx = DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo")
    ds = shared_dataset(ctx, lambda: load_dataset(dataset_dir), prefix="next")
    assert not any(f.name.startswith("datapath-killed.") for f in shm.iterdir())
    assert set(shared_tables()) == {f"next.{k}" for k in ("indptr", "indices", "features", "labels", "train_idx",
                                                          "val_idx", "test_idx")}
    from datapath.unified_tensor import unlink

    for name in list(shared_tables()):
        unlink(name)
    del ds


@pytest.mark.gpu
def test_gpu_two_ranks_nccl_match_one_process(dataset_dir: Path, shm: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cfg = dataclasses.replace(_cfg(dataset_dir), device="cuda")
    r0, r1 = launch(train, 2, (cfg,))
    assert r0["backend"] == "nccl" and r1["device"] == "cuda:1"
    ref_state, ref_losses = _reference(dataset_dir, cfg, "cuda")  # one GPU, global batch
    got = [(a + b) / 2 for h in r0["history"] for a, b in zip(h["ranks"][0]["losses"], h["ranks"][1]["losses"])]
    np.testing.assert_allclose(got, ref_losses, rtol=1e-4, atol=1e-5)
    for k, v in ref_state.items():
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-3, atol=1e-4, msg=k)
    for r in (r0, r1):  # pinned by each rank (cudaHostRegister touches every page: all resident)
        assert r["memory"]["shared_mappings"] == 7 and r["memory"]["shared_rss"] >= r["memory"]["segment"]["nbytes"] - 7 * 4096
    assert list(shm.iterdir()) == []


@pytest.mark.slow
def test_train_gnn_cli_spawns_the_ranks(tmp_path: Path, shm: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from datapath.cli import main

    out = tmp_path / "run.json"
    assert main(["train-gnn", "--gpus", "2", "--device", "cpu", "--epochs", "1", "--max-batches", "4",
                 "--eval-nodes", "500", "--no-progress", "--json", str(out)]) == 0
    text = capfd.readouterr().out
    assert "2 x cpu (gloo)" in text and "seeds/s" in text and "per rank" in text and "rank 1: RSS" in text
    import json

    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["epochs"][0]["aggregate"]["batches"] == 4
    assert doc["epochs"][0]["aggregate"]["seeds"] == 4 * 2 * 512
    assert doc["segment"]["tables"] == 7 and len(doc["memory"]) == 2
    assert list(shm.iterdir()) == []


@pytest.mark.slow
def test_train_gnn_under_torchrun(tmp_path: Path, shm: Path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "run.json"
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "datapath.cli",
         "train-gnn", "--device", "cpu", "--epochs", "1", "--max-batches", "3", "--eval-nodes", "500", "--no-progress",
         "--json", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["backend"] == "gloo"
    assert [r["batches"] for r in doc["epochs"][0]["ranks"]] == [3, 3]
    assert list(shm.iterdir()) == []
