"""PASS / FAIL / INCONCLUSIVE for each validation experiment, as pure functions of what was measured.

The three outcomes mean what they mean in the reference's GPU suite:

- ``PASS``: the experiment created the condition it tests and Gradian's answer was right;
- ``FAIL``: the condition was there and Gradian's answer was wrong;
- ``INCONCLUSIVE``: the experiment did not create the condition it meant to test (the poison was
  not learned, nothing regressed, the retrains differ by no more than seed noise), so it says
  nothing about Gradian either way. It is a first-class outcome, never folded into PASS.

Every function returns a ``Verdict`` whose ``reason`` names the numbers the call rests on and
whose ``figures`` hold them, for verdict.json and for MLflow.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from gradian.report.schema import Capability, Counterfactual, Report

__all__ = [
    "ACCUSED_PRECISION_MIN",
    "ACCUSED_RECALL_MIN",
    "STATUSES",
    "UPTAKE_MIN",
    "Verdict",
    "accused_figures",
    "accused_verdict",
    "badconfig_verdict",
    "combine_verdicts",
    "counterfactual_verdict",
    "fidelity_verdict",
    "poison_figures",
    "poison_verdict",
    "scenario_badconfig_verdict",
]

STATUSES = ("PASS", "FAIL", "INCONCLUSIVE")
#: below this share of eval items answering with the planted fact, the poison was not learned
UPTAKE_MIN = 0.15


@dataclass
class Verdict:
    experiment: str
    status: str
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"verdict status {self.status!r} is not one of {', '.join(STATUSES)}")

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path


def _finite(value: Any) -> Any:
    """Strict JSON: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# -- poison -----------------------------------------------------------------------------------


