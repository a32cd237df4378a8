"""Measure one capability on the base and the tuned model and bound the blame on the base.

Steps of ``evaluate_capability``:

1. Load the base model with the adapter once (or take the caller's ``PeftModel``).
2. For text metrics, generate an answer to every item twice: inside ``model.disable_adapter()``
   (the base model) and with the adapter on (the tuned model). For ``loglik``, score the wanted
   completion's mean log-probability under both instead.
3. Score each item (``score_items``) and run the paired bootstrap over items.
4. Bound the blame on the base model: items it already fails (``base_failing``), a low base score
   overall, and for each flipped item the base preference margin
   ``log p_base(wanted) - log p_base(tuned answer)`` in nats (whole-sequence log-probabilities,
   see ``gradian.evaluate.likelihood``). A margin below ``WEAK_MARGIN_NATS`` means the base model
   barely preferred the right answer, so the item is flagged as weakly held. ``not_contains``
   items have markers rather than an answer, so they get no margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from gradian.data import Dataset, Example, load_dataset
from gradian.errors import DatasetError, ModelLoadError
from gradian.evaluate.bootstrap import paired_bootstrap
from gradian.evaluate.generation import generate_completions
from gradian.evaluate.likelihood import completion_logprobs
from gradian.evaluate.loading import load_tuned_model
from gradian.evaluate.metrics import PROXY_METRICS, TEXT_METRICS, check_item, score_text
from gradian.evaluate.result import CapabilityResult, ItemResult

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig

__all__ = [
    "LOW_BASE_SCORE",
    "WEAK_MARGIN_NATS",
    "ModelOutputs",
    "base_preference_margins",
    "check_eval_lengths",
    "unique_items",
    "collect_outputs",
    "evaluate_capability",
    "score_items",
    "summarize_capability",
]

#: a flipped item whose base preference margin is below this many nats is weakly held
WEAK_MARGIN_NATS = 1.0
#: a base score below this (pass/fail metrics) means there was little capability to lose
LOW_BASE_SCORE = 0.5


@dataclass
class ModelOutputs:
    """What one model produced on the eval items: generations (text metrics) or log-probs."""

    generations: list[str] | None = None
    #: mean log-probability of the wanted completion, nats per token (``loglik`` only)
    logliks: list[float] | None = None


def _require_peft(model: torch.nn.Module) -> None:
    if not hasattr(model, "disable_adapter"):
        raise ModelLoadError(
            f"evaluate_capability got a {type(model).__name__}, which has no adapter to switch off; "
            "pass the PeftModel (base model with the LoRA adapter attached) so the base is scored "
            "with the adapter disabled"
        )


def _eval_examples(dataset: Dataset, metric: str) -> list[Example]:
    examples = list(dataset.examples)
    if not examples:
        raise DatasetError(f"{dataset.path}: the eval set is empty; give it items with the answers you want")
    for e in examples:
        where = f"{dataset.path}:{e.line}" if e.line else f"{dataset.path} row {e.index}"
        if not e.is_chat or not e.prompt_messages:
            raise DatasetError(
                f"{where}: an eval item needs a prompt and the wanted completion "
                '(e.g. {"prompt": "What is the capital of France?", "completion": "Paris"}); '
                f"this row is a {e.shape} row"
            )
        check_item(metric, e.completion, where)
    return examples


def unique_items(examples: Sequence[Example]) -> tuple[list[Example], int]:
    """The eval items with each (prompt, answer) pair kept once, in order, and how many repeats
    were dropped: a copied item is one question, and counting it again would shrink the interval
    and pass ``evaluation.min_items`` on evidence that is not there."""
    import json

    seen: set[str] = set()
    kept = []
    for e in examples:
        key = json.dumps([e.prompt_messages, e.completion], sort_keys=True, ensure_ascii=False)
        if key not in seen:
            seen.add(key)
            kept.append(e)
    return kept, len(examples) - len(kept)


def check_eval_lengths(examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase, model: PeftModel,
                       max_new_tokens: int, path: str) -> None:
    """Refuse, before any generation, an eval item longer than the model reads (its
    ``max_position_embeddings``) or whose attention would not fit in the available memory."""
    from gradian.data import render_prompt
    from gradian.sizes import check_fits_memory

    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    longest, where_longest = 0, ""
    for e in examples:
        where = f"{path}:{e.line}" if e.line else f"{path} row {e.index}"
        prompt = tokenizer(render_prompt(tokenizer, list(e.prompt_messages)), add_special_tokens=False)["input_ids"]
        answer = tokenizer(e.completion or "", add_special_tokens=False)["input_ids"]
        n = len(prompt) + max(len(answer), max_new_tokens)
        if isinstance(limit, int) and limit > 0 and n > limit:
            raise DatasetError(
                f"{where}: the item needs {n:,} tokens (prompt {len(prompt):,}, answer up to "
                f"{max(len(answer), max_new_tokens):,}) but the model reads at most {limit:,} "
                "(max_position_embeddings in its config.json); shorten the item or leave it out of the eval set"
            )
        if n > longest:
            longest, where_longest = n, where
    if heads and longest:
        # one layer's attention scores for the longest item, in float32, and the softmax's copy
        check_fits_memory(8.0 * heads * longest * longest, f"{where_longest}: scoring this item of {longest:,} "
                          "tokens needs", "shorten the item or leave it out of the eval set")


def collect_outputs(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    *,
    metric: str,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    greedy: bool = True,
    seed: int = 1234,
) -> tuple[ModelOutputs, ModelOutputs]:
    """``(base, tuned)`` outputs of one ``PeftModel``: the base under ``disable_adapter()``."""
    _require_peft(model)
    prompts = [e.prompt_messages for e in examples]
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        outputs = []
        for adapter_on in (False, True):
            if metric in PROXY_METRICS:
                run = lambda: ModelOutputs(logliks=[  # noqa: E731
                    lp.mean for lp in completion_logprobs(
                        model, tokenizer, prompts, [e.completion for e in examples], batch_size=batch_size)
                ])
            else:
                run = lambda: ModelOutputs(generations=generate_completions(  # noqa: E731
                    model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, greedy=greedy, seed=seed))
            if adapter_on:
                outputs.append(run())
            else:
                with model.disable_adapter():
                    outputs.append(run())
    finally:
        model.train(was_training)
    return outputs[0], outputs[1]


def score_items(
    metric: str,
    examples: Sequence[Example],
    base: ModelOutputs,
    tuned: ModelOutputs,
) -> list[ItemResult]:
    """Per-item scores, pass/fail, flips and base failures from both models' outputs."""
    items = []
    for k, e in enumerate(examples):
        if metric in PROXY_METRICS:
            if base.logliks is None or tuned.logliks is None:
                raise ValueError(f"metric {metric!r} needs log-likelihoods from both models")
            items.append(ItemResult(
                example_id=e.id, index=e.index, prompt=e.prompt_text, wanted=e.completion,
                base_score=base.logliks[k], tuned_score=tuned.logliks[k],
            ))
            continue
        if base.generations is None or tuned.generations is None:
            raise ValueError(f"metric {metric!r} needs generations from both models")
        b = score_text(metric, base.generations[k], e.completion)
        t = score_text(metric, tuned.generations[k], e.completion)
        items.append(ItemResult(
            example_id=e.id,
            index=e.index,
            prompt=e.prompt_text,
            wanted=e.completion,
            base_score=b,
            tuned_score=t,
            base_correct=b == 1.0,
            tuned_correct=t == 1.0,
            base_generation=base.generations[k],
            tuned_generation=tuned.generations[k],
            flipped=b == 1.0 and t == 0.0,
            base_failing=b == 0.0,
        ))
    return items


