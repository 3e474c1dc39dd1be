"""Starting and joining a data-parallel job: torchrun's variables, or processes spawned by `launch`.

    ctx = init_distributed()                      # under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)
    results = launch(fn, nprocs=2, args=(cfg,))   # or: spawn the job's processes from here

Each process calls `init_distributed`, which joins the process group (NCCL on GPUs,
gloo on CPUs) and makes SIGTERM unwind through the interpreter's normal shutdown, so
shared tables and offload files are removed.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import pickle
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from datapath._runtime.cuda_sched import use_blocking_sync
from datapath._runtime.device import require_cuda
from datapath._runtime.errors import DatapathError
from datapath._runtime.reaper import Reaper
from datapath.apps.errors import DistributedError

log = logging.getLogger("datapath.apps.launch")

PREFIX_ENV = "DATAPATH_SHARE_PREFIX"
T = TypeVar("T")


# -- process group -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job.

    ``device``: ``cuda:<local_rank>`` on a GPU machine, else ``cpu``; ``backend``: nccl or gloo.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op with one process)."""
        if self.world_size > 1:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    try:
        return default if v in (None, "") else int(v)
    except ValueError as exc:
        raise DistributedError(f"environment variable {name}={v!r} is not an integer") from exc


def in_launched_job() -> bool:
    """True inside a process started by torchrun or `launch` (RANK, WORLD_SIZE and LOCAL_RANK are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(device: str | None = None, backend: str | None = None,
                     timeout_s: float = 1800.0) -> DistContext:
    """Join the job described by RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun's variables).

    Without them: a one-process job.  ``device``: ``"cuda"`` (GPU ``LOCAL_RANK``; NCCL)
    or ``"cpu"`` (gloo); default cuda when available.  Also makes SIGTERM exit through
    the interpreter's normal shutdown, so shared tables and offload files are removed.
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if not 0 <= rank < world:
        raise DistributedError(f"RANK={rank} must lie in [0, WORLD_SIZE={world})")
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if use_cuda:
        if not torch.cuda.is_available():
            require_cuda("distributed training with device='cuda'")
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} "
                                   f"GPUs; start at most one process per GPU")
        use_blocking_sync(local_rank)
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    backend = backend or ("nccl" if use_cuda else "gloo")
    _exit_on_sigterm()
    if world > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise DistributedError("MASTER_PORT is not set; start the job with torchrun or datapath's launch()")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return DistContext(rank, world, local_rank, local_world, dev, backend)


_stop_signal: list[int] = []  # the signal that asked this process to stop, once one has


def stop_requested() -> int | None:
    """The signal (SIGTERM / SIGINT) that asked this rank to stop, or None.  Loops call `exit_if_stopped` per step."""
    return _stop_signal[0] if _stop_signal else None


def exit_if_stopped() -> None:
    """Raise ``SystemExit(128 + signal)`` if a stop signal arrived: the handler's own raise can land inside a
    weakref callback or ``__del__``, where Python prints it and carries on; a loop checking here still stops."""
    if _stop_signal:
        raise SystemExit(128 + _stop_signal[0])


def _exit_on_sigterm(also_sigint: bool = False) -> None:
    """Turn SIGTERM (and SIGINT) into one ``SystemExit(128 + signal)`` that unwinds normally.

    The first signal is recorded (`stop_requested`) and raises; later ones are ignored, so a second
    signal cannot interrupt the clean-up (finally blocks, atexit handlers removing shared tables and
    offload files).  Where the raise is swallowed (it arrived inside a weakref callback), the training
    loop's per-step `exit_if_stopped` raises it again.
    """
    signals = (signal.SIGTERM, signal.SIGINT) if also_sigint else (signal.SIGTERM,)

    def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        if not _stop_signal:
            _stop_signal.append(signum)
        raise SystemExit(128 + signum)

    try:
        for sig in signals:
            signal.signal(sig, handler)
    except ValueError:  # not the main thread
        return
    previous = sys.unraisablehook
    if getattr(previous, "_datapath_stop", False):
        return

    def quiet_stop(unraisable: Any) -> None:
        # our SystemExit swallowed in a callback: not an error to print; `exit_if_stopped` raises it again
        if _stop_signal and unraisable.exc_type is SystemExit:
            return
        previous(unraisable)

    quiet_stop._datapath_stop = True  # type: ignore[attr-defined]
    sys.unraisablehook = quiet_stop


