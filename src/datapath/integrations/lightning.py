"""PyTorch Lightning: activation offloading as one callback.

    from datapath.integrations import LightningOffloadCallback
    trainer = lightning.Trainer(callbacks=[LightningOffloadCallback(memory_budget="10GB")])
    trainer.fit(module, loader)

One offload cache for the whole fit: attached to the `LightningModule` at
``on_train_start``, its saved-tensor hooks on from ``on_train_batch_start`` to
``on_train_batch_end`` (the batch's forward, backward and optimizer step), closed at
``on_train_end`` or when the fit raises (``on_exception``).  Works with ``lightning`` and
with the older ``pytorch_lightning`` package.

The cache watches the forward of one module (a step begins when it is called): the
`LightningModule` itself where it defines ``forward`` and ``training_step`` calls
``self(...)``; otherwise its one child module (``self.model = ...``), or the one named by
``module="model"``.
"""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from datapath._runtime.optional import require
from datapath.integrations.session import OffloadSession
from datapath.offload import TensorCache


def _callback_base() -> Any:
    try:
        return importlib.import_module("lightning.pytorch").Callback
    except ImportError:
        pass
    try:
        return importlib.import_module("pytorch_lightning").Callback
    except ImportError:
        pass
    return require("lightning.pytorch", extra="lightning",
                   purpose="datapath.integrations.LightningOffloadCallback").Callback


class LightningOffloadCallback(_callback_base()):  # type: ignore[misc]
    """A Lightning `Callback` that offloads the module's activations in every training batch.

    Arguments are `datapath.offload.offload`'s (``target``, ``path``, ``memory_budget``,
    ``policy``, ``units``, `TensorCache` options) or ``cache=``; see `OffloadSession`.
    """

    def __init__(self, target: str = "host", path: str | None = None, *, module: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.session = OffloadSession(target, path, **kwargs)

    def watched(self, pl_module: nn.Module) -> nn.Module:
        """The module whose forward is a training step's forward (see the module docstring)."""
        if self.module is not None:
            m: Any = pl_module
            for part in self.module.split("."):
                m = getattr(m, part, None)
            if not isinstance(m, nn.Module):
                raise ValueError(f"LightningOffloadCallback(module={self.module!r}): {type(pl_module).__name__} has "
                                 f"no submodule of that name")
            return m
        if "forward" in {k for c in type(pl_module).__mro__ if c.__module__.split(".")[0] not in
                         ("lightning", "pytorch_lightning", "torch") for k in vars(c)}:
            return pl_module
        children = [c for c in pl_module.children() if any(True for _ in c.parameters())]
        if len(children) != 1:
            raise ValueError(f"LightningOffloadCallback: {type(pl_module).__name__} defines no forward and has "
                             f"{len(children)} child modules with parameters; name the one training_step calls "
                             f"with module=\"...\"")
        return children[0]

    @property
    def cache(self) -> TensorCache | None:
        """The offload cache (None before training starts)."""
        return self.session.cache

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.session.start(self.watched(pl_module))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.session.step_begin()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.session.step_end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.finish(raise_errors=False)
