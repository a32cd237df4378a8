"""Thresholds of the verdict: the ``verdict:`` section of the config.

Every number the verdict synthesis compares against (when a cluster is lumpy enough to accuse,
when the engines disagree, which config findings turn a verdict) lives here, with the reason for its
default, so the same thresholds reach the clustering of the attribution lane and the report's
verdict. ``gradian.report.decision`` reads them as ``VerdictThresholds``. Invalid values raise
``ConfigError`` naming ``verdict.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gradian.errors import ConfigError
from gradian.findings import SEVERITIES

__all__ = ["VerdictConfig"]


@dataclass
class VerdictConfig:
    """Every number the verdict depends on, with its default and why."""

    data_min_share: float = field(default=0.5, metadata={"help": (
        "The accused cluster must carry at least this share of the harm: the larger of its share of "
        "all negative scores and its share of the net harm of the net-harmful clusters")})
    data_min_negative_share: float = field(default=0.1, metadata={"help": (
        "Whatever its share of the net harm, the accused cluster must carry at least this share of "
        "all negative scores: the only net-harmful cluster can hold a sliver of the harm when the "
        "harmful rows sit in net-helpful clusters")})
    data_min_rate_ratio: float = field(default=5.0, metadata={"help": (
        "Its mean score per example must be at least this many times the rest's (infinite when the "
        "rest is net helpful); a cluster that wins only on size is not lumpy")})
    data_max_cluster_fraction: float = field(default=0.5, metadata={"help": (
        "A cluster holding more than this share of the dataset is the dataset, not a subset to blame "
        "(a harm group grown past it by helpful neighbours is judged on its harmful rows instead)")})
    engine_agreement_moderate: float = field(default=0.8, metadata={"help": (
        "Cross-check Spearman below this raises attribution.engine_disagreement (medium) and a hedge")})
    engine_agreement_low: float = field(default=0.5, metadata={"help": (
        "Below this the engine disagreement finding is high: at least one engine's approximation fails")})
    config_min_severity: str = field(default="medium", metadata={"help": (
        "Config/dynamics findings at least this severe make a flat distribution a config verdict")})
    mixed_config_min_severity: str = field(default="high", metadata={"help": (
        "Config/dynamics findings at least this severe turn a lumpy data verdict into mixed")})
    overlap_top_k: int = field(default=5, metadata={"help": (
        "How many top harmful examples are compared with the data findings' rows")})

    def __post_init__(self) -> None:
        for name in ("data_min_share", "data_max_cluster_fraction"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"'verdict.{name}' is {value!r}; it must lie in (0, 1]")
        if not 0.0 <= self.data_min_negative_share <= 1.0:
            raise ConfigError(f"'verdict.data_min_negative_share' is {self.data_min_negative_share!r}; "
                              "it must lie in [0, 1]")
        if not self.data_min_rate_ratio >= 1.0:
            raise ConfigError(f"'verdict.data_min_rate_ratio' is {self.data_min_rate_ratio!r}; it must be at least 1")
        if not self.engine_agreement_low <= self.engine_agreement_moderate:
            raise ConfigError(f"'verdict.engine_agreement_low' is {self.engine_agreement_low!r}; it must not exceed "
                              f"'verdict.engine_agreement_moderate' ({self.engine_agreement_moderate!r})")
        for name in ("config_min_severity", "mixed_config_min_severity"):
            if getattr(self, name) not in SEVERITIES:
                raise ConfigError(f"'verdict.{name}' is {getattr(self, name)!r}; it must be one of "
                                  f"{', '.join(SEVERITIES)}")
        if self.overlap_top_k < 1:
            raise ConfigError(f"'verdict.overlap_top_k' is {self.overlap_top_k!r}; it must be at least 1")
