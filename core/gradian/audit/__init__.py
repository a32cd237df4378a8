"""The audit: 41 deterministic checks over the dataset, the trainer config and the logged metrics.

Public interface: ``run_audit`` -> ``AuditResult`` (``findings``, ``skipped``, ``ran``,
``verdict()``); the registry (``all_checks``, ``get_check``, ``register``, ``Check``,
``CheckSkipped``); ``AuditContext`` for writing checks; ``build_diagnosis_report`` (the typed
``Report``) and ``write_diagnosis`` for ``diagnose.json``/``.md``/``.html``. Checks live by category in ``config_checks``,
``data_checks`` and ``dynamics_checks``; thresholds in ``gradian.config.audit.AuditConfig``.
No GPU and no model weights: a tokenizer at most.
"""

from gradian.audit.context import AuditContext
from gradian.audit.registry import Check, CheckSkipped, all_checks, get_check, register
from gradian.audit.report import build_diagnosis_report, render_diagnosis_markdown, write_diagnosis
from gradian.audit.runner import AuditResult, SkippedCheck, audit_verdict, run_audit

__all__ = [
    "AuditContext",
    "AuditResult",
    "Check",
    "CheckSkipped",
    "SkippedCheck",
    "all_checks",
    "audit_verdict",
    "build_diagnosis_report",
    "get_check",
    "register",
    "render_diagnosis_markdown",
    "run_audit",
    "write_diagnosis",
]
