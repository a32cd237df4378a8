"""``AuditContext``: the inputs of one audit and the figures several checks share.

Derived figures (tokenization, normalized prompts and completions, dataset size) are computed
once, lazily, on first use: a dataset-only audit never tokenizes, and the nine checks that read
token counts all read the same ``TokenizedExample`` list the other lanes use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Mapping, Sequence

from gradian.config.audit import AuditConfig
from gradian.findings import Finding

if TYPE_CHECKING:  # imported lazily at run time: the data layer pulls in tokenizer code
    from transformers import PreTrainedTokenizerBase

    from gradian.data import Dataset, Example, TokenizedExample
    from gradian.runs import RunRecord

__all__ = ["AuditContext"]


@dataclass
class AuditContext:
    dataset: "Dataset | None" = None
    eval_dataset: "Dataset | None" = None
    tokenizer: "PreTrainedTokenizerBase | None" = None
    run: "RunRecord | None" = None
    #: the training sequence length: the flag, else the run's recorded value
    max_seq_length: int | None = None
    #: the base model the user says the adapter belongs to (for config.base_model_mismatch)
    base_model: str | None = None
    config: AuditConfig = field(default_factory=AuditConfig)
    #: why there is no tokenizer when the run named a base model this machine does not have
    tokenizer_missing: str | None = None
    #: how the eval set is scored (``evaluation.metric``): decides what counts as its wanted answer
    eval_metric: str | None = None
    #: id of the check being run; set by the runner so ``finding`` can stamp it
    current_check: str = ""
    _tokenized: "list[TokenizedExample] | Exception | None" = field(default=None, repr=False)

    # -- inputs ----------------------------------------------------------------------------------

    def missing(self, needs: Sequence[str]) -> str | None:
        """Why a check needing ``needs`` cannot run, or None when everything is there."""
        for need in needs:
            if need == "dataset" and self.dataset is None:
                return "no training dataset (pass --dataset)"
            if need == "tokenizer" and self.tokenizer is None:
                return self.tokenizer_missing or "no tokenizer (pass --base-model, or set `tokenizer` in the config)"
            if need == "run" and self.run is None:
                return "no training run (pass --run with the trainer's output directory)"
            if need == "logs":
                if self.run is None:
                    return "no training run, so no logged metrics (pass --run)"
                if not self.run.logs.steps:
                    return "the run has no logged steps (trainer_state.json log_history missing or empty)"
            if need == "eval" and self.eval_dataset is None:
                return "no eval dataset (pass --eval-dataset)"
        return None

    # -- shared figures ----------------------------------------------------------------------

    @property
    def examples(self) -> list[Example]:
        return list(self.dataset.examples) if self.dataset is not None else []

    @cached_property
    def n_examples(self) -> int | None:
        """Rows in the training set: the dataset given, else the size the run recorded."""
        if self.dataset is not None:
            return len(self.dataset.examples)
        if self.run is not None and self.run.dataset.n_examples:
            return self.run.dataset.n_examples
        return None

    @property
    def tokenized(self) -> list[TokenizedExample]:
        """The data layer's tokenization of every training row, truncated at ``max_seq_length``.

        Computed once; a failure (slow tokenizer, a template that cannot render a row) is kept and
        raised again for each check that asks, instead of retokenizing the dataset each time.
        """
        if self._tokenized is None:
            from gradian.data import tokenize_examples

            try:
                self._tokenized = list(tokenize_examples(self.examples, self.tokenizer, self.max_seq_length))
            except Exception as err:
                self._tokenized = err
        if isinstance(self._tokenized, Exception):
            raise self._tokenized
        return self._tokenized

    @cached_property
    def normalized_prompts(self) -> list[str]:
        from gradian.data import normalize_text

        return [normalize_text(e.prompt_text) for e in self.examples]

    @cached_property
    def normalized_completions(self) -> list[str]:
        from gradian.data import normalize_text

        return [normalize_text(e.completion) for e in self.examples]

    @property
    def example_ids(self) -> list[str]:
        return [e.id for e in self.examples]

    # -- building findings -------------------------------------------------------------------

    def finding(
        self,
        severity: str,
        title: str,
        message: str,
        fix: str,
        evidence: Mapping[str, object] | None = None,
        example_ids: Sequence[str] = (),
    ) -> Finding:
        """A finding of the check being run, with example ids capped at ``max_example_ids``."""
        ids = list(example_ids)
        evidence = dict(evidence or {})
        if len(ids) > self.config.max_example_ids:
            evidence.setdefault("n_example_ids", len(ids))
            ids = ids[: self.config.max_example_ids]
        return Finding(
            id=self.current_check,
            category=self.current_check.partition(".")[0],
            severity=severity,
            title=title,
            message=message,
            evidence=evidence,
            example_ids=ids,
            fix=fix,
        )
