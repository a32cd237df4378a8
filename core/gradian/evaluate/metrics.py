"""Per-item scorers: how one generation is judged against the answer the user wanted.

Every text metric compares normalized text (``gradian.data.normalize_text``: case-folded,
punctuation replaced by spaces, whitespace collapsed) and returns 1.0 for a pass, 0.0 for a fail.

- ``exact_match``: the whole normalized generation equals the normalized answer.
- ``contains``: the normalized answer occurs inside the normalized generation on word boundaries,
  so ``Rome`` does not pass on ``Romeo``.
- ``not_contains``: the completion field holds markers separated by ``|``; the item passes when
  none of them occurs in the generation. Markers are matched as plain substrings of the normalized
  text, so a stem such as ``unable to assist`` also catches ``unable to assist you``.
- ``loglik``: no generation is judged; the score is the mean log-probability (nats per supervised
  token) of the wanted completion, computed in ``gradian.evaluate.likelihood``. It is a proxy: a
  fine-tune that teaches answer format raises it even while the content gets worse.
"""

from __future__ import annotations

from gradian.data import normalize_text
from gradian.errors import ConfigError, DatasetError

__all__ = ["METRICS", "TEXT_METRICS", "PROXY_METRICS", "check_item", "score_text", "split_markers"]

#: every metric ``evaluation.metric`` accepts
METRICS: tuple[str, ...] = ("exact_match", "contains", "not_contains", "loglik")
#: metrics that judge generated text (and so leave generations for a contrastive query)
TEXT_METRICS: tuple[str, ...] = ("exact_match", "contains", "not_contains")
#: metrics that measure likelihood instead of correctness; results carry ``proxy_used=True``
PROXY_METRICS: tuple[str, ...] = ("loglik",)


def split_markers(completion: str) -> list[str]:
    """The non-empty, normalized ``|``-separated markers of a ``not_contains`` item."""
    return [m for m in (normalize_text(part) for part in completion.split("|")) if m]


def check_item(metric: str, wanted: str, where: str) -> None:
    """Refuse an eval item the metric cannot judge (an empty answer would pass everything)."""
    if metric not in METRICS:
        raise ConfigError(
            f"evaluation.metric is {metric!r}; use one of {', '.join(METRICS)}"
        )
    if metric in ("exact_match", "contains") and not normalize_text(wanted):
        raise DatasetError(
            f"{where}: the wanted answer is empty after normalization ({wanted!r}), so "
            f"'{metric}' cannot judge it; give the item the answer you expect"
        )
    if metric == "not_contains" and not split_markers(wanted):
        raise DatasetError(
            f"{where}: a not_contains item needs at least one marker in its completion, "
            "separated by '|' (e.g. \"can't help | unable to assist\")"
        )


def score_text(metric: str, generation: str, wanted: str) -> float:
    """1.0 when ``generation`` passes ``metric`` against ``wanted``, else 0.0.

    ``loglik`` has no text score; asking for one raises ``ConfigError``.
    """
    gen = normalize_text(generation)
    if metric == "exact_match":
        return float(gen == normalize_text(wanted))
    if metric == "contains":
        return float(f" {normalize_text(wanted)} " in f" {gen} ")
    if metric == "not_contains":
        return float(not any(marker in gen for marker in split_markers(wanted)))
    if metric == "loglik":
        raise ConfigError(
            "evaluation.metric 'loglik' scores likelihood, not text; compute it with "
            "gradian.evaluate.completion_logprobs"
        )
    raise ConfigError(f"evaluation.metric is {metric!r}; use one of {', '.join(METRICS)}")
