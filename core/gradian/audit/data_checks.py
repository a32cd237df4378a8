"""The 16 ``data.*`` checks: the training rows themselves, several through the real tokenization.

Token-level checks read the data layer's ``TokenizedExample`` list (``AuditContext.tokenized``),
the same tokenization and loss mask every other lane uses, so a count here is a count of what
training saw. Text comparisons use ``gradian.data.normalize_text`` (case-folded, punctuation
dropped, whitespace collapsed).
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gradian.audit.context import AuditContext
from gradian.audit.registry import CheckOutcome, CheckSkipped, register
from gradian.findings import EVAL_CONFLICT_ID

if TYPE_CHECKING:  # imported lazily at run time: the data layer pulls in tokenizer code
    import numpy as np
    import numpy.typing as npt

    from gradian.data import Dataset, Example

__all__: list[str] = []

_ALNUM = re.compile(r"\w", re.UNICODE)


def _rows(k: int, noun: str = "example") -> str:
    """``1 example`` / ``3 examples``."""
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _share(k: int, n: int) -> str:
    return f"{k} of {n} ({k / n:.1%})" if n else f"{k}"


def _eval_set(ctx: AuditContext) -> Dataset:
    if ctx.eval_dataset is None:  # the runner only calls a check whose inputs exist
        raise CheckSkipped("no eval dataset")
    return ctx.eval_dataset


def _need_seq_length(ctx: AuditContext) -> int:
    if not ctx.max_seq_length:
        raise CheckSkipped("no max_seq_length (pass --max-seq-length, or a run that recorded it)")
    return ctx.max_seq_length


@register("data.completion_truncated", "Answers cut off by max_seq_length", needs=("dataset", "tokenizer"))
def completion_truncated(ctx: AuditContext) -> CheckOutcome:
    limit = _need_seq_length(ctx)
    toks = ctx.tokenized
    hit = [t for t in toks if t.n_completion_lost > 0]
    if not hit:
        return None
    n = len(toks)
    share = len(hit) / n
    cfg = ctx.config
    if share >= cfg.completion_truncated_critical_share:
        severity = "critical"
    elif share >= cfg.completion_truncated_high_share:
        severity = "high"
    else:
        severity = "medium"
    lost = sum(t.n_completion_lost for t in hit)
    whole = sum(1 for t in hit if t.n_supervised == 0)
    need = max(t.n_tokens_full for t in hit)
    return ctx.finding(
        severity,
        f"{_rows(len(hit))} ({share:.1%}) {'has its' if len(hit) == 1 else 'have their'} target truncated",
        f"At max_seq_length={limit}, {_share(len(hit), n)} rows lose part of their answer "
        f"({lost} supervised tokens in all; {whole} lose all of it). The model learns answers that "
        "stop mid-way, which breaks every metric that reads the whole answer.",
        f"Raise max_seq_length to {need} (the longest affected row), or shorten or drop these rows.",
        evidence={"n_truncated_targets": len(hit), "share": round(share, 4), "supervised_tokens_lost": lost,
                  "targets_lost_entirely": whole, "max_seq_length": limit, "longest_affected": need},
        example_ids=[t.example_id for t in hit],
    )


def _agree(a: str, b: str) -> bool:
    """Two normalized answers agree when equal or when one contains the other as whole words."""
    if a == b:
        return True
    short, long = (a, b) if len(a) <= len(b) else (b, a)
    return bool(short) and f" {short} " in f" {long} "


def _all_agree(distinct: list[str]) -> bool:
    """Whether every pair of these distinct answers agrees, in one pass instead of all pairs.

    Agreement between distinct answers is whole-word containment, which is transitive, and two
    distinct answers of equal length never agree; so the pairs all agree exactly when, sorted by
    length, each answer agrees with the next one.
    """
    ordered = sorted(distinct, key=len)
    return all(_agree(a, b) for a, b in zip(ordered, ordered[1:]))


@register("data.conflicting_answers", "One prompt, several disagreeing answers", needs=("dataset",))
def conflicting_answers(ctx: AuditContext) -> CheckOutcome:
    examples = ctx.examples  # a fresh list on each access: read it once
    groups: dict[str, list[int]] = defaultdict(list)
    for i, prompt in enumerate(ctx.normalized_prompts):
        if prompt:
            groups[prompt].append(i)
    answers = ctx.normalized_completions
    conflicting: list[list[int]] = []
    for rows in groups.values():
        if len(rows) < 2:
            continue
        distinct = list(dict.fromkeys(answers[i] for i in rows))[:50]
        if len(distinct) >= 2 and not _all_agree(distinct):
            conflicting.append(rows)
    if not conflicting:
        return None
    n = len(examples)
    rows = [i for group in conflicting for i in group]
    share = len(rows) / n
    severity = "high" if share >= ctx.config.conflicting_high_share else "medium"
    ex = examples[conflicting[0][0]]
    sample = [examples[i].completion[:80] for i in conflicting[0][:3]]
    return ctx.finding(
        severity,
        f"{_rows(len(conflicting), 'question')} with contradictory answers ({len(rows)} examples, {share:.1%})",
        f"{len(conflicting)} prompts appear more than once with answers that disagree, "
        f"{_share(len(rows), n)} rows in all. For example {ex.prompt_text[:80]!r} is answered "
        f"{' / '.join(repr(s) for s in sample)}. The model is trained toward both answers; "
        "planted or corrupted rows usually look exactly like this.",
        "Decide which answer is right for each listed prompt and remove or correct the others.",
        evidence={"n_prompts": len(conflicting), "n_examples": len(rows), "share": round(share, 4)},
        example_ids=[examples[i].id for i in rows],
    )


def _exact_key(example: Example) -> str:
    if example.messages:
        return json.dumps([(t["role"], t["content"].strip()) for t in example.messages], ensure_ascii=False)
    return (example.text or "").strip()


@register("data.duplicates", "Rows repeated word for word", needs=("dataset",))
def duplicates(ctx: AuditContext) -> CheckOutcome:
    examples = ctx.examples  # a fresh list on each access: indexing it per copy was quadratic
    seen: dict[str, int] = {}
    copies: list[int] = []
    for i, example in enumerate(examples):
        key = _exact_key(example)
        if key in seen:
            copies.append(i)
        else:
            seen[key] = i
    if not copies:
        return None
    n = len(examples)
    share = len(copies) / n
    severity = "medium" if share >= ctx.config.duplicate_medium_share else "low"
    return ctx.finding(
        severity,
        f"{_rows(len(copies), 'exact duplicate')} ({share:.1%})",
        f"{_share(len(copies), n)} rows repeat an earlier row word for word, so those rows count "
        "several times per epoch (an unplanned upweighting) and their copies split any attribution "
        "score between them.",
        "Deduplicate the dataset (keep the first copy of each row) unless the repetition is a "
        "deliberate upsampling.",
        evidence={"n_duplicates": len(copies), "share": round(share, 4), "n_unique": len(seen)},
        example_ids=[examples[i].id for i in copies],
    )


@register("data.empty_or_degenerate_targets", "Answers that are empty, punctuation or repetition", needs=("dataset",))
def empty_or_degenerate_targets(ctx: AuditContext) -> CheckOutcome:
    cfg = ctx.config
    empty, degenerate = [], []
    for example in ctx.examples:
        target = example.completion
        if not _ALNUM.search(target):
            empty.append(example.id)
            continue
        words = target.split()
        if len(words) >= cfg.degenerate_min_words:
            distinct = len({w.casefold() for w in words}) / len(words)
            if distinct <= cfg.degenerate_max_distinct_ratio:
                degenerate.append(example.id)
    bad = empty + degenerate
    if not bad:
        return None
    n = len(ctx.examples)
    share = len(bad) / n
    severity = "high" if share >= cfg.empty_targets_high_share else "medium"
    return ctx.finding(
        severity,
        f"{_rows(len(bad))} with an empty or degenerate target",
        f"{len(empty)} rows have an answer with no letters or digits at all and {len(degenerate)} "
        f"an answer of {cfg.degenerate_min_words}+ words that mostly repeats itself (distinct-word "
        f"share at most {cfg.degenerate_max_distinct_ratio:g}); {_share(len(bad), n)} rows in all. "
        "They teach the model to answer with nothing, or to loop.",
        "Remove these rows or write real answers for them.",
        evidence={"n_empty": len(empty), "n_degenerate": len(degenerate), "share": round(share, 4)},
        example_ids=bad,
    )


def _target_format(text: str) -> str:
    stripped = text.strip()
    if stripped[:1] in "{[":
        try:
            json.loads(stripped)
            return "json"
        except ValueError:
            pass
    if stripped.startswith("```"):
        return "code_block"
    return "plain"


@register("data.format_inconsistency", "Answers that break the dominant format, or mixed row shapes", needs=("dataset",))
def format_inconsistency(ctx: AuditContext) -> CheckOutcome:
    examples = ctx.examples
    n = len(examples)
    if not n:
        return None
    findings = []
    formats = [_target_format(e.completion) for e in examples]
    counts: dict[str, int] = defaultdict(int)
    for f in formats:
        counts[f] += 1
    major, k = max(counts.items(), key=lambda item: item[1])
    if major != "plain" and k < n and k / n >= ctx.config.format_majority_share:
        odd = [e.id for e, f in zip(examples, formats) if f != major]
        findings.append(ctx.finding(
            "medium",
            f"{_rows(len(odd), 'target')} breaking the dataset's {major} format",
            f"{_share(k, n)} targets are {major.replace('_', ' ')} but {len(odd)} are not "
            f"({dict(counts)}). The model learns to sometimes drop the format, which breaks parsers "
            "downstream.",
            f"Rewrite the listed targets as {major.replace('_', ' ')}, or drop them.",
            evidence={"formats": dict(counts), "majority": major},
            example_ids=odd,
        ))
    shapes: dict[str, int] = defaultdict(int)
    for e in examples:
        shapes[e.shape] += 1
    if len(shapes) > 1:
        minority = min(shapes, key=lambda shape: shapes[shape])
        findings.append(ctx.finding(
            "low",
            f"Rows come in {len(shapes)} different shapes",
            f"The file mixes row shapes {dict(shapes)}. Each shape is rendered differently (chat "
            "turns, plain text), so the model sees two conventions for the same task.",
            "Convert every row to one shape (messages, or prompt/completion) before training.",
            evidence={"shapes": dict(shapes)},
            example_ids=[e.id for e in examples if e.shape == minority],
        ))
    return findings


@register("data.length_outliers", "Rows far longer than the median", needs=("dataset",))
def length_outliers(ctx: AuditContext) -> CheckOutcome:
    if ctx.tokenizer is not None:
        lengths = [t.n_tokens_full for t in ctx.tokenized]
        unit = "tokens"
    else:  # without a tokenizer, about 4 characters per token
        lengths = [len(e.full_text) // 4 for e in ctx.examples]
        unit = "estimated tokens (characters / 4)"
    if not lengths:
        return None
    cfg = ctx.config
    median = statistics.median(lengths)
    limit = max(cfg.length_outlier_factor * median, cfg.length_outlier_min_tokens)
    outliers = [i for i, n in enumerate(lengths) if n > limit]
    if not outliers:
        return None
    ids = ctx.example_ids
    longest = max(lengths)
    return ctx.finding(
        "low",
        f"{_rows(len(outliers))} over {cfg.length_outlier_factor:g}x the median length",
        f"{_share(len(outliers), len(lengths))} rows are longer than {limit:g} {unit} against a "
        f"median of {median:g}; the longest has {longest}. Very long rows dominate the token count "
        "of their batch, get truncated first, and are often scraped or concatenated by mistake.",
        "Inspect the listed rows; split, shorten or drop the ones that are not real examples.",
        evidence={"n_outliers": len(outliers), "median_length": median, "limit": limit,
                  "longest": longest, "unit": unit},
        example_ids=[ids[i] for i in outliers],
    )


@register("data.loss_mask_coverage", "Loss mask covers prompt tokens, or very few tokens", needs=("dataset", "tokenizer"))
def loss_mask_coverage(ctx: AuditContext) -> CheckOutcome:
    toks = ctx.tokenized
    total = sum(len(t.input_ids) for t in toks)
    if not total:
        return None
    supervised = sum(t.n_supervised for t in toks)
    coverage = supervised / total
    in_mask = [t for t in toks if t.prompt_tokens_in_mask > 0]
    cfg = ctx.config
    n = len(toks)
    evidence = {"coverage": round(coverage, 4), "supervised_tokens": supervised, "total_tokens": total,
                "rows_with_prompt_in_mask": len(in_mask)}
    if in_mask:
        share = len(in_mask) / n
        prompt_tokens = sum(t.prompt_tokens_in_mask for t in in_mask)
        return ctx.finding(
            "high" if share >= cfg.prompt_in_mask_high_share else "medium",
            f"The loss covers prompt tokens in {_rows(len(in_mask))} ({share:.1%})",
            f"In {_share(len(in_mask), n)} rows the loss mask includes {prompt_tokens} tokens of "
            f"system/user turns; overall {coverage:.1%} of tokens are supervised. The model is "
            "trained to write the questions as well as the answers, which dilutes the answer "
            "signal and teaches it to continue with new questions.",
            "Train on completions only: give the tokenizer a chat template and use assistant-only "
            "(completion-only) loss.",
            evidence=evidence,
            example_ids=[t.example_id for t in in_mask],
        )
    if coverage < cfg.min_mask_coverage:
        return ctx.finding(
            "low",
            f"Only {coverage:.1%} of tokens are supervised",
            f"{supervised} of {total} tokens carry a label. Each update rests on very few tokens, so "
            "training is slow and noisy, and the loss curve says little about the answers.",
            "Shorten long shared prompts (system prompts, few-shot context) or check that the mask "
            "covers the whole answer.",
            evidence=evidence,
        )
    return None


@register("data.missing_eos", "Supervised answers that do not end in EOS", needs=("dataset", "tokenizer"))
def missing_eos(ctx: AuditContext) -> CheckOutcome:
    eos = getattr(ctx.tokenizer, "eos_token", None)
    # Rows whose answer was truncated lose their EOS too; data.completion_truncated reports those.
    judged = [t for t in ctx.tokenized if t.n_completion_tokens > 0 and t.n_completion_lost == 0]
    missing = [t for t in judged if not t.ends_with_eos]
    if not missing:
        return None
    share = len(missing) / len(judged)
    severity = "high" if share >= ctx.config.missing_eos_high_share else "medium"
    return ctx.finding(
        severity,
        f"{_rows(len(missing), 'target')} ({share:.1%}) not ending with EOS",
        f"In {_share(len(missing), len(judged))} untruncated rows the last supervised token is not "
        f"the tokenizer's EOS ({eos!r}). Without a supervised EOS the model never learns to stop: "
        "it runs to the generation cap and fails exact-match on answers it knew.",
        "Make the chat template close the assistant turn with the EOS token inside the loss mask, or "
        "append tokenizer.eos_token to each completion.",
        evidence={"n_missing": len(missing), "share": round(share, 4), "eos_token": eos},
        example_ids=[t.example_id for t in missing],
    )


def minhash_signatures(texts: list[str], num_perm: int, seed: int = 1) -> npt.NDArray[np.uint32]:
    """MinHash signatures (n_texts x num_perm, uint32) of each text's set of word 3-grams.

    Signature column j is min over the text's shingles of (a_j * h + b_j) mod 2^32, with odd
    a_j (a bijection on 32 bits) and h a mixed hash of the shingle's three word ids: the
    "affine32" scheme of datasketch 2, computed for every text in one vectorized pass. (datasketch
    itself hashes each shingle with sha1 in Python, about 3 s for 10,000 rows; this takes a
    tenth of that.) The share of equal columns of two signatures estimates their Jaccard
    similarity. A text of fewer than three words is one shingle of its words.
    """
    import numpy as np

    rng = np.random.RandomState(seed)
    a = (rng.randint(0, 1 << 31, size=num_perm, dtype=np.uint64) * 2 + 1).astype(np.uint32)
    b = rng.randint(0, 1 << 32, size=num_perm, dtype=np.uint64).astype(np.uint32)
    vocab: dict[str, int] = {}
    ids: list[int] = []
    lengths: list[int] = []
    for text in texts:
        words = [vocab.setdefault(w, len(vocab) + 1) for w in text.split()]
        words += [0] * (3 - len(words)) if len(words) < 3 else []
        ids.extend(words)
        lengths.append(len(words))
    out = np.zeros((len(texts), num_perm), dtype=np.uint32)
    if not texts:
        return out
    flat = np.asarray(ids, dtype=np.uint64)
    keys = (flat[:-2] * np.uint64(0x9E3779B97F4A7C15)) ^ (flat[1:-1] * np.uint64(0xBF58476D1CE4E5B9)) ^ flat[2:]
    keys ^= keys >> np.uint64(29)
    keys *= np.uint64(0x94D049BB133111EB)
    keys ^= keys >> np.uint64(32)
    ends = np.cumsum(lengths)
    starts = ends - np.asarray(lengths)
    # a 3-gram starting at position i belongs to its text when i + 2 is still inside it
    valid = np.ones(len(flat), dtype=bool)
    valid[ends - 1] = False
    valid[ends - 2] = False
    keys = keys[valid[:-2]].astype(np.uint32)
    shingle_starts = starts - 2 * np.arange(len(texts))  # two positions per text are dropped
    bounds = np.append(shingle_starts, len(keys))
    step = 2000  # texts per block: bounds the (shingles x num_perm) temporary
    for lo in range(0, len(texts), step):
        hi = min(lo + step, len(texts))
        block = keys[bounds[lo] : bounds[hi]]
        permuted = block[:, None] * a[None, :] + b[None, :]  # uint32 arithmetic wraps mod 2^32
        out[lo:hi] = np.minimum.reduceat(permuted, bounds[lo:hi] - bounds[lo], axis=0)
    return out


def _band_shape(num_perm: int, threshold: float) -> tuple[int, int]:
    """(bands, rows per band) for LSH: the most rows whose candidate threshold (1/b)^(1/r) stays
    at least 0.1 below the Jaccard threshold, so pairs at the threshold are nearly always found."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if (1 / bands) ** (1 / rows) <= threshold - 0.1:
            best = (bands, rows)
    return best


