"""Shared pytest configuration: GPU tests skip cleanly on machines without CUDA; with ``DATAPATH_INSTANT_FAILURES``
set, a failure's traceback is written to stderr as it happens (a run cut by a time limit keeps it)."""
from __future__ import annotations

import os
import sys

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def cuda_device() -> torch.device:
    """The current CUDA device; only requested by tests marked ``gpu``."""
    return torch.device("cuda", torch.cuda.current_device())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``DATAPATH_INSTANT_FAILURES`` set (`scripts/gpu_check.sh` sets it), a failed test's traceback now, not
    in the summary at the end: the GPU machine ends a command at its time limit, summary or not."""
    if report.failed and os.environ.get("DATAPATH_INSTANT_FAILURES"):
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when}) ===\n{report.longreprtext}\n")
        sys.stderr.flush()
