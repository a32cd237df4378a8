"""The attribution tables of the report: influence by cluster, and the top individual examples.

Sign convention (the one place the report relies on it): a positive score means the training
example reinforced the queried behaviour; a negative score means it degraded it. So harm is the
negative side. ``predicted_loss_delta_if_removed = score / n`` with ``n`` the number of scored
training examples.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["EXCERPT_CHARS", "cluster_table", "excerpt_of", "top_examples"]

#: longest excerpt of a training row shown in the report
EXCERPT_CHARS = 160


def _shorten(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def excerpt_of(example: Any, limit: int = EXCERPT_CHARS) -> str:
    """``prompt → completion`` of an ``Example`` on one line, cut to ``limit`` characters."""
    if example is None:
        return ""
    prompt, completion = example.prompt_text, example.completion
    if prompt and completion:
        half = limit // 2
        return f"{_shorten(prompt, half)} → {_shorten(completion, half)}"
    return _shorten(prompt or completion or example.full_text, limit)


def _by_id(examples: Sequence[Any] | Mapping[str, Any] | None) -> dict[str, Any]:
    if examples is None:
        return {}
    if isinstance(examples, Mapping):
        return dict(examples)
    return {e.id: e for e in examples}


def _cluster_key(assignment: Any, eid: str) -> str:
    if assignment is None:
        return "0"
    labels = assignment.labels if hasattr(assignment, "labels") else assignment
    return str(labels.get(eid, "0"))


def top_examples(scores: Sequence[float] | np.ndarray, example_ids: Sequence[str], assignment: Any = None,
                 examples: Sequence[Any] | Mapping[str, Any] | None = None, k: int = 10,
                 harmful: bool = True, order_by: Sequence[float] | np.ndarray | None = None) -> list[dict[str, Any]]:
    """The ``k`` most harmful (most negative) or most helpful (most positive) examples.

    Only examples on that side of zero are listed. Each row: ``example_id``, ``score``,
    ``predicted_loss_delta_if_removed`` (= score / n), ``cluster`` and ``excerpt``. Ties keep
    dataset order. ``order_by`` (e.g. a RelatIF ranking, harmful below zero too) orders the rows
    instead of the scores themselves; a row is then listed only when both are on the side asked
    for (a sum of RelatIF values over checkpoints can differ in sign from the sum of the scores).
    """
    values = np.asarray(scores, dtype=np.float64)
    n = len(values)
    by_id = _by_id(examples)
    key = values if order_by is None else np.asarray(order_by, dtype=np.float64)
    if key.shape != values.shape:
        raise ValueError(f"order_by has shape {key.shape}, the scores {values.shape}")
    order = np.argsort(key if harmful else -key, kind="stable")
    rows: list[dict[str, Any]] = []
    for i in order:
        if len(rows) == k or (harmful and key[i] >= 0) or (not harmful and key[i] <= 0):
            break
        score = float(values[i])
        if (harmful and score >= 0) or (not harmful and score <= 0):
            continue
        eid = str(example_ids[i])
        rows.append({
            "example_id": eid,
            "score": score,
            "predicted_loss_delta_if_removed": score / n,
            "cluster": _cluster_key(assignment, eid),
            "excerpt": excerpt_of(by_id.get(eid)),
        })
    return rows


def cluster_table(scores: Sequence[float] | np.ndarray, example_ids: Sequence[str], assignment: Any = None,
                  examples: Sequence[Any] | Mapping[str, Any] | None = None,
                  top_examples_per_cluster: int = 5) -> list[dict[str, Any]]:
    """Influence summed by cluster, most harmful cluster first.

    Per cluster: ``n``; ``signed_influence`` (sum of its scores); ``share_of_negative`` (the sum
    of its negative scores over the sum of all negative scores, 0 when nothing is negative);
    ``mean_per_example`` (signed influence / n); ``top_examples`` (its most harmful members, or
    its most helpful when none is harmful). ``assignment`` is a ``ClusterAssignment`` or a plain
    ``{example_id: cluster}`` mapping; without one every example is in cluster ``"0"``.
    Clusters are ordered by signed influence, most negative (the largest net harm) first, then by
    share of negative influence. Net harm is the steadier order: a large cluster collects many small
    negative scores and can rival a small harmful cluster on share alone while being net helpful.
    """
    values = np.asarray(scores, dtype=np.float64)
    ids = [str(e) for e in example_ids]
    if len(ids) != len(values):
        raise ValueError(f"{len(values)} scores but {len(ids)} example ids; they must be row-aligned")
    keys = np.asarray([_cluster_key(assignment, eid) for eid in ids])
    names = getattr(assignment, "names", {}) or {}
    total_negative = float(values[values < 0].sum())
    rows = []
    for key in dict.fromkeys(keys.tolist()):
        mask = keys == key
        member_scores = values[mask]
        negative = float(member_scores[member_scores < 0].sum())
        member_ids = [ids[i] for i in np.flatnonzero(mask)]
        harmful = bool((member_scores < 0).any())
        rows.append({
            "cluster": key,
            "label": names.get(key, ""),
            "n": int(mask.sum()),
            "signed_influence": float(member_scores.sum()),
            "share_of_negative": negative / total_negative if total_negative < 0 else 0.0,
            "mean_per_example": float(member_scores.mean()),
            "top_examples": top_examples(member_scores, member_ids, assignment, examples,
                                         top_examples_per_cluster, harmful=harmful),
        })
    # predicted_loss_delta in a cluster's top examples must use the whole dataset's n
    for row in rows:
        for ex in row["top_examples"]:
            ex["predicted_loss_delta_if_removed"] = ex["score"] / len(values)
    rows.sort(key=lambda r: (r["signed_influence"], -r["share_of_negative"], r["cluster"]))
    return rows
