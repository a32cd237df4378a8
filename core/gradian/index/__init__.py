"""The gradient index: content-addressed, chunked, memory-mapped, checksummed per-example gradients.

Public interface: ``GradientIndex`` (``build`` / ``open`` / ``iter_chunks`` / ``sq_norms`` /
``verify``, ``cache_hit`` after a build), ``index_root``, ``index_identity``, ``index_id``, ``tokenizer_fingerprint``,
``first_difference``, ``library_versions``. Building the index a config describes (load the
model, tokenizer and data, then build or reuse) is ``gradian.attribution.index_from_config``.
"""

from gradian.index.manifest import first_difference, index_id, index_identity, library_versions, tokenizer_fingerprint
from gradian.index.store import GradientIndex, index_root

__all__ = ["GradientIndex", "first_difference", "index_id", "index_identity",
           "index_root", "library_versions", "tokenizer_fingerprint"]
