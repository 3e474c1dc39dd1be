"""Hugging Face `transformers.Trainer`: activation offloading as one callback.

    from datapath.integrations import HFOffloadCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[HFOffloadCallback(memory_budget="10GB")])
    trainer.train()

The callback keeps one offload cache for the whole of ``train()``: it is attached to the
model at ``on_train_begin``, its saved-tensor hooks are on from ``on_step_begin`` (before
the first micro-batch's forward) to ``on_pre_optimizer_step`` (after the last one's
backward), and it is closed at ``on_train_end``.  Gradients are bit-identical to training
without it.  Should ``train()`` raise, call `HFOffloadCallback.close` (or use the callback
in a ``with`` block) so that no hook outlives the run.
"""
from __future__ import annotations

from typing import Any

from datapath._runtime.optional import require
from datapath.integrations.session import OffloadSession
from datapath.offload import TensorCache

_trainer_callback = require("transformers.trainer_callback", extra="hf",
                            purpose="datapath.integrations.HFOffloadCallback (Hugging Face Trainer)")


class HFOffloadCallback(_trainer_callback.TrainerCallback):  # type: ignore[misc, name-defined]
    """A `transformers.TrainerCallback` that offloads the model's activations in every training step.

    Arguments are `datapath.offload.offload`'s (``target``, ``path``, ``memory_budget``,
    ``policy``, ``units``, `TensorCache` options) or ``cache=``; see `OffloadSession`.
    After training, ``callback.cache`` (its ``stats``, ``plan``) is kept for inspection.
    """

    def __init__(self, target: str = "host", path: str | None = None, **kwargs: Any) -> None:
        self.session = OffloadSession(target, path, **kwargs)

    @property
    def cache(self) -> TensorCache | None:
        """The offload cache (None before training starts)."""
        return self.session.cache

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise RuntimeError("HFOffloadCallback: the Trainer passed no model to on_train_begin")
        self.session.start(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step_begin()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step_end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step_end()  # Trainers without on_pre_optimizer_step; a no-op otherwise

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.finish()

    def close(self) -> None:
        """End the session after a failed ``train()`` (hooks off, model detached, cache closed)."""
        self.session.finish(raise_errors=False)

    def __enter__(self) -> "HFOffloadCallback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.session.finish(raise_errors=exc[0] is None)
