"""mkdocs hook: the Changelog page is the repository's CHANGELOG.md (one copy, read at build time)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def on_page_read_source(page: Any, config: Any) -> str | None:
    if page.file.src_uri != "changelog.md":
        return None
    return (Path(config.config_file_path).parent / "CHANGELOG.md").read_text(encoding="utf-8")
