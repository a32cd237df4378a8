"""Human labels for clusters: each cluster's most distinctive TF-IDF terms.

A term's weight in a cluster is its mean TF-IDF inside the cluster minus its mean outside it, so
words every row shares ("what", "the") do not name every cluster. A cluster that holds every row
has no outside; its label is then its highest mean terms.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

__all__ = ["label_clusters"]


def label_clusters(texts: Sequence[str], keys: Sequence[Hashable], top_terms: int = 4,
                   max_features: int = 4096) -> dict[Hashable, str]:
    """``{cluster key: "term, term, ..."}`` for every key in ``keys`` (row-aligned with ``texts``)."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    unique = list(dict.fromkeys(keys))
    try:
        vectorizer = TfidfVectorizer(max_features=max_features, stop_words="english",
                                     token_pattern=r"(?u)\b[^\W\d_][\w-]+\b")
        matrix = vectorizer.fit_transform(texts).tocsr()
    except ValueError:  # no usable terms anywhere
        return {k: "(no terms)" for k in unique}
    terms = np.asarray(vectorizer.get_feature_names_out())
    keys_arr = np.asarray([str(k) for k in keys])
    total = np.asarray(matrix.sum(axis=0)).ravel()
    n = matrix.shape[0]
    labels: dict[Hashable, str] = {}
    for key in unique:
        mask = keys_arr == str(key)
        inside_sum = np.asarray(matrix[mask].sum(axis=0)).ravel()
        inside = inside_sum / mask.sum()
        outside_n = n - mask.sum()
        weight = inside - (total - inside_sum) / outside_n if outside_n else inside
        # stable order: by weight, then alphabetically, so equal weights never shuffle
        order = np.lexsort((terms, -weight))
        chosen = [terms[i] for i in order[:top_terms] if inside[i] > 0]
        labels[key] = ", ".join(chosen) if chosen else "(no terms)"
    return labels
