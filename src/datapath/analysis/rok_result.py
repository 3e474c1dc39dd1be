"""Results of a ROK sweep: points, the efficient frontier, the best point under a budget, tables and plots."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_MARKERS = "os^vD<>ph*"

@dataclass
class RokPoint:
    """One run: a strategy at a micro-batch size. Bytes are bytes, times seconds, FLOP/s per second."""

    strategy: str
    micro_batch: int
    status: str  # "ok", "oom", "skipped" or "error"
    step_time_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    activation_peak_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    baseline_bytes: int | None = None
    flops_per_step: float | None = None
    throughput_flops: float | None = None
    samples_per_s: float | None = None
    activation_estimate_bytes: float | None = None  # what autograd saves (ssd-plan's count)
    stored_estimate_bytes: float | None = None  # offload strategies: what the offloader stores (ssd-plan's count)
    bytes_offloaded_per_step: float | None = None
    offload_stats: dict[str, Any] | None = None  # the offloader's counters at the end of the point
    offload_stats_per_step: dict[str, float] | None = None  # counter increments per measured step
    memory_measure: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _frontier(points: Sequence[RokPoint]) -> list[RokPoint]:
    """Pareto-efficient points: no other point has a lower-or-equal peak and a higher throughput."""
    ok = sorted((p for p in points if p.ok), key=lambda p: (p.activation_peak_bytes, -(p.throughput_flops or 0)))
    out: list[RokPoint] = []
    best = -math.inf
    for p in ok:
        if (p.throughput_flops or 0.0) > best:
            out.append(p)
            best = p.throughput_flops or 0.0
    return out


@dataclass
class RokResult:
    """All points of a sweep, with the workload and machine they ran on."""

    workload: dict[str, Any]
    device: str
    dtype: str
    points: list[RokPoint]
    settings: dict[str, Any] = field(default_factory=dict)

    def frontier(self) -> list[RokPoint]:
        return _frontier(self.points)

    def best_under(self, budget_bytes: float) -> RokPoint | None:
        """The fastest point whose activation peak fits in ``budget_bytes``, or None."""
        fits = [p for p in self.points if p.ok and (p.activation_peak_bytes or 0) <= budget_bytes]
        return max(fits, key=lambda p: p.throughput_flops or 0.0, default=None)

    def point(self, strategy: str, micro_batch: int) -> RokPoint | None:
        return next((p for p in self.points if p.strategy == strategy and p.micro_batch == micro_batch), None)

    def to_dict(self, budget_bytes: float | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "workload": self.workload,
            "device": self.device,
            "dtype": self.dtype,
            "settings": self.settings,
            "points": [asdict(p) for p in self.points],
            "frontier": [{"strategy": p.strategy, "micro_batch": p.micro_batch} for p in self.frontier()],
        }
        if budget_bytes is not None:
            best = self.best_under(budget_bytes)
            doc["budget_bytes"] = budget_bytes
            doc["best_under_budget"] = None if best is None else asdict(best)
        return doc

    def table_rows(self) -> list[dict[str, Any]]:
        """One row per point: strategy, micro-batch, status, activation peak (GB), step (s), TFLOP/s..."""
        front = {(p.strategy, p.micro_batch) for p in self.frontier()}
        rows = []
        for p in self.points:
            rows.append({
                "strategy": p.strategy,
                "mb": p.micro_batch,
                "status": p.status,
                "act_peak_GB": None if p.activation_peak_bytes is None else p.activation_peak_bytes / 1e9,
                "step_s": p.step_time_s,
                "TFLOP/s": None if p.throughput_flops is None else p.throughput_flops / 1e12,
                "offloaded_GB": None if p.bytes_offloaded_per_step is None else p.bytes_offloaded_per_step / 1e9,
                "frontier": "*" if (p.strategy, p.micro_batch) in front else "",
            })
        return rows

    def format_table(self, budget_bytes: float | None = None) -> str:
        """The points as an aligned text table, and the best strategy under the budget."""
        text = format_rows(self.table_rows())
        if budget_bytes is not None:
            best = self.best_under(budget_bytes)
            if best is None:
                text += f"\nno point fits an activation budget of {budget_bytes / 1e9:.3g} GB"
            else:
                assert best.throughput_flops is not None and best.activation_peak_bytes is not None
                text += (f"\nbest under {budget_bytes / 1e9:.3g} GB: {best.strategy} at micro-batch "
                         f"{best.micro_batch} ({best.throughput_flops / 1e12:.4g} TFLOP/s, activation peak "
                         f"{best.activation_peak_bytes / 1e9:.3g} GB)")
        return text

    def plot_on(self, ax: Any, budget_bytes: float | None = None, title: str | None = None) -> None:
        """Draw the ROK curve on a matplotlib axis: x activation peak (GB), y model TFLOP/s,
        one marker per strategy, micro-batches annotated, the efficient frontier dashed."""
        markers = dict(zip(dict.fromkeys(p.strategy for p in self.points), _MARKERS))
        for strat in dict.fromkeys(p.strategy for p in self.points):
            pts = [p for p in self.points if p.strategy == strat and p.ok]
            if not pts:
                continue
            xs = [p.activation_peak_bytes / 1e9 for p in pts]  # type: ignore[operator]
            ys = [p.throughput_flops / 1e12 for p in pts]  # type: ignore[operator]
            ax.scatter(xs, ys, marker=markers.get(strat, "o"), s=50, label=strat, alpha=0.85)
            for p, x, y in zip(pts, xs, ys):
                ax.annotate(f"b{p.micro_batch}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        front = self.frontier()
        if front:
            fx = [p.activation_peak_bytes / 1e9 for p in front]  # type: ignore[operator]
            fy = [p.throughput_flops / 1e12 for p in front]  # type: ignore[operator]
            ax.step(fx, fy, where="post", linestyle="--", color="gray", linewidth=1, label="efficient frontier")
        if budget_bytes is not None:
            ax.axvline(budget_bytes / 1e9, color="red", linewidth=0.8, linestyle=":", label="budget")
        ax.set_xlabel("activation memory peak (GB)")
        ax.set_ylabel("model throughput (TFLOP/s)")
        ax.set_title(title or f"ROK curve: {self.workload.get('name', '')} on {self.device}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    def plot(self, path: str | Path, budget_bytes: float | None = None, title: str | None = None) -> Path:
        """Save the ROK curve (`plot_on`) as a PNG at ``path``."""
        from datapath._runtime.optional import require  # noqa: PLC0415

        matplotlib = require("matplotlib", extra="plot", purpose="plotting a ROK curve")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, ax = plt.subplots(figsize=(7.5, 5))
        self.plot_on(ax, budget_bytes, title)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """``rows`` (dicts with the same keys) as an aligned text table."""
    if not rows:
        return "(no points)"
    cols = list(rows[0])

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)
