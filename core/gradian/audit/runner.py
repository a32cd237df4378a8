"""``run_audit``: run every registered check over the inputs given, and collect the outcome.

A check whose inputs are missing is not run but listed in ``AuditResult.skipped`` with the reason;
so is a check that raised ``CheckSkipped``, and one that failed (its error is the reason), so one
broken row or template never hides the other forty checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Iterable, cast

from gradian.audit.context import AuditContext
from gradian.audit.registry import Check, CheckSkipped, all_checks, get_check
from gradian.config.audit import AuditConfig
from gradian.errors import GradianError
from gradian.findings import SEVERITIES, Finding, severity_rank

if TYPE_CHECKING:  # imported lazily at run time: the data layer pulls in tokenizer code
    from transformers import PreTrainedTokenizerBase

    from gradian.config.verdict import VerdictConfig
    from gradian.data import Dataset
    from gradian.jsontypes import JsonObject
    from gradian.runs import RunRecord

__all__ = ["AuditResult", "SkippedCheck", "run_audit", "audit_verdict"]


@dataclass
class SkippedCheck:
    id: str
    category: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class AuditResult:
    """Findings most severe first, the checks skipped with their reasons, and the ids that ran."""

    findings: list[Finding] = field(default_factory=list)
    skipped: list[SkippedCheck] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)

    def at_least(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if f.at_least(severity)]

    def counts(self) -> dict[str, int]:
        """Findings per severity, every severity present (zero included)."""
        out = {s: 0 for s in SEVERITIES}
        for f in self.findings:
            out[f.severity] += 1
        return out

    def verdict(self, thresholds: VerdictConfig | None = None) -> JsonObject:
        return audit_verdict(self, thresholds)


def run_audit(
    dataset: Dataset | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    run: RunRecord | None = None,
    eval_dataset: Dataset | None = None,
    max_seq_length: int | None = None,
    base_model: str | None = None,
    config: AuditConfig | None = None,
    checks: Iterable[str] | None = None,
    tokenizer_missing: str | None = None,
    eval_metric: str | None = None,
) -> AuditResult:
    """Run the audit checks (all, or the ids in ``checks``) over whichever inputs are given.

    ``dataset``/``eval_dataset`` are ``gradian.data.Dataset``; ``tokenizer`` a fast HF tokenizer;
    ``run`` a ``gradian.runs.RunRecord``. ``max_seq_length`` defaults to the run's recorded value.
    ``base_model`` is what the adapter is being analyzed against (for config.base_model_mismatch).
    ``tokenizer_missing`` says why no tokenizer is given although the run named one (skip lines).
    ``eval_metric`` is how the eval set is scored (what counts as an item's wanted answer).
    """
    if max_seq_length is None and run is not None:
        max_seq_length = run.config.max_seq_length
    ctx = AuditContext(
        dataset=dataset,
        eval_dataset=eval_dataset,
        tokenizer=tokenizer,
        run=run,
        max_seq_length=max_seq_length,
        base_model=base_model,
        config=config if config is not None else AuditConfig(),
        tokenizer_missing=tokenizer_missing,
        eval_metric=eval_metric,
    )
    selected = all_checks() if checks is None else [get_check(c) for c in checks]
    result = AuditResult()
    for check in selected:
        _run_one(check, ctx, result)
    result.findings.sort(key=lambda f: (severity_rank(f.severity), f.id))
    return result


def _run_one(check: Check, ctx: AuditContext, result: AuditResult) -> None:
    reason = ctx.missing(check.needs)
    if reason is not None:
        result.skipped.append(SkippedCheck(check.id, check.category, reason))
        return
    ctx.current_check = check.id
    try:
        out = check.run(ctx)
    except CheckSkipped as skip:
        result.skipped.append(SkippedCheck(check.id, check.category, str(skip)))
        return
    except GradianError as err:  # e.g. a chat template that cannot render a row
        result.skipped.append(SkippedCheck(check.id, check.category, str(err)))
        return
    except Exception as err:  # a bug must not take the other checks down with it
        result.skipped.append(
            SkippedCheck(check.id, check.category, f"check failed ({type(err).__name__}: {err})")
        )
        return
    result.ran.append(check.id)
    if out is None:
        return
    # a check returns one Finding, an iterable of them, or None
    for finding in [out] if isinstance(out, Finding) else list(cast("Iterable[Finding]", out)):
        result.findings.append(finding)


def audit_verdict(result: AuditResult, thresholds: VerdictConfig | None = None) -> JsonObject:
    """The report's ``verdict`` for an audit alone, decided by ``gradian.report.decision.decide_verdict``
    with no capability and no attribution: the critical findings lead, else the high ones name the
    kind of cause (``config``, ``data``, ``mixed``), else ``inconclusive``. Skipped checks are hedged.
    ``thresholds`` is the config's ``verdict`` section (its defaults when None).
    """
    from gradian.report.decision import Hedge, decide_verdict
    from gradian.report.verdict import verdict_block

    decision = decide_verdict(None, result.findings, None, thresholds)
    if result.skipped:
        skipped = Hedge("checks_skipped", {"n_skipped": len(result.skipped),
                                           "n_checks": len(result.skipped) + len(result.ran)})
        decision = replace(decision, hedges=decision.hedges + (skipped,))
    return verdict_block(decision)