def shutdown_distributed() -> None:
    """Leave the process group (if any)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_objects(ctx: DistContext, obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (a one-element list with one process)."""
    if ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def on_every_rank(ctx: DistContext, fn: Callable[[], T], what: str) -> T:
    """``fn()`` on every rank; when it fails on any rank, every rank raises instead of waiting for it.

    The rank that failed raises its own error; the others a `DistributedError` naming the first
    rank that failed and its error (``what`` says what that rank could not do, e.g. "load its
    shard").  Collective: every rank calls it.
    """
    try:
        out, err = fn(), None
    except Exception as exc:  # noqa: BLE001 - told to every rank, raised here
        out, err = None, exc
    said = all_gather_objects(ctx, None if err is None else f"{type(err).__name__}: {_first_line(err)}")
    if err is not None:
        raise err
    failed = [(r, m) for r, m in enumerate(said) if m is not None]
    if failed:
        r, m = failed[0]
        raise DistributedError(f"rank {ctx.rank} of {ctx.world_size} stops: rank {r} could not {what}: {m}")
    return out  # type: ignore[return-value]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_PEER_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out", "timeout",
              "communicator was aborted", "nccl error", "socket", "connection refused")


def rank_error(ctx_rank: int, world_size: int, exc: BaseException) -> DistributedError:
    """``exc`` of rank ``ctx_rank`` as one line naming the rank and the cause (what torchrun's log shows).

    A collective that failed because another rank is gone says so: the rank that died is named
    by its own error, or by torchrun's report of its exit.
    """
    text = _first_line(exc)
    if text.startswith(f"rank {ctx_rank} "):
        return DistributedError(text)
    hint = ""
    if not isinstance(exc, DatapathError) and any(k in text.lower() for k in _PEER_GONE):
        hint = ("; another rank of the job has died or stopped answering: its own error, or torchrun's report of "
                "its exit, names it")
    return DistributedError(f"rank {ctx_rank} of {world_size} failed: {type(exc).__name__}: {text}{hint}")


