"""``offload(model, ...)``: the one-line way to offload a model's activations."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from datapath.offload.cache import TensorCache
from datapath.offload.errors import OffloadConfigError
from datapath.offload.integrations import patch_schedules, restore_patches


@contextlib.contextmanager
def offload(model: nn.Module | None = None, target: str = "host", path: str | None = None, *,
            memory_budget: int | float | str | None = None, policy: str | None = None,
            units: Iterable[nn.Module] | str | None = None, cache: TensorCache | None = None,
            on_error: str = "raise", schedule_hints: bool = True, **options: Any) -> Iterator[TensorCache]:
    """Offload the activations autograd saves inside the ``with`` block.

    ::

        with offload(model, memory_budget="10GB") as cache:        # fit each step in 10 GB
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                opt.step(); opt.zero_grad()

        with offload(model, target="ssd", path="/nvme/act"):         # everything to disk
            ...

    ``memory_budget``: the step's peak device memory, in bytes, a string (``"10GB"``,
    ``"12GiB"``) or a fraction of device memory (``0.5``): the first steps are profiled,
    then every saved storage and every block is kept, offloaded (to ``target``) or
    recomputed, whichever fits the budget fastest.  Without a budget, ``policy="all"``
    (default) offloads everything, as fast as the store drains it, and
    ``policy="adaptive"`` offloads what the measured bandwidth hides.

    Keep the block around the whole training loop (or pass the same ``cache=`` to each
    block): planning uses the steps before.  ``model`` gets the scope hooks (``units``:
    ``"leaves"``, every module owning parameters, or ``"blocks"``, the layers of its
    largest ``ModuleList``; or a list) and its parameters and buffers are never
    offloaded.  Other options are `TensorCache`'s (``min_bytes``, ``host_budget_bytes``,
    ``max_disk_bytes``, ``engine``, ``verify``, ``offload_cpu_tensors``...).  A cache made
    here is closed at the end of the block; with ``cache=`` the caller closes it.
    ``schedule_hints`` patches Megatron-core's and DeepSpeed's pipeline schedules
    (when the program imported them) so the cache knows each micro-batch.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise OffloadConfigError(f"offload(model=...) takes the torch.nn.Module whose activations are offloaded, got "
                                 f"{type(model).__name__} {model!r:.60}; pass the model itself (or None for no "
                                 f"module hooks): offload(model, target={target!r})")
    own = cache is None
    if cache is None:
        cache = TensorCache(target=target, path=path, policy=policy, memory_budget=memory_budget,
                            on_error=on_error, **options)
    elif options or memory_budget is not None or policy is not None:
        raise TypeError("options, policy and memory_budget are for a new TensorCache; not allowed with cache=")
    attached = False
    patches: list[Any] = []
    try:
        if model is not None:
            cache.attach(model, units=units)
            attached = True
        if schedule_hints and own:
            patches = patch_schedules(cache)
        with cache:
            yield cache
        cache.wait_io()
    finally:
        restore_patches(patches)
        if attached and not own:
            cache.detach(model)
        if own:
            cache.close(raise_errors=sys.exc_info()[0] is None)
