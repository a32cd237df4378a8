"""The cluster stage: group training examples so the report can speak about groups, not rows.

Interface:

- ``cluster_examples(examples, config, seed) -> ClusterAssignment``: one cluster key per example
  id, a human label per cluster (its most distinctive TF-IDF terms), and the method actually used
  with the reason it was chosen.
- ``embed_texts(texts, config, seed) -> Embeddings``: sentence-transformers with the packaged
  all-MiniLM-L6-v2 when it is installed and allowed, else TF-IDF + TruncatedSVD.
- ``label_clusters(texts, keys, top_terms, max_features) -> dict``: top-terms labels.
- ``gradient_features(train, rows, dim, seed) -> ndarray``: unit-length, seeded-projected
  per-example gradients from the index, the points of ``clustering.space: gradient``.
- ``harm_groups(examples, scores, config, seed, base) -> ClusterAssignment | None``: ``base`` with
  the groups found among the rows whose score is negative (clustered on their own, by text) as
  clusters ``harm-0``, ``harm-1``, ...: the table to use when no topic of ``base`` carries the harm;
  ``ungrown(examples, scores, config, grouped=, base=, group=)`` cuts one such group back to its
  harmful rows.
- ``refine_accused(cluster, member_ids, member_scores, ...) -> AccusedSet``: the rows to act on
  inside the accused cluster, the share of its harm they carry, and the rows left out;
  ``add_gradient_siblings`` then adds the rows whose gradients copy an accused row's, and
  ``leave_out_known`` takes out the rows the base model already answered as written.

Methods: ``declared`` (the rows' own ``cluster``/``cluster_id``), ``hdbscan``, ``kmeans``,
``none`` (one cluster holding everything) and ``auto`` (see ``gradian.cluster.assign``).
"""

from gradian.cluster.accused import (KNOWN_NATS, AccusedCandidate, AccusedSet, add_gradient_siblings,
                                     gradient_cosines_to, leave_out_known, refine_accused, sibling_anchors)
from gradian.cluster.assign import NOISE, SPACES, ClusterAssignment, cluster_examples
from gradian.cluster.embed import DEFAULT_EMBED_MODEL, Embeddings, embed_texts
from gradian.cluster.gradient_space import DEFAULT_GRADIENT_DIM, gradient_features
from gradian.cluster.harm_groups import HARM_GROUP_METHOD, HARM_GROUP_PREFIX, harm_groups, ungrown
from gradian.cluster.labels import label_clusters

__all__ = [
    "DEFAULT_EMBED_MODEL",
    "DEFAULT_GRADIENT_DIM",
    "HARM_GROUP_METHOD",
    "HARM_GROUP_PREFIX",
    "KNOWN_NATS",
    "NOISE",
    "SPACES",
    "AccusedCandidate",
    "AccusedSet",
    "ClusterAssignment",
    "Embeddings",
    "cluster_examples",
    "embed_texts",
    "gradient_features",
    "harm_groups",
    "label_clusters",
    "leave_out_known",
    "refine_accused",
    "add_gradient_siblings",
    "gradient_cosines_to",
    "sibling_anchors",
    "ungrown",
]