# -- launching ---------------------------------------------------------------------------------
def _entry(local_rank: int, fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, port: int,
           outdir: str, prefix: str) -> None:
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ[PREFIX_ENV] = prefix
    _exit_on_sigterm(also_sigint=True)  # the launcher forwards both; neither leaves a KeyboardInterrupt mid-exit
    _term_with_parent()
    try:
        result = fn(*args)
        with open(os.path.join(outdir, f"rank{local_rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        _leave_together()
    finally:
        shutdown_distributed()


def _term_with_parent() -> None:
    """Linux: have the kernel send this rank SIGTERM when the launcher dies, SIGKILL included (no orphan ranks)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _leave_together() -> None:
    """Wait for every rank before the group is destroyed: a rank that tears its Gloo pairs down while a peer's last
    collective is still in flight can abort the peer ("terminate called without an active exception").  Only on the
    way out after success: a rank that failed is stopped by the launcher instead."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # DDP/FSDP objects of the finished work release their pending Work handles now
        dist.barrier()


class _Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher while its ranks ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _install_stop_handlers(handler: Any) -> dict[int, Any]:
    """Install ``handler`` for SIGINT and SIGTERM (main thread only); returns the previous handlers."""
    old: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: the caller's own handling stays
            break
    return old


def _stop_children(processes: list[Any], signum: int, grace_period: float) -> None:
    """Send ``signum`` to the live ``processes``, give them ``grace_period`` s, then SIGKILL what is left."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        try:
            os.kill(p.pid, signum)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_period
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            log.warning("rank process %d did not stop within %.0f s of signal %d; killing it", p.pid,
                        grace_period, signum)
            p.kill()
            p.join(5.0)


def launch(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *,
           prefix: str | None = None, grace_period: float = 5.0) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes (spawned) forming one job; return their results by rank.

    Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (as under torchrun; ``fn`` calls `init_distributed`) and
    ``DATAPATH_SHARE_PREFIX`` = ``prefix``, which names the job's shared tables.
    ``fn`` must be importable (a module-level function) and its result picklable.

    Every way out cleans up: the job's shared tables, the launcher's temporary folder and
    PyTorch's per-process error files are removed, and no rank outlives the launcher.  Killed
    outright (SIGKILL), the launcher leaves nothing either: a watchdog (`datapath._runtime.reaper`)
    removes its folder, and rank 0's removes the tables.

    - A rank fails: the others get ``grace_period`` seconds to finish, then SIGTERM, then after
      another ``grace_period`` SIGKILL (a rank blocked in a collective cannot run its SIGTERM
      handler); `DistributedError` names the rank and its exception on its first line, followed
      by every failed rank's traceback.
    - SIGINT or SIGTERM reaches the launcher (alone, or with its process group): it is
      forwarded to every rank, the ranks get ``grace_period`` seconds, then SIGKILL; the launcher
      then raises KeyboardInterrupt (SIGINT) or exits with ``128 + signal`` (SIGTERM).
    """
    import torch.multiprocessing as mp  # noqa: PLC0415
    from torch.multiprocessing.spawn import ProcessException  # noqa: PLC0415

    if nprocs < 1:
        raise DistributedError(f"nprocs must be >= 1, got {nprocs}")
    prefix = prefix or new_prefix()
    outdir = tempfile.mkdtemp(prefix="datapath-launch-")
    reaper = Reaper([outdir])  # the folder goes even when the launcher is killed (SIGKILL)
    pctx = None
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:  # noqa: ARG001
        received.append(signum)
        if len(received) == 1:
            raise _Interrupted(signum)

    old = _install_stop_handlers(on_signal)
    try:
        pctx = mp.start_processes(_entry, args=(fn, args, nprocs, _free_port(), outdir, prefix),
                                  nprocs=nprocs, join=False, start_method="spawn")
        while not pctx.join(timeout=0.5, grace_period=grace_period):
            pass
        results = []
        for r in range(nprocs):
            with open(os.path.join(outdir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    except ProcessException as exc:
        raise DistributedError(_failure_report(pctx, exc, nprocs)) from None
    except _Interrupted as stop:
        log.warning("signal %d: stopping the %d rank processes", stop.signum, nprocs)
        if pctx is not None:
            _stop_children(pctx.processes, stop.signum, grace_period)
        if stop.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise SystemExit(128 + stop.signum) from None
    finally:
        received.append(-1)  # a signal from here on is recorded, not raised: the clean-up must finish
        if pctx is not None:
            _stop_children(pctx.processes, signal.SIGTERM, grace_period)
            for path in pctx.error_files:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        _remove_tables(prefix)
        shutil.rmtree(outdir, ignore_errors=True)
        reaper.fire(wait=False)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _remove_tables(prefix: str) -> None:
    from datapath.unified_tensor import shared_tables, unlink  # noqa: PLC0415

    for name in shared_tables():
        if name.startswith(prefix + "."):
            unlink(name)
            log.debug("removed shared table %s", name)


def _failure_report(pctx: Any, exc: Exception, nprocs: int) -> str:
    """The failing rank and its exception (first line), then what every failed rank said (its traceback)."""
    first = getattr(exc, "error_index", None)
    parts = {}
    for i, path in enumerate(getattr(pctx, "error_files", [])):
        try:
            with open(path, "rb") as f:
                parts[i] = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
    if first is not None and first not in parts:
        parts[first] = str(exc)

    def last_line(r: int) -> str:
        text = parts[r].strip()
        return text.splitlines()[-1] if text else ""

    # a rank that failed on its own comes before ranks that only report another rank's failure
    derived = {r for r in parts if last_line(r).startswith(f"{DistributedError.__module__}.DistributedError")}
    ranks = sorted(parts, key=lambda r: (r in derived, r != first, r))
    if ranks:
        first = ranks[0]
    cause = last_line(first) if first in parts and last_line(first) else str(exc)
    body = "".join(f"\n-- rank {r}:\n{parts[r].strip()}\n" for r in ranks)
    return (f"rank {first} of {nprocs} failed: {cause} (the other ranks were stopped; ranks that raised: "
            f"{', '.join(map(str, sorted(parts)))}){body}")


def new_prefix() -> str:
    """A fresh name prefix for one job's shared tables."""
    return f"job{os.getpid()}-{secrets.token_hex(3)}"
