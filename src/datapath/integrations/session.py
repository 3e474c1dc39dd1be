"""`OffloadSession`: one offload cache kept across the steps of a training loop someone else runs.

`datapath.offload.offload` is a ``with`` block around a loop you write.  A trainer
(Hugging Face `Trainer`, Lightning) runs the loop itself and tells callbacks when a
step begins and ends; the session turns those calls into the same thing: one
`TensorCache` built and attached to the model when training starts, its saved-tensor
hooks active from each step's start to its end (forward and backward of every
micro-batch), and closed when training ends.  Because the cache lives across steps,
``memory_budget=`` plans each step from the steps before, exactly as in a ``with`` block.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch import nn

from datapath.offload import TensorCache, patch_schedules, restore_patches

log = logging.getLogger("datapath.integrations")


class OffloadSession:
    """A `TensorCache` for a trainer's loop: `start` (attach), `step_begin`/`step_end` (hooks on/off), `finish`.

    Arguments are `datapath.offload.offload`'s: ``target`` (``"host"``, ``"ssd"``, ``"tiered"``),
    ``path`` (directory for files), ``memory_budget`` (bytes, ``"10GB"``, or a fraction of the
    GPU), ``policy``, ``units``, ``on_error``, ``schedule_hints`` and `TensorCache` options
    (``min_bytes=``, ``compile=``, ``offload_cpu_tensors=``...); or ``cache=``, a cache you
    built and close yourself.
    """

    def __init__(self, target: str = "host", path: str | None = None, *,
                 memory_budget: int | float | str | None = None, policy: str | None = None,
                 units: Iterable[nn.Module] | str | None = None, cache: TensorCache | None = None,
                 on_error: str = "raise", schedule_hints: bool = True, **options: Any) -> None:
        if cache is not None and (options or memory_budget is not None or policy is not None):
            raise TypeError("options, policy and memory_budget are for a new TensorCache; not allowed with cache=")
        self._kwargs = dict(target=target, path=path, policy=policy, memory_budget=memory_budget,
                            on_error=on_error, **options)
        self.units = units
        self.schedule_hints = schedule_hints
        self.cache: TensorCache | None = cache
        self._own = cache is None
        self._model: nn.Module | None = None
        self._patches: list[Any] = []
        self._active = False
        self.steps = 0

    @property
    def active(self) -> bool:
        """True between `step_begin` and `step_end` (the saved-tensor hooks are on this thread's stack)."""
        return self._active

    def start(self, model: nn.Module) -> TensorCache:
        """Build the cache (unless one was given) and attach it to ``model``; a second call with the same
        model does nothing, with another model it moves the cache over."""
        if self.cache is None or self.cache.closed:
            if not self._own and self.cache is not None:
                raise RuntimeError("the cache= given to this session is closed; pass an open one")
            self.cache = TensorCache(**self._kwargs)
            self._own = True
        if self._model is model:
            return self.cache
        if self._model is not None:
            self.cache.detach(self._model)
        self.cache.attach(model, units=self.units)
        self._model = model
        if self.schedule_hints and self._own and not self._patches:
            self._patches = patch_schedules(self.cache)
        log.debug("offload session attached to %s", model.__class__.__name__)
        return self.cache

    def step_begin(self) -> None:
        """A training step starts: route what autograd saves through the cache (idempotent)."""
        if self.cache is None:
            raise RuntimeError("OffloadSession.step_begin before start(model): the trainer did not report its model")
        if self._active:
            return
        self.cache.__enter__()
        self._active = True

    def step_end(self) -> None:
        """The step's backward is done: saved tensors are no longer routed through the cache (idempotent)."""
        if not self._active:
            return
        assert self.cache is not None
        self._active = False
        self.cache.__exit__(None, None, None)
        self.steps += 1

    def finish(self, raise_errors: bool = True) -> None:
        """Training ended: hooks off, patches undone, model detached; the cache closed if this session built it.

        ``raise_errors=False`` (after the trainer failed): a pending store error is not raised again.
        """
        self.step_end()
        restore_patches(self._patches)
        cache, model, self._model = self.cache, self._model, None
        if cache is None:
            return
        if self._own:
            cache.close(raise_errors=raise_errors)
        else:
            if model is not None:
                cache.detach(model)
            if raise_errors:
                cache.wait_io()
