"""Groups among the harmful rows: topics formed where the harm is, for when the topic table is flat.

Interface: ``harm_groups(examples, scores, config, seed, base) -> ClusterAssignment | None``.

A topic table is formed without the scores, so its groups follow whatever varies most in the text.
When that is not what the harmful rows have in common, the harm spreads over many topics and no
cluster stands out, although the per-row ranking finds the harmful rows. Measured on the bestiary's
``bestiary_poison_diets`` (48 planted rows among 848, declared clusters removed, EK-FAC scores,
planted rows at AUC 0.989): the sentence encoder groups the rows by the made-up animal name each
one mentions, and the three phrasings the planted rows use share no word ("Which plant does the X
feed on?", "Name the food of the X.", "The X eats what?"). HDBSCAN put 38 of the 48 planted rows
in its noise group and the rest in three entity clusters; the most harmful cluster carried 17% of
the harm. Over TF-IDF every planted row was noise; KMeans (k=8) split them by phrasing (16, 16,
16) over TF-IDF, and 32 / 16 over the sentence encoder. Gradient space has no group to find:
the planted rows' unit gradients have a mean cosine of 0.02 with each other (0.00 with the other
rows).

The harmful rows themselves do share a kind: among the rows whose scores are negative, the
planted rows differ from the other harmful rows (letter and arithmetic drills, hurt by the answer
format) by their whole phrasing. So the rows with a negative score are clustered on their own,
with the same embedding and HDBSCAN (``clustering.min_cluster_size``) as the topic table: 286
rows on the bestiary give three groups, one of 110 rows holding all 48 planted rows, carrying
66% of the harm; grown with the rows near it (below), 392 rows, and the accused set refined in it
is the 48 planted rows (precision and recall 1.00 under EK-FAC and K-FAC). Each group found becomes a cluster ``harm-0``, ``harm-1``, ... (largest first);
every row with a non-negative score joins the group of its nearest harmful row when it lies within
the group's reach, so that a group is a kind of row with its helpful members, and the verdict
judges the kind's net influence (without them, DataInf's scores made a group of clean letter
drills lumpy; with them it harms at 0.6x the rest's rate and the verdict stays ``config``). The
harmful rows HDBSCAN leaves as noise join the group of their nearest grouped harmful row under the
same rule (HDBSCAN's noise is a row too sparse to seed a group, not one unlike every group: under
EK-FAC over the bestiary's checkpoints, 8 of the 48 planted rows were noise and the accused set
missed them); the rows near no group keep the topic ``base`` gave them. The accused set is then
refined inside the group as usual (``refine_accused``).

The growth weighs a group; it does not size it. The helpful rows that join can make a group more
than ``verdict.data_max_cluster_fraction`` of the data although the rows to blame are a small part
of it: on the bestiary's fine-tune seed 2 (final adapter, EK-FAC, planted rows at AUC 0.9997) the
group holding all 48 planted rows was 126 harmful rows grown to 427 of 848 (50.4%), and the verdict
read ``config``. So when a grown group passes every other test of the verdict (its share of the
harm, its rate against the rest's), fails only the size one, and its harmful rows stand apart from
its helpful ones (their mean harm at least ``verdict.data_min_rate_ratio`` times the helpful rows'
mean help), the caller judges it again cut back to its harmful rows (``ungrown``: its helpful rows
go back to their topics); there, 126 rows with 98% of the net harm, and the accused set refined in
them is the 48 planted rows. The last condition is what keeps a clean kind hurt as a whole by a
broken setting unaccused: tinyworld's ``lr_10x`` with its declared clusters removed grows a group
of arithmetic drills to 470 of 800 rows, net harmful with the rest net helpful, so only its size
stops it; its harmful rows harm at 2.2x the rate its helpful rows help, and cut back without that
condition they were accused (a ``mixed`` verdict where the setting is the cause). On the bestiary's
three fine-tunes the groups holding the planted rows measure 9.8x to 12.8x, the groups of clean
rows 0.7x to 1.6x. A group that fails the share or the rate test grown is never cut back either.
A tighter reach would not do instead: it changes every group and with it the refined accused sets
(with the median member's nearest-neighbour similarity as the reach, seed 2's group shrank to 144
rows, the refinement found no cut in it and the whole group was accused, precision 0.33), and it
brings the ``lr_10x`` drills under the size limit too (390 rows, 49%, with the 10th percentile).

The cut is ``score < 0`` and not a harm threshold, so the groups keep the small-harm rows of the
same kind around the harmful ones; that is what lets ``refine_accused`` find a gap inside the
group. Taking only the rows with ``asinh(-score / median |score|) > 1`` gave a group of the 48
planted rows alone, in which the gap cut 35 (recall 0.73); with every negative row it cut 48
(precision 1.00, recall 1.00).

Groups are formed over text whatever ``clustering.space`` the base used: inside the harmful rows
the gradient features split the planted rows as much as the whole table did. The caller decides
whether to use the result (``gradian.attribution`` keeps it only when the base table has no lumpy
cluster and this one has, or its top group cut back as above is); this module never reads the
verdict thresholds. Returns None when
there is nothing to group: a declared or single-cluster base, fewer than ``2 x min_cluster_size``
harmful rows, or no group found.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from gradian.cluster.assign import NOISE, ClusterAssignment, _renumber

if TYPE_CHECKING:
    from gradian.config import ClusteringConfig
    from gradian.data import Example

__all__ = ["HARM_GROUP_METHOD", "HARM_GROUP_PREFIX", "harm_groups", "ungrown"]

#: cluster keys of the groups found among the harmful rows
HARM_GROUP_PREFIX = "harm-"
#: ``ClusterAssignment.method`` of an assignment that carries such groups
HARM_GROUP_METHOD = "harm_groups"


def harm_groups(examples: Sequence[Example], scores: Sequence[float] | np.ndarray, config: ClusteringConfig,
                seed: int = 1234, *,
                base: ClusterAssignment, text_vectors: np.ndarray | None = None) -> ClusterAssignment | None:
    """``base`` with the groups HDBSCAN finds among the rows whose score is negative carved out.

    ``examples`` (``gradian.data.Example``) and ``scores`` (sign convention: negative is harm) are
    row-aligned; ``config`` is a ``ClusteringConfig``; ``base`` the topic assignment of the same
    examples; ``text_vectors`` their text embeddings when the caller has them (``embed_texts``
    with the same config and seed), else they are computed. See the module docstring for when None
    is returned.
    """
    from sklearn.cluster import HDBSCAN

    from gradian.cluster.embed import embed_texts
    from gradian.cluster.labels import label_clusters

    examples = list(examples)
    values = np.asarray(scores, dtype=np.float64)
    if len(values) != len(examples):
        raise ValueError(f"{len(values)} scores for {len(examples)} examples; they must be row-aligned")
    if base.method in ("declared", "none", HARM_GROUP_METHOD):
        return None
    min_size = max(2, int(config.min_cluster_size))
    harmful = np.flatnonzero(values < 0)
    if len(harmful) < 2 * min_size:
        return None
    texts = [e.full_text for e in examples]
    if text_vectors is not None:
        if len(text_vectors) != len(examples):
            raise ValueError(f"{len(text_vectors)} text vectors for {len(examples)} examples; they must be row-aligned")
        vectors, backend, described = np.asarray(text_vectors, dtype=np.float64), base.embed_backend, "the given text embeddings"
    else:
        emb = embed_texts(texts, config, seed)
        vectors, backend, described = emb.vectors, emb.backend, emb.reason
    raw = HDBSCAN(min_cluster_size=min_size, copy=True).fit_predict(vectors[harmful])
    found = _renumber(raw)
    groups = sorted({k for k in found if k != NOISE}, key=int)
    if not groups:
        return None
    ids = [e.id for e in examples]
    keys = [str(base.labels[eid]) for eid in ids]
    for row, key in zip(harmful, found):
        if key != NOISE:
            keys[row] = HARM_GROUP_PREFIX + key
    # every other row joins the group of its nearest harmful row, so that a group is a kind of row
    # with its helpful members too, and its net influence is judged, not its harmful members' alone
    # (when it lies within the group's reach: no farther from that row than the group's loosest
    # member is from its nearest fellow member; a row near nothing harmful keeps its topic)
    rest = np.flatnonzero(values >= 0)
    nearest, similarity = _nearest(vectors[rest], vectors[harmful])
    reach = {g: _reach(vectors[harmful[[k == g for k in found]]]) for g in groups}
    joined = 0
    for row, j, sim in zip(rest, nearest, similarity):
        if found[j] != NOISE and sim >= reach[found[j]]:
            keys[row] = HARM_GROUP_PREFIX + found[j]
            joined += 1
    # a harmful row HDBSCAN left as noise joins the group of its nearest grouped harmful row by the
    # same rule: noise means "not dense enough to seed a group", not "unlike every group"
    loose = [k for k, key in enumerate(found) if key == NOISE]
    members = np.asarray([k for k, key in enumerate(found) if key != NOISE], dtype=np.int64)
    adopted = 0
    if loose:
        near, sims = _nearest(vectors[harmful[loose]], vectors[harmful[members]])
        for k, j, sim in zip(loose, near, sims):
            group = found[members[j]]
            if sim >= reach[group]:
                keys[harmful[k]] = HARM_GROUP_PREFIX + group
                adopted += 1
    grouped = sum(k != NOISE for k in found) + adopted
    sizes = ", ".join(f"{HARM_GROUP_PREFIX}{g}: {keys.count(HARM_GROUP_PREFIX + g)}" for g in groups)
    reason = (f"{base.reason}; no topic carried the harm, so the {len(harmful)} rows with a negative score "
              f"were clustered on their own (HDBSCAN, min_cluster_size={min_size}, over {described}) into "
              f"{len(groups)} group(s) holding {grouped} of them, and {joined} of the {len(rest)} other rows "
              f"joined the group of their nearest harmful row ({sizes}); the rest keep their topic")
    names = label_clusters(texts, keys, config.label_top_terms, config.max_features)
    return ClusterAssignment(
        labels=dict(zip(ids, keys)),
        names={str(k): v for k, v in names.items()},
        method=HARM_GROUP_METHOD,
        requested=base.requested,
        reason=reason,
        embed_backend=backend,
        space="text",
    )


def ungrown(examples: Sequence[Example], scores: Sequence[float] | np.ndarray, config: ClusteringConfig, *,
            grouped: ClusterAssignment, base: ClusterAssignment, group: str) -> ClusterAssignment:
    """``grouped`` (what ``harm_groups`` returned for ``base``) with ``group`` cut back to its
    harmful rows: its members whose score is not negative (the helpful rows that joined it) go back
    to the topic ``base`` gave them; the other groups stay as they are. ``examples`` and ``scores``
    are row-aligned, as for ``harm_groups``; the clusters are named again over their new members.
    """
    from gradian.cluster.labels import label_clusters

    examples = list(examples)
    values = np.asarray(scores, dtype=np.float64)
    if len(values) != len(examples):
        raise ValueError(f"{len(values)} scores for {len(examples)} examples; they must be row-aligned")
    ids = [e.id for e in examples]
    keys = [str(grouped.labels[eid]) for eid in ids]
    returned = 0
    for row, (eid, value) in enumerate(zip(ids, values)):
        if value >= 0 and keys[row] == group:
            keys[row] = str(base.labels[eid])
            returned += 1
    names = label_clusters([e.full_text for e in examples], keys, config.label_top_terms, config.max_features)
    return ClusterAssignment(
        labels=dict(zip(ids, keys)),
        names={str(k): v for k, v in names.items()},
        method=grouped.method,
        requested=grouped.requested,
        reason=(f"{grouped.reason}; {group} cut back to its {keys.count(group)} harmful rows, "
                f"its {returned} helpful rows back in their topic"),
        embed_backend=grouped.embed_backend,
        space=grouped.space,
    )


def _nearest(points: np.ndarray, anchors: np.ndarray, chunk: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """Per point, the anchor with the largest dot product (cosine: the vectors are unit length) and
    that similarity."""
    index = np.zeros(len(points), dtype=np.int64)
    best = np.zeros(len(points), dtype=np.float64)
    for start in range(0, len(points), chunk):
        sims = points[start:start + chunk] @ anchors.T
        index[start:start + chunk] = np.argmax(sims, axis=1)
        best[start:start + chunk] = sims[np.arange(len(sims)), index[start:start + chunk]]
    return index, best


def _reach(members: np.ndarray) -> float:
    """The smallest, over a group's members, similarity to the member's nearest fellow member."""
    sims = members @ members.T
    np.fill_diagonal(sims, -np.inf)
    return float(sims.max(axis=1).min())
