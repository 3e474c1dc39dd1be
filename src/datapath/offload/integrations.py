"""Schedule hints for Megatron-core's and DeepSpeed's pipeline schedules (SSDTrain Algorithm 5.1).

Pipeline schedules interleave the forwards and backwards of several
micro-batches, so "the last forward" is not "the next backward".  The patches
tell the cache which micro-batch a forward or backward belongs to
(`TensorCache.set_microbatch`), when a backward starts (`begin_backward`), and,
for DeepSpeed, to start loading the last units while the gradient is still
being received (`prefetch_last_module`).  Only a package the program has already
imported is patched (datapath never imports Megatron or DeepSpeed itself: both are
heavy and warn at import); `Patch.restore` puts the original function back.
"""
from __future__ import annotations

import collections
import functools
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("datapath.offload.integrations")


class ScheduleHints(Protocol):
    """What the patched schedules call (a `TensorCache` is one)."""

    def set_microbatch(self, index: int) -> None: ...

    def begin_backward(self) -> None: ...

    def prefetch_last_module(self) -> None: ...


@dataclass
class Patch:
    """One replaced attribute, and how to put the original back."""

    name: str
    owner: Any
    attr: str
    original: Any

    def restore(self) -> None:
        setattr(self.owner, self.attr, self.original)


def _import(name: str) -> Any | None:
    """``name`` when its top-level package is already imported by the program, else None."""
    if name.split(".")[0] not in sys.modules:
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - not installed, or broken without its GPU stack: leave it alone
        return None


def _patch(owner: Any, attr: str, name: str, make: Any) -> Patch | None:
    original = getattr(owner, attr, None)
    if original is None:
        return None
    setattr(owner, attr, functools.wraps(original)(make(original)))
    return Patch(name, owner, attr, original)


def patch_megatron(cache: ScheduleHints) -> list[Patch]:
    """Wrap ``megatron.core.pipeline_parallel.schedules.forward_step``/``backward_step``.

    Megatron runs the backwards of a pipeline stage in the order of its forwards
    (1F1B and its interleaved form), so the micro-batch of a backward is the
    oldest forward not yet backpropagated.
    """
    mod = _import("megatron.core.pipeline_parallel.schedules")
    if mod is None:
        return []
    queue: collections.deque[int] = collections.deque()
    counter = iter(range(1 << 62))

    def fwd(original: Any) -> Any:
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            mb = next(counter)
            queue.append(mb)
            cache.set_microbatch(mb)
            return original(*args, **kwargs)
        return forward_step

    def bwd(original: Any) -> Any:
        def backward_step(*args: Any, **kwargs: Any) -> Any:
            if queue:
                cache.set_microbatch(queue.popleft())
            cache.begin_backward()
            return original(*args, **kwargs)
        return backward_step

    out = [p for p in (_patch(mod, "forward_step", "megatron.forward_step", fwd),
                       _patch(mod, "backward_step", "megatron.backward_step", bwd)) if p is not None]
    if out:
        log.info("patched Megatron-core's pipeline schedule for offload hints")
    return out


def patch_deepspeed(cache: ScheduleHints) -> list[Patch]:
    """Wrap DeepSpeed ``PipelineEngine``'s forward, backward and gradient-receive instructions."""
    mod = _import("deepspeed.runtime.pipe.engine")
    engine = getattr(mod, "PipelineEngine", None) if mod is not None else None
    if engine is None:
        return []

    def fwd(original: Any) -> Any:
        def _exec_forward_pass(self: Any, buffer_id: int) -> Any:
            cache.set_microbatch(buffer_id)
            return original(self, buffer_id)
        return _exec_forward_pass

    def recv(original: Any) -> Any:
        def _exec_recv_grads(self: Any, buffer_id: int) -> Any:
            cache.set_microbatch(buffer_id)
            cache.prefetch_last_module()  # load while the gradient is on its way
            return original(self, buffer_id)
        return _exec_recv_grads

    def bwd(original: Any) -> Any:
        def _exec_backward_pass(self: Any, buffer_id: int) -> Any:
            cache.set_microbatch(buffer_id)
            cache.begin_backward()
            return original(self, buffer_id)
        return _exec_backward_pass

    out = [p for p in (_patch(engine, "_exec_forward_pass", "deepspeed._exec_forward_pass", fwd),
                       _patch(engine, "_exec_recv_grads", "deepspeed._exec_recv_grads", recv),
                       _patch(engine, "_exec_backward_pass", "deepspeed._exec_backward_pass", bwd))
           if p is not None]
    if out:
        log.info("patched DeepSpeed's PipelineEngine for offload hints")
    return out


def patch_schedules(cache: ScheduleHints) -> list[Patch]:
    """Every patch that applies here (none when neither package imports); `restore_patches` undoes them."""
    return patch_megatron(cache) + patch_deepspeed(cache)


def restore_patches(patches: list[Patch]) -> None:
    """Put the original functions back, last patch first."""
    while patches:
        patches.pop().restore()
