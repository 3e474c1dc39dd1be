"""``datapath info``: what it reports, as text and as JSON, without measuring or building anything."""
from __future__ import annotations

import json

import pytest

from datapath.cli import main


def test_info_reports_the_machine_and_the_native_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--no-measure", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cpu_count"] >= 1 and info["ram_bytes"] > 0
    assert set(info["native_launcher"]) == {"status", "path"}
    status = info["native_launcher"]["status"]
    assert status in ("ready", "building", "not started") or status.startswith("unavailable: ")
    assert "bandwidth" not in info  # --no-measure
    assert main(["info", "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert "native launcher (small gathers in one C++ call): " in text and "pinned memory: ulimit -l" in text
