"""``offload(model, ...)``: the one-line way to offload a model's activations."""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from datapath.offload.cache import TensorCache


@contextlib.contextmanager
def offload(model: nn.Module | None = None, target: str = "host", path: str | None = None, *,
            policy: str = "all", min_bytes: int = 1 << 20, keep_last_modules: int = 1,
            units: Iterable[nn.Module] | str | None = None, cache: TensorCache | None = None,
            on_error: str = "raise", offload_cpu_tensors: bool = False,
            host_budget_bytes: int | None = None, max_disk_bytes: int | None = None,
            engine: str = "auto", verify: bool = False,
            schedule_hints: bool = True, **options: Any) -> Iterator[TensorCache]:
    """Offload the activations autograd saves inside the ``with`` block.

    ::

        with offload(model, target="ssd", path="/nvme/act", policy="adaptive") as cache:
            for batch in loader:
                loss = model(batch).loss
                loss.backward()
                opt.step(); opt.zero_grad()
        print(cache.stats.bytes_offloaded)

    Keep the block around the whole training loop (or pass the same ``cache=``
    to each block): the adaptive policy profiles the first step and plans the
    next ones.  ``model`` gets the scope hooks (units: the blocks of its largest
    ``ModuleList``/``Sequential``; ``"leaves"``: every module owning parameters, the lower
    peak on transformer stacks; or a list) and its parameters
    and buffers are never offloaded.  The options are `TensorCache`'s
    (``on_error``, ``offload_cpu_tensors``, ``host_budget_bytes``, ``max_disk_bytes``,
    ``engine``, ``verify``; more in ``options``: ``prefetch_distance``, ``io_threads``, ...).  A cache made here is closed at the end of the
    block; with ``cache=`` the caller closes it.  ``schedule_hints`` patches
    Megatron-core's and DeepSpeed's pipeline schedules when they are importable.
    """
    own = cache is None
    if cache is None:
        cache = TensorCache(target=target, path=path, policy=policy, min_bytes=min_bytes,
                            keep_last_modules=keep_last_modules, on_error=on_error,
                            offload_cpu_tensors=offload_cpu_tensors, host_budget_bytes=host_budget_bytes,
                            max_disk_bytes=max_disk_bytes, engine=engine, verify=verify, **options)
    elif options:
        raise TypeError(f"options {sorted(options)} are for a new TensorCache; not allowed with cache=")
    attached = False
    try:
        if model is not None:
            cache.attach(model, units=units)
            attached = True
        if schedule_hints and own:
            cache.patch_schedules()
        with cache:
            yield cache
        cache.wait_io()
    finally:
        if attached and not own:
            cache.detach(model)
        if own:
            import sys  # noqa: PLC0415

            cache.close(raise_errors=sys.exc_info()[0] is None)
