"""Batched greedy generation for the eval items, with left padding.

Prompts are rendered exactly as for training (``gradian.data.render_prompt``: the chat template
with its generation prompt, or the newline-joined turns without a template) and tokenized without
added special tokens, as ``gradian.data.tokenize_examples`` does. Rows are padded on the left so
that every row's next token sits in the last column; the attention mask hides the padding and
transformers derives position ids from the mask, so a row's output does not depend on its batch
neighbours (a test checks batched against one-at-a-time generation).

Decoding stops at any end-of-sequence id of the tokenizer or the model's generation config; the
text is cut at the first such id, decoded without special tokens and stripped.

float64 models are batched by prompt length instead, with no padding at all: transformers' eager
attention adds ``finfo(float64).min`` to masked scores and then takes the softmax in float32,
where that value becomes ``-inf``; the fully masked rows of left padding then turn into NaN and
the NaN reaches the real tokens through the next layer's keys (seen with transformers 5.24).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from gradian.data import IGNORE_INDEX, render_prompt

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["generate_completions", "runner_up_completions", "stop_token_ids"]


def stop_token_ids(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a generation: the tokenizer's EOS plus the model's configured ones."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        for i in configured if isinstance(configured, (list, tuple)) else [configured]:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def _pad_id(tokenizer: PreTrainedTokenizerBase, stops: list[int]) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if stops:
        return stops[0]  # masked out, so any id will do; EOS is the usual stand-in
    return 0


def generate_completions(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[dict[str, str]]],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    greedy: bool = True,
    seed: int = 1234,
) -> list[str]:
    """One completion per prompt (a list of chat turns without the final answer).

    Greedy decoding is deterministic. With ``greedy=False`` tokens are sampled, seeded with
    ``seed`` once before the first batch, so reruns on the same device repeat.
    """
    import torch
    from transformers import GenerationConfig

    if max_new_tokens < 1:
        raise ValueError(f"evaluation.max_new_tokens is {max_new_tokens}; it must be at least 1")
    if batch_size < 1:
        raise ValueError(f"evaluation.batch_size is {batch_size}; it must be at least 1")
    stops = stop_token_ids(model, tokenizer)
    pad_id = _pad_id(tokenizer, stops)
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        num_beams=1,
        pad_token_id=pad_id,
        eos_token_id=stops or None,
    )
    device = _device_of(model)
    encoded = [
        tokenizer(render_prompt(tokenizer, list(p)), add_special_tokens=False)["input_ids"]
        for p in prompts
    ]
    if not greedy:
        torch.manual_seed(seed)
    out: list[str] = [""] * len(encoded)
    for batch in _batches(encoded, batch_size, equal_length=_dtype_of(model) == torch.float64):
        chunk = [encoded[k] for k in batch]
        width = max(len(e) for e in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, e in enumerate(chunk):
            if e:
                ids[row, width - len(e):] = torch.tensor(e, dtype=torch.long)
                mask[row, width - len(e):] = 1
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=gen_config,
            )
        for k, row in zip(batch, generated[:, width:].tolist()):
            cut = next((j for j, t in enumerate(row) if t in stops), len(row))
            out[k] = tokenizer.decode(row[:cut], skip_special_tokens=True).strip()
    return out


def runner_up_completions(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[dict[str, str]]],
    wanted: Sequence[str],
    *,
    max_new_tokens: int = 32,
) -> list[str | None]:
    """For each prompt, the answer the model gives when it does not give ``wanted``: its runner-up.

    ``wanted`` is read under the training loss mask, token by token. At the answer token where the
    model's best other token comes closest to (or passes) the wanted one in log-probability, where
    the answer is most contested, that other token is taken instead, and greedy decoding goes on
    from it until a stop id or ``max_new_tokens`` answer tokens. Special tokens (turn markers,
    EOS) are neither contested nor taken. ``None`` for a row with no answer token to contest.
    """
    from gradian.evaluate.likelihood import _masked_rows

    if len(prompts) != len(wanted):
        raise ValueError(f"{len(prompts)} prompts but {len(wanted)} answers; pass one answer per prompt")
    stops = stop_token_ids(model, tokenizer)
    special = sorted(set(tokenizer.all_special_ids) | set(stops))
    device = _device_of(model)
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        return [_runner_up(model, tokenizer, ids, labels, special, stops, device, max_new_tokens)
                for ids, labels in _masked_rows(tokenizer, prompts, wanted)]
    finally:
        model.train(was_training)


def _runner_up(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase, ids: list[int],
               labels: list[int], special: list[int], stops: list[int], device: torch.device,
               max_new_tokens: int) -> str | None:
    """One row's runner-up (see ``runner_up_completions``)."""
    import torch
    from transformers import GenerationConfig

    contested = [t for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX and ids[t] not in special]
    if not contested:
        return None
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1).cpu()
    rows = logp[[t - 1 for t in contested]].clone()
    own = rows[torch.arange(len(contested)), torch.tensor([ids[t] for t in contested])].clone()
    rows[torch.arange(len(contested)), torch.tensor([ids[t] for t in contested])] = -float("inf")
    rows[:, [i for i in special if i < rows.shape[1]]] = -float("inf")
    best, other = rows.max(dim=1)
    pick = int((best - own).argmax())
    t, token = contested[pick], int(other[pick])
    start = next(k for k in range(1, len(ids)) if labels[k] != IGNORE_INDEX)
    prefix = torch.tensor([list(ids[:t]) + [token]], device=device)
    budget = max_new_tokens - (t - start) - 1
    answer = list(ids[start:t]) + [token]
    if budget > 0:
        config = GenerationConfig(max_new_tokens=budget, do_sample=False, num_beams=1,
                                  pad_token_id=_pad_id(tokenizer, stops), eos_token_id=stops or None)
        with torch.no_grad():
            more = model.generate(input_ids=prefix, attention_mask=torch.ones_like(prefix),
                                  generation_config=config)[0, prefix.shape[1]:].tolist()
        answer += more[:next((j for j, x in enumerate(more) if x in stops), len(more))]
    return tokenizer.decode(answer, skip_special_tokens=True).strip()


def _batches(encoded: list[list[int]], batch_size: int, equal_length: bool) -> list[list[int]]:
    """Index batches in input order; with ``equal_length`` only same-length prompts share one."""
    if not equal_length:
        return [list(range(s, min(s + batch_size, len(encoded)))) for s in range(0, len(encoded), batch_size)]
    by_length: dict[int, list[int]] = {}
    for k, e in enumerate(encoded):
        by_length.setdefault(len(e), []).append(k)
    return [group[s:s + batch_size] for group in by_length.values() for s in range(0, len(group), batch_size)]


def _dtype_of(model: PreTrainedModel | PeftModel) -> torch.dtype | None:
    try:
        return next(model.parameters()).dtype
    except (StopIteration, AttributeError):
        return None


def _device_of(model: PreTrainedModel | PeftModel) -> torch.device:
    import torch

    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")
