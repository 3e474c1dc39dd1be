"""The `datapath` entry point itself (src/datapath/cli.py): options that apply to no subcommand."""
from __future__ import annotations

import pytest

import datapath
from datapath.cli import main


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"datapath {datapath.__version__} (torch ")