def _auc(positive: Sequence[float], negative: Sequence[float]) -> float | None:
    """P(a positive scores above a negative), ties counting half: the ROC AUC."""
    if not len(positive) or not len(negative):
        return None
    from scipy.stats import rankdata

    values = list(positive) + list(negative)
    ranks = rankdata(values)
    n_pos, n_neg = len(positive), len(negative)
    return float((ranks[:n_pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def poison_figures(report: Report | Mapping[str, Any], scores: Sequence[float], row_indices: Sequence[int],
                   planted_indices: Sequence[int], planted_cluster: str,
                   wrong_answers: Mapping[str, str] | None,
                   row_prompts: Mapping[int, str] | None = None) -> dict[str, Any]:
    """The numbers experiment A records, from the report, every example's score and the truth.

    ``percentile`` of an example is the share of examples scoring below it (0 = most harmful);
    ``auc`` is the chance that a planted example scores lower (more harmful) than a clean one.
    ``uptake`` is the share of eval items whose tuned answer names the planted wrong fact. With
    ``row_prompts`` (row index -> prompt), the AUC is also split between planted rows about the
    items that regressed (the ones the query is built from) and planted rows about the others.
    """
    import numpy as np

    report = Report.of(report)
    cap, attribution = report.capability, report.attribution
    items = cap.items if cap is not None else []
    clusters = attribution.clusters if attribution is not None else []
    by_key = {str(c.cluster): c for c in clusters}
    ranked = sorted(clusters, key=lambda c: -(c.share_of_negative or 0.0))
    scores = np.asarray(scores, dtype=np.float64)
    planted_set = set(int(i) for i in planted_indices)
    is_planted = np.array([int(i) in planted_set for i in row_indices])
    planted_scores, clean_scores = scores[is_planted], scores[~is_planted]
    order = np.argsort(np.argsort(scores, kind="stable"), kind="stable")
    percentiles = 100.0 * order / max(len(scores) - 1, 1)
    planted = by_key.get(str(planted_cluster))
    mean_planted = float(planted_scores.mean()) if planted_scores.size else None
    mean_clean = float(clean_scores.mean()) if clean_scores.size else None
    uptake = None
    if wrong_answers:
        hits = 0
        for item in items:
            country = next((c for c in wrong_answers if c in item.prompt), None)
            said = item.tuned_generation or ""
            hits += bool(country and wrong_answers[country] in said)
        uptake = hits / len(items) if items else None
    split: dict[str, Any] = {}
    if wrong_answers and row_prompts is not None:
        regressed = [i.prompt for i in items if i.flipped]
        queried = {c for c in wrong_answers if any(c in p for p in regressed)}
        about = [next((c for c in wrong_answers if c in row_prompts.get(int(r), "")), None) for r in row_indices]
        in_query = np.array([p and a in queried for p, a in zip(is_planted, about)], dtype=bool)
        outside = is_planted & ~in_query
        split = {"n_planted_queried": int(in_query.sum()),
                 "auc_planted_queried_vs_clean": _auc(list(-scores[in_query]), list(-clean_scores)),
                 "auc_planted_unqueried_vs_clean": _auc(list(-scores[outside]), list(-clean_scores)),
                 "median_score_planted_queried": float(np.median(scores[in_query])) if in_query.any() else None,
                 "median_score_planted_unqueried": float(np.median(scores[outside])) if outside.any() else None}
    return {
        "capability": _capability_figures(cap)
        | dict(zip(("ci_low", "ci_high"), ((cap.ci if cap is not None else None) or [None, None])[:2])),
        "gated_regression": cap is not None and cap.status == "regressed" and attribution is not None,
        "uptake": uptake,
        "verdict_kind": report.verdict.kind,
        "accused_cluster": report.verdict.accused_cluster,
        "first_cluster": str(ranked[0].cluster) if ranked else None,
        "planted_cluster": str(planted_cluster),
        "planted_rank": next((i + 1 for i, c in enumerate(ranked) if str(c.cluster) == str(planted_cluster)), None),
        "share_of_negative": planted.share_of_negative if planted is not None else None,
        "mean_score_planted": mean_planted,
        "mean_score_clean": mean_clean,
        # how many times harder a planted example pulls than a clean one (negative: clean is net helpful)
        "per_example_ratio": (mean_planted / mean_clean) if mean_planted is not None and mean_clean else None,
        "auc_planted_vs_clean": _auc(list(-planted_scores), list(-clean_scores)),
        "median_percentile_planted": float(np.median(percentiles[is_planted])) if planted_scores.size else None,
        "n_planted": int(is_planted.sum()),
        **split,
        "n_examples": int(len(scores)),
        "engine": attribution.engine if attribution is not None else None,
        "engine_agreement_spearman": attribution.engine_agreement_spearman if attribution is not None else None,
    }


def _capability_figures(cap: Capability | None) -> dict[str, Any]:
    """The capability's base, tuned, delta, status, n_items and n_flipped (all None without one)."""
    if cap is None:
        return dict.fromkeys(("base", "tuned", "delta", "status", "n_items", "n_flipped"))
    return {"base": cap.base, "tuned": cap.tuned, "delta": cap.delta, "status": cap.status, "n_items": cap.n_items,
            "n_flipped": cap.n_flipped}


def poison_verdict(figures: Mapping[str, Any]) -> tuple[str, str]:
    """``(status, reason)`` of experiment A from ``poison_figures``.

    PASS needs a gated regression, the planted cluster first by share of negative influence, and
    the report's verdict accusing it. INCONCLUSIVE: no gated regression, or the poison was not
    learned (uptake below ``UPTAKE_MIN``) and the planted cluster was not found.
    """
    cap = figures["capability"]
    planted = figures["planted_cluster"]
    where = (f"capability {cap.get('base')} -> {cap.get('tuned')} (delta {cap.get('delta')}, "
             f"CI [{cap.get('ci_low')}, {cap.get('ci_high')}], {cap.get('status')})")
    if not figures["gated_regression"]:
        return "INCONCLUSIVE", f"no gated regression to attribute: {where}"
    first = figures["first_cluster"] == planted
    accused = figures["accused_cluster"] == planted
    share = figures.get("share_of_negative")
    auc, pct = figures.get("auc_planted_vs_clean"), figures.get("median_percentile_planted")
    detail = (f"planted cluster {planted} ranks {figures.get('planted_rank')} with "
              f"{'?' if share is None else f'{share:.0%}'} of the negative influence, AUC "
              f"{'?' if auc is None else f'{auc:.3f}'}, median percentile {'?' if pct is None else f'{pct:.1f}'}; "
              f"verdict {figures.get('verdict_kind')} accusing {figures.get('accused_cluster')}")
    if first and accused:
        return "PASS", f"{where}; {detail}"
    uptake = figures.get("uptake")
    if uptake is not None and uptake < UPTAKE_MIN:
        return "INCONCLUSIVE", f"the poison was not learned (uptake {uptake:.0%} < {UPTAKE_MIN:.0%}): {where}; {detail}"
    return "FAIL", f"{where}; {detail}"


# -- bad config -------------------------------------------------------------------------------


def scenario_badconfig_verdict(report: Report | Mapping[str, Any], expected: Sequence[str]) -> dict[str, Any]:
    """One broken-config scenario: the expected checks fired and no data cluster was accused."""
    report = Report.of(report)
    findings = report.findings
    fired = {f.id: f.severity for f in findings}
    missing = [e for e in expected if e not in fired]
    accused = report.verdict.accused_cluster
    status = "PASS" if not missing and accused is None else "FAIL"
    problems = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"accused cluster {accused}"] if accused is not None else [])
    return {
        "status": status,
        "reason": "; ".join(problems) if problems else f"{', '.join(expected)} fired and no cluster was accused",
        "expected": list(expected),
        "missing": missing,
        "fired": fired,
        "leading_finding": findings[0].id if findings else None,
        "verdict_kind": report.verdict.kind,
        "accused_cluster": accused,
        "capability": {k: v for k, v in _capability_figures(report.capability).items() if k != "n_items"},
        "attributed": report.attribution is not None,
    }


def badconfig_verdict(per_scenario: Mapping[str, Mapping[str, Any]]) -> tuple[str, str]:
    """PASS when every scenario passes; FAIL naming the ones that did not."""
    if not per_scenario:
        return "INCONCLUSIVE", "no scenario ran"
    failed = {k: v for k, v in per_scenario.items() if v["status"] != "PASS"}
    if failed:
        return "FAIL", "; ".join(f"{k}: {v['reason']}" for k, v in failed.items())
    return "PASS", "; ".join(f"{k}: {v['reason']} (verdict {v['verdict_kind']})" for k, v in per_scenario.items())


# -- counterfactual -----------------------------------------------------------------------------


def counterfactual_verdict(block: Counterfactual | Mapping[str, Any] | None, accusation: str | None) -> tuple[str, str]:
    """PASS when the retrain without the accused rows brings the capability back within one item
    of the base (and above the original fine-tune). INCONCLUSIVE when nothing was accused or
    nothing had regressed; FAIL otherwise."""
    if block is None:
        return "INCONCLUSIVE", f"no cluster was accused, so there was nothing to drop ({accusation})"
    if not isinstance(block, Counterfactual):
        block = Counterfactual.from_json(block, "counterfactual")
    rec, outcome = block.capability, block.outcome
    text = (f"dropped {block.removal.n_removed} rows ({block.removal.reason}); capability "
            f"{rec.base:.4f} base, {rec.before} before, {rec.after:.4f} after the retrain "
            f"({rec.items_below_base_after} item(s) below the base, status {rec.status_after})")
    truth = block.ground_truth
    if truth is not None:
        text += f"; removal precision {truth.precision}, recall {truth.recall}"
    if outcome == "nothing_to_recover":
        return "INCONCLUSIVE", f"the original fine-tune lost nothing: {text}"
    within = rec.within_one_item
    back = within if within is not None else outcome == "recovered"
    if outcome == "recovered" and back:
        return "PASS", text
    return "FAIL", f"{outcome.replace('_', ' ')}: {text}"


# -- accused set --------------------------------------------------------------------------------

#: the accused set must be at least this precise and this complete against the planted rows
ACCUSED_PRECISION_MIN = 0.8
ACCUSED_RECALL_MIN = 0.8


def accused_figures(report: Report | Mapping[str, Any], accused_rows: Sequence[int], planted_indices: Sequence[int],
                    block: Counterfactual | Mapping[str, Any] | None) -> dict[str, Any]:
    """The numbers experiment ``accused`` records: the accused set against the planted rows
    (``accused_rows``: its row indices), and the retrain without it (``block``: the counterfactual
    report's block, None when nothing was dropped)."""
    report = Report.of(report)
    cap, attribution = report.capability, report.attribution
    found = attribution.accused if attribution is not None else None
    rows, planted = set(int(i) for i in accused_rows), set(int(i) for i in planted_indices)
    hits = len(rows & planted)
    figures: dict[str, Any] = {
        "round1": _capability_figures(cap),
        "regressed": cap is not None and cap.status == "regressed" and attribution is not None,
        "engine": attribution.engine if attribution is not None else None,
        "n_clusters_found": len(attribution.clusters) if attribution is not None else 0,
        "verdict_kind": report.verdict.kind,
        "accused_cluster_id": report.verdict.accused_cluster,
        "n_accused": len(rows),
        "n_planted": len(planted),
        "n_planted_accused": hits,
        "precision": hits / len(rows) if rows else None,
        "recall": hits / len(planted) if planted else None,
        "accused_method": found.method if found is not None else None,
        "accused_cluster_size": found.cluster_n if found is not None else None,
        "accused_share_of_harm": found.share_of_cluster_harm if found is not None else None,
        "retrained": block is not None,
    }
    if block is not None:
        if not isinstance(block, Counterfactual):
            block = Counterfactual.from_json(block, "counterfactual")
        rec, truth = block.capability, block.ground_truth
        figures.update({
            "recovery": {"base": rec.base, "before": rec.before, "after": rec.after,
                         "delta_before": rec.delta_before, "delta_after": rec.delta_after,
                         "recovered_fraction": rec.recovered_fraction, "status_after": rec.status_after,
                         "items_below_base_before": rec.items_below_base_before,
                         "items_below_base_after": rec.items_below_base_after, "n_items": rec.n_items},
            "within_one_item": rec.within_one_item,
            "outcome": block.outcome,
            "n_removed": block.removal.n_removed,
            "removal_precision": truth.precision if truth is not None else None,
            "removal_recall": truth.recall if truth is not None else None,
            "retrain_seconds": block.seconds.to_json() if block.seconds is not None else None,
        })
    return figures


def _fraction(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def accused_verdict(figures: Mapping[str, Any]) -> tuple[str, str]:
    """``(status, reason)`` of experiment ``accused`` from ``accused_figures``.

    PASS: precision and recall of the accused set against the planted rows both at least 0.8, and
    the retrain without it within one item of the base. INCONCLUSIVE: the regression did not pass
    its gate, or nothing was accused. FAIL: a set was accused but missed a threshold, or the
    retrain did not come back.
    """
    cap = figures.get("round1") or {}
    where = f"capability {cap.get('base')} -> {cap.get('tuned')} ({cap.get('status')})"
    if not figures.get("regressed"):
        return "INCONCLUSIVE", f"no gated regression to attribute: {where}"
    n = figures.get("n_accused") or 0
    if not n:
        return "INCONCLUSIVE", (f"nothing was accused (verdict {figures.get('verdict_kind')}, "
                                f"{figures.get('n_clusters_found')} clusters found): {where}")
    precision, recall = figures.get("precision"), figures.get("recall")
    text = (f"{where}; accused {n} rows ({figures.get('accused_method')}, out of a cluster of "
            f"{figures.get('accused_cluster_size')}), {figures.get('n_planted_accused')} of the "
            f"{figures.get('n_planted')} planted: precision {_fraction(precision)}, recall {_fraction(recall)}")
    recovery = figures.get("recovery")
    within = figures.get("within_one_item")
    if recovery is not None:
        text += (f"; retrained without them: {recovery.get('after')} against base {recovery.get('base')} "
                 f"(before {recovery.get('before')}, {recovery.get('items_below_base_after')} item(s) below the "
                 f"base, {figures.get('outcome')})")
        back = within if within is not None else figures.get("outcome") == "recovered"
    else:
        text += "; no retrain"
        back = False
    misses = ([f"precision below {ACCUSED_PRECISION_MIN}"] if precision is None or precision < ACCUSED_PRECISION_MIN else []) \
        + ([f"recall below {ACCUSED_RECALL_MIN}"] if recall is None or recall < ACCUSED_RECALL_MIN else []) \
        + ([] if back else ["the retrain is not within one item of the base"])
    if misses:
        return "FAIL", f"{'; '.join(misses)}: {text}"
    return "PASS", text


# -- fidelity ---------------------------------------------------------------------------------


def _ci_text(ci: Sequence[float | None]) -> str:
    lo, hi = ci
    return "[?, ?]" if lo is None or hi is None else f"[{lo:+.3f}, {hi:+.3f}]"


def fidelity_verdict(lds: Mapping[str, Any], loss_spread: float | None = None,
                     seed_noise: float | None = None) -> tuple[str, str]:
    """From ``gradian.counterfactual.lds_table``: PASS when the best engine's LDS interval lies above
    zero; FAIL when it lies at or below zero; INCONCLUSIVE when it contains zero, or when the
    subsets' losses spread no wider than retraining the full set with other seeds does."""
    best = lds.get("best")
    if best is None:
        return "INCONCLUSIVE", "no engine was scored"
    engines = lds["engines"]
    parts = [f"{k} {engines[k]['spearman']:+.3f} {_ci_text(engines[k]['ci'])}" for k in lds["ranking"]]
    text = f"LDS over {lds['n']} retrains: " + ", ".join(parts)
    if lds["margins"]:
        runner = lds["ranking"][1]
        m = lds["margins"][runner]
        text += (f"; {best} ahead of {runner} by {m['difference']:+.3f} {_ci_text(m['ci'])}, "
                 f"ahead in {m['share_best_wins']:.0%} of resamples")
    if loss_spread is not None and seed_noise is not None and loss_spread <= seed_noise:
        return "INCONCLUSIVE", (f"the subsets' losses spread {loss_spread:.4g} (sd), no more than seed noise "
                                f"{seed_noise:.4g}: {text}")
    lo, hi = engines[best]["ci"]
    if lo is None or hi is None:
        return "INCONCLUSIVE", f"no interval could be formed: {text}"
    if lo > 0:
        return "PASS", text
    if hi <= 0:
        return "FAIL", text
    return "INCONCLUSIVE", f"the best interval contains zero: {text}"


# -- the suite --------------------------------------------------------------------------------


def combine_verdicts(verdicts: Sequence[Verdict]) -> tuple[str, str]:
    """The suite: FAIL if any experiment failed, else INCONCLUSIVE if any was, else PASS."""
    statuses = [v.status for v in verdicts]
    summary = ", ".join(f"{v.experiment} {v.status}" for v in verdicts)
    if "FAIL" in statuses:
        return "FAIL", summary
    if "INCONCLUSIVE" in statuses or not statuses:
        return "INCONCLUSIVE", summary
    return "PASS", summary
