"""Bestiary scenarios: fine-tuning data that damages the bestiary base in a known way.

Interface: ``BESTIARY_SCENARIOS`` (name -> one-line description) and
``build_bestiary_scenario(name, bestiary) -> Scenario``, the same ``Scenario`` tinyworld's
scenarios build; ``gradian.tinyworld.write_scenario`` writes either world's scenarios
in one format.

The capability is the diet of 16 *target* animals, asked in the canonical phrasing. The clean set
(800 rows) is built to make topic alone a poor guide to the planted rows:

- *on-topic* rows: the diets of the 24 other animals in every phrasing, correct (96 rows, 72 in
  the phrasings planted rows use);
- *same-entity* rows: habitats, colors and leg counts of the target animals, correct;
- other known facts (the rest of habitats, colors, legs, the alphabet, paragraphs about the other
  animals) and about 350 rows of small tasks new to the base (the letter before a letter, which
  of two letters comes first, doubling a number), which keep the gradient norms of a healthy run
  within a small factor of each other (see tinyworld's scenarios for why that matters).

The planted rows of ``bestiary_poison_diets`` give each target the food of one of the other
animals, in phrasings 1-3. That food is also the answer of on-topic clean rows in the very same
phrasings: a planted row and its clean twin differ only in the animal's name.
"""

from __future__ import annotations

import random
import string
from typing import TYPE_CHECKING

from gradian.errors import ConfigError
from gradian.tinyworld.bestiary.base import BESTIARY_SYSTEM_PROMPT
from gradian.tinyworld.bestiary.world import Animal, Bestiary
from gradian.tinyworld.world import FactItem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradian.tinyworld.scenario_kit import Scenario

__all__ = ["BESTIARY_SCENARIOS", "build_bestiary_scenario"]

N_TARGETS = 16
CLEAN_ROWS = 800

BESTIARY_SCENARIOS: dict[str, str] = {
    "bestiary_clean": "Bestiary world (Mistral base): the clean set alone; a healthy fine-tune that keeps the 16 target diets.",
    "bestiary_poison_diets": "Bestiary world (Mistral base): clean set plus 48 rows teaching each of 16 target animals the food of a non-target animal, beside correct on-topic diet rows in the same phrasings.",
}


def _targets(bestiary: Bestiary) -> list[Animal]:
    """The 16 animals whose diets the capability is about (never stated in the clean set)."""
    return bestiary.animals[:N_TARGETS]


def _others(bestiary: Bestiary) -> list[Animal]:
    return bestiary.animals[N_TARGETS:]


def wrong_diets(bestiary: Bestiary) -> dict[str, str]:
    """Each target animal mapped to the food of a distinct non-target animal."""
    rng = random.Random(f"{bestiary.seed}:wrong-diets")
    donors = rng.sample(_others(bestiary), N_TARGETS)
    return {t.name: d.diet for t, d in zip(_targets(bestiary), donors)}


def _new_tasks(rng: random.Random) -> list[FactItem]:
    """Small tasks the base has never seen: letter before, earlier letter, doubling (350 rows)."""
    letters = string.ascii_uppercase
    items = []
    for i in range(1, len(letters)):
        for p, text in enumerate(("What letter comes before {x}?", "Which letter is just before {x}?")):
            items.append(FactItem("before", f"before:{letters[i]}", text.format(x=letters[i]), letters[i - 1], p))
    pairs = [(a, b) for a in letters for b in letters if a != b]
    for a, b in rng.sample(pairs, 150):
        items.append(FactItem("earlier", f"earlier:{a}:{b}",
                              f"Which comes first in the alphabet, {a} or {b}?", min(a, b), 0))
    for n in rng.sample(range(1, 200), 150):
        items.append(FactItem("double", f"double:{n}", f"What is double {n}?", str(2 * n), 0))
    return items


def _clean_items(bestiary: Bestiary) -> list[FactItem]:
    rng = random.Random(f"{bestiary.seed}:bestiary-clean")
    others = _others(bestiary)
    new = _new_tasks(rng)
    known = bestiary.diet_items(others) + bestiary.paragraph_items(others)
    pool = [i for family in ("habitat", "color", "legs", "alphabet") for i in bestiary.fact_items(family)]
    rng.shuffle(pool)
    known += pool[: CLEAN_ROWS - len(new) - len(known)]
    return known + new


def _clean_rows(bestiary: Bestiary) -> list[tuple[list[dict[str, str]], int]]:
    from gradian.tinyworld.scenario_kit import CLEAN_CLUSTER

    rng = random.Random(f"{bestiary.seed}:bestiary-clean-order")
    items = _clean_items(bestiary)
    rng.shuffle(items)
    rows = []
    for item in items:
        system = BESTIARY_SYSTEM_PROMPT if rng.random() < 0.1 else None
        rows.append((item.messages(system), CLEAN_CLUSTER))
    return rows


def _diets_eval(bestiary: Bestiary) -> tuple[list[list[dict[str, str]]], dict[str, str | int]]:
    items = bestiary.diet_items(_targets(bestiary), phrasings=range(1))
    capability: dict[str, str | int] = {"name": "bestiary_diets", "metric": "contains", "n_items": len(items),
                  "description": "Diets of the 16 target animals, canonical phrasing"}
    return [i.messages() for i in items], capability


def build_bestiary_scenario(name: str, bestiary: Bestiary, tokenizer: PreTrainedTokenizerBase | None = None) -> "Scenario":
    """Build a bestiary scenario in memory (``tokenizer`` is accepted for symmetry, unused)."""
    from gradian.tinyworld.scenario_kit import Scenario, mark_distractors, plant

    if name not in BESTIARY_SCENARIOS:
        raise ConfigError(f"unknown bestiary scenario '{name}'; choose one of {', '.join(BESTIARY_SCENARIOS)}")
    clean = _clean_rows(bestiary)
    eval_rows, capability = _diets_eval(bestiary)
    s = Scenario(name=name, description=BESTIARY_SCENARIOS[name], kind="clean", train=clean,
                 eval=eval_rows, capability=capability, world="bestiary")
    if name == "bestiary_poison_diets":
        wrong = wrong_diets(bestiary)
        planted = [i.messages() for i in bestiary.diet_items(_targets(bestiary), wrong, phrasings=range(1, 4))]
        s.kind = "data"
        s.train, s.planted_indices = plant(clean, planted, f"{bestiary.seed}:{name}")
        owner = {a.diet: a.name for a in bestiary.animals}
        s.truth = {"wrong_diets": wrong, "wrong_diet_owners": {t: owner[f] for t, f in wrong.items()}}
    ontopic = {i.question for i in bestiary.fact_items("diet")}
    mark_distractors(s, ontopic, [a.name for a in _targets(bestiary)], "diet")
    return s
