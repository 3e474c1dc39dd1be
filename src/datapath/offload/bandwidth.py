"""The store's bandwidth, as the policies see it: measured transfers once there are enough, else a probe.

`StoreBandwidth.start_probe` writes and reads a few MB through the store once, in the
store's worker thread, before any activation is queued; `StoreBandwidth.now` prefers the
cache's measured transfers (`OffloadStats`) once 256 MB have moved each way, unless a
``source`` was set (``cache.bandwidth = lambda: (w, r)``: a known disk, or a test).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from datapath.offload.stats import OffloadStats
from datapath.offload.store import Store, Streams

log = logging.getLogger("datapath.offload.cache")

MEASURED_BYTES = 256 << 20  # below this many bytes moved, the probe's figure is preferred


class StoreBandwidth:
    """(write, read) bytes/s of the store, from ``stats`` (the cache's counters) and a probe."""

    def __init__(self, stats: OffloadStats) -> None:
        self.stats = stats
        self.probe: tuple[float, float] | None = None
        self.probe_done = threading.Event()
        self.source: Callable[[], tuple[float, float]] | None = None  # set: what `now` returns instead

    def now(self) -> tuple[float, float]:
        """(write, read) bytes/s: measured transfers once there are some, else the probe (else 1 GB/s)."""
        if self.source is not None:
            return self.source()
        st = self.stats
        w, r = st.write_bandwidth, st.read_bandwidth
        pw, pr = self.probe if self.probe is not None else (0.0, 0.0)
        if st.bytes_offloaded + st.bytes_written_partial < MEASURED_BYTES:
            w = pw or w
        if st.bytes_loaded < MEASURED_BYTES:
            r = pr or r
        return (w or 1e9, r or w or 1e9)

    def probed(self, wait: float = 0.0) -> tuple[float | None, float | None]:
        """The probe's (write, read) (None when it did not run or failed); waits up to ``wait`` s for it."""
        if wait > 0:
            self.probe_done.wait(wait)
        return self.probe if self.probe is not None else (None, None)

    def start_probe(self, store: Store, nbytes: int, device: torch.device,
                    streams_for: Callable[[torch.device], Streams],
                    submit: Callable[[str, Callable[[], None]], None]) -> None:
        """Measure ``store`` with ``nbytes`` once, by a job given to ``submit`` (the store's worker)."""
        if nbytes <= 0:
            self.probe_done.set()
            return
        cuda = device.type == "cuda"

        def job() -> None:
            try:
                if cuda:
                    torch.cuda.set_device(device)
                streams = streams_for(device) if cuda else None
                self.probe = store.probe(nbytes, streams)
                log.debug("%s store probe: write %.2f GB/s, read %.2f GB/s", store.kind,
                          self.probe[0] / 1e9, self.probe[1] / 1e9)
            except (OSError, RuntimeError) as exc:  # a full disk must not fail training: plan on measurements
                log.info("%s store bandwidth probe failed (%s); using measured transfers", store.kind, exc)
            finally:
                self.probe_done.set()
        submit(store.kind, job)
