"""``explain_example``: the harmful span of one training example, against one query item.

The query is built from the single item the example hurts (not the average over every regressed
item): a buried sentence's signal is small, and averaging it against items it has nothing to do
with dilutes it further. With ``item`` left out, the item is the one the report's rankings name
as the row's ``worst_item``, else the one whose per-item score of the row is most negative.

Interface:

- ``explain_example(gm, tokenizer, train, example, query, cfg, ...) -> SpanExplanation``: the
  drill-down itself, given a loaded model, the gradient index and one query ``{block: [width]}``;
- ``explain_top_accused(gm, tokenizer, train, dataset, qg, item_scores, accused_ids, cfg, k)``:
  the same for the top ``k`` rows of an accused set, each against the item it hurts most (the
  attribution pipeline puts these in ``attribution.spans``);
- ``span_engine_state(gm, tokenizer, train, cfg, engine, dataset)``: the engine's fitted state the
  direction is preconditioned with (from the cache beside the index when attribute stored it);
  resolve it once and pass it as ``state=`` when explaining many rows;
- ``explain_from_report(report_dir, example_id, item_id=None, config=None)``: everything loaded
  from a ``gradian attribute --out`` folder (what ``gradian explain`` runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from gradian.errors import ConfigError
from gradian.explain.direction import query_direction, span_state
from gradian.explain.spans import SpanExplanation, score_example_spans
from gradian.report.schema import AnalysisInputs, AttributeManifest, CapabilityItem, CounterfactualManifest, Report

if TYPE_CHECKING:
    import pandas as pd
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig
    from gradian.data import Dataset, Example
    from gradian.engines.base import EngineState, TrainGradients
    from gradian.grads.model import GradientModel
    from gradian.jsontypes import JsonValue
    from gradian.query import QueryGradient, QueryItem

__all__ = ["SPAN_ENGINE", "explain_example", "explain_from_report", "explain_top_accused", "item_signal",
           "span_engine_state"]

#: the direction spans are scored against by default. Measured on the buried-sentence scenario
#: (``gradian.explain.buried``, docs/report.md): the plain query gradient puts the planted sentence
#: on top for 53 of 60 rows of the first draw and 51 of 52 of the second, DataInf's preconditioned
#: query for 52 of the first draw's 60; the preconditioner amplifies low-curvature directions that
#: single uncertain tokens also excite.
SPAN_ENGINE = "graddot"


def _answered_right(item: QueryItem) -> bool:
    return item.generated is not None and item.wanted.strip().lower() in item.generated.strip().lower()


def item_signal(item: QueryItem, requested: str) -> str:
    """The query signal for one item: ``target`` when its answer was right and nothing replaced it."""
    if requested in ("auto", "contrastive") and _answered_right(item):
        return "target"
    return requested


def span_engine_state(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, train: TrainGradients, cfg: GradianConfig,
                      engine: str | None = None, dataset: Dataset | None = None,
                      log: Callable[[str], None] | None = None) -> EngineState:
    """The fitted state of ``engine`` (``SPAN_ENGINE`` by default) over the index ``train``, on the final adapter.

    Loaded from ``cfg.cache_dir`` when it was stored before (``gradian attribute`` stores the
    Kronecker engines' states there); otherwise fitted through ``gradian.engines.fit_engine``, with
    the passes over the model a curvature fit needs when ``dataset`` (the indexed training set) is
    given. Engines that fit on the stored gradients alone (graddot, DataInf) need no dataset.
    """
    import dataclasses

    from gradian.engines import FitContext, get_engine

    engine = engine or SPAN_ENGINE
    engine_cfg = dataclasses.replace(cfg.engine, name=engine)
    context = FitContext(grads=cfg.grads, seed=cfg.seed, cache_dir=cfg.cache_dir, log=log)
    if dataset is not None and get_engine(engine).needs_model:
        from gradian.data import tokenize_examples
        from gradian.grads.collectors import ModelPasses

        tokenized = tokenize_examples(dataset.examples, tokenizer, cfg.grads.max_seq_length)
        context = dataclasses.replace(context, passes=ModelPasses(gm, tokenized, tokenizer.pad_token_id, cfg.grads))
    state = span_state(engine, train, engine_cfg, context, cache_dir=cfg.cache_dir)
    if log is not None and state.state_id:
        log(f"{engine}: fitted state {state.state_id}" + (" (cached)" if state.cache_hit else f" in {state.fit_seconds:.1f} s"))
    return state


def explain_example(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, train: TrainGradients, example: Example,
                    query: Mapping[str, np.ndarray], cfg: GradianConfig, *, item_id: str = "", signal: str = "",
                    row: int | None = None, engine: str | None = None, state: EngineState | None = None,
                    dataset: Dataset | None = None) -> SpanExplanation:
    """Token, word and sentence contributions of ``example`` to ``query``.

    ``engine`` is whose direction the tokens are scored against: ``SPAN_ENGINE`` (``graddot``, the
    query gradient itself) by default, or any engine's preconditioned query (``datainf``,
    ``ekfac``, ...), which the engine computes itself (``Engine.precondition``) on ``state``, its
    fitted state over ``train`` (``span_engine_state(..., dataset=dataset)`` when not given).
    ``train`` is the gradient index; ``row`` the example's row in it, to record that engine's score
    of the row beside the token sum.
    """
    import dataclasses

    from gradian.grads import make_projector

    engine = engine or SPAN_ENGINE
    engine_cfg = dataclasses.replace(cfg.engine, name=engine)
    if state is None:
        state = span_engine_state(gm, tokenizer, train, cfg, engine, dataset)
    direction = query_direction(gm, train, query, engine, engine_cfg, make_projector(cfg.grads, gm), state)
    score = direction.score_of(train, row) if row is not None else None
    return score_example_spans(gm, tokenizer, example, direction, cfg.grads, item_id=item_id, signal=signal,
                               score=score)


def explain_top_accused(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, train: TrainGradients, dataset: Dataset,
                        qg: QueryGradient, item_scores: np.ndarray, accused_ids: Sequence[str], cfg: GradianConfig,
                        k: int = 3, engine: str | None = None,
                        state: EngineState | None = None) -> list[SpanExplanation]:
    """The harmful span of the first ``k`` accused rows (most harmful first), each against its worst item.

    ``state``: ``engine``'s fitted state over ``train`` when the caller holds it (fitted once here otherwise)."""
    accused_ids = list(accused_ids)[:k]
    if state is None and accused_ids:
        state = span_engine_state(gm, tokenizer, train, cfg, engine, dataset)
    position = {eid: i for i, eid in enumerate(dataset.ids)}
    examples = dataset.by_id()
    out = []
    for eid in accused_ids:
        row = position[eid]
        if qg.per_item is not None and item_scores.ndim == 2 and item_scores.shape[1] > 1:
            j = int(np.argmin(item_scores[row]))
            query = {b: v[j] for b, v in qg.per_item.items()}
            item = qg.item_ids[j] if j < len(qg.item_ids) else str(j)
        else:
            query, item = qg.vectors, (qg.item_ids[0] if len(qg.item_ids) == 1 else "all query items")
        out.append(explain_example(gm, tokenizer, train, examples[eid], query, cfg, item_id=item,
                                   signal=qg.signal, row=row, engine=engine, state=state))
    return out


