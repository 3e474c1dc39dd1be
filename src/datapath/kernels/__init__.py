"""The CUDA sources of datapath (``*.cu``, ``*.cuh`` beside this file), compiled at run time with NVRTC.

    from datapath.kernels import kernel_files, kernel_source
    kernel_files()                 # ["aggregate.cu", "gather.cu", ...]
    kernel_source("gather.cu")     # the text NVRTC compiles: prelude + the file, local headers inlined

Nothing here needs a GPU; ``scripts/nvrtc_check.py`` compiles every source as the GPU machine will.
"""
from __future__ import annotations

import importlib.resources

from datapath._runtime.kernels import kernel_source


def kernel_files() -> list[str]:
    """Names of the CUDA sources (``*.cu``) shipped in this package, sorted."""
    return sorted(p.name for p in importlib.resources.files(__name__).iterdir() if p.name.endswith(".cu"))


__all__ = ["kernel_files", "kernel_source"]
