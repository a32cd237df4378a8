"""The ``Finding``: one statement the audit or the attribution lane makes about a run.

A finding is what every lane hands to the report: an id such as ``data.completion_truncated``, a
category, a severity, a one-line title, a message carrying the actual numbers, the evidence those
numbers came from, the example ids involved and a concrete fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EVAL_CONFLICT_ID", "SEVERITIES", "Finding", "severity_rank"]

#: Most severe first. ``critical`` means the run is invalid or dominated by this problem.
SEVERITIES: tuple[str, ...] = ("critical", "high", "medium", "low", "info")


def severity_rank(severity: str) -> int:
    """0 for ``critical`` up to 4 for ``info``; lower is more severe."""
    try:
        return SEVERITIES.index(severity)
    except ValueError:
        raise ValueError(
            f"unknown severity {severity!r}; use one of {', '.join(SEVERITIES)}"
        ) from None


#: the finding ``data.train_eval_contamination`` raises when eval prompts are trained with other
#: answers than the eval's; its ``evidence["row_ids"]`` lists every such training row
EVAL_CONFLICT_ID = "data.train_eval_conflict"


@dataclass
class Finding:
    id: str
    category: str
    severity: str
    title: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    example_ids: list[str] = field(default_factory=list)
    fix: str = ""

    def __post_init__(self) -> None:
        severity_rank(self.severity)

    def at_least(self, severity: str) -> bool:
        """True when this finding is as severe as ``severity`` or more."""
        return severity_rank(self.severity) <= severity_rank(severity)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Finding":
        return cls(**data)
