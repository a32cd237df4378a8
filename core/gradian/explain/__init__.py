"""Span drill-down: which words and sentences of a training example carry its influence.

A whole-example score dilutes one wrong sentence among many right ones; splitting the score over
the example's supervised tokens (exactly: the token contributions add up to the example's score)
and summing them into words and sentences points at the sentence to fix.

Interface:

- ``explain_example(gm, tokenizer, train, example, query, cfg, ...) -> SpanExplanation``;
- ``explain_top_accused(...)``: the harmful span of each top row of an accused set;
- ``explain_from_report(report_dir, example_id, item_id=None)``: what ``gradian explain`` runs;
- ``score_example_spans(gm, tokenizer, example, direction, grads_config) -> SpanExplanation`` and
  ``query_direction(gm, train, query, engine, engine_config, projector, state) -> QueryDirection``:
  the two steps, for callers who build their own query (they then own the choice of query item).
  The direction is the engine's own preconditioned query (``Engine.precondition``) on its fitted
  state (``span_engine_state`` / ``span_state``: from the cache beside the index when stored), so
  a row's span score is that engine's score of the row, for every engine (``DIRECT_ENGINES``: the
  built-ins for which that holds exactly; TracIn gives its final-adapter term).
- ``gradian.explain.buried``: the buried-sentence scenario and its localization measurement.
"""

from gradian.explain.direction import DIRECT_ENGINES, QueryDirection, preconditioned_query, query_direction, span_state
from gradian.explain.session import (
    SPAN_ENGINE,
    explain_example,
    explain_from_report,
    explain_top_accused,
    span_engine_state,
)
from gradian.explain.spans import SpanExplanation, TextPiece, score_example_spans, split_sentences, split_words

__all__ = [
    "DIRECT_ENGINES",
    "SPAN_ENGINE",
    "QueryDirection",
    "SpanExplanation",
    "TextPiece",
    "explain_example",
    "explain_from_report",
    "explain_top_accused",
    "preconditioned_query",
    "query_direction",
    "score_example_spans",
    "span_engine_state",
    "span_state",
    "split_sentences",
    "split_words",
]
