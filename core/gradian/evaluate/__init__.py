"""The evaluate lane: did the capability really regress, and how much of it can data explain?

Interface:

- ``evaluate_capability(config, eval_dataset=None, *, model=None, tokenizer=None, adapter_path=None,
  capability="capability") -> CapabilityResult``: the whole lane. Loads the base model and adapter
  once as a ``PeftModel`` (or reuses the caller's) and scores the base with the adapter disabled.
- ``gate_attribution(result, require_significant=True) -> AttributionGate``: the significance
  gate; a failed gate carries the ``attribution.gate_failed`` finding.
- Stages, for callers that hold their own pieces: ``load_tuned_model``, ``collect_outputs``,
  ``generate_completions``, ``completion_logprobs``, ``score_items``, ``base_preference_margins``,
  ``summarize_capability``, ``paired_bootstrap``, ``score_text``.
- Results: ``CapabilityResult`` (``to_dict()`` is report.json's ``capability`` block),
  ``ItemResult``, ``BootstrapResult``, ``CompletionLogprob``, ``ModelOutputs``.

Torch, transformers and peft are imported inside the functions that need them.
"""

from gradian.evaluate.bootstrap import (
    STATUSES,
    BootstrapResult,
    bootstrap_deltas,
    paired_bootstrap,
    status_of_interval,
)
from gradian.evaluate.capability import (
    LOW_BASE_SCORE,
    WEAK_MARGIN_NATS,
    ModelOutputs,
    base_preference_margins,
    collect_outputs,
    evaluate_capability,
    score_items,
    summarize_capability,
)
from gradian.evaluate.gate import AttributionGate, gate_attribution
from gradian.evaluate.generation import generate_completions
from gradian.evaluate.likelihood import CompletionLogprob, completion_logprobs
from gradian.evaluate.loading import load_tuned_model
from gradian.evaluate.metrics import METRICS, PROXY_METRICS, TEXT_METRICS, score_text, split_markers
from gradian.evaluate.result import CapabilityResult, ItemResult

__all__ = [
    "LOW_BASE_SCORE",
    "METRICS",
    "PROXY_METRICS",
    "STATUSES",
    "TEXT_METRICS",
    "WEAK_MARGIN_NATS",
    "AttributionGate",
    "BootstrapResult",
    "CapabilityResult",
    "CompletionLogprob",
    "ItemResult",
    "ModelOutputs",
    "base_preference_margins",
    "bootstrap_deltas",
    "collect_outputs",
    "completion_logprobs",
    "evaluate_capability",
    "gate_attribution",
    "generate_completions",
    "load_tuned_model",
    "paired_bootstrap",
    "score_items",
    "score_text",
    "split_markers",
    "status_of_interval",
    "summarize_capability",
]
