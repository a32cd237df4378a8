"""What the evaluate lane hands on: one ``ItemResult`` per eval item and a ``CapabilityResult``.

``CapabilityResult.to_dict()`` is the ``capability`` block of report.json; ``to_full_dict()`` adds
the items, the flags and the bootstrap settings. The tuned model's generations stay on the items
because the contrastive query gradient of the attribution lane is built from them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradian.jsontypes import JsonObject

__all__ = ["ItemResult", "CapabilityResult"]


@dataclass
class ItemResult:
    """One eval item measured on both models.

    For pass/fail metrics the scores are 1.0 or 0.0 and ``base_correct``/``tuned_correct`` say the
    same as booleans. For ``loglik`` the scores are nats per token, there is no pass/fail (the
    booleans are ``None``), nothing counts as flipped or base-failing, and there are no
    generations.
    """

    example_id: str
    index: int
    prompt: str
    #: the completion field of the item: the wanted answer (markers, for not_contains)
    wanted: str
    base_score: float
    tuned_score: float
    base_correct: bool | None = None
    tuned_correct: bool | None = None
    base_generation: str | None = None
    tuned_generation: str | None = None
    #: the base passed and the tuned model fails: a capability lost on this item
    flipped: bool = False
    #: the base model already fails this item, so no training example can explain a failure here
    base_failing: bool = False
    #: log p_base(wanted) - log p_base(tuned generation), in nats; set on flipped items only
    base_margin: float | None = None
    #: the base margin is below the weak-margin threshold
    weakly_held: bool = False

    @property
    def regressed(self) -> bool:
        """The tuned model scores this item lower than the base model did."""
        return self.tuned_score < self.base_score

    def to_dict(self) -> JsonObject:
        return asdict(self)


@dataclass
class CapabilityResult:
    """A capability measured on the base and tuned models, with its bootstrap interval."""

    name: str
    metric: str
    base: float
    tuned: float
    delta: float
    ci: tuple[float, float]
    n_items: int
    n_flipped: int
    n_base_failing: int
    status: str
    proxy_used: bool
    ci_level: float = 0.95
    n_bootstrap: int = 2000
    seed: int = 1234
    items: list[ItemResult] = field(default_factory=list)
    #: margins below this many nats mark an item as weakly held by the base model
    weak_margin_nats: float = 1.0
    #: a base score below this (pass/fail metrics only) is flagged as low
    low_base_threshold: float = 0.5
    low_base_score: bool = False
    #: ``evaluation.min_items``: fewer items than this cannot show a significant change
    min_items: int | None = None
    #: eval items dropped because they repeat an earlier one (same prompt and answer)
    n_repeats: int = 0

    @property
    def too_few_items(self) -> bool:
        """Fewer items than ``min_items``: ``status`` is the bootstrap's reading of too few items
        to call any change significant (one item resamples to itself: an interval of no width)."""
        return self.min_items is not None and self.n_items < self.min_items

    # -- views the report and the attribution lane read --------------------------------------

    @property
    def generations_available(self) -> bool:
        """The tuned model's answers exist, so a contrastive query can be built."""
        return any(i.tuned_generation is not None for i in self.items)

    @property
    def flipped_items(self) -> list[ItemResult]:
        return [i for i in self.items if i.flipped]

    @property
    def regressed_items(self) -> list[ItemResult]:
        """Flipped items for pass/fail metrics; items whose log-probability fell for ``loglik``."""
        if self.proxy_used:
            return [i for i in self.items if i.regressed]
        return self.flipped_items

    @property
    def base_failing_items(self) -> list[ItemResult]:
        return [i for i in self.items if i.base_failing]

    @property
    def weakly_held_items(self) -> list[ItemResult]:
        return [i for i in self.items if i.weakly_held]

    @property
    def mean_base_margin(self) -> float | None:
        """Mean base preference margin (nats) over the flipped items that have one."""
        margins = [i.base_margin for i in self.items if i.base_margin is not None]
        return sum(margins) / len(margins) if margins else None

    def hedges(self) -> list[str]:
        """Plain-language qualifiers on any data verdict drawn from this capability."""
        out = []
        if self.n_repeats:
            out.append(
                f"{self.n_repeats} of the {self.n_items + self.n_repeats} eval items repeated an earlier item "
                f"(the same prompt and answer) and were counted once: the measurement rests on {self.n_items} "
                "distinct items."
            )
        if self.n_base_failing:
            out.append(
                f"{self.n_base_failing} of the {self.n_items} eval items already fail on the base "
                "model; no training example explains those, so they are not counted as losses."
            )
        if self.low_base_score:
            out.append(
                f"The base model scores only {self.base:.3f} on this capability (below "
                f"{self.low_base_threshold:g}): there was little there for the fine-tune to lose."
            )
        weak = self.weakly_held_items
        if weak:
            margins = [i.base_margin for i in weak if i.base_margin is not None]
            out.append(
                f"The base model held {len(weak)} of the {self.n_flipped} flipped items weakly "
                f"(preference margin under {self.weak_margin_nats:g} nat, mean "
                f"{sum(margins) / len(margins):+.2f}): on those, almost any fine-tune could have tipped "
                "the answer, so the data may be the trigger rather than the cause."
            )
        if self.proxy_used:
            out.append(
                f"'{self.metric}' measures likelihood, not correctness: training on the answer format "
                "raises it even while the content gets worse, so its direction can mislead."
            )
        return out

    # -- serialization ------------------------------------------------------------------------

    def to_dict(self) -> JsonObject:
        """The ``capability`` block of report.json."""
        return {
            "name": self.name,
            "metric": self.metric,
            "base": self.base,
            "tuned": self.tuned,
            "delta": self.delta,
            "ci": [self.ci[0], self.ci[1]],
            "n_items": self.n_items,
            "n_flipped": self.n_flipped,
            "n_base_failing": self.n_base_failing,
            "status": self.status,
            "too_few_items": self.too_few_items,
            "proxy_used": self.proxy_used,
        }

    def to_full_dict(self) -> dict[str, Any]:
        """``to_dict()`` plus bootstrap settings, flags, hedges and every item."""
        out: dict[str, Any] = self.to_dict()
        out.update(
            ci_level=self.ci_level,
            n_bootstrap=self.n_bootstrap,
            seed=self.seed,
            weak_margin_nats=self.weak_margin_nats,
            low_base_threshold=self.low_base_threshold,
            low_base_score=self.low_base_score,
            min_items=self.min_items,
            n_repeats=self.n_repeats,
            n_weakly_held=len(self.weakly_held_items),
            mean_base_margin=self.mean_base_margin,
            hedges=self.hedges(),
            items=[i.to_dict() for i in self.items],
        )
        return out
