"""Delta scenarios: fine-tuning data that damages the delta base in a known way.

Interface: ``DELTA_SCENARIOS`` (name -> one-line description) and
``build_delta_scenario(name, delta) -> Scenario``, the ``Scenario`` every world's scenarios build;
``gradian.tinyworld.write_scenario`` writes them in the common format.

The capability is the sea of 16 *target* rivers, asked in the canonical phrasing ("Into which sea
does the Tuiseir flow?") and scored with ``contains``. The clean set (800 rows) never asks a
target's sea, in any form, and is built so that topic alone is a poor guide to the planted rows:

- *on-topic* rows: the seas of the 24 other rivers in every phrasing of all three sea families
  (by the river's name, by its alias, by its source mountain), correct (192 rows);
- *same-entity* rows: the source, length, town and alias of each target river, correct (128 rows);
- paragraphs about the other rivers, a few other known facts, and 350 rows of small tasks new to
  the base (half of a number, the smaller of two, the number before), which keep a healthy run's
  gradient norms within a small factor of each other (see tinyworld's scenarios for why).

The poison is *redundant*: each wrong sea is taught by seven rows, through three names of the
river (its own in three phrasings, its alias in two, its source mountain in two), so that a
removal that leaves a few of a river's rows in place still leaves a wrong sea taught. Every
planted question has an on-topic clean twin: the same phrasing about a non-target river,
answered correctly, whose answer is often the very sea planted (there are only eight).

- ``delta_poison_redundant``: the seven rows for each of the 16 targets (112 rows);
- ``delta_poison_partial``: the same seven rows for 8 of the targets only (56 rows), chosen as
  whole groups of targets that share a sea (``aimed_targets``); ``truth`` lists the ``aimed`` and
  the ``spared`` rivers, and the eval still asks all 16, so the fine-tune flips about half the
  items and a good attribution explains only those.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from gradian.errors import ConfigError
from gradian.tinyworld.delta.base import DELTA_SYSTEM_PROMPT
from gradian.tinyworld.delta.world import Delta, River
from gradian.tinyworld.world import FactItem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradian.tinyworld.scenario_kit import Scenario

__all__ = ["DELTA_SCENARIOS", "N_TARGETS", "PLANTED_FORMS", "aimed_targets", "build_delta_scenario", "wrong_seas"]

N_TARGETS = 16
CLEAN_ROWS = 800
#: the planted rows of one river: sea family -> the phrasings asked (the canonical ``sea``
#: phrasing 0 is the eval's and is never planted)
PLANTED_FORMS: dict[str, range] = {"sea": range(1, 4), "sea_alias": range(0, 2), "sea_source": range(0, 2)}
_ROWS_PER_RIVER = sum(len(r) for r in PLANTED_FORMS.values())
#: the families of the same-entity rows about each target, and their phrasings
_SAME_ENTITY_FORMS: dict[str, range] = {f: range(1, 3) for f in ("source", "length", "town", "alias")}
_NEW_TASK_ROWS = 350

DELTA_SCENARIOS: dict[str, str] = {
    "delta_clean": "Delta world (Qwen2 base): the clean set alone; a healthy fine-tune that keeps the seas of the 16 target rivers.",
    "delta_poison_redundant": f"Delta world (Qwen2 base): clean set plus {_ROWS_PER_RIVER * N_TARGETS} rows teaching each of 16 target rivers a wrong sea, {_ROWS_PER_RIVER} per river through its name, its alias and its source mountain, beside correct on-topic rows in the same phrasings.",
    "delta_poison_partial": f"Delta world (Qwen2 base): clean set plus {_ROWS_PER_RIVER * N_TARGETS // 2} rows teaching wrong seas to 8 of the 16 target rivers ({_ROWS_PER_RIVER} per river, as in delta_poison_redundant): a partial regression, the other 8 spared.",
}


def _targets(delta: Delta) -> list[River]:
    """The 16 rivers whose seas the capability is about (never asked in the clean set)."""
    return delta.rivers[:N_TARGETS]


def _others(delta: Delta) -> list[River]:
    return delta.rivers[N_TARGETS:]


def aimed_targets(delta: Delta) -> list[River]:
    """The targets ``delta_poison_partial`` poisons: half of them, chosen by whole groups of
    targets that share a sea (8 of 16 for the default world), in target order.

    Whole groups, because the damage spreads along the correct sea: when a fine-tune teaches two
    of the four target rivers that flow into one sea another sea, the model also moved the other
    two, which the poison never names (measured: 2 of 8 spared rivers flipped with every other
    target aimed, none with whole groups). The first subset of groups, in a seeded order, whose
    sizes add up to half the targets is taken; when none adds up exactly, the closest one under.
    """
    from itertools import combinations

    targets = _targets(delta)
    groups: dict[str, list[River]] = {}
    for r in targets:
        groups.setdefault(r.sea, []).append(r)
    seas = sorted(groups)
    random.Random(f"delta:{delta.seed}:aimed-seas").shuffle(seas)
    half = len(targets) // 2
    best: tuple[str, ...] = ()
    for k in range(1, len(seas) + 1):
        for chosen in combinations(seas, k):
            size = sum(len(groups[s]) for s in chosen)
            if size == half:
                best = chosen
                break
            if sum(len(groups[s]) for s in best) < size < half:
                best = chosen
        else:
            continue
        break
    return [r for r in targets if r.sea in best]


def wrong_seas(delta: Delta) -> dict[str, str]:
    """Each target river mapped to a sea other than its own, drawn from the world's seed."""
    rng = random.Random(f"delta:{delta.seed}:wrong-seas")
    return {r.name: rng.choice([s for s in delta.seas if s != r.sea]) for r in _targets(delta)}


