"""The gradient index: content-addressed, chunked, memory-mapped, checksummed per-example gradients.

Public interface: ``GradientIndex`` (``build`` / ``open`` / ``iter_chunks`` / ``sq_norms`` /
``verify``, ``cache_hit`` after a build), ``index_from_config(config) -> IndexBuild`` (load, build
or reuse), ``index_root``, ``index_identity``, ``index_id``, ``tokenizer_fingerprint``,
``first_difference``, ``library_versions``.
"""

from gradian.index.from_config import IndexBuild, index_from_config
from gradian.index.manifest import first_difference, index_id, index_identity, library_versions, tokenizer_fingerprint
from gradian.index.store import GradientIndex, index_root

__all__ = ["GradientIndex", "IndexBuild", "index_from_config", "first_difference", "index_id", "index_identity",
           "index_root", "library_versions", "tokenizer_fingerprint"]
