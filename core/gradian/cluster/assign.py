"""``cluster_examples``: one cluster per training example, by the method the config asks for.

Cluster keys are strings. Discovered clusters are numbered ``"0"``, ``"1"``, ... from the largest
down; HDBSCAN's unclustered points go to the ``"noise"`` cluster; declared clusters keep the row's
own value (``"100"``, ``"invoice"``).

The ``auto`` rule, in order:

1. every row declares a ``cluster``/``cluster_id``: use them (``declared``): the user's taxonomy
   beats a discovered one;
2. fewer than two rows: ``none``;
3. fewer rows than ``2 x min_cluster_size``: ``kmeans`` (HDBSCAN cannot form two clusters);
4. HDBSCAN on the embeddings; when it leaves more than half the rows as noise
   (``AUTO_MAX_NOISE_SHARE``) or finds fewer than two clusters, ``kmeans`` instead: a "cluster"
   table whose largest row is noise, or that holds everything in one group, cannot separate a
   harmful group from the rest.

Spaces (``clustering.space``): ``text`` embeds the rows' text (``embed_texts``); ``gradient``
clusters the rows' unit-length, projected per-example gradients (``gradient_features``, passed in
as ``gradient_vectors``); ``both`` concatenates the two, each weighted ``1/sqrt(2)``. ``auto`` is
decided by the caller, who can score both assignments (``gradian.attribution`` keeps the lumpier);
here it means ``text``. Declared clusters ignore the space.

The result is deterministic for a seed: KMeans and TruncatedSVD take it as their random state,
HDBSCAN and the sentence encoder are deterministic on CPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from gradian.errors import ConfigError

if TYPE_CHECKING:
    from gradian.config import ClusteringConfig
    from gradian.data import Example
    from gradian.jsontypes import JsonObject

__all__ = ["AUTO_MAX_NOISE_SHARE", "NOISE", "ClusterAssignment", "cluster_examples"]

NOISE = "noise"
UNDECLARED = "undeclared"
#: auto falls back from HDBSCAN to KMeans when more than this share of rows is noise
AUTO_MAX_NOISE_SHARE = 0.5
_METHODS = ("auto", "declared", "hdbscan", "kmeans", "none")
SPACES = ("text", "gradient", "both", "auto")


@dataclass
class ClusterAssignment:
    """Which cluster each example belongs to, what each cluster is called, and how it was decided.

    ``labels`` maps example id -> cluster key; ``names`` maps cluster key -> its human label;
    ``method`` is the method actually used (never ``auto``), ``requested`` the configured one, and
    ``reason`` why the two differ or how the embeddings were made.
    """

    labels: dict[str, str]
    names: dict[str, str]
    method: str
    requested: str
    reason: str
    embed_backend: str | None = None
    sizes: dict[str, int] = field(default_factory=dict)
    #: what the clusters were formed over: text, gradient or both (declared/none: text)
    space: str = "text"

    def __post_init__(self) -> None:
        if not self.sizes:
            self.sizes = dict(Counter(self.labels.values()))

    def cluster_of(self, example_id: str) -> str:
        return self.labels[example_id]

    def members(self, cluster: str) -> list[str]:
        """Example ids in ``cluster``, in dataset order."""
        return [eid for eid, key in self.labels.items() if key == str(cluster)]

    def to_dict(self) -> JsonObject:
        return asdict(self)


def _renumber(raw: np.ndarray) -> list[str]:
    """Cluster ids ``"0".."k-1"`` ordered by size (largest first, ties by first appearance)."""
    counts = Counter(int(x) for x in raw if x >= 0)
    first: dict[int, int] = {}
    for i, x in enumerate(raw):
        first.setdefault(int(x), i)
    order = sorted(counts, key=lambda c: (-counts[c], first[c]))
    mapping = {c: str(i) for i, c in enumerate(order)}
    return [mapping[int(x)] if x >= 0 else NOISE for x in raw]


def _kmeans(vectors: np.ndarray, n_clusters: int, seed: int) -> list[str]:
    from sklearn.cluster import KMeans

    k = max(1, min(n_clusters, len(vectors), len(np.unique(vectors.round(12), axis=0))))
    if k == 1:
        return ["0"] * len(vectors)
    raw = KMeans(n_clusters=k, random_state=seed, n_init=10).fit_predict(vectors)
    return _renumber(raw)


def _hdbscan(vectors: np.ndarray, min_cluster_size: int) -> list[str]:
    from sklearn.cluster import HDBSCAN

    raw = HDBSCAN(min_cluster_size=max(2, min_cluster_size), copy=True).fit_predict(vectors)
    return _renumber(raw)


def cluster_examples(examples: Sequence[Example], config: ClusteringConfig, seed: int = 1234, *,
                     gradient_vectors: np.ndarray | None = None, space: str | None = None) -> ClusterAssignment:
    """Assign every example (``gradian.data.Example``) to a cluster per ``config`` (a ``ClusteringConfig``).

    ``space`` overrides ``config.space``; ``gradient`` and ``both`` need ``gradient_vectors``
    (row-aligned with ``examples``).
    """
    from gradian.cluster.embed import embed_texts
    from gradian.cluster.labels import label_clusters

    requested = config.method
    if requested not in _METHODS:
        raise ConfigError(f"clustering.method={requested!r} is not one of {', '.join(_METHODS)}")
    space = space or getattr(config, "space", "text")
    if space not in SPACES:
        raise ConfigError(f"clustering.space={space!r} is not one of {', '.join(SPACES)}")
    if space == "auto":
        space = "text"
    if space in ("gradient", "both") and gradient_vectors is None:
        raise ConfigError(f"clustering.space={space!r} needs the per-example gradients of the index; "
                          "it is available in `gradian attribute`, or set clustering.space: text")
    examples = list(examples)
    ids = [e.id for e in examples]
    texts = [e.full_text for e in examples]
    declared = [e.cluster for e in examples]
    n = len(examples)
    method, reason, backend = requested, "", None

    if requested == "auto":
        if n and all(c not in (None, "") for c in declared):
            method, reason = "declared", "every row declares a cluster"
        elif n < 2:
            method, reason = "none", f"only {n} example(s)"
        elif n < 2 * max(2, config.min_cluster_size):
            method, reason = "kmeans", f"{n} examples are too few for HDBSCAN (min_cluster_size={config.min_cluster_size})"
        else:
            method = "hdbscan"

    if method == "declared":
        missing = sum(c in (None, "") for c in declared)
        keys = [str(c) if c not in (None, "") else UNDECLARED for c in declared]
        reason = reason or "clustering.method: declared"
        if missing:
            reason += f"; {missing} row(s) without a cluster are grouped as '{UNDECLARED}'"
    elif method == "none":
        keys = ["0"] * n
        reason = reason or "clustering.method: none (one cluster holds every example)"
    else:
        if space == "gradient":
            vectors, backend, described = np.asarray(gradient_vectors, dtype=np.float64), None, "per-example gradients"
        else:
            emb = embed_texts(texts, config, seed)
            vectors, backend, described = emb.vectors, emb.backend, emb.reason
            if space == "both":
                vectors = np.concatenate([vectors, np.asarray(gradient_vectors, dtype=np.float64)], axis=1) / np.sqrt(2.0)
                described += " concatenated with per-example gradients"
        if method == "hdbscan":
            if n < config.min_cluster_size:  # sklearn would raise a bare ValueError about min_samples
                raise ConfigError(
                    f"'clustering.min_cluster_size' is {config.min_cluster_size} but only {n} rows are clustered, "
                    f"so HDBSCAN cannot form a single cluster; set it to at most {max(2, n // 2)}, or use "
                    "clustering.method: kmeans"
                )
            keys = _hdbscan(vectors, config.min_cluster_size)
            noise_share = keys.count(NOISE) / n
            n_found = len(set(keys) - {NOISE})
            if requested == "auto" and (noise_share > AUTO_MAX_NOISE_SHARE or n_found < 2):
                keys = _kmeans(vectors, config.n_clusters, seed)
                method = "kmeans"
                reason = (f"HDBSCAN left {noise_share:.0%} of rows as noise and found {n_found} "
                          f"cluster(s), so KMeans (k={config.n_clusters}) was used")
            else:
                reason = reason or (f"HDBSCAN found {n_found} cluster(s), {noise_share:.0%} noise")
        else:
            keys = _kmeans(vectors, config.n_clusters, seed)
            reason = reason or f"KMeans with n_clusters={config.n_clusters}"
        reason += f"; embeddings: {described}"

    names = label_clusters(texts, keys, config.label_top_terms, config.max_features) if n else {}
    return ClusterAssignment(
        labels=dict(zip(ids, keys)),
        names={str(k): v for k, v in names.items()},
        method=method,
        requested=requested,
        reason=reason,
        embed_backend=backend,
        space=space if method not in ("declared", "none") else "text",
    )
