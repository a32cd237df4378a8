"""The query gradient: the direction in LoRA-gradient space that stands for the lost capability.

Interface: ``QueryItem`` (plain ``prompt_messages``, ``wanted`` text, optional ``generated`` text:
what the tuned model actually said); ``select_query_items(eval_items, train_examples)`` picks the
items the query is built from; ``resolve_signal(requested, items)`` decides target vs
contrastive; ``build_query_gradient(gm, tokenizer, items, signal, grads_config)`` returns a
``QueryGradient`` with one vector per block, in the same (projected) space as the index.

Signals, with ``l(text)`` the loss of ``text`` as the assistant's answer to the item's prompt:

- ``target``: ``g_q = mean_items grad l(wanted)``.
- ``contrastive``: ``g_q = mean_items [grad l(wanted) - grad l(generated)]``. When the model now
  says something else, most of ``grad l(wanted)`` is about answer format, which every training
  example teaches; subtracting ``grad l(generated)`` cancels that shared part and leaves the
  direction separating the right answer from the wrong one.
- ``auto``: contrastive when every item carries a generation, else target.

An item the tuned model still answers right can be in the query too, because its wanted answer
lost likelihood (``evaluation.query_scope: lost``; ``QueryItem.kept``): it has no generated answer
to subtract, so it contributes ``grad l(wanted)`` alone under either signal, unless it carries its
runner-up answer in ``generated`` (``evaluation.query_kept_contrast: runner_up``), which a
contrastive query then subtracts as it does a wrong answer.

Both are gradients of a loss to be lowered, so an engine's positive score means the example
lowers it (reinforces the wanted behaviour over the generated one) and a negative score means
the example pushed the model toward what it now says.

The loss masks come from ``gradian.data.tokenize_examples``, the same as the training examples'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from gradian.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradsConfig
    from gradian.data import Example, TokenizedExample
    from gradian.grads.model import GradientModel
    from gradian.grads.projection import BlockProjector, KroneckerProjector
    from gradian.jsontypes import JsonObject

__all__ = [
    "QueryItem",
    "QueryGradient",
    "QUERY_SIGNALS",
    "NO_CAPABILITY_TARGET",
    "resolve_signal",
    "select_query_items",
    "build_query_gradient",
    "query_rows",
]

QUERY_SIGNALS = ("auto", "contrastive", "target")
#: finding id raised when there is no eval set and the query falls back to training examples
NO_CAPABILITY_TARGET = "attribution.no_capability_target"


@dataclass
class QueryItem:
    """One eval item as the query sees it; independent of how it was evaluated."""

    prompt_messages: list[dict[str, str]]
    wanted: str
    #: the tuned model's answer, when the metric produced text
    generated: str | None = None
    #: the item got worse under the fine-tune (passed on the base, fails on the tuned model, or
    #: still passes but its wanted answer lost likelihood: ``kept``)
    regressed: bool = True
    item_id: str = ""
    #: the tuned model still answers the item right, and it is in the query because its wanted
    #: answer lost likelihood: no generated answer is subtracted from it under ``contrastive``
    kept: bool = False

    @property
    def contrasts(self) -> bool:
        """Under ``contrastive``, whether an answer is subtracted: every item now answered wrong, and
        a ``kept`` item that carries its runner-up answer in ``generated``."""
        return not self.kept or self.generated is not None


@dataclass
class QueryGradient:
    """``vectors``: ``{block: [width]}``; ``signal``: the one actually used; notes for the report.

    ``per_item``: ``{block: [items, width]}``, one query gradient per item (``vectors`` is their
    mean, so the mean of the per-item scores is the score of ``vectors``); ``item_ids`` names them,
    and ``kept_item_ids`` those of them the tuned model still answers right (``QueryItem.kept``).
    """

    vectors: dict[str, np.ndarray]
    signal: str
    requested_signal: str
    n_items: int
    scope: str = "regressed"
    notes: list[str] = field(default_factory=list)
    finding_ids: list[str] = field(default_factory=list)
    per_item: dict[str, np.ndarray] | None = None
    item_ids: list[str] = field(default_factory=list)
    kept_item_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> JsonObject:
        return {"signal": self.signal, "requested_signal": self.requested_signal, "n_items": self.n_items,
                "scope": self.scope, "notes": list(self.notes), "finding_ids": list(self.finding_ids),
                "item_ids": list(self.item_ids), "kept_item_ids": list(self.kept_item_ids)}

    def measured_columns(self) -> np.ndarray | None:
        """The per-item columns of the items the tuned model now fails (a boolean mask over
        ``item_ids``), or None when every item is one of them or none is."""
        kept = set(self.kept_item_ids)
        mask = np.array([i not in kept for i in self.item_ids], dtype=bool)
        return mask if kept and mask.any() else None


def resolve_signal(requested: str, items: Sequence[QueryItem]) -> tuple[str, list[str]]:
    """(signal used, notes). ``auto`` is contrastive only when every item has a generation (the
    ``kept`` items, which have none to subtract, aside)."""
    if requested not in QUERY_SIGNALS:
        raise ConfigError(f"evaluation.query_signal '{requested}' is not one of {', '.join(QUERY_SIGNALS)}")
    contrasted = [item for item in items if item.contrasts]
    missing = sum(1 for item in contrasted if item.generated is None)
    if requested == "target":
        return "target", []
    if requested == "contrastive":
        if missing:
            raise ConfigError(
                f"evaluation.query_signal is 'contrastive' but {missing} of {len(items)} query items have no "
                "generated answer to subtract (a loglik metric produces none); use a text metric "
                "(exact_match, contains) or set evaluation.query_signal: target"
            )
        return "contrastive", []
    if contrasted and not missing:
        return "contrastive", ["query_signal auto: generations exist, so the query is contrastive"]
    return "target", [
        "query_signal auto fell back to target: no generated answers to subtract. On a substitution "
        "failure a target query can rank the culprits as helpful; prefer a text metric"
    ]


def select_query_items(eval_items: Sequence[QueryItem] | None, train_examples: Sequence[Example] = (),
                       n_fallback: int = 8) -> tuple[list[QueryItem], str, list[str], list[str]]:
    """(items, scope, notes, finding ids): regressed items; else the whole eval set; else training.

    Scopes: ``regressed`` (the normal case), ``eval_set`` (nothing regressed: the whole eval set is
    averaged, and the report says so), ``training_fallback`` (no eval set: the first
    ``n_fallback`` training examples, a smoke test flagged with ``attribution.no_capability_target``).
    """
    if eval_items:
        regressed = [item for item in eval_items if item.regressed]
        if regressed:
            kept = sum(1 for item in regressed if item.kept)
            also = (f": {len(regressed) - kept} now answered wrong and {kept} still answered right whose wanted "
                    "answer lost likelihood" if kept else "")
            return regressed, "regressed", [f"query built from the {len(regressed)} regressed eval items{also}"], []
        return list(eval_items), "eval_set", [
            f"no eval item regressed; the query averages all {len(eval_items)} eval items"
        ], []
    examples = list(train_examples)[:n_fallback]
    if not examples:
        raise ConfigError("no eval set and no training examples to build a query from; set eval_dataset")
    items = [QueryItem(e.prompt_messages, e.completion, None, True, e.id) for e in examples]
    return items, "training_fallback", [
        f"no eval set: the query is the first {len(items)} training examples, a smoke test rather than a diagnosis"
    ], [NO_CAPABILITY_TARGET]


def query_rows(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[list[dict[str, str]]], answers: Sequence[str],
               max_seq_length: int | None) -> list[TokenizedExample]:
    """Each prompt with its answer as the assistant's turn, tokenized with the training rows' loss
    mask (``TokenizedExample``); refused when an answer loses every token to truncation."""
    from gradian.data import dataset_from_rows, tokenize_examples

    rows = [{"messages": list(p) + [{"role": "assistant", "content": a}]} for p, a in zip(prompts, answers)]
    tokenized = tokenize_examples(dataset_from_rows(rows, name="<query>").examples, tokenizer, max_seq_length)
    lost = [t for t in tokenized if t.n_supervised == 0]
    if lost:
        raise ConfigError(
            f"{len(lost)} query item(s) have no supervised token left within grads.max_seq_length="
            f"{max_seq_length}; raise it or shorten the eval prompts"
        )
    return tokenized


def _item_gradients(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[list[dict[str, str]]],
                    answers: Sequence[str], grads_config: GradsConfig,
                    projector: BlockProjector | KroneckerProjector | None) -> dict[str, np.ndarray]:
    """``{block: [items, width]}``: each item's gradient (float64)."""
    from gradian.grads import iter_example_gradients

    tokenized = query_rows(tokenizer, prompts, answers, grads_config.max_seq_length)
    parts: dict[str, list[np.ndarray]] = {}
    for _, chunk in iter_example_gradients(gm, tokenized, grads_config, tokenizer.pad_token_id,
                                           projector=projector):
        for b, g in chunk.items():
            parts.setdefault(b, []).append(g.astype(np.float64))
    return {b: np.concatenate(v, axis=0) for b, v in parts.items()}


