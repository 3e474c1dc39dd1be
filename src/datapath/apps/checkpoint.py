"""``train-gnn --save DIR`` / ``--resume DIR``: the training state after an epoch, and a run continued from it.

``DIR/checkpoint.pt`` holds the model's and optimizer's state, the last finished epoch, the
per-epoch history, the job's configuration and every random state the next epoch draws from
(torch on the CPU and each CUDA device, numpy, Python's ``random``; one set per rank).  The
loaders' shuffles and samples are seeded by (seed, epoch), so a resumed run repeats the
uninterrupted one exactly where the arithmetic is deterministic (always on the CPU).  The file
is written to a temporary name and renamed: an interrupted save leaves the previous one.
"""
from __future__ import annotations

import os
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datapath._runtime.errors import DatapathError

FILE = "checkpoint.pt"
FORMAT = 1
#: Settings that must match between the saved run and the resumed one (they shape the model or its data).
MUST_MATCH = ("dataset", "model", "fanouts", "hidden", "heads", "optimizer", "seed", "batch_size")


class CheckpointError(DatapathError, ValueError):
    """A checkpoint directory is missing, unreadable, or from a job that cannot be continued with these settings."""


def rng_state() -> dict[str, Any]:
    """Every random state a training epoch draws from, in this process."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
         history: list[dict[str, Any]], config: Any, rng: list[dict[str, Any]]) -> Path:
    """Write ``directory/checkpoint.pt`` after epoch ``epoch`` (``rng``: one `rng_state` per rank)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / FILE
    tmp = d / f".{FILE}.tmp-{os.getpid()}"
    doc = {"format": FORMAT, "epoch": int(epoch), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
           "history": history, "config": asdict(config), "rng": rng}
    try:
        torch.save(doc, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load(directory: str | Path, config: Any) -> dict[str, Any]:
    """The checkpoint in ``directory``, checked against ``config`` (the settings in `MUST_MATCH` must agree)."""
    path = Path(directory) / FILE
    if not path.is_file():
        raise CheckpointError(f"--resume {directory}: there is no {FILE} in it (written by train-gnn --save DIR)")
    try:
        doc = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - unpickling raises anything
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc}); it is truncated or not a "
                              f"train-gnn checkpoint") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a train-gnn checkpoint of format {FORMAT}")
    mine = asdict(config)
    diff = [f"{k}: saved {doc['config'].get(k)!r}, now {mine.get(k)!r}" for k in MUST_MATCH
            if _norm(doc["config"].get(k)) != _norm(mine.get(k))]
    if diff:
        raise CheckpointError(f"{path} is from another job ({'; '.join(diff)}); resume with the saved settings")
    return doc


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def resume_into(directory: str | Path, config: Any, ctx: Any, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, loaders: list[Any]) -> tuple[int, list[dict[str, Any]]]:
    """Load the checkpoint into ``model`` / ``optimizer``, set the ``loaders`` and random states to the next
    epoch; returns (that epoch, the history so far).  Call it last before the epoch loop."""
    doc = load(directory, config)
    model.load_state_dict(doc["model"])
    optimizer.load_state_dict(doc["optimizer"])
    start = int(doc["epoch"]) + 1
    for loader in loaders:
        if loader is not None:
            loader.set_epoch(start)
    rngs = doc["rng"]
    set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world_size else rngs[0])
    return start, list(doc["history"])


def save_epoch(directory: str | Path, config: Any, ctx: Any, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer, epoch: int, history: list[dict[str, Any]]) -> None:
    """Every rank's random states gathered; rank 0 writes the checkpoint after ``epoch``."""
    from datapath.apps.launch import all_gather_objects  # noqa: PLC0415

    rngs = all_gather_objects(ctx, rng_state())
    if ctx.is_main:
        save(directory, model=model, optimizer=optimizer, epoch=epoch, history=history, config=config, rng=rngs)
