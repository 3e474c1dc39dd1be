"""Compile every CUDA source in src/datapath/kernels with NVRTC, as datapath does at run time.

Needs no GPU: `pip install cuda-bindings nvidia-cuda-nvrtc`, then
    PYTHONPATH=src python scripts/nvrtc_check.py [NAME.cu ...]
Exits non-zero and prints the compiler log for any source that fails.
"""
from __future__ import annotations

import sys

from cuda.bindings import nvrtc

from datapath.kernels import kernel_files, kernel_source


def compile_one(name: str, arch: str = "sm_90") -> str | None:
    src = kernel_source(name).encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, name.encode(), 0, [], [])
    opts = [b"--std=c++17", f"--gpu-architecture={arch}".encode()]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return log.decode(errors="replace")
    return None


def main() -> int:
    names = sys.argv[1:] or kernel_files()
    failed = 0
    for name in names:
        log = compile_one(name)
        print(f"{name}: {'ok' if log is None else 'FAILED'}")
        if log:
            print(log)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