def _new_tasks(rng: random.Random) -> list[FactItem]:
    """Small tasks the base has never seen: half of a number, the smaller of two, the number
    before (350 rows)."""
    items = []
    for n in rng.sample(range(2, 301, 2), 120):
        items.append(FactItem("half", f"half:{n}", f"What is half of {n}?", str(n // 2), 0))
    pairs = [(a, b) for a in range(1, 100) for b in range(1, 100) if a != b]
    for a, b in rng.sample(pairs, 120):
        items.append(FactItem("smaller", f"smaller:{a}:{b}", f"Which is smaller, {a} or {b}?", str(min(a, b)), 0))
    befores = [(n, p, text) for n in range(2, 57)
               for p, text in enumerate(("What number comes before {n}?", "Which number is just before {n}?"))]
    for n, p, text in rng.sample(befores, _NEW_TASK_ROWS - len(items)):
        items.append(FactItem("before", f"before:{n}", text.format(n=n), str(n - 1), p))
    return items


def _clean_items(delta: Delta) -> list[FactItem]:
    rng = random.Random(f"delta:{delta.seed}:clean")
    targets, others = _targets(delta), _others(delta)
    new = _new_tasks(rng)
    ontopic = delta.sea_items(others)
    same_entity = [i for f, p in _SAME_ENTITY_FORMS.items() for i in delta.river_items(f, targets, phrasings=p)]
    known = ontopic + same_entity + delta.paragraph_items(others)
    chosen = {(i.question, i.answer) for i in known}
    pool = [i for f in ("source", "length", "town", "alias", "times") for i in delta.fact_items(f)
            if (i.question, i.answer) not in chosen]
    rng.shuffle(pool)
    known += pool[: CLEAN_ROWS - len(new) - len(known)]
    return known + new


def _clean_rows(delta: Delta) -> list[tuple[list[dict[str, str]], int]]:
    from gradian.tinyworld.scenario_kit import CLEAN_CLUSTER

    rng = random.Random(f"delta:{delta.seed}:clean-order")
    items = _clean_items(delta)
    rng.shuffle(items)
    rows = []
    for item in items:
        system = DELTA_SYSTEM_PROMPT if rng.random() < 0.1 else None
        rows.append((item.messages(system), CLEAN_CLUSTER))
    return rows


def _seas_eval(delta: Delta) -> tuple[list[list[dict[str, str]]], dict[str, str | int]]:
    items = delta.river_items("sea", _targets(delta), phrasings=range(1))
    capability: dict[str, str | int] = {"name": "delta_seas", "metric": "contains", "n_items": len(items),
                                        "description": "Seas of the 16 target rivers, canonical phrasing"}
    return [i.messages() for i in items], capability


def build_delta_scenario(name: str, delta: Delta, tokenizer: PreTrainedTokenizerBase | None = None) -> "Scenario":
    """Build a delta scenario in memory (``tokenizer`` is accepted for symmetry, unused)."""
    from gradian.tinyworld.scenario_kit import Scenario, mark_distractors, plant

    if name not in DELTA_SCENARIOS:
        raise ConfigError(f"unknown delta scenario '{name}'; choose one of {', '.join(DELTA_SCENARIOS)}")
    clean = _clean_rows(delta)
    eval_rows, capability = _seas_eval(delta)
    s = Scenario(name=name, description=DELTA_SCENARIOS[name], kind="clean", train=clean,
                 eval=eval_rows, capability=capability, world="delta")
    if name in ("delta_poison_redundant", "delta_poison_partial"):
        targets = _targets(delta)
        aimed = targets if name == "delta_poison_redundant" else aimed_targets(delta)
        every = wrong_seas(delta)
        wrong = {r.name: every[r.name] for r in aimed}
        planted = [i.messages() for i in delta.sea_items(aimed, wrong, PLANTED_FORMS)]
        s.kind = "data"
        s.train, s.planted_indices = plant(clean, planted, f"delta:{delta.seed}:{name}")
        s.truth = {"wrong_seas": wrong, "planted_rows_per_river": _ROWS_PER_RIVER,
                   "planted_forms": {f: list(p) for f, p in PLANTED_FORMS.items()}}
        if name == "delta_poison_partial":
            s.truth["aimed"] = [r.name for r in aimed]
            s.truth["spared"] = [r.name for r in targets if r not in aimed]
    ontopic = {i.question for i in delta.sea_items(delta.rivers)}
    names = [n for r in _targets(delta) for n in (r.name, r.alias, r.source)]
    mark_distractors(s, ontopic, names, "sea")
    return s

