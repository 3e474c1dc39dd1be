"""`huge_pinned_empty` on any machine: bad arguments are refused by name; where nothing can be pinned it gives None."""
from __future__ import annotations

import pytest
import torch

from datapath.memory import free_hugetlb_pages, huge_pinned_empty, thp_mode


def test_a_bad_way_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="how must be 'auto', 'hugetlb' or 'thp', got 'huge'"):
        huge_pinned_empty((4, 4), torch.float32, how="huge")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answer")
def test_without_cuda_there_is_nothing_to_pin() -> None:
    assert huge_pinned_empty((1024, 64), torch.float32) is None


def test_the_system_settings_read_back() -> None:
    assert thp_mode() in ("", "always", "madvise", "never")
    assert free_hugetlb_pages() >= 0