def explain_from_report(report_dir: str | Path, example_id: str, item_id: str | None = None,
                        config: str | Path | None = None, log: Callable[[str], None] = lambda m: None,
                        engine: str | None = None) -> SpanExplanation:
    """Load what a ``gradian attribute --out`` folder names and explain ``example_id``.

    The model, data, engine and gradient settings come from the report's manifest (or
    ``config``); the index is reopened from the cache (rebuilt when missing). The query item is
    ``item_id``, else the row's ``worst_item`` in rankings.parquet, else the first regressed item.
    ``engine`` is whose direction the tokens are scored against (``SPAN_ENGINE`` by default; the
    report's own engine, ``attribution.engine``, to split the score the report ranked by): its
    fitted state is the one the attribution stored beside the index, fitted again when missing.
    """
    from gradian.config import load_config
    from gradian.counterfactual import load_report
    from gradian.data import load_dataset
    from gradian.grads import load_model_for_gradients
    from gradian.index.stream import choose_store, training_gradients
    from gradian.model_loading import load_tokenizer
    from gradian.paths import ensure_writable_dir
    from gradian.query import QueryItem, build_query_gradient

    recorded, rankings = load_report(report_dir)
    report = Report.of(recorded)
    cfg = load_config(config, overrides=_report_overrides(report)) if config is None else load_config(config)
    # the index may be (re)built into cache_dir: refuse a folder that cannot take it before any loading
    ensure_writable_dir(cfg.cache_dir, "cache_dir")
    source = "the config" if config is not None else "the report's recorded config"
    if not cfg.dataset:
        raise ConfigError(f"{report_dir}: {source} names no training data (dataset); pass --config with "
                          "the dataset the attribution ran on")
    dataset = load_dataset(cfg.dataset)
    examples = dataset.by_id()
    if example_id not in examples:
        raise ConfigError(f"--example-id {example_id!r} is not a row of {cfg.dataset}; ids look like "
                          f"'{dataset.ids[0]}' (see the example_id column of rankings.parquet)")
    items = report.capability.items if report.capability is not None else []
    if not items:
        raise ConfigError(f"{report_dir}: the report has no evaluated items to build a query from; "
                          "attribute with an eval set (--eval-dataset) first")
    chosen = _choose_item(items, example_id, item_id, rankings)
    if not cfg.eval_dataset:
        raise ConfigError(f"{report_dir}: {source} names no eval set (eval_dataset); pass --config with "
                          "the eval set the attribution ran on")
    eval_set = load_dataset(cfg.eval_dataset)
    prompt = eval_set.by_id()[chosen.example_id].prompt_messages
    query_item = QueryItem(prompt_messages=prompt, wanted=chosen.wanted,
                           generated=chosen.tuned_generation, regressed=True, item_id=chosen.example_id)
    if not cfg.adapter_path:
        raise ConfigError(f"{report_dir}: neither {source} nor the report's inputs name the adapter "
                          "(adapter_path); pass --config with adapter_path")
    log(f"loading {cfg.base_model} with the adapter {cfg.adapter_path}")
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.base_model, cfg.trust_remote_code)
    from gradian.engines.registry import whole_gradient_engines

    cfg, choice = choose_store(cfg, gm, tokenizer, dataset, whole_gradient_engines([engine or SPAN_ENGINE]))
    log("opening the gradient index" if choice.store == "index" else f"note: {choice.message()}")
    # a stream writes nothing: the row's score and the fitted state read only the rows they need
    index = training_gradients(gm, tokenizer, dataset, cfg, choice, log=log)
    qg = build_query_gradient(gm, tokenizer, [query_item], item_signal(query_item, cfg.evaluation.query_signal),
                              cfg.grads, scope="item")
    log(f"scoring the tokens of {example_id} against item {query_item.item_id} ({qg.signal})")
    state = span_engine_state(gm, tokenizer, index, cfg, engine, dataset, log=log)
    return explain_example(gm, tokenizer, index, examples[example_id], qg.vectors, cfg, item_id=query_item.item_id,
                           signal=qg.signal, row=dataset.ids.index(example_id), engine=engine, state=state)


