"""Shared pytest configuration: GPU tests skip cleanly on machines without CUDA."""
from __future__ import annotations

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