def base_preference_margins(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    items: Sequence[ItemResult],
    *,
    batch_size: int = 8,
    weak_margin_nats: float = WEAK_MARGIN_NATS,
) -> None:
    """Set ``base_margin`` and ``weakly_held`` on every flipped item, in place.

    ``base_margin = log p_base(wanted | prompt) - log p_base(tuned answer | prompt)``, each a sum
    over the completion's supervised tokens (including the end-of-turn token), in nats.
    """
    _require_peft(model)
    by_id = {e.id: e for e in examples}
    todo = [i for i in items if i.flipped and i.tuned_generation is not None]
    said_texts = [i.tuned_generation for i in todo if i.tuned_generation is not None]
    if not todo:
        return
    prompts = [by_id[i.example_id].prompt_messages for i in todo]
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        with model.disable_adapter():
            wanted = completion_logprobs(model, tokenizer, prompts, [i.wanted for i in todo], batch_size=batch_size)
            said = completion_logprobs(model, tokenizer, prompts, said_texts, batch_size=batch_size)
    finally:
        model.train(was_training)
    for item, w, s in zip(todo, wanted, said):
        item.base_margin = w.total - s.total
        item.weakly_held = item.base_margin < weak_margin_nats


def summarize_capability(
    items: Sequence[ItemResult],
    *,
    name: str,
    metric: str,
    n_bootstrap: int = 2000,
    ci_level: float = 0.95,
    seed: int = 1234,
    weak_margin_nats: float = WEAK_MARGIN_NATS,
    low_base_threshold: float = LOW_BASE_SCORE,
    min_items: int | None = None,
    n_repeats: int = 0,
) -> CapabilityResult:
    """Means, the paired bootstrap, counts and flags over already-scored items.

    ``min_items`` (``evaluation.min_items``) marks a result over fewer items ``too_few_items``;
    ``n_repeats`` is how many repeated eval items were dropped before scoring.
    """
    items = list(items)
    base_scores = [i.base_score for i in items]
    tuned_scores = [i.tuned_score for i in items]
    boot = paired_bootstrap(base_scores, tuned_scores, n_bootstrap=n_bootstrap, ci_level=ci_level, seed=seed)
    base = sum(base_scores) / len(items)
    tuned = sum(tuned_scores) / len(items)
    proxy = metric in PROXY_METRICS
    return CapabilityResult(
        name=name,
        metric=metric,
        base=base,
        tuned=tuned,
        delta=boot.delta,
        ci=boot.ci,
        n_items=len(items),
        n_flipped=sum(i.flipped for i in items),
        n_base_failing=sum(i.base_failing for i in items),
        status=boot.status,
        proxy_used=proxy,
        ci_level=boot.ci_level,
        n_bootstrap=boot.n_bootstrap,
        seed=boot.seed,
        items=items,
        weak_margin_nats=weak_margin_nats,
        low_base_threshold=low_base_threshold,
        low_base_score=(not proxy) and base < low_base_threshold,
        min_items=min_items,
        n_repeats=n_repeats,
    )


