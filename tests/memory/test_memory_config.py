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

