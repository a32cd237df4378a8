"""The cluster stage: group training examples so the report can speak about groups, not rows.

Interface:

- ``cluster_examples(examples, config, seed) -> ClusterAssignment``: one cluster key per example
  id, a human label per cluster (its most distinctive TF-IDF terms), and the method actually used
  with the reason it was chosen.
- ``embed_texts(texts, config, seed) -> Embeddings``: sentence-transformers with the packaged
  all-MiniLM-L6-v2 when it is installed and allowed, else TF-IDF + TruncatedSVD.
- ``label_clusters(texts, keys, top_terms, max_features) -> dict``: top-terms labels.

Methods: ``declared`` (the rows' own ``cluster``/``cluster_id``), ``hdbscan``, ``kmeans``,
``none`` (one cluster holding everything) and ``auto`` (see ``gradian.cluster.assign``).
"""

from gradian.cluster.assign import NOISE, ClusterAssignment, cluster_examples
from gradian.cluster.embed import DEFAULT_EMBED_MODEL, Embeddings, embed_texts
from gradian.cluster.labels import label_clusters

__all__ = [
    "DEFAULT_EMBED_MODEL",
    "NOISE",
    "ClusterAssignment",
    "Embeddings",
    "cluster_examples",
    "embed_texts",
    "label_clusters",
]
