"""The attribution tables of the report: influence by cluster, and the top individual examples.

Sign convention (the one place the report relies on it): a positive score means the training
example reinforced the queried behaviour; a negative score means it degraded it. So harm is the
negative side. ``predicted_loss_delta_if_removed = score / n`` with ``n`` the number of scored
training examples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence, Union

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

    from gradian.cluster.assign import ClusterAssignment
    from gradian.data import Example
    from gradian.report.schema import ExampleRow, QueryLoss, Report

__all__ = ["EXCERPT_CHARS", "AssignmentInput", "cluster_table", "excerpt_of", "item_prompts", "items_hurt_text",
           "query_loss_text",
           "top_examples"]

#: which cluster each example is in: a ``ClusterAssignment``, a plain ``{example_id: cluster}``
#: mapping, or None (every example in cluster ``"0"``)
AssignmentInput = Union["ClusterAssignment", Mapping[str, object], None]

#: longest excerpt of a training row shown in the report
EXCERPT_CHARS = 160
#: longest excerpt of an eval prompt named among the items a row hurts
_PROMPT_CHARS = 60


def item_prompts(report: "Report") -> dict[str, str]:
    """Each measured eval item's prompt by its id (the query's item ids), for naming the items a row hurts."""
    return {item.example_id: item.prompt for item in (report.capability.items if report.capability else [])}


def items_hurt_text(row: "ExampleRow", prompts: Mapping[str, str]) -> str:
    """The query items a row hurts most, each by its prompt (``prompts``: item id -> prompt text;
    the id where the prompt is unknown), with its share of the row's harm."""
    parts = []
    for item in row.items_hurt or []:
        prompt = " ".join(str(prompts.get(item.item_id) or "").split())
        if len(prompt) > _PROMPT_CHARS:
            prompt = prompt[:_PROMPT_CHARS - 1].rstrip() + "…"
        parts.append(f"“{prompt}” ({item.share:.0%})" if prompt else f"{item.item_id} ({item.share:.0%})")
    return "; ".join(parts)


def query_loss_text(query_loss: "QueryLoss") -> str:
    """The measured query loss in one line: base, tuned, the rise, over how many items."""
    q = query_loss
    return (f"query loss ({q.signal}) {q.base:.4g} on the base and {q.tuned:.4g} tuned, a rise of {q.rise:.4g} "
            f"{q.unit} over {q.n_items} items; every score is a first-order change of this loss")


def _shorten(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def excerpt_of(example: Example | None, limit: int = EXCERPT_CHARS) -> str:
    """``prompt → completion`` of an ``Example`` on one line, cut to ``limit`` characters."""
    if example is None:
        return ""
    prompt, completion = example.prompt_text, example.completion
    if prompt and completion:
        half = limit // 2
        return f"{_shorten(prompt, half)} → {_shorten(completion, half)}"
    return _shorten(prompt or completion or example.full_text, limit)


def _by_id(examples: Sequence[Example] | Mapping[str, Example] | None) -> dict[str, Example]:
    if examples is None:
        return {}
    if isinstance(examples, Mapping):
        return dict(examples)
    return {e.id: e for e in examples}


def _cluster_key(assignment: AssignmentInput, eid: str) -> str:
    if assignment is None:
        return "0"
    labels = assignment.labels if hasattr(assignment, "labels") else assignment
    return str(labels.get(eid, "0"))


def top_examples(scores: Sequence[float] | np.ndarray, example_ids: Sequence[str], assignment: AssignmentInput = None,
                 examples: Sequence[Example] | Mapping[str, Example] | None = None, k: int = 10,
                 harmful: bool = True, order_by: Sequence[float] | np.ndarray | None = None) -> list[dict[str, object]]:
    """The ``k`` most harmful (most negative) or most helpful (most positive) examples.

    Only examples on that side of zero are listed. Each row: ``example_id``, ``score``,
    ``predicted_loss_delta_if_removed`` (= score / n), ``cluster`` and ``excerpt``. Ties keep
    dataset order. ``order_by`` (e.g. a RelatIF ranking, harmful below zero too) orders the rows
    instead of the scores themselves; a row is then listed only when both are on the side asked
    for (a sum of RelatIF values over checkpoints can differ in sign from the sum of the scores).
    """
    values = np.asarray(scores, dtype=np.float64)
    n = len(values)
    return _top_rows(values, example_ids, assignment, _by_id(examples), k, harmful, order_by, n)


def _top_rows(values: npt.NDArray[np.float64], example_ids: Sequence[str], assignment: AssignmentInput,
              by_id: Mapping[str, Example], k: int, harmful: bool, order_by: Sequence[float] | np.ndarray | None,
              n: int) -> list[dict[str, object]]:
    """``top_examples`` over ``values``, ``predicted_loss_delta_if_removed`` = score / ``n``."""
    key = values if order_by is None else np.asarray(order_by, dtype=np.float64)
    if key.shape != values.shape:
        raise ValueError(f"order_by has shape {key.shape}, the scores {values.shape}")
    order = np.argsort(key if harmful else -key, kind="stable")
    rows: list[dict[str, object]] = []
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


def cluster_table(scores: Sequence[float] | np.ndarray, example_ids: Sequence[str], assignment: AssignmentInput = None,
                  examples: Sequence[Example] | Mapping[str, Example] | None = None,
                  top_examples_per_cluster: int = 5) -> list[dict[str, object]]:
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
    keyed: list[tuple[tuple[float, float, str], dict[str, object]]] = []
    for key in dict.fromkeys(keys.tolist()):
        mask = keys == key
        member_scores = values[mask]
        negative = float(member_scores[member_scores < 0].sum())
        member_ids = [ids[i] for i in np.flatnonzero(mask)]
        harmful = bool((member_scores < 0).any())
        signed = float(member_scores.sum())
        share = negative / total_negative if total_negative < 0 else 0.0
        keyed.append(((signed, -share, key), {
            "cluster": key,
            "label": names.get(key, ""),
            "n": int(mask.sum()),
            "signed_influence": signed,
            "share_of_negative": share,
            "mean_per_example": float(member_scores.mean()),
            # predicted_loss_delta in a cluster's top examples uses the whole dataset's n
            "top_examples": _top_rows(member_scores, member_ids, assignment, _by_id(examples),
                                      top_examples_per_cluster, harmful, None, len(values)),
        }))
    keyed.sort(key=lambda kr: kr[0])
    return [row for _, row in keyed]