def build_query_gradient(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[QueryItem],
                         signal: str = "auto", grads_config: GradsConfig | None = None, *, scope: str = "regressed",
                         notes: Sequence[str] = (), finding_ids: Sequence[str] = ()) -> QueryGradient:
    """The query gradient of ``items`` under ``gm``, in the index's block space.

    ``grads_config`` must be the one the index was built with (projection, loss reduction,
    max_seq_length); its per-example normalization is not applied to the query (it would reweight
    items, and a query's overall scale does not change any ranking).
    """
    from gradian.config import GradsConfig
    from gradian.grads import make_projector

    if not items:
        raise ConfigError("no query items; the query needs at least one eval item")
    grads_config = dataclasses.replace(grads_config or GradsConfig(), normalization="none")
    used, signal_notes = resolve_signal(signal, items)
    projector = make_projector(grads_config, gm)
    prompts = [item.prompt_messages for item in items]
    per_item = _item_gradients(gm, tokenizer, prompts, [i.wanted for i in items], grads_config, projector)
    all_notes = list(notes) + signal_notes
    if used == "contrastive":
        contrasted = [k for k, item in enumerate(items) if item.contrasts]
        if contrasted:
            generated = _item_gradients(gm, tokenizer, [prompts[k] for k in contrasted],
                                        [items[k].generated or "" for k in contrasted], grads_config, projector)
            for b in per_item:
                per_item[b][contrasted] -= generated[b]
        same = sum(1 for k in contrasted if (items[k].generated or "").strip() == items[k].wanted.strip())
        if same:
            all_notes.append(f"{same} query item(s) generated the wanted answer and add nothing to a contrastive query")
        if len(contrasted) < len(items):
            all_notes.append(f"{len(items) - len(contrasted)} query item(s) still answered right add their wanted "
                             "answer's gradient alone: they have no other answer to subtract")
        runner_ups = sum(1 for k in contrasted if items[k].kept)
        if runner_ups:
            all_notes.append(f"{runner_ups} query item(s) still answered right subtract their runner-up answer, the "
                             "one the tuned model gives when it does not give the wanted one")
    vectors = {b: v.mean(axis=0) for b, v in per_item.items()}
    item_ids = [item.item_id or str(k) for k, item in enumerate(items)]
    return QueryGradient(vectors, used, signal, len(items), scope, all_notes, list(finding_ids), per_item=per_item,
                         item_ids=item_ids, kept_item_ids=[i for i, item in zip(item_ids, items) if item.kept])