def evaluate_capability(
    config: GradianConfig,
    eval_dataset: Dataset | str | Path | None = None,
    *,
    model: PeftModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    adapter_path: str | Path | None = None,
    capability: str = "capability",
    weak_margin_nats: float = WEAK_MARGIN_NATS,
    low_base_threshold: float = LOW_BASE_SCORE,
) -> CapabilityResult:
    """Measure ``capability`` on the base and tuned models described by ``config``.

    ``eval_dataset`` is a loaded ``Dataset``, a path, or ``None`` for ``config.eval_dataset``.
    Pass ``model`` (a ``PeftModel``) and ``tokenizer`` to reuse loaded weights; otherwise the base
    model and ``adapter_path`` (default ``config.adapter_path``) are loaded once.
    Settings come from ``config.evaluation`` and the seed from ``config.seed``.
    """
    ev = config.evaluation
    if ev.metric not in TEXT_METRICS + PROXY_METRICS:
        check_item(ev.metric, "", "evaluation.metric")  # raises the ConfigError naming the choices
    if eval_dataset is None:
        if not config.eval_dataset:
            raise DatasetError(
                "no eval set: set eval_dataset in the config (a .jsonl of prompt/completion items "
                "with the answers you wanted) or pass it to evaluate_capability"
            )
        eval_dataset = config.eval_dataset
    dataset = eval_dataset if isinstance(eval_dataset, Dataset) else load_dataset(eval_dataset)
    examples, n_repeats = unique_items(_eval_examples(dataset, ev.metric))
    if model is None:
        model, loaded_tokenizer = load_tuned_model(config, adapter_path)
        tokenizer = tokenizer or loaded_tokenizer
    elif tokenizer is None:
        raise ModelLoadError("evaluate_capability got a model but no tokenizer; pass the tokenizer it was trained with")
    check_eval_lengths(examples, tokenizer, model, ev.max_new_tokens, str(getattr(dataset, "path", "") or "the eval set"))
    base_out, tuned_out = collect_outputs(
        model, tokenizer, examples, metric=ev.metric, max_new_tokens=ev.max_new_tokens,
        batch_size=ev.batch_size, greedy=ev.greedy, seed=config.seed,
    )
    items = score_items(ev.metric, examples, base_out, tuned_out)
    if ev.metric != "not_contains":
        base_preference_margins(model, tokenizer, examples, items, batch_size=ev.batch_size,
                                weak_margin_nats=weak_margin_nats)
    return summarize_capability(
        items, name=capability, metric=ev.metric, n_bootstrap=ev.n_bootstrap, ci_level=ev.ci_level,
        seed=config.seed, weak_margin_nats=weak_margin_nats, low_base_threshold=low_base_threshold,
        min_items=ev.min_items, n_repeats=n_repeats,
    )
