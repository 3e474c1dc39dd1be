"""Row-fetch settings: arguments first, environment variables second, the config object last."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datapath.memory import GatherConfig, config_from_env, gather_rows


def test_environment_sets_the_defaults() -> None:
    cfg = config_from_env({"DATAPATH_GATHER_SYNC": "1", "DATAPATH_GATHER_MODE": "shift_mask",
                           "DATAPATH_GATHER_SORT": "0"})
    assert (cfg.sync_bounds_check, cfg.gather_mode, cfg.sort_indices) == (True, "shift_mask", False)
    assert config_from_env({}) == GatherConfig()


@pytest.mark.parametrize("env, name", [({"DATAPATH_GATHER_SYNC": "maybe"}, "DATAPATH_GATHER_SYNC"),
                                       ({"DATAPATH_GATHER_MODE": "diagonal"}, "DATAPATH_GATHER_MODE"),
                                       ({"DATAPATH_GATHER_SORT": "2"}, "DATAPATH_GATHER_SORT")])
def test_a_bad_environment_value_names_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        config_from_env(env)


@pytest.mark.slow
def test_the_environment_reaches_a_new_process() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    code = "from datapath.memory import gather_config as c; print(c.sync_bounds_check, c.gather_mode)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(src), "DATAPATH_GATHER_SYNC": "1",
                              "DATAPATH_GATHER_MODE": "unaligned"}).stdout.split()
    assert out == ["True", "unaligned"]


def test_arguments_come_first() -> None:
    table = torch.randn(50, 3)
    idx = torch.randint(0, 50, (20,))
    assert torch.equal(gather_rows(table, idx, sync=True), table[idx])


def test_visit_order_settings_are_checked() -> None:
    cfg = GatherConfig()
    assert (cfg.sort_method, cfg.host_window_bytes) == ("buckets", 32 << 20)
    cfg.sort_method = "buckets_unfused"
    cfg.sort_method, cfg.host_window_bytes, cfg.host_min_inflight_bytes = "torch", 0, 1 << 20
    with pytest.raises(ValueError, match="sort_method"):
        cfg.sort_method = "radix"
    for name in ("host_window_bytes", "host_min_inflight_bytes"):
        with pytest.raises(ValueError, match=name):
            setattr(cfg, name, -1)
        with pytest.raises(ValueError, match=name):
            setattr(cfg, name, "32MB")



def test_sort_from_is_the_threshold_of_sorts() -> None:
    cfg = GatherConfig()
    for choice in ("auto", True, False):
        cfg.sort_indices = choice
        for row_bytes in (4, 256, 1024, 2048, 4096, 8192, 16384):
            for table_bytes in (1 << 20, 256 << 20, 16 << 30):
                for on_host in (True, False):
                    start = cfg.sort_from(row_bytes, table_bytes, on_host)
                    for rows in (1, 1000, 4095, 4096, 32767, 32768, 65535, 65536, 131072, 262143, 262144, 1 << 22):
                        assert cfg.sorts(rows, row_bytes, table_bytes, None, on_host) == (rows >= start), \
                            (choice, row_bytes, table_bytes, on_host, rows)
                        assert cfg.sorts(rows, row_bytes, table_bytes, True, on_host)
                        assert not cfg.sorts(rows, row_bytes, table_bytes, False, on_host)


def test_every_assignment_bumps_the_version() -> None:
    cfg = GatherConfig()
    v = cfg.version
    cfg.blocks_per_sm = 3
    cfg.sort_min_rows = 1000
    assert cfg.version == v + 2
    with pytest.raises(ValueError, match="blocks_per_sm"):
        cfg.blocks_per_sm = 0
    assert cfg.version == v + 2 and cfg.blocks_per_sm == 3
    assert cfg == GatherConfig(blocks_per_sm=3, sort_min_rows=1000)  # the version is not a setting


@pytest.mark.slow
def test_a_bad_launcher_names_the_variable() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    proc = subprocess.run([sys.executable, "-c", "import datapath.memory"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(src), "DATAPATH_GATHER_LAUNCHER": "ctypes"})
    assert proc.returncode == 0, proc.stderr  # never at import: where a gather runs, and in `datapath info`
    with pytest.raises(ValueError, match="DATAPATH_GATHER_LAUNCHER='ctypes'.*native, driver or cupy"):
        config_from_env({"DATAPATH_GATHER_LAUNCHER": "ctypes"})
    assert config_from_env({"DATAPATH_GATHER_LAUNCHER": "CuPy"}).launcher == "cupy"
    with pytest.raises(ValueError, match="launcher"):
        GatherConfig().launcher = "ctypes"


def test_the_grid_comes_from_the_environment() -> None:
    cfg = config_from_env({"DATAPATH_GATHER_THREADS": "128", "DATAPATH_GATHER_BLOCKS_PER_SM": " 4"})
    assert (cfg.threads_per_block, cfg.blocks_per_sm) == (128, 4)
    for env, name in (({"DATAPATH_GATHER_THREADS": "100"}, "DATAPATH_GATHER_THREADS"),
                      ({"DATAPATH_GATHER_THREADS": "lots"}, "DATAPATH_GATHER_THREADS"),
                      ({"DATAPATH_GATHER_BLOCKS_PER_SM": "0"}, "DATAPATH_GATHER_BLOCKS_PER_SM")):
        with pytest.raises(ValueError, match=name):
            config_from_env(env)
