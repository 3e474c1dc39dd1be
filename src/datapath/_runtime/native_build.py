"""The native launcher's build child: ``python -m datapath._runtime.native_build NAME BUILD_DIR``.

Started by `datapath._runtime.native` in a session of its own, so that the build finishes
(and its locks are released) whatever becomes of the process that asked for it.  Prints
the built file's path; on failure, one line on stderr and status 1.
"""
from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

from datapath._runtime.native import DONE_MARK, SOURCE, source_text


def build_here(name: str, build_dir: Path) -> Path:
    """Compile the extension ``name`` into ``build_dir`` in this process and return the built file.

    Holds an exclusive ``flock`` on the folder meanwhile (the system releases it if this process
    dies), so a second builder waits and then finds the build done; a lock file that
    `torch.utils.cpp_extension` left behind a builder that died is removed first.  The marker
    naming the built file is written last (whole): a folder without it holds no finished build.
    """
    from torch.utils import cpp_extension  # noqa: PLC0415 - heavy; only here

    cpp_extension.verify_ninja_availability()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        mark = build_dir / DONE_MARK
        if mark.exists() and Path(mark.read_text().strip()).exists():
            return Path(mark.read_text().strip())
        (build_dir / "lock").unlink(missing_ok=True)  # torch's own lock, left by a builder that died
        text = source_text()
        src = build_dir / SOURCE
        if not src.exists() or src.read_text() != text:
            src.write_text(text)
        module = cpp_extension.load(name=name, sources=[str(src)], build_directory=str(build_dir),
                                    extra_cflags=["-O2"], with_cuda=False, verbose=False)
        path = Path(module.__file__)
        tmp = build_dir / f".{DONE_MARK}.{os.getpid()}"
        tmp.write_text(str(path))
        os.replace(tmp, mark)
        return path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m datapath._runtime.native_build NAME BUILD_DIR", file=sys.stderr)
        return 2
    try:
        print(build_here(argv[0], Path(argv[1])))
    except Exception as exc:  # noqa: BLE001 - reported to the parent on stderr, last line
        lines = str(exc).strip().splitlines()
        print(f"{type(exc).__name__}: {lines[0] if lines else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
