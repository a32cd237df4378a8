"""The accused set: from the cluster a verdict accuses to the rows to act on.

A topic cluster is a reading aid, not a deletion list. When the planted rows share their topic with
many clean rows (same question form, right answers), the accused cluster holds both, and deleting
all of it throws away more good rows than bad. ``refine_accused`` splits the cluster and returns an
``AccusedSet``: the rows whose harm stands out, what share of the cluster's harm they carry, the
estimated share of them that is harmful, and the rows left out.

Is there a split at all? Gaussian mixtures of one, two and three components are fitted to the
transformed harm ``t = asinh(-score / s)`` (``s`` = the dataset's median absolute score: linear
near zero, logarithmic in the tail, so one very harmful row does not flatten the rest). The harm
is bimodal when a mixture of more than one component fits better than one Gaussian (lower BIC)
and its most harmful component stands apart from the next one (Ashman's D >= 2); of those, the
one with the lowest BIC is kept. If there is none, the whole cluster is the accused set. Three
components, not two: curvature-corrected scores put many clean rows in a narrow spike at zero with
the rest of the clean rows spread around it, and a two-component fit then spends itself separating
the spike from the spread, not the harmful rows from the clean ones. Two still count where the
best three straddle the harmful tail and the clean spread with one wide component.

If it is bimodal, the accused set is ``score_gap``: the rows above the widest gap in sorted ``t``
between the most harmful component's mean and the next one's. The other candidates are computed and listed beside it with their
figures, for the reader to check: ``score_mixture`` (the rows more likely in the harmful
component), ``gradient_k2``..``gradient_k4`` (KMeans on the members' unit-length, projected
per-example gradients, the most harmful sub-cluster), ``whole_cluster``. Each candidate carries
its *harm captured* (its negative scores over the cluster's), its *estimated harmful share* (the
mean, over its rows, of the mixture's probability of the harmful component; the indicator
``score < 0`` when the harm is not bimodal) and their harmonic mean.

Why the gap, by measurement on tinyworld's ``poison_capitals_ontopic`` under
``clustering.method: auto`` (48 planted rows in a 374-row topic cluster, one fine-tune), with
DataInf's scores: the gap kept 46 rows (precision 0.89, recall 0.85), the mixture's posterior 35
(1.00, 0.73): it cuts inside the planted rows' long tail when their harm spans decades. With
EK-FAC's scores: the gap kept 52 (0.88, 0.96), the posterior 46 (0.96, 0.92); a two-component fit
found no split there at all and kept the whole cluster (0.13, 1.00). Gradient sub-clusters mix the
planted rows with the on-topic clean rows (the best held 44 planted among 129 rows), so they are
reported, not chosen. Reproduce with ``projects/benchmarks/bench_accused.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from gradian.engines.base import TrainGradients
    from gradian.jsontypes import JsonObject

__all__ = ["AccusedCandidate", "AccusedSet", "KNOWN_NATS", "SIBLING_COSINE", "add_gradient_siblings",
           "gradient_cosines_to", "harm_transform", "leave_out_known", "refine_accused", "sibling_anchors"]

#: Ashman's D a two-component mixture must reach to count as two groups
MIN_SEPARATION = 2.0
#: mixture sizes compared by BIC, and the restarts of each fit
MIXTURE_KS = (1, 2, 3)
N_INIT = 5
#: gradient sub-cluster counts tried
GRADIENT_KS = (2, 3, 4)
#: the cosine between full per-example gradients from which a row counts as an accused row's sibling
SIBLING_COSINE = 0.5
#: the harmful probability an accused row needs before its siblings join
SIBLING_ANCHOR = 0.25
#: the base model's loss (nats, summed over a row's supervised tokens) at or under which a row
#: counts as known to the base: it gave the row's answer with probability >= exp(-0.1) ~ 0.9
KNOWN_NATS = 0.1


@dataclass
class AccusedCandidate:
    """One way of splitting the cluster, with the figures it was judged by."""

    method: str
    n: int
    share_of_cluster_harm: float
    estimated_harmful_share: float
    score: float

    def to_dict(self) -> JsonObject:
        return asdict(self)


@dataclass
class AccusedSet:
    """The rows to act on, refined from the accused cluster.

    ``example_ids`` most harmful first; ``share_of_cluster_harm``: their negative scores over the
    cluster's (0..1); ``share_of_negative``: over every negative score in the dataset;
    ``estimated_harmful_share``: the expected share of its rows that are harmful (see the module
    docstring); ``left_out_ids``: the cluster's other rows, with their mean score.
    """

    cluster: str
    cluster_label: str
    cluster_n: int
    example_ids: list[str]
    left_out_ids: list[str]
    share_of_cluster_harm: float
    share_of_negative: float
    estimated_harmful_share: float
    mean_per_example: float
    left_out_mean_per_example: float | None
    method: str
    reason: str
    #: per example id: the probability its row belongs to the harmful component
    harmful_probability: dict[str, float] = field(default_factory=dict, repr=False)
    candidates: list[AccusedCandidate] = field(default_factory=list)
    #: rows added after the cut because their gradient is a near copy of an accused row's, each as
    #: ``{"example_id", "sibling_of", "cosine", "score"}`` (``add_gradient_siblings``)
    added: list[dict[str, Any]] = field(default_factory=list)
    #: rows of the whole dataset that ask an eval prompt and teach another answer than the eval's
    #: (``data.train_eval_conflict``), and how many of them this set holds; None without that finding
    eval_conflict_rows: int | None = None
    eval_conflict_in_set: int | None = None
    #: rows the cut or the siblings held that the base model already answered as written, left out,
    #: each as ``{"example_id", "base_loss"}`` (nats over the row's supervised tokens; ``leave_out_known``)
    known_to_base: list[dict[str, Any]] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.example_ids)

    @property
    def n_left_out(self) -> int:
        return len(self.left_out_ids)

    @property
    def n_in_cluster(self) -> int:
        """The accused rows that belong to the cluster (the cluster's rows not left out)."""
        return max(int(self.cluster_n) - self.n_left_out, 0)

    @property
    def n_outside_cluster(self) -> int:
        """The accused rows from other clusters: gradient siblings that joined from elsewhere."""
        return max(self.n - self.n_in_cluster, 0)

    def rows_text(self) -> str:
        """``"N of cluster C's M rows"``, or, once siblings joined from other clusters, ``"N rows: K
        of cluster C's M and J gradient siblings from other clusters"``."""
        inside = f"of cluster {self.cluster}'s {self.cluster_n}"
        if not self.n_outside_cluster:
            return f"{self.n} {inside} rows"
        return (f"{self.n} rows: {self.n_in_cluster} {inside} and {self.n_outside_cluster} gradient "
                f"sibling(s) from other clusters")

    def to_dict(self) -> JsonObject:
        out = asdict(self)
        out["n"] = self.n
        out["n_left_out"] = self.n_left_out
        out["candidates"] = [c.to_dict() for c in self.candidates]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AccusedSet":
        fields = {k: v for k, v in data.items() if k not in ("n", "n_left_out", "candidates")}
        fields["candidates"] = [AccusedCandidate(**c) for c in data.get("candidates") or []]
        return cls(**fields)


def harm_transform(scores: np.ndarray, scale: float) -> np.ndarray:
    """``asinh(-score / scale)``: harm, linear near zero and logarithmic in the tail."""
    scale = scale if scale > 0 else 1.0
    return np.arcsinh(-np.asarray(scores, dtype=np.float64) / scale)


def _harmful_probability(t: np.ndarray, scores: np.ndarray, seed: int) -> tuple[np.ndarray, tuple[float, float] | None]:
    """P(most harmful component) per row, and the means of that component and the next one below
    it (None when the harm is not bimodal: see the module docstring)."""
    from sklearn.mixture import GaussianMixture

    fallback = (scores < 0).astype(np.float64)
    if len(t) < 6 or np.ptp(t) == 0:
        return fallback, None
    x = t[:, None]
    fits = [GaussianMixture(k, random_state=seed, n_init=N_INIT).fit(x) for k in MIXTURE_KS if k < len(t)]
    # by BIC, the mixtures that fit better than one Gaussian; the first whose most harmful
    # component stands apart from the next decides. The best-BIC mixture alone is not enough: a
    # wide third component can straddle the planted rows' tail and the clean spread (no
    # separation) where two components split them cleanly (docs/clustering.md)
    for mixture in sorted(fits, key=lambda g: g.bic(x)):
        if mixture.n_components == 1:
            break
        means = mixture.means_.ravel()
        variances = mixture.covariances_.ravel()
        order = np.argsort(means)
        top, below = int(order[-1]), int(order[-2])
        separation = (math.sqrt(2.0) * (means[top] - means[below])
                      / math.sqrt(float(variances[top] + variances[below])))
        if separation >= MIN_SEPARATION:
            return mixture.predict_proba(x)[:, top], (float(means[below]), float(means[top]))
    return fallback, None


def _gap_split(t: np.ndarray, between: tuple[float, float] | None = None) -> np.ndarray | None:
    """Rows above the widest gap in sorted harm: the gap separating the mixture's two components
    (both ends of the gap between their means), else the widest among the harmful half."""
    order = np.argsort(-t, kind="stable")
    ordered = t[order]
    gaps = ordered[:-1] - ordered[1:]
    if not len(gaps):
        return None
    if between is not None:
        low, high = between
        allowed = (ordered[:-1] <= high) & (ordered[1:] >= low)
    else:
        allowed = np.arange(len(gaps)) < max(1, len(t) // 2)
    if not allowed.any():
        return None
    k = int(np.argmax(np.where(allowed, gaps, -np.inf))) + 1
    mask = np.zeros(len(t), dtype=bool)
    mask[order[:k]] = True
    return mask


def _gradient_splits(features: np.ndarray, scores: np.ndarray, seed: int) -> list[tuple[str, np.ndarray]]:
    from sklearn.cluster import KMeans

    out = []
    distinct = len(np.unique(features.round(9), axis=0))
    for k in GRADIENT_KS:
        if distinct <= k:
            break
        labels = KMeans(n_clusters=k, random_state=seed, n_init=10).fit_predict(features)
        worst = min(range(k), key=lambda c: float(scores[labels == c].mean()))
        out.append((f"gradient_k{k}", labels == worst))
    return out


def refine_accused(cluster: str, member_ids: Sequence[str], member_scores: Sequence[float] | np.ndarray, *,
                   label: str = "", features: np.ndarray | None = None, scale: float | None = None,
                   total_negative: float | None = None, seed: int = 1234) -> AccusedSet:
    """Split the accused cluster into the rows to act on and the rows to leave; see the module doc.

    ``member_scores`` are the members' scores (sign convention: negative is harm);
    ``features`` the members' gradient features (``gradient_features``), row-aligned, or None;
    ``scale`` the dataset's median absolute score (the members' when None); ``total_negative``
    the sum of every negative score in the dataset (for ``share_of_negative``).
    """
    ids = [str(i) for i in member_ids]
    scores = np.asarray(member_scores, dtype=np.float64)
    if len(ids) != len(scores):
        raise ValueError(f"{len(scores)} scores for {len(ids)} members; they must be row-aligned")
    if scale is None:
        scale = float(np.median(np.abs(scores))) if len(scores) else 1.0
    t = harm_transform(scores, scale)
    probability, means = _harmful_probability(t, scores, seed)
    bimodal = means is not None
    cluster_harm = float(-scores[scores < 0].sum())

    masks: list[tuple[str, np.ndarray]] = [("whole_cluster", np.ones(len(ids), dtype=bool))]
    if bimodal:
        masks.append(("score_mixture", (probability > 0.5) & (scores < 0)))
    gap = _gap_split(t, means)
    if gap is not None:
        masks.append(("score_gap", gap & (scores < 0)))
    if features is not None and len(features) == len(ids) and len(ids) >= 6:
        masks += _gradient_splits(np.asarray(features, dtype=np.float64), scores, seed)

    candidates: list[tuple[AccusedCandidate, np.ndarray]] = []
    for method, mask in masks:
        if not mask.any():
            continue
        captured = float(-scores[mask & (scores < 0)].sum()) / cluster_harm if cluster_harm > 0 else 0.0
        estimated = float(probability[mask].mean())
        f = 2 * captured * estimated / (captured + estimated) if captured + estimated > 0 else 0.0
        candidates.append((AccusedCandidate(method, int(mask.sum()), round(captured, 6), round(estimated, 6),
                                            round(f, 6)), mask))
    chosen_method = "score_gap" if bimodal and any(c.method == "score_gap" for c, _ in candidates) else "whole_cluster"
    best, mask = next((c, m) for c, m in candidates if c.method == chosen_method)

    order = np.argsort(scores, kind="stable")
    chosen = [ids[i] for i in order if mask[i]]
    left = [ids[i] for i in order if not mask[i]]
    negative = float(scores[mask & (scores < 0)].sum())
    reason = (f"{best.n} of {len(ids)} rows carry {best.share_of_cluster_harm:.0%} of the "
              f"cluster's harm, an estimated {best.estimated_harmful_share:.0%} of them harmful"
              + ("" if bimodal else "; the cluster's scores are not bimodal"))
    return AccusedSet(
        cluster=str(cluster),
        cluster_label=label,
        cluster_n=len(ids),
        example_ids=chosen,
        left_out_ids=left,
        share_of_cluster_harm=best.share_of_cluster_harm,
        share_of_negative=negative / total_negative if total_negative and total_negative < 0 else 0.0,
        estimated_harmful_share=best.estimated_harmful_share,
        mean_per_example=float(scores[mask].mean()),
        left_out_mean_per_example=float(scores[~mask].mean()) if (~mask).any() else None,
        method=best.method,
        reason=reason,
        harmful_probability={ids[i]: round(float(probability[i]), 6) for i in range(len(ids))},
        candidates=[c for c, _ in candidates],
    )


def gradient_cosines_to(train: TrainGradients, anchors: Sequence[int]) -> np.ndarray:
    """``[n, len(anchors)]`` cosines between every row's full gradient and each anchor row's.

    ``train`` is any ``TrainGradients``: the anchors are read through its ``rows`` when it has
    one, then one pass over every chunk; exact, block by block, in float64. A zero gradient
    has cosine 0 with everything.
    """
    from gradian.cluster.gradient_space import _wanted_chunks

    anchor_rows = np.asarray(list(anchors), dtype=np.int64)
    blocks = list(train.block_names)
    held: dict[str, np.ndarray] = {}
    for slots, chunk in _wanted_chunks(train, anchor_rows, False):
        for b in blocks:
            if b not in held:
                held[b] = np.zeros((len(anchor_rows), chunk[b].shape[1]), dtype=np.float64)
            held[b][slots] = chunk[b]
    anchor_norm = np.sqrt(sum(np.einsum("ij,ij->i", v, v) for v in held.values()))
    out = np.zeros((int(train.n), len(anchor_rows)), dtype=np.float64)
    for start, chunk in train.iter_chunks():
        parts = {b: np.asarray(chunk[b], dtype=np.float64) for b in blocks}
        size = len(parts[blocks[0]]) if blocks else 0
        dots = sum(parts[b] @ held[b].T for b in blocks)
        norms = np.sqrt(sum(np.einsum("ij,ij->i", v, v) for v in parts.values()))
        scale = norms[:, None] * anchor_norm[None, :]
        out[start:start + size] = np.divide(dots, scale, out=np.zeros_like(scale), where=scale > 0)
    return out


def sibling_anchors(accused: AccusedSet, minimum: float = SIBLING_ANCHOR) -> list[str]:
    """The accused rows whose siblings may join: those the score mixture holds harmful with
    probability >= ``minimum`` (``accused.harmful_probability``; a row it has no figure for counts
    as sure). The rows at the weak end of the cut are where its clean rows sit; a clean row's
    gradient siblings are clean rows on the same topic, so letting them anchor spreads the cut's
    errors instead of its finds (see docs/clustering.md). ``minimum`` 0 keeps every row.
    """
    probability = accused.harmful_probability or {}
    return [eid for eid in accused.example_ids if float(probability.get(eid, 1.0)) >= minimum]


def add_gradient_siblings(accused: AccusedSet, ids: Sequence[str], scores: Sequence[float] | np.ndarray,
                          cosines: np.ndarray, accused_rows: Sequence[int],
                          threshold: float = SIBLING_COSINE) -> AccusedSet:
    """``accused`` with every row whose gradient has cosine >= ``threshold`` with some accused row's.

    A wrong fact taught by several rows in other words is a row per phrasing; when the query moves
    on one phrasing's rows more than another's, the score cut keeps some and leaves their siblings
    (small or even positive scores), and retraining without the set keeps the fact. Their gradients
    give them away: the same answer after the same entity pushes the adapter the same way (see
    docs/clustering.md for the measurements). ``ids`` and ``scores`` cover the whole dataset,
    ``cosines`` is ``gradient_cosines_to(train, accused_rows)``, ``accused_rows`` the dataset rows
    of ``accused.example_ids`` in that order. Rows from anywhere in the dataset may join; each
    added row is recorded in ``added`` with the accused row it copies, and ``reason`` says how
    many were added. ``threshold`` <= 0 or > 1 adds nothing.
    """
    ids = [str(i) for i in ids]
    values = np.asarray(scores, dtype=np.float64)
    if not 0 < threshold <= 1 or not len(accused_rows):
        return accused
    if cosines.shape != (len(ids), len(accused_rows)):
        raise ValueError(f"cosines of shape {cosines.shape}; expected ({len(ids)}, {len(accused_rows)})")
    inside = set(accused.example_ids)
    best = np.argmax(cosines, axis=1)
    nearest = cosines[np.arange(len(ids)), best]
    added = []
    for row in np.argsort(-nearest, kind="stable"):
        if nearest[row] < threshold:
            break
        if ids[row] in inside:
            continue
        added.append({"example_id": ids[row], "sibling_of": ids[int(accused_rows[best[row]])],
                      "cosine": round(float(nearest[row]), 6), "score": float(values[row])})
    if not added:
        return accused
    new_ids = [a["example_id"] for a in added]
    joined = set(new_ids)
    reason = (f"{accused.reason}; {len(added)} more row(s) added whose gradient has cosine >= {threshold:g} "
              "with an accused row's (the same lesson in other words)")
    return _with_rows(accused, ids, values, list(accused.example_ids) + new_ids,
                      [i for i in accused.left_out_ids if i not in joined], reason=reason,
                      added=list(accused.added) + added)


def _with_rows(accused: AccusedSet, ids: Sequence[str], values: np.ndarray, members: list[str], left: list[str],
               **changes: Any) -> AccusedSet:
    """``accused`` holding ``members`` and leaving ``left``, with the figures that follow from them
    (mean per example on both sides, share of every negative score in the dataset) recomputed from
    the dataset's ``ids`` and ``values``; ``changes`` replace other fields."""
    score_of = dict(zip(ids, values.tolist()))
    total_negative = float(values[values < 0].sum())
    member_scores = np.asarray([score_of[i] for i in members])
    return dataclasses.replace(
        accused, example_ids=members, left_out_ids=left, **changes,
        mean_per_example=float(member_scores.mean()) if members else 0.0,
        left_out_mean_per_example=float(np.mean([score_of[i] for i in left])) if left else None,
        share_of_negative=(float(member_scores[member_scores < 0].sum()) / total_negative
                           if members and total_negative < 0 else 0.0))


def leave_out_known(accused: AccusedSet, ids: Sequence[str], scores: Sequence[float] | np.ndarray,
                    base_losses: Mapping[str, float], members: Collection[str],
                    threshold: float = KNOWN_NATS) -> AccusedSet:
    """``accused`` without the rows the base model already answered as written: a loss of at most
    ``threshold`` nats over the row's supervised tokens under the base (``base_losses``, by example
    id; a row without a figure stays).

    Why: the fine-tune cannot have taught such a row anything. Its loss was near zero from the first
    step, so its gradient, and with it its push on the adapter, was near zero at every step; its
    influence estimate at the tuned adapter can still be large (a small gradient along a direction
    the curvature barely constrains) when it gives the answer the planted rows teach for another
    entity, where it is true (measured on the three worlds' poison scenarios in docs/clustering.md).

    ``ids`` and ``scores`` cover the whole dataset, ``members`` are the accused cluster's ids: a
    member goes back to ``left_out_ids``, a sibling from another cluster leaves the set (and
    ``added``). ``threshold`` <= 0 leaves the set as it is.
    """
    if threshold <= 0:
        return accused
    known = [eid for eid in accused.example_ids
             if eid in base_losses and float(base_losses[eid]) <= threshold]
    if not known:
        return accused
    gone = set(known)
    inside = set(members)
    reason = (f"{accused.reason}; {len(known)} row(s) left out that the base model already answered as written "
              f"(loss <= {threshold:g} nat under the base: the fine-tune taught them nothing)")
    return _with_rows(
        accused, [str(i) for i in ids], np.asarray(scores, dtype=np.float64),
        [eid for eid in accused.example_ids if eid not in gone],
        list(accused.left_out_ids) + [eid for eid in known if eid in inside], reason=reason,
        added=[a for a in accused.added if a["example_id"] not in gone],
        known_to_base=list(accused.known_to_base) + [{"example_id": eid, "base_loss": round(float(base_losses[eid]), 6)}
                                                     for eid in known])