def near_duplicate_groups(texts: list[str], threshold: float, num_perm: int) -> list[list[int]]:
    """Groups (by index, sorted) of texts whose estimated 3-gram Jaccard similarity links them
    at ``threshold`` or above, found by LSH banding over the MinHash signatures.

    In each band, every text is a candidate pair with the first text of its bucket (the bucket's
    lowest index); candidate pairs whose signatures agree on at least ``threshold`` of their
    columns are linked, and a group is a connected component of those links. Everything is done
    per band on whole arrays (sort-based bucketing, batched signature comparison), so a dataset
    made mostly of near-copies, whose buckets hold thousands of rows, costs about what a dataset
    of distinct rows costs.
    """
    import numpy as np

    n = len(texts)
    if n < 2:
        return []
    signatures = minhash_signatures(texts, num_perm)
    bands, rows = _band_shape(num_perm, threshold)
    index = np.arange(n, dtype=np.int64)
    candidates = []
    for band in range(bands):
        block = np.ascontiguousarray(signatures[:, band * rows : (band + 1) * rows])
        keys = block.view(np.dtype((np.void, block.dtype.itemsize * rows))).ravel()
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        head = first[inverse.ravel()].astype(np.int64)  # np.unique's first occurrence: the lowest index
        mask = head != index
        candidates.append(head[mask] * n + index[mask])
    pairs = np.unique(np.concatenate(candidates))
    linked = []
    step = max(1, (1 << 24) // max(num_perm, 1))  # bounds the (pairs x num_perm) temporary
    for lo in range(0, len(pairs), step):
        chunk = pairs[lo : lo + step]
        a, b = chunk // n, chunk % n
        agree = (signatures[a] == signatures[b]).mean(axis=1)
        linked.append(chunk[agree >= threshold])
    links = np.concatenate(linked) if linked else np.zeros(0, dtype=np.int64)
    if not len(links):
        return []
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(links), dtype=np.int8), (links // n, links % n)), shape=(n, n))
    _, labels = connected_components(graph, directed=False)
    order = np.argsort(labels, kind="stable")  # members of each component in index order
    sizes = np.bincount(labels)
    groups = [g.tolist() for g in np.split(order, np.cumsum(sizes)[:-1]) if len(g) > 1]
    return sorted(groups, key=lambda g: g[0])


@register("data.near_duplicates", "Rows that are almost copies of each other (MinHash)", needs=("dataset",))
def near_duplicates(ctx: AuditContext) -> CheckOutcome:
    from gradian.data import normalize_text

    cfg = ctx.config
    examples = ctx.examples
    texts = [normalize_text(e.full_text) for e in examples]
    # Exact copies belong to data.duplicates; keep one representative per distinct text.
    first: dict[str, int] = {}
    for i, text in enumerate(texts):
        if text:
            first.setdefault(text, i)
    reps = list(first.values())
    if len(reps) < 2:
        return None
    num_perm = cfg.near_duplicate_num_perm
    found = near_duplicate_groups([texts[i] for i in reps], cfg.near_duplicate_jaccard, num_perm)
    if not found:
        return None
    clusters = [[reps[j] for j in group] for group in found]
    rows = [i for g in clusters for i in g]
    n = len(examples)
    share = len(rows) / n
    severity = "medium" if share >= cfg.near_duplicate_medium_share else "low"
    return ctx.finding(
        severity,
        f"{_rows(len(rows))} in {_rows(len(clusters), 'near-duplicate group')}",
        f"{_share(len(rows), n)} rows fall in {len(clusters)} groups whose word 3-gram Jaccard "
        f"similarity (MinHash estimate, {num_perm} permutations) is at least "
        f"{cfg.near_duplicate_jaccard:g}. Near-copies act as an unplanned upweighting and often "
        "come from templated or scraped generation.",
        "Keep one row per group unless the variation is intended (paraphrase augmentation).",
        evidence={"n_examples": len(rows), "n_groups": len(clusters), "share": round(share, 4),
                  "jaccard_threshold": cfg.near_duplicate_jaccard},
        example_ids=[examples[i].id for i in rows],
    )


@register("data.no_chat_template", "Conversation rows but a tokenizer without a chat template", needs=("dataset", "tokenizer"))
def no_chat_template(ctx: AuditContext) -> CheckOutcome:
    from gradian.data import has_chat_template

    chat = [e for e in ctx.examples if e.is_chat]
    if not chat or has_chat_template(ctx.tokenizer):
        return None
    return ctx.finding(
        "high",
        f"{len(chat)} chat rows but the tokenizer has no chat template",
        f"{_share(len(chat), len(ctx.examples))} rows are conversations, but the tokenizer defines no "
        "chat_template, so they can only be joined as plain text: no role markers, no turn "
        "boundaries, and the loss falls on the prompts too. Inference through a chat template will "
        "then see a format the adapter never trained on.",
        "Use the instruct model's tokenizer (which ships a template), or set tokenizer.chat_template "
        "to the template you train and serve with.",
        evidence={"n_chat_rows": len(chat)},
        example_ids=[e.id for e in chat],
    )


@register("data.no_supervised_tokens", "Rows with no token under the loss", needs=("dataset", "tokenizer"))
def no_supervised_tokens(ctx: AuditContext) -> CheckOutcome:
    toks = ctx.tokenized
    empty = [t for t in toks if t.n_supervised == 0]
    if not empty:
        return None
    n = len(toks)
    share = len(empty) / n
    severity = "critical" if share >= ctx.config.no_supervised_critical_share else "high"
    by_truncation = sum(1 for t in empty if t.n_completion_tokens > 0)
    return ctx.finding(
        severity,
        f"{_rows(len(empty))} with zero supervised tokens",
        f"{_share(len(empty), n)} rows leave no token under the loss: {by_truncation} because the "
        f"prompt alone fills max_seq_length={ctx.max_seq_length}, {len(empty) - by_truncation} "
        "because the mask selects nothing (empty answer, or a template the mask cannot follow). They "
        "contribute no gradient, or a NaN loss, and are invisible to attribution.",
        "Raise max_seq_length or shorten the prompts of the listed rows; check that the chat "
        "template marks the assistant turn.",
        evidence={"n_examples": len(empty), "share": round(share, 4), "by_truncation": by_truncation},
        example_ids=[t.example_id for t in empty],
    )


@register("data.prompt_equals_target", "Answer identical to its prompt", needs=("dataset",))
def prompt_equals_target(ctx: AuditContext) -> CheckOutcome:
    same = [
        e.id
        for e, p, c in zip(ctx.examples, ctx.normalized_prompts, ctx.normalized_completions)
        if p and p == c
    ]
    if not same:
        return None
    n = len(ctx.examples)
    share = len(same) / n
    severity = "medium" if share >= ctx.config.prompt_equals_target_medium_share else "low"
    return ctx.finding(
        severity,
        f"{_rows(len(same))} answering with {'its' if len(same) == 1 else 'their'} own prompt",
        f"In {_share(len(same), n)} rows the answer equals the prompt (after normalizing case, "
        "punctuation and spaces). These teach the model to echo its input, usually the sign of a "
        "broken field mapping when the dataset was built.",
        "Check the column mapping that produced these rows and fix or drop them.",
        evidence={"n_examples": len(same), "share": round(share, 4)},
        example_ids=same,
    )


@register("data.template_prefix_mismatch", "Chat template renders prompts that are not prefixes of the conversation", needs=("dataset", "tokenizer"))
def template_prefix_mismatch(ctx: AuditContext) -> CheckOutcome:
    from gradian.data import has_chat_template

    if not has_chat_template(ctx.tokenizer):
        raise CheckSkipped("the tokenizer has no chat template (see data.no_chat_template)")
    chat = {e.id for e in ctx.examples if e.is_chat}
    unstable = [t for t in ctx.tokenized if t.example_id in chat and not t.prefix_stable]
    if not unstable:
        return None
    return ctx.finding(
        "medium",
        f"The chat template is not prefix-stable for {_rows(len(unstable), 'conversation')}",
        f"For {_share(len(unstable), len(chat))} chat rows, rendering the turns before an answer "
        "(with the generation prompt) is not a prefix of the rendered conversation: the template "
        "rewrites earlier turns (some drop past reasoning) or changes the generation prompt. The "
        "text trained on then differs from the text the model sees at inference, and masks built "
        "from the prefix land on the wrong tokens.",
        "Train and serve with a prefix-stable template, or train on single-turn rows rendered "
        "exactly as at inference.",
        evidence={"n_examples": len(unstable)},
        example_ids=[t.example_id for t in unstable],
    )


@register("data.tiny_dataset", "Too few rows for trustworthy attribution", needs=("dataset",))
def tiny_dataset(ctx: AuditContext) -> CheckOutcome:
    n = len(ctx.examples)
    threshold = ctx.config.tiny_dataset_examples
    if n >= threshold:
        return None
    return ctx.finding(
        "medium",
        f"Only {n} training examples",
        f"{n} rows is fewer than {threshold}: influence estimates and cluster shares over so few "
        "rows are dominated by noise, and a LoRA on so little data mostly memorizes it.",
        "Collect more rows; read per-example attribution on this dataset as a hint, not a verdict.",
        evidence={"n_examples": n},
    )


def teaches_wanted_answer(answer: str, wanted: str, metric: str | None) -> bool:
    """Whether a training row's normalized ``answer`` gives the eval item's ``wanted`` answer as
    ``metric`` scores it: for ``not_contains``, none of the item's markers occurs in the answer;
    otherwise the wanted answer occurs in it on word boundaries (so a row answering "Rome, of
    course" teaches an ``exact_match`` item's "Rome" too)."""
    from gradian.data import normalize_text
    from gradian.evaluate.metrics import score_text, split_markers

    # the eval's own scorer, with the row's answer in place of a generation ("contains" for every
    # metric but not_contains); an item with nothing to match teaches nothing
    kind = "not_contains" if metric == "not_contains" else "contains"
    judged = split_markers(wanted) if kind == "not_contains" else normalize_text(wanted)
    return bool(judged) and score_text(kind, answer, wanted) == 1.0


@dataclass
class EvalPromptCopies:
    """An eval item whose prompt the training set asks: the rows giving its wanted answer and the
    rows teaching another one (dataset row positions)."""

    item_id: str
    same: list[int]
    other: list[int]


def eval_prompt_copies(examples: Sequence[Example], eval_items: Sequence[Example], metric: str | None = None,
                       normalized_prompts: Sequence[str] | None = None,
                       normalized_completions: Sequence[str] | None = None) -> list[EvalPromptCopies]:
    """Every eval item whose normalized prompt (its whole text when it has no prompt) is also a
    training row's, with those rows split by whether they teach the item's wanted answer."""
    from gradian.data import normalize_text

    prompts = normalized_prompts if normalized_prompts is not None else [normalize_text(e.prompt_text) for e in examples]
    answers = (normalized_completions if normalized_completions is not None
               else [normalize_text(e.completion) for e in examples])
    train: dict[str, list[int]] = defaultdict(list)
    for i, (e, prompt) in enumerate(zip(examples, prompts)):
        train[prompt or normalize_text(e.full_text)].append(i)
    out = []
    for item in eval_items:
        key = normalize_text(item.prompt_text) or normalize_text(item.full_text)
        rows = train.get(key) if key else None
        if not rows:
            continue
        wanted = item.completion or ""
        same = [i for i in rows if teaches_wanted_answer(answers[i], wanted, metric)]
        out.append(EvalPromptCopies(str(item.id), same, [i for i in rows if i not in set(same)]))
    return out


@register("data.train_eval_contamination", "Eval prompts that also occur in the training set", needs=("dataset", "eval"))
def train_eval_contamination(ctx: AuditContext) -> CheckOutcome:
    """Two findings from one comparison. An eval prompt trained with its wanted answer inflates the
    eval (``data.train_eval_contamination``, critical from a share of the items); one trained only
    with other answers does not: those rows teach against the eval, the regression they cause is
    real, and they are reported as conflicting supervision (``data.train_eval_conflict``, never
    critical), for the attribution to confirm."""
    examples = ctx.examples  # a fresh list on each access: read it once
    items = list(_eval_set(ctx).examples)
    copies = eval_prompt_copies(examples, items, ctx.eval_metric, ctx.normalized_prompts, ctx.normalized_completions)
    if not copies or not items:
        return None
    inflated = [c for c in copies if c.same]
    conflicted = [c for c in copies if not c.same]
    critical_share = ctx.config.contamination_critical_share
    findings = []
    if inflated:
        share = len(inflated) / len(items)
        rows = sorted({i for c in inflated for i in c.same})
        also = (f" {len(conflicted)} more are trained only with other answers (data.train_eval_conflict)."
                if conflicted else "")
        findings.append(ctx.finding(
            "critical" if share >= critical_share else "high",
            f"{_rows(len(inflated), 'eval item')} ({share:.1%}) also in the training set with the wanted answer",
            f"{_share(len(inflated), len(items))} eval prompts occur in training after normalization, "
            f"answered there as the eval wants.{also} Scores on those items measure recall of training "
            "rows, not the capability, so a before/after comparison on this eval set is not trustworthy.",
            "Remove the listed training rows, or evaluate on items that share no prompt with the "
            "training set.",
            evidence={"n_eval_items": len(items), "n_contaminated": len(inflated), "with_same_answer": len(inflated),
                      "n_conflicting": len(conflicted), "share": round(share, 4),
                      "eval_item_ids": [c.item_id for c in inflated][:50]},
            example_ids=[examples[i].id for i in rows],
        ))
    if conflicted:
        share = len(conflicted) / len(items)
        rows = sorted({i for c in conflicted for i in c.other})
        finding = ctx.finding(
            "high" if share >= critical_share else "medium",
            f"{_rows(len(conflicted), 'eval prompt')} ({share:.1%}) trained with another answer than the eval's",
            f"{_share(len(conflicted), len(items))} eval prompts occur in training after normalization, "
            f"and each of their {_rows(len(rows), 'training row')} teaches an answer other than the one "
            "the eval wants. That does not inflate the eval: it is supervision against it, and the "
            "likeliest cause of a regression on those items. The attribution says whether the "
            "accused rows are these.",
            "Check the listed rows' answers; if they are wrong, remove or correct them and retrain "
            "(gradian counterfactual --drop-ids measures the effect first).",
            evidence={"n_eval_items": len(items), "n_conflicting": len(conflicted), "n_rows": len(rows),
                      "share": round(share, 4), "eval_item_ids": [c.item_id for c in conflicted][:50],
                      "row_ids": [examples[i].id for i in rows]},
            example_ids=[examples[i].id for i in rows],
        )
        findings.append(dataclasses.replace(finding, id=EVAL_CONFLICT_ID))
    return findings


@register("data.truncated", "Rows longer than max_seq_length at all", needs=("dataset", "tokenizer"))
def truncated(ctx: AuditContext) -> CheckOutcome:
    limit = _need_seq_length(ctx)
    toks = ctx.tokenized
    cut = [t for t in toks if t.truncated]
    if not cut:
        return None
    share = len(cut) / len(toks)
    severity = "medium" if share >= ctx.config.truncated_medium_share else "low"
    return ctx.finding(
        severity,
        f"{_rows(len(cut))} ({share:.1%}) longer than max_seq_length={limit}",
        f"{_share(len(cut), len(toks))} rows are cut at {limit} tokens (longest "
        f"{max(t.n_tokens_full for t in cut)}). Whatever falls past the limit is never trained on; "
        "data.completion_truncated says whether answers were hit.",
        f"Raise max_seq_length to {max(t.n_tokens_full for t in cut)} or shorten the listed rows.",
        evidence={"n_truncated": len(cut), "share": round(share, 4), "max_seq_length": limit},
        example_ids=[t.example_id for t in cut],
    )