def _report_overrides(report: Report) -> dict[str, JsonValue]:
    """Dotted config keys from the report's recorded config (what the attribution ran with)."""
    manifest = report.manifest
    recorded = manifest.config if isinstance(manifest, (AttributeManifest, CounterfactualManifest)) else {}
    out: dict[str, JsonValue] = {}
    for key in ("base_model", "tokenizer", "adapter_path", "dataset", "eval_dataset", "cache_dir", "seed",
                "device", "dtype", "quantization", "trust_remote_code", "attn_implementation"):
        if recorded.get(key) is not None:
            out[key] = recorded[key]
    for section in ("grads", "engine", "evaluation"):
        for key, value in (recorded.get(section) or {}).items():
            if value is not None:
                out[f"{section}.{key}"] = value
    if not out.get("adapter_path"):
        out["adapter_path"] = report.inputs.adapter if isinstance(report.inputs, AnalysisInputs) else None
    return out


def _choose_item(items: Sequence[CapabilityItem], example_id: str, item_id: str | None,
                 rankings: pd.DataFrame | None) -> CapabilityItem:
    by_id = {str(i.example_id): i for i in items}
    if item_id is not None:
        if item_id not in by_id:
            raise ConfigError(f"--item {item_id!r} is not an eval item of the report; items are "
                              f"{', '.join(list(by_id)[:6])}{' ...' if len(by_id) > 6 else ''}")
        return by_id[item_id]
    if rankings is not None and "worst_item" in rankings.columns:
        row = rankings.loc[rankings["example_id"] == example_id]
        if len(row) and str(row["worst_item"].iloc[0]) in by_id:
            return by_id[str(row["worst_item"].iloc[0])]
    flipped = [i for i in items if i.flipped] or list(items)
    return flipped[0]
