"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot state).

``draw_plots(report, rankings, logs) -> {name: png bytes}``; a figure whose inputs are missing is
left out. Names: ``capability`` (base vs tuned with the interval), ``clusters`` (signed influence
by cluster), ``scores`` (per-example score distribution, accused cluster highlighted), ``training``
(loss and grad-norm curves with the steps the dynamics checks flagged).

``rankings`` is a DataFrame with at least ``score`` and, for highlighting, ``cluster``.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Mapping, Sequence

from gradian.redact import terminal_safe
from gradian.report.schema import Capability, ClusterRow, Report, ReportFinding

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from gradian.runs import TrainingLogs

__all__ = ["PLOT_NAMES", "draw_plots", "flagged_steps"]

PLOT_NAMES = ("capability", "clusters", "scores", "training")
_HARM, _HELP, _REST, _FLAG = "#c0392b", "#2e86c1", "#95a5a6", "#e67e22"


def _label(text: object) -> str:
    """A user's string as plot text: control characters shown as escapes, ``$`` kept literal
    (matplotlib would read ``$...$`` as mathtext)."""
    return terminal_safe(text).replace("$", r"\$")


def _figure(width: float = 7.0, height: float = 3.6) -> "Figure":
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig: "Figure") -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _capability_plot(cap: Capability) -> bytes:
    fig = _figure(5.5, 3.4)
    ax = fig.add_subplot()
    base, tuned = float(cap.base), float(cap.tuned)
    lo, hi = (cap.ci or [cap.delta, cap.delta])[:2]
    ax.bar(["base", "tuned"], [base, tuned], color=[_REST, _HARM if tuned < base else _HELP], width=0.55)
    # the interval is on the delta; drawn on the tuned bar as base + [lo, hi]
    ax.errorbar([1], [tuned], yerr=[[max(0.0, tuned - (base + lo))], [max(0.0, base + hi - tuned)]],
                color="black", capsize=8, lw=1.5)
    ax.axhline(base, color=_REST, ls=":", lw=1)
    ax.set_ylabel(_label(cap.metric))
    ax.set_title(f"{_label(cap.name)}: delta {cap.delta:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}] "
                 f"({cap.status})", fontsize=9)
    return _png(fig)


def _clusters_plot(clusters: Sequence[ClusterRow], accused: str | None) -> bytes:
    rows = list(clusters)[:15]
    fig = _figure(7.0, max(2.2, 0.38 * len(rows) + 1.0))
    ax = fig.add_subplot()
    names = [_label(f"{c.cluster}: {str(c.label)[:40]}" if c.label else c.cluster) for c in rows][::-1]
    values = [float(c.signed_influence) for c in rows][::-1]
    colors = [_HARM if str(c.cluster) == accused else (_REST if c.signed_influence < 0 else _HELP)
              for c in rows][::-1]
    ax.barh(names, values, color=colors)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("signed influence (negative = degraded the capability)")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title("Influence by cluster", fontsize=10)
    return _png(fig)


def _scores_plot(rankings: pd.DataFrame, accused: str | None) -> bytes:
    import numpy as np

    fig = _figure(7.0, 3.4)
    ax = fig.add_subplot()
    scores = np.asarray(rankings["score"], dtype=float)
    bins = np.histogram_bin_edges(scores, bins=min(60, max(10, len(scores) // 5)))
    if accused is not None and "cluster" in rankings:
        mask = np.asarray(rankings["cluster"].astype(str) == str(accused))
        ax.hist(scores[~mask], bins=bins, color=_REST, label="other examples")
        ax.hist(scores[mask], bins=bins, color=_HARM, alpha=0.85, label=f"cluster {accused}")
        ax.legend(fontsize=8)
    else:
        ax.hist(scores, bins=bins, color=_REST)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("per-example influence score")
    ax.set_ylabel("examples (log)")
    ax.set_title("Per-example score distribution", fontsize=10)
    return _png(fig)


def flagged_steps(evidence: Mapping[str, object]) -> list[int]:
    """Training steps named in a dynamics finding's evidence.

    Reads ``step``-like integers (``first_step``, ``best_eval_step``, ...), lists under ``steps`` or
    ``*_steps``, and lists of ``{"step": ...}`` records (``spikes``). Counts such as
    ``clipped_steps: 40`` are integers under a plural key and are not steps.
    """
    out: set[int] = set()
    for key, value in evidence.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and (key == "step" or key.endswith("_step")):
            out.add(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, Mapping) and isinstance(item.get("step"), int):
                    out.add(item["step"])
                elif isinstance(item, int) and not isinstance(item, bool) and (key == "steps" or key.endswith("_steps")):
                    out.add(item)
    return sorted(out)


def _training_plot(logs: TrainingLogs, findings: Sequence[ReportFinding]) -> bytes | None:
    import math

    loss = [(s, v) for s, v in logs.series("loss") if math.isfinite(v)]
    norm = [(s, v) for s, v in logs.series("grad_norm") if math.isfinite(v)]
    evals = [(s, v) for s, v in logs.series("eval_loss") if math.isfinite(v)]
    if not (loss or norm):
        return None
    flags = [(f.id, flagged_steps(f.evidence or {})[:200]) for f in findings if f.id.startswith("dynamics.")]
    flags = [(fid, steps) for fid, steps in flags if steps]
    fig = _figure(7.0, 5.0)
    axes = fig.subplots(2, 1, sharex=True)
    for ax, series, name in ((axes[0], loss, "loss"), (axes[1], norm, "grad_norm")):
        if series:
            ax.plot([s for s, _ in series], [v for _, v in series], color="#34495e", lw=1.2, label=name)
        if name == "loss" and evals:
            ax.plot([s for s, _ in evals], [v for _, v in evals], color=_HELP, lw=1.2, marker="o", ms=3,
                    label="eval_loss")
        ax.set_ylabel(name)
    palette = [_FLAG, _HARM, "#8e44ad", "#16a085"]
    for i, (fid, steps) in enumerate(flags):
        color = palette[i % len(palette)]
        for j, step in enumerate(steps):
            for ax in axes:
                ax.axvline(step, color=color, lw=0.9, ls="--", alpha=0.8,
                           label=fid if (j == 0 and ax is axes[0]) else None)
    axes[0].legend(fontsize=7, loc="upper right")
    axes[1].set_xlabel("step")
    axes[0].set_title("Training curves (dashed: steps flagged by dynamics checks)", fontsize=10)
    return _png(fig)


def draw_plots(report: Report | Mapping[str, object], rankings: pd.DataFrame | None = None,
               logs: TrainingLogs | None = None) -> dict[str, bytes]:
    """Every figure the inputs allow, as PNG bytes keyed by name (see ``PLOT_NAMES``)."""
    out: dict[str, bytes] = {}
    report = Report.of(report)
    accused = report.verdict.accused_cluster
    cap = report.capability
    if cap is not None and all(isinstance(v, (int, float)) for v in (cap.base, cap.tuned, cap.delta)):
        out["capability"] = _capability_plot(cap)
    if report.attribution is not None and report.attribution.clusters:
        out["clusters"] = _clusters_plot(report.attribution.clusters, accused)
    if rankings is not None and len(rankings) and "score" in rankings:
        out["scores"] = _scores_plot(rankings, accused)
    if logs is not None and len(logs):
        png = _training_plot(logs, report.findings)
        if png is not None:
            out["training"] = png
    return out
