"""Each mistake of issue 36's list gets one line naming the argument, variable, file or flag and what is
accepted -- never an AttributeError, a TypeError from deep inside, or a figure that means nothing unremarked."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from datapath.cli import main
from datapath.graph import Graph
from datapath.loaders import NeighborLoader
from datapath.offload import OffloadConfigError, offload
from datapath.sampling import NeighborSampler
from datapath.unified_tensor import SharedTableError, as_unified, attach, share, unlink


def test_neighbor_sampler_of_an_int_says_to_give_a_list() -> None:
    with pytest.raises(ValueError, match=r"fanouts=5: give one fanout per hop as a list.*NeighborSampler\(\[5\]\)"):
        NeighborSampler(5)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_neighbor_loader_on_cuda_without_cuda_names_the_device() -> None:
    g = torch.Generator().manual_seed(0)
    graph = Graph.from_edge_index(torch.randint(0, 50, (2, 200), generator=g), 50)
    with pytest.raises(ValueError, match=r"NeighborLoader\(device='cuda'\) needs a CUDA GPU.*device='cpu'"):
        NeighborLoader(graph, torch.arange(10), NeighborSampler([3]), batch_size=4, device="cuda")


def test_offload_of_a_string_names_the_model_argument() -> None:
    with pytest.raises(OffloadConfigError, match=r"offload\(model=\.\.\.\) takes the torch.nn.Module.*got str"):
        with offload("model"):  # type: ignore[arg-type]
            pass


def test_as_unified_of_a_list_says_what_it_takes() -> None:
    with pytest.raises(TypeError, match=r"as_unified\(t\) takes a CPU torch.Tensor or a numpy array.*got list"):
        as_unified([1, 2, 3])  # type: ignore[arg-type]


def test_a_corrupt_shared_table_description_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAPATH_SHM_DIR", str(tmp_path))
    name = "h36-corrupt"
    share(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), name)
    try:
        meta = tmp_path / f"datapath-{name}.json"
        meta.write_text(meta.read_text()[:-7])  # cut short, as by a crash mid-write
        with pytest.raises(SharedTableError, match=f"{meta}.*is corrupt"):
            attach(name)
    finally:
        unlink(name)


def test_prepare_dataset_under_a_file_says_not_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    rc = main(["prepare-dataset", "tiny", str(tmp_path / "afile" / "sub"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{tmp_path / 'afile'} is a file, not a directory" in err


def test_ssd_plan_sweep_error_names_the_flag_before_printing_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["ssd-plan", "--sweep", "hidden=1,x"])
    out = capsys.readouterr().out
    assert rc == 2 and "--sweep hidden=1,x" in out and "must be numbers" in out
    assert "quantity" not in out  # no plan printed first


def test_ssd_plan_of_a_tiny_preset_says_it_is_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ssd-plan", "--preset", "gpt-tiny"]) == 0
    assert "note: this shape is too small for these figures to mean anything" in capsys.readouterr().out
    assert main(["ssd-plan"]) == 0
    assert "too small" not in capsys.readouterr().out


def test_rok_png_without_matplotlib_names_the_extra_before_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on the plain install: import matplotlib fails
    rc = main(["rok", "--preset", "gpt-tiny", "--strategies", "keep", "--micro-batches", "1", "--steps", "1",
               "--warmup", "0", "--device", "cpu", "--png", str(tmp_path / "out.png")])
    captured = capsys.readouterr()
    assert rc != 0 and captured.err.count("\n") == 1, captured
    assert 'pip install "datapath[plot]"' in captured.err and "--png" in captured.err
    assert "keep" not in captured.out  # nothing ran


@pytest.mark.slow
def test_rok_of_a_tiny_preset_says_it_is_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["rok", "--preset", "gpt-tiny", "--strategies", "keep,offload-host", "--micro-batches", "1",
               "--steps", "1", "--warmup", "1", "--device", "cpu"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "note: this preset is too small to measure" in out and "moved 0 bytes" in out, out


def test_int_features_are_rejected_naming_the_file_when_loading(tmp_path: Path) -> None:
    from datapath.graph import Dataset, load_dataset  # noqa: PLC0415

    g = torch.Generator().manual_seed(2)
    n = 40
    graph = Graph.from_edge_index(torch.randint(0, n, (2, 160), generator=g), n)
    ids = torch.randperm(n, generator=g)
    Dataset("ints", graph, torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g),
            ids[:20].sort().values, ids[20:30].sort().values, ids[30:].sort().values, 2).save(tmp_path / "ds")
    np.save(tmp_path / "ds" / "features.npy", np.random.default_rng(3).integers(0, 9, (n, 4), dtype=np.int32))
    meta = (tmp_path / "ds" / "meta.json")
    import json  # noqa: PLC0415

    doc = json.loads(meta.read_text())
    doc["files"]["features.npy"]["bytes"] = (tmp_path / "ds" / "features.npy").stat().st_size
    meta.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"{tmp_path / 'ds' / 'features.npy'} holds int32 values.*float"):
        load_dataset(tmp_path / "ds")
