"""Configuration: dataclass schemas, YAML loading with flag overrides, validation and hashing.

Public interface: ``GradianConfig`` (and its sections), ``load_config``, ``validate_config``,
``config_hash``, ``config_to_dict``, ``render_starter_config``; ``engine_names`` / ``engine_entry``
(the engines ``engine.name`` may choose, from ``gradian.config.engines``, without importing one).
"""

from gradian.config.loader import (
    config_hash,
    config_to_dict,
    load_config,
    render_starter_config,
    validate_config,
)
from gradian.config.schema import (
    ClusteringConfig,
    EngineConfig,
    EvaluationConfig,
    GradianConfig,
    GradsConfig,
    TrainConfig,
)
from gradian.config.audit import AuditConfig
from gradian.config.verdict import VerdictConfig
from gradian.config.engines import engine_entry, engine_names

__all__ = [
    "AuditConfig",
    "VerdictConfig",
    "ClusteringConfig",
    "EngineConfig",
    "EvaluationConfig",
    "GradianConfig",
    "GradsConfig",
    "TrainConfig",
    "config_hash",
    "config_to_dict",
    "engine_entry",
    "engine_names",
    "load_config",
    "render_starter_config",
    "validate_config",
]
