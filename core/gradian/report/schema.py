"""The report.json contract: typed, versioned dataclasses for every block, and their JSON Schema.

Interface:

- ``Report`` and its blocks (``Capability``, ``ReportFinding``, ``Attribution``, ``Verdict``, the
  four manifests, ``Counterfactual``, ...): ``to_json() -> dict`` gives exactly the keys and
  nesting report.json has; ``Report.from_json(dict)`` loads any report.json this version or an
  earlier one wrote. ``SCHEMA_VERSION`` is written as ``schema_version``; a report without one was
  written before the field existed and has version 1's shape.
- ``json_schema() -> dict``: a JSON Schema (draft 2020-12) generated from the dataclasses; the
  published copy is ``docs/report-schema.json`` (``python -m gradian.report`` prints it).

Unknown keys: ``from_json`` is forward compatible. A key a block does not declare (written by a
newer version, or added by hand) is kept in that block's ``extra`` mapping and written back by
``to_json``, never dropped and never an error. A declared key with a value of the wrong JSON type,
or a required key that is missing, raises ``ReportSchemaError`` naming the path
(``attribution.clusters[2].n``). The JSON Schema, by contrast, describes exactly what this version
writes (``additionalProperties: false``), so a test can hold the builders to it.

Absent and null: a field marked ``omit_if_none`` is left out of the JSON when it is None (the
kind-specific parts of a manifest, ``skipped``, ``counterfactual``, ``deletions_withheld``,
``items_hurt``); every other field is always written, null when unknown. Readers treat an absent
optional key and a null one alike.

Sign convention, as everywhere: a positive score means the example reinforced the queried
behaviour, a negative one that it degraded it; ``predicted_loss_delta_if_removed = score / n``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping, Protocol, Sequence, TypedDict, TypeVar, Union

from gradian.cluster.accused import AccusedCandidate, AccusedSet
from gradian.errors import GradianError
from gradian.findings import Finding

if TYPE_CHECKING:
    from gradian.cluster.assign import ClusterAssignment
    from gradian.evaluate.query_loss import QueryLossChange as _QueryLossChange
    from gradian.evaluate.result import CapabilityResult, ItemResult
    from gradian.jsontypes import JsonObject, JsonValue

__all__ = [
    "SCHEMA_VERSION",
    "version_problem",
    "Accused",
    "AccusedCandidateRow",
    "AnalysisInputs",
    "Attribution",
    "AttributeManifest",
    "AttributionMetrics",
    "Capability",
    "CapabilityItem",
    "ClusterRow",
    "ClusteringSummary",
    "Counterfactual",
    "CounterfactualRound",
    "CounterfactualInputs",
    "CounterfactualManifest",
    "DatasetSummary",
    "DiagnoseManifest",
    "EngineStateSummary",
    "ExampleRow",
    "Harm",
    "IndexBuildManifest",
    "IndexSummary",
    "ItemHurt",
    "Lumpiness",
    "Manifest",
    "OtherManifest",
    "QueryLoss",
    "QuerySummary",
    "Report",
    "ReportFinding",
    "ReportSchemaError",
    "SkippedCheckRow",
    "Span",
    "SpanPiece",
    "Verdict",
    "json_schema",
    "json_schema_text",
]

#: the version this code writes; bump it when a key changes meaning, moves or disappears
SCHEMA_VERSION = 1
#: the version of a report written before ``schema_version`` existed (the same shape as 1)
UNVERSIONED = 1

VERDICT_KINDS = ("data", "config", "mixed", "inconclusive", "no_regression")
CAPABILITY_STATUSES = ("regressed", "improved", "not_significant")
COUNTERFACTUAL_OUTCOMES = ("recovered", "partial", "not_recovered", "nothing_to_recover")


class ReportSchemaError(GradianError, ValueError):
    """A report.json that does not have the report's shape (the message names the path)."""


def _help(text: str, omit_if_none: bool = False) -> dict[str, str | bool]:
    return {"help": text, "omit_if_none": omit_if_none}


def _optional(text: str = "") -> dict[str, str | bool]:
    """Metadata of a field left out of the JSON when it is None."""
    return {"help": text, "omit_if_none": True}


def _extra() -> dict[str, JsonValue]:
    return field(default_factory=dict, repr=False, compare=True,
                 metadata={"extra": True, "help": "keys this version does not declare, kept as read"})


# -- the generic machinery: dataclass fields + type hints <-> JSON --------------------------------


class _Block:
    """Mixin of every schema dataclass: ``to_json`` / ``from_json`` driven by the type hints.

    ``_DERIVED`` names properties written into the JSON (``n`` of the accused set) and ignored
    when reading; ``_OPEN`` marks a block whose JSON Schema admits any other key.
    """

    _DERIVED: ClassVar[tuple[str, ...]] = ()
    _OPEN: ClassVar[bool] = False

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.metadata.get("extra"):
                continue
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_if_none"):
                continue
            out[f.name] = _encode(value)
        for name in self._DERIVED:
            out[name] = _encode(getattr(self, name))
        for key, value in (getattr(self, "extra", None) or {}).items():
            out.setdefault(key, _encode(value))
        return out

    @classmethod
    def from_json(cls: type[_B], data: Mapping[str, object], path: str = "") -> _B:
        return _decode_block(cls, data, path or cls.__name__)


_B = TypeVar("_B", bound=_Block)


def _encode(value: object) -> object:
    if isinstance(value, _Block):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


_HINTS: dict[type, dict[str, object]] = {}

#: how the codec reads a field typed ``JsonValue``: any JSON value, copied as read (``{}`` in the
#: JSON Schema)
_OPEN_JSON: dict[str, object] = {"JsonValue": Any}


