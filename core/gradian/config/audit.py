"""Thresholds of the audit checks: the ``audit:`` section of the config.

Every number a check compares against lives here, with the reason for its default in the help
text, so a team can tighten or relax a check without touching code. ``docs/checks.md`` lists which
check reads which key. Invalid values raise ``ConfigError`` naming ``audit.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TypeVar

from gradian.errors import ConfigError

__all__ = ["AuditConfig"]


_T = TypeVar("_T")


def _f(default: _T, help: str) -> _T:
    return field(default=default, metadata={"help": help})


@dataclass
class AuditConfig:
    """Thresholds of the 41 audit checks. Shares are fractions in [0, 1]; rates are per step."""

    # -- learning rate (effective LoRA rate = learning_rate x alpha / r, or alpha / sqrt(r)) ---
    reference_effective_lr: float = _f(
        4e-4,
        "The usual effective LoRA rate (2e-4 at alpha = 2r); quoted in messages for comparison",
    )
    lr_high_effective: float = _f(
        8e-4, "config.lr_too_high fires (high) when the effective LoRA rate exceeds this (2x usual)"
    )
    lr_critical_effective: float = _f(
        3e-3, "config.lr_too_high becomes critical above this effective rate (7.5x usual)"
    )
    lr_low_effective: float = _f(
        2e-5, "config.lr_too_low fires when the effective LoRA rate is below this (1/20 of usual)"
    )
    no_warmup_effective_lr: float = _f(
        5e-4, "config.no_warmup fires when there is no warmup and the effective rate exceeds this"
    )
    small_batch_max: int = _f(
        2, "config.small_effective_batch: effective batch sizes at or below this count as small"
    )
    small_batch_effective_lr: float = _f(
        4e-4, "config.small_effective_batch fires only when the effective rate is above this"
    )
    # -- training length -------------------------------------------------------------------------
    overtraining_epochs_medium: float = _f(
        3.0, "config.overtraining (medium): epochs at or above this on a dataset below overtraining_small_dataset rows "
        "(3 passes over a few hundred rows already invite memorization; raise to 4 to leave the trainers' default unflagged)"
    )
    overtraining_epochs_high: float = _f(
        6.0, "config.overtraining (high): epochs at or above this on any dataset size"
    )
    overtraining_small_dataset: int = _f(
        5000, "Datasets with fewer rows than this count as small for config.overtraining"
    )
    undertrained_min_steps: int = _f(
        30, "config.undertrained fires when the run plans fewer optimizer steps than this"
    )
    # -- adapter ---------------------------------------------------------------------------------
    capacity_min_examples_per_rank: float = _f(
        8.0, "config.capacity_vs_data fires when the dataset has fewer than this many rows per unit of LoRA rank"
    )
    high_lora_dropout: float = _f(
        0.1, "config.high_lora_dropout fires when lora_dropout is above this on a small dataset"
    )
    dropout_small_dataset: int = _f(
        1000, "Datasets with fewer rows than this count as small for config.high_lora_dropout"
    )
    seq_length_quantile: float = _f(
        0.95, "config.max_seq_length_vs_data fires when max_seq_length is below this quantile of tokenized lengths"
    )
    # -- data ------------------------------------------------------------------------------------
    tiny_dataset_examples: int = _f(
        100, "data.tiny_dataset fires below this many rows (too few for stable attribution)"
    )
    truncated_medium_share: float = _f(
        0.05, "data.truncated is medium (else low) when this share of rows or more is truncated"
    )
    completion_truncated_high_share: float = _f(
        0.02, "data.completion_truncated is high (else medium) from this share of rows"
    )
    completion_truncated_critical_share: float = _f(
        0.25, "data.completion_truncated is critical from this share of rows"
    )
    no_supervised_critical_share: float = _f(
        0.05, "data.no_supervised_tokens is critical (else high) from this share of rows"
    )
    missing_eos_high_share: float = _f(
        0.5, "data.missing_eos is high (else medium) when this share of untruncated rows lacks EOS"
    )
    min_mask_coverage: float = _f(
        0.02, "data.loss_mask_coverage (low) fires when supervised tokens are below this share of all tokens"
    )
    prompt_in_mask_high_share: float = _f(
        0.05, "data.loss_mask_coverage is high when this share of rows trains on prompt tokens"
    )
    duplicate_medium_share: float = _f(
        0.05, "data.duplicates is medium (else low) when extra copies reach this share of rows"
    )
    near_duplicate_jaccard: float = _f(
        0.9, "data.near_duplicates: estimated Jaccard similarity of word 3-gram shingles at or above this"
    )
    near_duplicate_num_perm: int = _f(
        64, "MinHash permutations for data.near_duplicates (more is slower and more exact)"
    )
    near_duplicate_medium_share: float = _f(
        0.05, "data.near_duplicates is medium (else low) from this share of rows"
    )
    conflicting_high_share: float = _f(
        0.01, "data.conflicting_answers is high (else medium) when conflicting rows reach this share"
    )
    contamination_critical_share: float = _f(
        0.1, "data.train_eval_contamination is critical from this share of eval items (high below)"
    )
    length_outlier_factor: float = _f(
        8.0, "data.length_outliers: rows longer than this multiple of the median length"
    )
    length_outlier_min_tokens: int = _f(
        512, "data.length_outliers ignores rows shorter than this many tokens (estimated at 4 characters per token without a tokenizer)"
    )
    empty_targets_high_share: float = _f(
        0.01, "data.empty_or_degenerate_targets is high (else medium) from this share of rows"
    )
    degenerate_min_words: int = _f(
        12, "data.empty_or_degenerate_targets checks repetition only in targets of at least this many words"
    )
    degenerate_max_distinct_ratio: float = _f(
        0.2, "A target whose distinct-word share is at or below this counts as degenerate repetition"
    )
    format_majority_share: float = _f(
        0.8, "data.format_inconsistency fires when a structured target format (JSON, code) covers at least this share but not all"
    )
    prompt_equals_target_medium_share: float = _f(
        0.01, "data.prompt_equals_target is medium (else low) from this share of rows"
    )
    # -- dynamics --------------------------------------------------------------------------------
    min_logged_steps: int = _f(
        5, "dynamics.too_few_steps fires below this many logged loss values; curve checks need at least this many"
    )
    clipping_share: float = _f(
        0.8, "dynamics.always_clipping fires when this share of logged grad norms is at or above max_grad_norm"
    )
    spike_factor: float = _f(
        3.0, "dynamics.loss_spike: a loss above this multiple of the rolling median of the previous losses"
    )
    spike_window: int = _f(10, "Number of previous logged losses in the rolling median for spikes")
    grad_explosion_factor: float = _f(
        10.0, "dynamics.grad_norm_explosion: a grad norm above this multiple of the run's median grad norm"
    )
    grad_explosion_sustained_steps: int = _f(
        3, "dynamics.grad_norm_explosion: this many blown-up steps make it high; fewer isolated ones, "
        "clipped by max_grad_norm, are medium"
    )
    plateau_min_relative_drop: float = _f(
        0.02, "dynamics.loss_plateau fires when the loss fell by less than this share from the first to the last tenth of the logs"
    )
    lr_end_fraction: float = _f(
        0.25, "dynamics.lr_schedule_incomplete fires when a decaying schedule ends above this share of its peak rate"
    )
    overfit_min_rise: float = _f(
        0.05, "dynamics.overfitting (medium): final eval loss this share above its minimum while train loss kept falling"
    )
    overfit_high_rise: float = _f(0.25, "dynamics.overfitting is high from this relative rise")
    # -- reporting -------------------------------------------------------------------------------
    max_example_ids: int = _f(50, "At most this many example ids are attached to one finding")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"audit.{f.name} must be a number, got {value!r}")
            if value < 0:
                raise ConfigError(f"audit.{f.name} must not be negative, got {value!r}")
        for name in _SHARES:
            value = getattr(self, name)
            if value > 1:
                raise ConfigError(
                    f"audit.{name} is a share and must lie in [0, 1], got {value!r}; write 0.05 for 5%"
                )
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ConfigError(f"audit.{name} must be positive, got {getattr(self, name)!r}")
        if self.lr_critical_effective < self.lr_high_effective:
            raise ConfigError(
                f"audit.lr_critical_effective ({self.lr_critical_effective}) must be at least "
                f"audit.lr_high_effective ({self.lr_high_effective})"
            )
        if self.overtraining_epochs_high < self.overtraining_epochs_medium:
            raise ConfigError(
                f"audit.overtraining_epochs_high ({self.overtraining_epochs_high}) must be at least "
                f"audit.overtraining_epochs_medium ({self.overtraining_epochs_medium})"
            )
        if self.overfit_high_rise < self.overfit_min_rise:
            raise ConfigError(
                f"audit.overfit_high_rise ({self.overfit_high_rise}) must be at least "
                f"audit.overfit_min_rise ({self.overfit_min_rise})"
            )
        if self.spike_factor <= 1 or self.grad_explosion_factor <= 1 or self.length_outlier_factor <= 1:
            raise ConfigError(
                "audit.spike_factor, audit.grad_explosion_factor and audit.length_outlier_factor "
                "are multiples of a median and must be above 1"
            )


_SHARES = (
    "seq_length_quantile",
    "truncated_medium_share",
    "completion_truncated_high_share",
    "completion_truncated_critical_share",
    "no_supervised_critical_share",
    "missing_eos_high_share",
    "min_mask_coverage",
    "prompt_in_mask_high_share",
    "duplicate_medium_share",
    "near_duplicate_jaccard",
    "near_duplicate_medium_share",
    "conflicting_high_share",
    "contamination_critical_share",
    "degenerate_max_distinct_ratio",
    "empty_targets_high_share",
    "format_majority_share",
    "prompt_equals_target_medium_share",
    "clipping_share",
    "plateau_min_relative_drop",
    "lr_end_fraction",
    "high_lora_dropout",
)

_POSITIVE = (
    "reference_effective_lr",
    "lr_high_effective",
    "lr_critical_effective",
    "small_batch_max",
    "overtraining_epochs_medium",
    "overtraining_epochs_high",
    "near_duplicate_num_perm",
    "spike_window",
    "min_logged_steps",
    "max_example_ids",
    "near_duplicate_jaccard",
)