def _hints(cls: type) -> dict[str, object]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, localns=_OPEN_JSON)
    return _HINTS[cls]


def _derived_hint(cls: type, name: str) -> object:
    prop = getattr(cls, name)
    return typing.get_type_hints(prop.fget).get("return", Any)


def _is_union(hint: object) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


def _fail(path: str, wanted: str, value: object) -> ReportSchemaError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ReportSchemaError(f"report.json {path}: expected {wanted}, found {_json_type(value)} {shown}")


def _decode(value: object, hint: object, path: str) -> object:
    if hint is Any:
        return _encode(value)  # a fresh copy: open-ended mappings stay plain JSON
    if _is_union(hint):
        args = typing.get_args(hint)
        if value is None:
            if type(None) in args:
                return None
            raise _fail(path, _describe(hint), value)
        options = [a for a in args if a is not type(None)]
        blocks = [a for a in options if isinstance(a, type) and issubclass(a, _Block)]
        if isinstance(value, Mapping) and len(blocks) > 1:
            return _decode(value, _by_kind(blocks, value, path), path)
        for option in options:
            if _matches(value, option):
                return _decode(value, option, path)
        raise _fail(path, _describe(hint), value)
    if value is None:
        raise _fail(path, _describe(hint), value)
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        # forward compatible: a value a newer version added is kept, as long as its type fits
        if not any(type(value) is type(a) for a in allowed):
            raise _fail(path, _describe(hint), value)
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _fail(path, "an array", value)
        (item,) = typing.get_args(hint)
        return [_decode(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _fail(path, "an object", value)
        _, item = typing.get_args(hint)
        return {str(k): _decode(v, item, f"{path}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, _Block):
        if not isinstance(value, Mapping):
            raise _fail(path, f"an object ({hint.__name__})", value)
        return _decode_block(hint, value, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise _fail(path, "a boolean", value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise _fail(path, "an integer", value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, "a number", value)
        return value
    if hint is str:
        if not isinstance(value, str):
            raise _fail(path, "a string", value)
        return value
    raise TypeError(f"the report schema has no JSON mapping for {hint!r} at {path}")


def _matches(value: object, hint: object) -> bool:
    """Whether ``value``'s JSON type is the one ``hint`` wants (to pick a union member)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin is list:
        return isinstance(value, (list, tuple))
    if origin is dict or (isinstance(hint, type) and issubclass(hint, _Block)):
        return isinstance(value, Mapping)
    if origin is Literal:
        return any(type(value) is type(a) for a in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return False


def _by_kind(blocks: list[type[_Block]], value: Mapping[str, object], path: str) -> type[_Block]:
    """The union member whose ``kind`` literal is the value's ``kind`` (else the open one)."""
    kind = value.get("kind")
    fallback = None
    for block in blocks:
        hint = _hints(block).get("kind")
        if typing.get_origin(hint) is Literal and kind in typing.get_args(hint):
            return block
        if block._OPEN:
            fallback = block
    if fallback is None:
        raise _fail(f"{path}.kind", "one of " + ", ".join(_kinds(blocks)), kind)
    return fallback


def _kinds(blocks: list[type[_Block]]) -> list[str]:
    out = []
    for block in blocks:
        hint = _hints(block).get("kind")
        if typing.get_origin(hint) is Literal:
            out += [str(k) for k in typing.get_args(hint)]
    return out


def _decode_block(cls: type[_B], data: Mapping[str, object], path: str) -> _B:
    if not isinstance(data, Mapping):
        raise _fail(path, f"an object ({cls.__name__})", data)
    hints = _hints(cls)
    kwargs: dict[str, object] = {}
    known = set(cls._DERIVED)
    extra_field = None
    klass: type = cls  # every block is a dataclass
    for f in dataclasses.fields(klass):
        if f.metadata.get("extra"):
            extra_field = f.name
            continue
        known.add(f.name)
        if f.name in data:
            kwargs[f.name] = _decode(data[f.name], hints[f.name], f"{path}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ReportSchemaError(f"report.json {path}: the required key {f.name!r} is missing")
    unknown = {str(k): _encode(v) for k, v in data.items() if k not in known}
    if extra_field is not None:
        kwargs[extra_field] = unknown
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ReportSchemaError(f"report.json {path}: {err}") from None


# -- what the ``of`` constructors read of the lanes' own objects ---------------------------------


class SkippedCheckLike(Protocol):
    """The audit's ``SkippedCheck`` (or a ``SkippedCheckRow``)."""

    @property
    def id(self) -> str: ...
    @property
    def category(self) -> str: ...
    @property
    def reason(self) -> str: ...


class _QueryGradient(Protocol):
    """A ``gradian.query.QueryGradient``, without its vectors."""

    @property
    def signal(self) -> str: ...
    @property
    def requested_signal(self) -> str: ...
    @property
    def n_items(self) -> int: ...
    @property
    def scope(self) -> str: ...
    @property
    def notes(self) -> Sequence[str]: ...
    @property
    def finding_ids(self) -> Sequence[str]: ...
    @property
    def item_ids(self) -> Sequence[str]: ...
    @property
    def kept_item_ids(self) -> Sequence[str]: ...


class _TextPiece(Protocol):
    """A ``gradian.explain.TextPiece``: a word or sentence, its offsets and score."""

    @property
    def text(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def score(self) -> float: ...


class _SpanExplanation(Protocol):
    """A ``gradian.explain.SpanExplanation``, without its tokens."""

    @property
    def example_id(self) -> str: ...
    @property
    def item_id(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def signal(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def token_sum(self) -> float: ...
    @property
    def words(self) -> Sequence[_TextPiece]: ...
    @property
    def sentences(self) -> Sequence[_TextPiece]: ...
    @property
    def span(self) -> _TextPiece | None: ...
    @property
    def score(self) -> float | None: ...
    @property
    def notes(self) -> Sequence[str]: ...


class _RemovalPlan(Protocol):
    """A counterfactual's ``RemovalPlan``: the rows it drops and the data file."""

    @property
    def reason(self) -> str: ...
    @property
    def cluster(self) -> str | None: ...
    @property
    def n_examples(self) -> int: ...
    @property
    def n_drop(self) -> int: ...
    @property
    def n_keep(self) -> int: ...
    @property
    def drop_ids(self) -> Sequence[str]: ...
    @property
    def dataset_path(self) -> str | None: ...
    @property
    def dataset_sha256(self) -> str | None: ...


# -- the blocks ---------------------------------------------------------------------------------


@dataclass
class CapabilityItem(_Block):
    """One eval item measured on the base and the tuned model (scores 1/0 for pass/fail metrics,
    nats per token for loglik, whose booleans are null)."""

    example_id: str
    index: int
    prompt: str
    wanted: str = field(metadata=_help("the item's completion field: the wanted answer"))
    base_score: float = 0.0
    tuned_score: float = 0.0
    base_correct: bool | None = None
    tuned_correct: bool | None = None
    base_generation: str | None = None
    tuned_generation: str | None = None
    flipped: bool = field(default=False, metadata=_help("the base passed and the tuned model fails"))
    base_failing: bool = field(default=False, metadata=_help("the base model already fails this item"))
    base_margin: float | None = field(default=None, metadata=_help(
        "log p_base(wanted) - log p_base(tuned generation), nats; flipped items only"))
    weakly_held: bool = False
    extra: dict[str, JsonValue] = _extra()

    @classmethod
    def of(cls, item: ItemResult) -> "CapabilityItem":
        return cls(example_id=item.example_id, index=item.index, prompt=item.prompt, wanted=item.wanted,
                   base_score=item.base_score, tuned_score=item.tuned_score, base_correct=item.base_correct,
                   tuned_correct=item.tuned_correct, base_generation=item.base_generation,
                   tuned_generation=item.tuned_generation, flipped=item.flipped, base_failing=item.base_failing,
                   base_margin=item.base_margin, weakly_held=item.weakly_held)


_CapabilityStatus = Literal["regressed", "improved", "not_significant"]
_CAPABILITY_STATUS: dict[str, _CapabilityStatus] = {"regressed": "regressed", "improved": "improved",
                                                    "not_significant": "not_significant"}


@dataclass
class Capability(_Block):
    """The capability measured on the base and the tuned model, with its paired bootstrap CI."""

    name: str
    metric: str
    base: float
    tuned: float
    delta: float = field(metadata=_help("tuned - base"))
    ci: list[float] = field(metadata=_help("[lo, hi] of the delta at ci_level"))
    n_items: int
    n_flipped: int
    n_base_failing: int
    status: _CapabilityStatus
    proxy_used: bool = field(metadata=_help("the metric measures likelihood (loglik), not correctness"))
    too_few_items: bool = field(default=False, metadata=_help(
        "fewer items than min_items: status is the bootstrap's reading of too few items to call any change "
        "significant, and the gate refuses attribution"))
    min_items: int | None = field(default=None, metadata=_optional("evaluation.min_items when it was measured"))
    n_repeats: int = field(default=0, metadata=_help(
        "eval items left out because they repeat an earlier item (the same prompt and answer); n_items counts "
        "the distinct ones"))
    ci_level: float = 0.95
    n_bootstrap: int = 2000
    seed: int = 1234
    weak_margin_nats: float = 1.0
    low_base_threshold: float = 0.5
    low_base_score: bool = False
    n_weakly_held: int = 0
    mean_base_margin: float | None = None
    hedges: list[str] = field(default_factory=list)
    items: list[CapabilityItem] = field(default_factory=list)
    extra: dict[str, JsonValue] = _extra()

    def ci_bounds(self) -> tuple[float | None, float | None]:
        """``(lo, hi)`` of the delta's interval, or ``(None, None)`` when it was not recorded."""
        return (self.ci[0], self.ci[1]) if len(self.ci) >= 2 else (None, None)

    @classmethod
    def of(cls, result: CapabilityResult) -> "Capability":
        """The block of a measured capability: its figures, bootstrap settings, hedges and items."""
        if result.status not in _CAPABILITY_STATUS:
            raise _fail("capability.status", "one of " + ", ".join(_CAPABILITY_STATUS), result.status)
        return cls(
            name=result.name, metric=result.metric, base=result.base, tuned=result.tuned, delta=result.delta,
            ci=[result.ci[0], result.ci[1]], n_items=result.n_items, n_flipped=result.n_flipped,
            n_base_failing=result.n_base_failing, status=_CAPABILITY_STATUS[result.status],
            proxy_used=result.proxy_used, too_few_items=result.too_few_items, min_items=result.min_items,
            n_repeats=result.n_repeats, ci_level=result.ci_level, n_bootstrap=result.n_bootstrap, seed=result.seed,
            weak_margin_nats=result.weak_margin_nats, low_base_threshold=result.low_base_threshold,
            low_base_score=result.low_base_score, n_weakly_held=len(result.weakly_held_items),
            mean_base_margin=result.mean_base_margin, hedges=result.hedges(),
            items=[CapabilityItem.of(i) for i in result.items],
        )


@dataclass
class ReportFinding(Finding, _Block):
    """A ``gradian.findings.Finding`` as report.json holds it (``evidence`` stays open-ended)."""

    extra: dict[str, JsonValue] = _extra()

    @classmethod
    def of(cls, finding: Finding | Mapping[str, object]) -> "ReportFinding":
        if isinstance(finding, ReportFinding):
            return finding
        if isinstance(finding, Finding):
            return cls(**{f.name: getattr(finding, f.name) for f in dataclasses.fields(Finding)})
        return cls.from_json(finding, "findings[]")


@dataclass
class SkippedCheckRow(_Block):
    """An audit check that did not run, and why."""

    id: str
    category: str
    reason: str
    extra: dict[str, JsonValue] = _extra()

    @classmethod
    def of(cls, skipped: "SkippedCheckLike | Mapping[str, object]") -> "SkippedCheckRow":
        """From the audit's ``SkippedCheck`` (anything with ``id``, ``category`` and ``reason``), or
        a row already read from JSON."""
        if isinstance(skipped, SkippedCheckRow):
            return skipped
        if isinstance(skipped, Mapping):
            return cls.from_json(skipped, "skipped[]")
        return cls(id=str(skipped.id), category=str(skipped.category), reason=str(skipped.reason))


@dataclass
class QuerySummary(_Block):
    """How the query gradient was built (its vectors stay out of the report)."""

    signal: str = field(metadata=_help("the signal used: contrastive or target"))
    requested_signal: str = ""
    n_items: int = 0
    scope: str = field(default="regressed", metadata=_help("which items the query covers"))
    notes: list[str] = field(default_factory=list)
    finding_ids: list[str] = field(default_factory=list)
    item_ids: list[str] = field(default_factory=list)
    kept_item_ids: list[str] = field(default_factory=list, metadata=_help(
        "the items among item_ids the tuned model still answers right (evaluation.query_scope: lost); "
        "they order the rows but leave the score column, the clusters and the accused set alone"))
    extra: dict[str, JsonValue] = _extra()

    @classmethod
    def of(cls, query: _QueryGradient) -> "QuerySummary":
        """From a ``gradian.query.QueryGradient``: how it was built, without its vectors."""
        return cls(signal=query.signal, requested_signal=query.requested_signal, n_items=int(query.n_items),
                   scope=query.scope, notes=list(query.notes), finding_ids=list(query.finding_ids),
                   item_ids=list(query.item_ids), kept_item_ids=list(query.kept_item_ids))


@dataclass
class ItemHurt(_Block):
    """A query item a listed row hurts, with its share of the row's harm (0..1)."""

    item_id: str
    share: float
    extra: dict[str, JsonValue] = _extra()


@dataclass
class ExampleRow(_Block):
    """One training example in a ranking (``top_harmful``, ``top_helpful``, a cluster's top rows)."""

    example_id: str
    score: float = field(metadata=_help("the engine's score; negative degraded the capability"))
    predicted_loss_delta_if_removed: float = field(metadata=_help("score / n over the whole dataset"))
    cluster: str
    excerpt: str = ""
    items_hurt: list[ItemHurt] | None = field(default=None, metadata=_optional(
        "top_harmful only, with per-item scores: the query items this row hurts most"))
    extra: dict[str, JsonValue] = _extra()


@dataclass
class ClusterRow(_Block):
    """Influence summed over one cluster of training examples."""

    cluster: str
    label: str
    n: int
    signed_influence: float = field(metadata=_help("sum of the members' scores"))
    share_of_negative: float = field(metadata=_help("its negative scores over all negative scores (0..1)"))
    mean_per_example: float = field(metadata=_help("signed_influence / n"))
    top_examples: list[ExampleRow] = field(default_factory=list)
    extra: dict[str, JsonValue] = _extra()


@dataclass
class AccusedCandidateRow(AccusedCandidate, _Block):
    """One way of splitting the accused cluster, with the figures it was judged by."""

    extra: dict[str, JsonValue] = _extra()


@dataclass
class Accused(AccusedSet, _Block):
    """``gradian.cluster.AccusedSet``, the rows to act on, as report.json holds it (plus ``n`` and
    ``n_left_out``, derived from the id lists)."""

    candidates: list[AccusedCandidateRow] = field(default_factory=list)  # type: ignore[assignment]
    extra: dict[str, JsonValue] = _extra()

    _DERIVED: ClassVar[tuple[str, ...]] = ("n", "n_left_out")

    @classmethod
    def of(cls, accused: AccusedSet) -> "Accused":
        values = {f.name: getattr(accused, f.name) for f in dataclasses.fields(AccusedSet)}
        values["candidates"] = [AccusedCandidateRow(**dataclasses.asdict(c)) for c in accused.candidates]
        return cls(**values)


@dataclass
class SpanPiece(_Block):
    """A word or sentence of an example's supervised text: ``[start, end)`` and its contribution."""

    text: str
    start: int
    end: int
    score: float
    extra: dict[str, JsonValue] = _extra()


@dataclass
class Span(_Block):
    """Where inside one accused row its harm on one query item sits."""

    example_id: str
    item_id: str
    engine: str
    signal: str
    text: str
    token_sum: float
    words: list[SpanPiece] = field(default_factory=list)
    sentences: list[SpanPiece] = field(default_factory=list)
    span: SpanPiece | None = field(default=None, metadata=_help("the most harmful sentence, or null"))
    score: float | None = None
    notes: list[str] = field(default_factory=list)
    span_start: int | None = None
    span_end: int | None = None
    span_text: str = ""
    span_score: float | None = None
    extra: dict[str, JsonValue] = _extra()

    @classmethod
    def of(cls, explanation: _SpanExplanation) -> "Span":
        """From a ``gradian.explain.SpanExplanation``: its words and sentences (not its tokens), and
        the harmful span's offsets, text and score."""
        def piece(p: _TextPiece) -> SpanPiece:
            return SpanPiece(text=p.text, start=int(p.start), end=int(p.end), score=float(p.score))

        span = explanation.span
        return cls(example_id=explanation.example_id, item_id=explanation.item_id, engine=explanation.engine,
                   signal=explanation.signal, text=explanation.text, token_sum=float(explanation.token_sum),
                   words=[piece(w) for w in explanation.words], sentences=[piece(x) for x in explanation.sentences],
                   span=piece(span) if span is not None else None,
                   score=None if explanation.score is None else float(explanation.score),
                   notes=list(explanation.notes),
                   span_start=int(span.start) if span is not None else None,
                   span_end=int(span.end) if span is not None else None,
                   span_text=span.text if span is not None else "",
                   span_score=float(span.score) if span is not None else None)


@dataclass
class Lumpiness(_Block):
    """Is the harm concentrated in one cluster? The candidate and the numbers behind the call
    (the candidate's figures are null when no cluster has a negative mean)."""

    lumpy: bool
    cluster: str | None
    n_clusters: int
    n_examples: int
    label: str | None = None
    n: int | None = None
    share: float | None = None
    share_of_negative: float | None = None
    net_harm_share: float | None = None
    mean_per_example: float | None = None
    rest_mean_per_example: float | None = None
    rate_ratio: float | None = field(default=None, metadata=_help("null when the rest is net helpful"))
    rest_net_helpful: bool | None = None
    fraction_of_dataset: float | None = None
    reason: str = ""
    extra: dict[str, JsonValue] = _extra()


@dataclass
class AttributionMetrics(_Block):
    """Timings of the attribution lane, in seconds (one name whatever the engine)."""

    index_seconds: float | None = None
    fit_seconds: float | None = None
    extra: dict[str, JsonValue] = _extra()


@dataclass
class QueryLoss(_Block):
    """The query's loss measured on the base and the tuned model: the function every score is a
    first-order change of (mean over the query items of l(wanted), minus l(generated) when
    contrastive), in nats per supervised token (loss_reduction mean) or nats (sum)."""

    signal: str
    unit: str
    base: float
    tuned: float
    rise: float = field(metadata=_help("tuned - base: how much the fine-tune raised the query loss"))
    n_items: int
    extra: dict[str, JsonValue] = _extra()

    @classmethod
    def of(cls, change: _QueryLossChange) -> "QueryLoss":
        return cls(signal=change.signal, unit=change.unit, base=float(change.base), tuned=float(change.tuned),
                   rise=float(change.rise), n_items=int(change.n_items))


@dataclass
class Attribution(_Block):
    """The attribution lane: engines, query, clusters, rankings, accused set and spans."""

    engine: str
    cross_check: str | None = None
    engine_agreement_spearman: float | None = field(default=None, metadata=_help(
        "rank correlation of the two engines' scores, null without a cross-check"))
    query_signal: str = ""
    query: QuerySummary | None = None
    gated: bool = field(default=False, metadata=_help("attribution ran without a significant regression"))
    n_examples: int = 0
    clusters: list[ClusterRow] = field(default_factory=list)
    ranked_clusters: list[ClusterRow] | None = field(default=None, metadata=_optional(
        "the cluster table again in the ranking's units (each row's influence over the square root of its "
        "self-influence), present only when no cluster stands out in loss units and one does in these: the "
        "verdict and the accused set then read it"))
    top_harmful: list[ExampleRow] = field(default_factory=list)
    top_helpful: list[ExampleRow] = field(default_factory=list)
    accused: Accused | None = field(default=None, metadata=_help(
        "the rows to act on, refined from the accused cluster; null when no cluster is accused"))
    spans: list[Span] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metrics: AttributionMetrics | None = None
    lumpiness: Lumpiness | None = None
    deletions_withheld: str | None = field(default=None, metadata=_optional(
        "why top_harmful is empty: no cluster carries the harm at a distinctly higher rate"))
    query_loss: QueryLoss | None = field(default=None, metadata=_optional(
        "the query's loss on the base and the tuned model; null when it was not measured"))
    extra: dict[str, JsonValue] = _extra()


@dataclass
class Harm(_Block):
    """The harm of the accused cluster and set in the query loss's own units: their share of the
    negative influence applied to the measured rise, beside the first-order estimate (the sum of
    score / n over the set), which overshoots when many rows are removed at once."""

    unit: str
    rise: float = field(metadata=_help("the query loss's rise from base to tuned (attribution.query_loss.rise)"))
    cluster_share: float | None = None
    cluster_loss: float | None = field(default=None, metadata=_help("cluster_share x rise"))
    accused_share: float | None = None
    accused_loss: float | None = field(default=None, metadata=_help(
        "accused_share x rise: the drop of the query loss expected from removing the accused set"))
    accused_first_order: float | None = field(default=None, metadata=_help(
        "sum of score / n over the accused set: the linear estimate of the same drop (negative: the loss falls)"))
    extra: dict[str, JsonValue] = _extra()


@dataclass
class Verdict(_Block):
    """The report's conclusion, as data (kind, accused cluster) and as prose (summary, hedges)."""

    kind: Literal["data", "config", "mixed", "inconclusive", "no_regression"]
    summary: str
    hedges: list[str] = field(default_factory=list)
    accused_cluster: str | None = None
    accused_set_n: int | None = None
    harm: Harm | None = field(default=None, metadata=_optional(
        "the accused rows' harm in the query loss's units; null without a measured query loss or an accused cluster"))
    extra: dict[str, JsonValue] = _extra()


# -- manifests: one per report kind -------------------------------------------------------------


@dataclass
class DatasetSummary(_Block):
    """A data file as analyzed: where, its content hash, its rows."""

    path: str | None
    sha256: str | None
    n_examples: int | None = field(default=None, metadata=_optional())
    extra: dict[str, JsonValue] = _extra()


@dataclass
class AnalysisInputs(_Block):
    """What the audit (and the attribution) read."""

    dataset: DatasetSummary | None = None
    eval_dataset: DatasetSummary | None = None
    run: str | None = field(default=None, metadata=_help("the run's source: a folder or mlflow:<id>"))
    base_model: str | None = None
    tokenizer: str | None = None
    max_seq_length: int | None = None
    adapter: str | None = field(default=None, metadata=_optional("attribute only"))
    capability: str | None = field(default=None, metadata=_optional("attribute only"))
    extra: dict[str, JsonValue] = _extra()


@dataclass
class IndexSummary(_Block):
    """The gradient index an attribution used or ``gradian index`` built."""

    index_id: str
    n_examples: int
    bytes: int
    bytes_per_example: float
    path: str | None = field(default=None, metadata=_optional())
    build_seconds: float | None = field(default=None, metadata=_optional())
    repaired: list[str] = field(default_factory=list, metadata=_help(
        "files of the stored index found damaged, missing or left over by this run and recomputed or "
        "removed, in words (the index manifest's 'repairs' keeps every build's records)"))
    store: str = field(default="index", metadata=_help(
        "where the training gradients came from: index (written once to the on-disk index, read by each "
        "pass) or stream (recomputed from the model in each pass, nothing written)"))
    passes: int | None = field(default=None, metadata=_optional(
        "full passes over the training set that recomputed its gradients (stream only)"))
    extra: dict[str, JsonValue] = _extra()


@dataclass
class EngineStateSummary(_Block):
    """The main engine's fitted state (cached beside the index under its own id)."""

    engine: str
    state_id: str | None = None
    cache_hit: bool = False
    settings: dict[str, JsonValue] = field(default_factory=dict)
    fit_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    repaired: str | None = field(default=None, metadata=_optional(
        "what was wrong with the stored state that was fitted again to replace it"))
    params: dict[str, Any] = field(default_factory=dict, metadata=_help(
        "the settings this engine's run is known by (Engine.describe: damping and its kind, the Fisher, the "
        "ranking, ...), logged as tracking parameters"))
    extra: dict[str, JsonValue] = _extra()


@dataclass
class ClusteringSummary(_Block):
    """How the training examples were clustered (the per-example labels are in rankings.parquet)."""

    names: dict[str, str]
    method: str
    requested: str
    reason: str
    embed_backend: str | None = None
    sizes: dict[str, int] = field(default_factory=dict)
    space: str = "text"
    extra: dict[str, JsonValue] = _extra()

    @classmethod
    def of(cls, assignment: ClusterAssignment) -> "ClusteringSummary":
        """How ``assignment`` was made, without its per-example labels."""
        return cls(names=dict(assignment.names), method=assignment.method, requested=assignment.requested,
                   reason=assignment.reason, embed_backend=assignment.embed_backend, sizes=dict(assignment.sizes),
                   space=assignment.space)


@dataclass
class AttributeManifest(_Block):
    """What ``gradian attribute`` ran on and with (the index fields only when attribution ran)."""

    kind: Literal["attribute"] = "attribute"
    gradian_version: str = ""
    config_hash: str = ""
    config: dict[str, Any] = field(default_factory=dict, metadata=_help("the effective config, every key"))
    inputs: AnalysisInputs = field(default_factory=AnalysisInputs)
    index: IndexSummary | None = field(default=None, metadata=_optional())
    index_manifest: dict[str, JsonValue] | None = field(default=None, metadata=_optional(
        "the index's manifest.json (its own format: gradian.index)"))
    damping: dict[str, float] | None = field(default=None, metadata=_optional("damping per block"))
    engine_state: EngineStateSummary | None = field(default=None, metadata=_optional())
    clustering: ClusteringSummary | None = field(default=None, metadata=_optional())
    seconds: float = 0.0
    extra: dict[str, JsonValue] = _extra()


@dataclass
class DiagnoseManifest(_Block):
    """What ``gradian diagnose`` read, which checks ran and how many findings of each severity."""

    kind: Literal["diagnose"] = "diagnose"
    gradian_version: str = ""
    inputs: AnalysisInputs = field(default_factory=AnalysisInputs)
    checks_run: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict, metadata=_help("findings per severity"))
    audit_config: dict[str, JsonValue] = field(default_factory=dict, metadata=_help("the audit thresholds used"))
    started_at: float | None = field(default=None, metadata=_optional("when the work started, seconds since the epoch"))
    seconds: float | None = field(default=None, metadata=_optional("how long the work took"))
    extra: dict[str, JsonValue] = _extra()


@dataclass
class IndexBuildManifest(_Block):
    """What ``gradian index`` built or reused."""

    kind: Literal["index"] = "index"
    index: IndexSummary | None = None
    index_manifest: dict[str, JsonValue] = field(default_factory=dict, metadata=_help("the index's manifest.json"))
    started_at: float | None = field(default=None, metadata=_optional("when the work started, seconds since the epoch"))
    seconds: float | None = field(default=None, metadata=_optional("how long the work took"))
    extra: dict[str, JsonValue] = _extra()


@dataclass
class CounterfactualInputs(_Block):
    """What a counterfactual retrain started from and produced."""

    dataset: DatasetSummary
    kept_dataset: DatasetSummary
    eval_dataset: str | None
    base_model: str | None
    adapter_before: str | None
    adapter_after: str | None
    capability: str
    seed: int
    extra: dict[str, JsonValue] = _extra()


@dataclass
class CounterfactualManifest(_Block):
    """What ``gradian counterfactual`` retrained on and with."""

    kind: Literal["counterfactual"] = "counterfactual"
    gradian_version: str = ""
    config_hash: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    inputs: CounterfactualInputs | None = None
    seconds: float = 0.0
    extra: dict[str, JsonValue] = _extra()


@dataclass
class OtherManifest(_Block):
    """A manifest of a kind this version does not know (written by a newer one): kept as read."""

    kind: str = ""
    extra: dict[str, JsonValue] = _extra()

    _OPEN: ClassVar[bool] = True


Manifest = Union[AttributeManifest, DiagnoseManifest, IndexBuildManifest, CounterfactualManifest, OtherManifest]


# -- the counterfactual block -------------------------------------------------------------------


@dataclass
class Removal(_Block):
    """The rows a counterfactual left out."""

    reason: str
    cluster: str | None
    n_examples: int
    n_removed: int
    n_kept: int
    removed_ids: list[str]
    dataset: DatasetSummary
    extra: dict[str, JsonValue] = _extra()

    @classmethod
    def of(cls, plan: _RemovalPlan) -> "Removal":
        """From a counterfactual's ``DropPlan``: why, how many, which ids, and the data file."""
        return cls(reason=plan.reason, cluster=plan.cluster, n_examples=int(plan.n_examples),
                   n_removed=int(plan.n_drop), n_kept=int(plan.n_keep), removed_ids=list(plan.drop_ids),
                   dataset=DatasetSummary(path=plan.dataset_path, sha256=plan.dataset_sha256))


@dataclass
class Recovery(_Block):
    """How much of the lost capability came back: ``recovered_fraction = (after - before) /
    (base - before)``; item counts for pass/fail metrics only."""

    metric: str
    n_items: int
    base: float
    before: float | None
    after: float
    delta_before: float | None
    delta_after: float
    status_after: str | None
    recovered_fraction: float | None
    items_below_base_before: float | None
    items_below_base_after: float | None
    within_one_item: bool | None
    before_source: str = ""
    extra: dict[str, JsonValue] = _extra()


@dataclass
class GroundTruth(_Block):
    """Removal precision and recall against known planted rows."""

    n_removed: int
    n_planted: int
    n_planted_removed: int
    precision: float | None
    recall: float | None
    extra: dict[str, JsonValue] = _extra()


@dataclass
class PredictedSums(_Block):
    """The accusing scores summed over all, removed and kept examples (signs -1, 0, 1)."""

    n: int
    sum_all: float
    sum_removed: float
    sum_kept: float
    predicted_loss_delta_if_removed: float | None
    sign_all: int
    sign_kept: int
    sign_changed: bool
    extra: dict[str, JsonValue] = _extra()


@dataclass
class CounterfactualSeconds(_Block):
    train: float
    evaluate: float
    total: float
    #: spelled as first written: the block has no docstring, so dataclasses writes its signature, this
    #: annotation included, as the description docs/report-schema.json publishes
    extra: dict[str, Any] = _extra()


@dataclass
class CounterfactualRound(_Block):
    """One round of ``gradian counterfactual --until-recovered``: the retrain without every row
    removed so far, and the rows the attribution of that retrain added for the next round."""

    round: int
    n_removed: int
    outcome: str
    after: float
    recovered_fraction: float | None = None
    items_below_base_after: float | None = None
    #: removal precision / recall against known-bad rows, when given (``--truth``)
    precision: float | None = None
    recall: float | None = None
    #: where this round's report is, relative to the folder of the final one
    report: str = ""
    #: rows the attribution of this round's retrain accused, removed in the next round, each as
    #: ``{"example_id", "score"}`` (ids of the original training file)
    added: list[dict[str, JsonValue]] = field(default_factory=list)
    #: why the rounds stopped here, on the last round only
    stopped: str | None = None
    extra: dict[str, JsonValue] = _extra()


@dataclass
class Counterfactual(_Block):
    """A retrain without the removed rows, and what it did to the capability."""

    outcome: Literal["recovered", "partial", "not_recovered", "nothing_to_recover"]
    removal: Removal
    capability: Recovery
    ground_truth: GroundTruth | None = None
    predicted: PredictedSums | None = None
    recipe_source: str = ""
    seconds: CounterfactualSeconds | None = None
    rounds: list[CounterfactualRound] | None = field(
        default=None, metadata=_optional("--until-recovered: every round, the last one being this report's"))
    extra: dict[str, JsonValue] = _extra()


# -- the report ---------------------------------------------------------------------------------


@dataclass
class Report(_Block):
    """report.json: every lane's output in one document.

    ``capability`` and ``attribution`` are null in a diagnose or index report; ``skipped`` is there
    when an audit ran; ``counterfactual`` only in a counterfactual report. ``manifest.kind`` says
    which command wrote it.
    """

    schema_version: int = SCHEMA_VERSION
    capability: Capability | None = None
    findings: list[ReportFinding] = field(default_factory=list, metadata=_help("most severe first"))
    attribution: Attribution | None = None
    verdict: Verdict = field(default_factory=lambda: Verdict(kind="inconclusive", summary=""))
    manifest: Manifest = field(default_factory=OtherManifest)
    skipped: list[SkippedCheckRow] | None = field(default=None, metadata=_optional(
        "audit checks that did not run, with the reason"))
    counterfactual: Counterfactual | None = field(default=None, metadata=_optional())
    extra: dict[str, JsonValue] = _extra()

    @property
    def kind(self) -> str:
        """Which command wrote the report: attribute, diagnose, index or counterfactual."""
        return self.manifest.kind

    @property
    def inputs(self) -> AnalysisInputs | CounterfactualInputs | None:
        """What the command read (``manifest.inputs``), None for a kind that records none."""
        if isinstance(self.manifest, (AttributeManifest, DiagnoseManifest, CounterfactualManifest)):
            return self.manifest.inputs
        return None

    @classmethod
    def of(cls, report: "Report | Mapping[str, object]") -> "Report":
        """``report`` itself, or the ``Report`` its report.json dict holds."""
        return report if isinstance(report, Report) else cls.from_json(report)

    @classmethod
    def from_json(cls, data: Mapping[str, object], path: str = "") -> "Report":
        if not isinstance(data, Mapping):
            raise _fail("(top level)", "an object", data)
        if "schema_version" not in data:
            data = {"schema_version": UNVERSIONED, **data}
        return _decode_block(cls, data, path or "report")


def version_problem(data: Mapping[str, object]) -> str | None:
    """Why a report.json read back to act on (``counterfactual --report``, ``explain --report``)
    cannot be used as this version's report: a ``schema_version`` that is not a version, or one newer
    than ``SCHEMA_VERSION`` (naming the gradian that wrote it). None when it can. ``from_json``
    itself stays forward compatible; this is the check for a reader that acts on the fields."""
    version = data.get("schema_version", UNVERSIONED)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return f"schema_version {version!r} is not a report version; the file was edited or not written by Gradian"
    if version > SCHEMA_VERSION:
        manifest = data.get("manifest")
        writer = manifest.get("gradian_version") if isinstance(manifest, Mapping) else None
        return (f"schema_version {version} is newer than this Gradian reads ({SCHEMA_VERSION})"
                + (f"; it was written by gradian {writer}" if writer else "")
                + "; use that version of gradian, or upgrade this one")
    return None


# -- JSON Schema --------------------------------------------------------------------------------


def _describe(hint: object) -> str:
    if _is_union(hint):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if isinstance(hint, type):
        return {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}.get(hint, hint.__name__)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    return str(hint)


def _schema_of(hint: object, defs: dict[str, _BlockSchema]) -> JsonObject:
    if hint is Any:
        return {}
    if _is_union(hint):
        args = typing.get_args(hint)
        options = [_schema_of(a, defs) for a in args if a is not type(None)]
        if type(None) in args:
            options.append({"type": "null"})
        return options[0] if len(options) == 1 else {"anyOf": list(options)}
    origin = typing.get_origin(hint)
    if origin is Literal:
        values = list(typing.get_args(hint))
        return {"const": values[0]} if len(values) == 1 else {"enum": values}
    if origin is list:
        return {"type": "array", "items": _schema_of(typing.get_args(hint)[0], defs)}
    if origin is dict:
        item = _schema_of(typing.get_args(hint)[1], defs)
        return {"type": "object", "additionalProperties": item} if item else {"type": "object"}
    if isinstance(hint, type) and issubclass(hint, _Block):
        if hint.__name__ not in defs:
            defs[hint.__name__] = {}  # placeholder against recursion
            defs[hint.__name__] = _block_schema(hint, defs)
        return {"$ref": f"#/$defs/{hint.__name__}"}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if hint in simple:
        return {"type": simple[hint]}
    raise TypeError(f"no JSON Schema for {hint!r}")


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


class _BlockSchema(TypedDict, total=False):
    """The JSON Schema of one block."""

    type: str
    description: str
    properties: dict[str, JsonValue]
    required: list[str]
    additionalProperties: bool


def _block_schema(cls: type[_Block], defs: dict[str, _BlockSchema]) -> _BlockSchema:
    hints = _hints(cls)
    properties: dict[str, JsonValue] = {}
    required: list[str] = []
    klass: type = cls  # every block is a dataclass
    for f in dataclasses.fields(klass):
        if f.metadata.get("extra"):
            continue
        prop = _schema_of(hints[f.name], defs)
        if f.metadata.get("help"):
            prop = {"description": f.metadata["help"], **prop}
        properties[f.name] = prop
        if not f.metadata.get("omit_if_none"):
            required.append(f.name)
    for name in cls._DERIVED:
        properties[name] = _schema_of(_derived_hint(cls, name), defs)
        required.append(name)
    out: _BlockSchema = {"type": "object"}
    description = _first_paragraph(cls.__doc__)
    if description:
        out["description"] = description
    out["properties"] = properties
    out["required"] = required
    out["additionalProperties"] = bool(cls._OPEN)
    if cls is OtherManifest:
        known = _kinds([AttributeManifest, DiagnoseManifest, IndexBuildManifest, CounterfactualManifest])
        out["properties"]["kind"] = {"type": "string", "not": {"enum": list(known)}}
    return out


def json_schema() -> dict[str, object]:
    """The JSON Schema (draft 2020-12) of report.json, generated from the dataclasses above."""
    defs: dict[str, _BlockSchema] = {}
    root = _block_schema(Report, defs)
    root["properties"]["schema_version"] = {
        "description": "the report.json schema version this file follows", "const": SCHEMA_VERSION}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"Gradian report.json, schema version {SCHEMA_VERSION}",
        **root,
        "$defs": dict(sorted(defs.items())),
    }


def json_schema_text() -> str:
    """``json_schema()`` as docs/report-schema.json holds it (``python -m gradian.report`` prints it)."""
    return json.dumps(json_schema(), indent=2) + "\n"
