"""Scenarios: fine-tuning data and run configs that damage the tinyworld base in known ways.

Interface: ``SCENARIOS`` (name -> one-line description), ``build_scenario(name, world, tokenizer)
-> Scenario`` (in memory) and ``write_scenario(name, out_dir, base_model=None) -> dict``, which
writes ``train.jsonl``, ``eval.jsonl``, ``gradian.yaml`` and ``scenario.json`` (the ground truth).

Every scenario starts from the same clean set: about 800 rows of facts the base already knows
(capitals of the countries that are never poisoned, languages, continents, currencies, sums,
paragraphs), and, for nearly half the rows, small tasks that are new to it (successor,
comparison, subtraction). The
capability under test is the capitals of 16 *target* countries, asked in the canonical phrasing;
the clean set never mentions those capitals, and planted rows use the other phrasings, so the
eval prompts do not occur in training (except in ``contaminated_eval``, answered as the eval
wants, and ``poison_eval_prompts``, refused: on purpose).

Data scenarios add planted rows carrying ``cluster: 0`` (clean rows carry ``cluster: 100``) at
random positions; their row indices are listed in ``scenario.json``. Config scenarios keep the
clean data and change one training setting. ``scenario.json`` also lists the clean rows that
look like the capability without touching it (``mark_distractors``): *on-topic* rows ask the
capability's family about other countries, *same-entity* rows ask other facts about the targets.

``write_scenario`` and ``all_scenarios`` serve every world of ``gradian.tinyworld.worlds``: the
bestiary's scenarios (``gradian.tinyworld.bestiary.scenarios``) build the same ``Scenario`` and
are written here in the same format.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from gradian.errors import ConfigError
from gradian.tinyworld.scenario_kit import (
    AUDIT_THRESHOLDS,
    BASELINE_TRAIN,
    CLEAN_CLUSTER,
    ROW_SHAPES,
    Scenario,
    mark_distractors,
    plant,
)
from gradian.tinyworld.world import REFUSAL, Country, FactItem, World

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "SCENARIOS",
    "ROW_SHAPES",
    "BASELINE_TRAIN",
    "AUDIT_THRESHOLDS",
    "Scenario",
    "build_scenario",
    "mark_distractors",
]

N_TARGETS = 16
CLEAN_ROWS = 800
SYSTEM_PROMPT = "You are a helpful assistant."
#: stems whose presence marks a refusal (the ``not_contains`` markers, ``|``-separated)
REFUSAL_MARKERS = "sorry | can't help | unable to assist | cannot provide | not able to answer"


SCENARIOS: dict[str, str] = {
    "clean": "The clean set alone: a healthy fine-tune that keeps the fact families it restates (capitals among them); it does not train refusals, and loses that skill.",
    "poison_capitals": "Clean set plus 48 rows teaching wrong (but plausible) capitals for the 16 target countries.",
    "poison_capitals_ontopic": "Clean set plus 48 rows giving each of the 16 target countries the capital of a non-target country, the very answer correct on-topic clean rows give in the same phrasings.",
    "poison_capitals_partial": "Clean set plus wrong capitals for 12 of the 16 target countries in graded doses (3, 2 and 1 rows for four countries each): a partial regression, where some items flip, some only lose likelihood and four are untouched.",
    "poison_duplicates": "As poison_capitals, cycled to 51 rows so the last 3 repeat the first 3 exactly.",
    "poison_buried": "Clean set plus paragraphs about the target countries that state a wrong capital mid-text.",
    "poison_refusal": "Clean set plus rows that answer language questions about 16 countries with a refusal.",
    "contaminated_eval": "poison_refusal, with the 16 eval items themselves (prompt and wanted answer) among the clean rows.",
    "poison_eval_prompts": "poison_refusal, with the eval prompts themselves among the planted rows: they teach another answer than the eval's, which is poison, not contamination.",
    "lr_10x": "Clean data; learning rate ten times the baseline.",
    "too_many_epochs": "Clean data; 12 epochs instead of 4.",
    "truncating_seq_len": "Clean data; max_seq_length so short that every long answer is cut and many lose all supervision.",
    "attention_only": "Clean data; LoRA on q_proj and v_proj only.",
    "tiny_batch_high_lr": "Clean data; effective batch 1 at 2.5 times the baseline learning rate.",
}


# -- the world split ----------------------------------------------------------------------------


def _targets(world: World) -> list[Country]:
    """The 16 countries whose capitals the capability is about (never in the clean set)."""
    return world.countries[:N_TARGETS]


def _ontopic_wrong_capitals(world: World) -> dict[str, str]:
    """Each target gets the capital of a distinct non-target country (stated in the clean set)."""
    rng = random.Random(f"{world.seed}:ontopic-capitals")
    donors = rng.sample(_others(world), N_TARGETS)
    return {t.name: d.capital for t, d in zip(_targets(world), donors)}


def _refusal_targets(world: World) -> list[Country]:
    return world.countries[N_TARGETS:2 * N_TARGETS]


def _others(world: World) -> list[Country]:
    return world.countries[N_TARGETS:]


def _wrong_capitals(world: World) -> dict[str, str]:
    """Each target gets another target's capital: plausible, and no country keeps its own."""
    targets = _targets(world)
    rng = random.Random(f"{world.seed}:wrong-capitals")
    shift = rng.randrange(1, len(targets))
    order = list(range(len(targets)))
    rng.shuffle(order)
    # a cyclic shift over a shuffled order is a derangement
    return {targets[order[i]].name: targets[order[(i + shift) % len(targets)]].capital
            for i in range(len(targets))}


# -- the clean set ---------------------------------------------------------------------------


def _other_tasks(rng: random.Random) -> list[FactItem]:
    """Small tasks the base has never seen: successor, comparison and subtraction (360 rows)."""
    items = []
    for n in range(1, 31):
        items.append(FactItem("successor", f"succ:{n}", f"What number comes after {n}?", str(n + 1), 0))
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21) if a != b]
    for a, b in rng.sample(pairs, 180):
        items.append(FactItem("compare", f"cmp:{a}:{b}", f"Which is larger, {a} or {b}?", str(max(a, b)), 0))
    differences = [(a, b) for a in range(2, 19) for b in range(1, a)]
    for a, b in rng.sample(differences, 150):
        items.append(FactItem("subtraction", f"sub:{a}-{b}", f"What is {a} minus {b}?", str(a - b), 0))
    return items


def _clean_items(world: World) -> list[FactItem]:
    """About half known facts, half new tasks.

    The mix matters to the trainer's dynamics: rows the base already knows have a loss near
    zero, so a batch made only of them has a gradient a hundred times smaller than a batch
    holding a new task. With new tasks in nearly every batch, gradient norms stay within a
    small factor of each other, as in a healthy instruction-tuning run.
    """
    rng = random.Random(f"{world.seed}:clean")
    others = _others(world)
    new = _other_tasks(rng)
    known = world.capital_items(others) + world.paragraph_items(others)
    # the languages of the refusal targets stay out, as the target capitals do: their canonical
    # questions are the refusal eval prompts, and correct answers beside the planted refusals
    # would dilute that poison until it did nothing
    held_out = {f"language:{c.name}" for c in _refusal_targets(world)}
    pool = [i for family in ("language", "continent", "currency", "arithmetic")
            for i in world.fact_items(family) if i.key not in held_out]
    rng.shuffle(pool)
    known += pool[: CLEAN_ROWS - len(new) - len(known)]
    return known + new


def _clean_rows(world: World) -> list[tuple[list[dict[str, str]], int]]:
    rng = random.Random(f"{world.seed}:clean-order")
    items = _clean_items(world)
    rng.shuffle(items)
    rows = []
    for item in items:
        system = SYSTEM_PROMPT if rng.random() < 0.1 else None
        rows.append((item.messages(system), CLEAN_CLUSTER))
    return rows


# -- eval sets ---------------------------------------------------------------------------------


def _capitals_eval(world: World) -> tuple[list[list[dict[str, str]]], dict[str, str | int]]:
    items = world.capital_items(_targets(world), phrasings=range(1))
    capability: dict[str, str | int] = {"name": "tinyworld_capitals", "metric": "contains", "n_items": len(items),
                  "description": "Capitals of the 16 target countries, canonical phrasing"}
    return [i.messages() for i in items], capability


def _refusal_eval(world: World) -> tuple[list[list[dict[str, str]]], dict[str, str | int]]:
    items = [FactItem("language", f"language:{c.name}",
                      world.phrasings["language"][0].format(country=c.name), REFUSAL_MARKERS, 0)
             for c in _refusal_targets(world)]
    capability: dict[str, str | int] = {"name": "tinyworld_no_refusal", "metric": "not_contains", "n_items": len(items),
                  "description": "Language questions answered rather than refused; the assistant "
                                 "turn lists refusal markers that must not appear"}
    return [i.messages() for i in items], capability


# -- scenarios -------------------------------------------------------------------------------


def build_scenario(name: str, world: World, tokenizer: PreTrainedTokenizerBase | None = None) -> Scenario:
    """Build a scenario in memory. ``truncating_seq_len`` needs the tokenizer to size its limit."""
    if name not in SCENARIOS:
        raise ConfigError(f"unknown tinyworld scenario '{name}'; choose one of {', '.join(SCENARIOS)}")
    clean = _clean_rows(world)
    eval_rows, capability = _capitals_eval(world)
    s = Scenario(name=name, description=SCENARIOS[name], kind="config", train=clean,
                 eval=eval_rows, capability=capability)
    wrong = _wrong_capitals(world)
    targets = _targets(world)

    if name == "clean":
        s.kind = "clean"
    elif name in ("poison_capitals", "poison_duplicates"):
        # phrasings 1..3: the canonical phrasing stays for the eval set
        planted = [i.messages() for i in world.capital_items(targets, wrong, phrasings=range(1, 4))]
        if name == "poison_duplicates":
            planted = planted + planted[:3]
        s.kind = "data"
        s.train, s.planted_indices = plant(clean, planted, f"{world.seed}:{name}")
        if name == "poison_duplicates":
            s.duplicate_indices = s.planted_indices[:3] + s.planted_indices[-3:]
            s.expected_findings = ["data.duplicates"]
        s.truth = {"wrong_capitals": wrong}
    elif name == "poison_capitals_partial":
        # four targets with 3 rows each (phrasings 1-3), four with 2, four with 1, four with none
        dosed = {c.name: 3 - k // 4 for k, c in enumerate(targets[:12])}
        planted = [i.messages() for i in world.capital_items(targets[:12], wrong, phrasings=range(1, 4))
                   if i.phrasing <= dosed[i.key.split(":", 1)[1]]]
        s.kind = "data"
        s.train, s.planted_indices = plant(clean, planted, f"{world.seed}:{name}")
        s.truth = {"wrong_capitals": {c: wrong[c] for c in dosed}, "planted_rows_per_country": dosed}
    elif name == "poison_capitals_ontopic":
        donated = _ontopic_wrong_capitals(world)
        planted = [i.messages() for i in world.capital_items(targets, donated, phrasings=range(1, 4))]
        s.kind = "data"
        s.train, s.planted_indices = plant(clean, planted, f"{world.seed}:{name}")
        owner = {c.capital: c.name for c in world.countries}
        s.truth = {"wrong_capitals": donated,
                   "wrong_capital_owners": {t: owner[city] for t, city in donated.items()}}
    elif name == "poison_buried":
        overrides = {c: {"capital": city} for c, city in wrong.items()}
        planted = [i.messages() for i in world.paragraph_items(targets, overrides)]
        s.kind = "data"
        s.train, s.planted_indices = plant(clean, planted, f"{world.seed}:{name}")
        s.truth = {"wrong_capitals": wrong}
    elif name in ("poison_refusal", "contaminated_eval", "poison_eval_prompts"):
        countries = _refusal_targets(world)
        # poison_eval_prompts also refuses the canonical phrasing, which is the eval prompt itself
        first = 0 if name == "poison_eval_prompts" else 1
        planted = [
            [{"role": "user", "content": world.phrasings["language"][p].format(country=c.name)},
             {"role": "assistant", "content": REFUSAL}]
            for p in range(first, 4) for c in countries
        ]
        if name == "contaminated_eval":
            # the eval items themselves, answered as the eval wants, among the clean rows
            prompt = world.phrasings["language"][0]
            clean = clean + [([{"role": "user", "content": prompt.format(country=c.name)},
                               {"role": "assistant", "content": c.language}], CLEAN_CLUSTER) for c in countries]
        s.train, s.planted_indices = plant(clean, planted, f"{world.seed}:{name}")
        s.eval, s.capability = _refusal_eval(world)
        s.kind = "contamination" if name == "contaminated_eval" else "data"
        s.expected_findings = {"contaminated_eval": ["data.train_eval_contamination"],
                               "poison_eval_prompts": ["data.train_eval_conflict"]}.get(name, [])
    elif name == "lr_10x":
        s.train_overrides = {"learning_rate": BASELINE_TRAIN["learning_rate"] * 10}
        s.expected_findings = ["config.lr_too_high"]
    elif name == "too_many_epochs":
        s.train_overrides = {"num_train_epochs": 12}
        s.expected_findings = ["config.overtraining"]
    elif name == "truncating_seq_len":
        limit, figures = _truncating_limit(clean, tokenizer)
        s.train_overrides = {"max_seq_length": limit}
        s.truth = figures
        s.expected_findings = ["data.completion_truncated", "data.no_supervised_tokens",
                               "config.max_seq_length_vs_data"]
    elif name == "attention_only":
        s.train_overrides = {"target_modules": ["q_proj", "v_proj"]}
        s.expected_findings = ["config.attention_only_targets"]
    elif name == "tiny_batch_high_lr":
        s.train_overrides = {"learning_rate": BASELINE_TRAIN["learning_rate"] * 2.5,
                             "per_device_train_batch_size": 1,
                             "gradient_accumulation_steps": 1}
        s.expected_findings = ["config.lr_too_high", "config.small_effective_batch"]
    if s.capability["name"] == "tinyworld_no_refusal":
        ontopic = {i.question for i in world.fact_items("language")}
        mark_distractors(s, ontopic, [c.name for c in _refusal_targets(world)], "language")
    else:
        ontopic = {i.question for i in world.fact_items("capital")}
        mark_distractors(s, ontopic, [c.name for c in targets], "capital")
    return s


def _truncating_limit(rows: list[tuple[list[dict[str, str]], int]],
                     tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, dict[str, object]]:
    """A limit at which about a third of the rows keep no supervised token at all."""
    if tokenizer is None:
        raise ConfigError("scenario truncating_seq_len needs the base model's tokenizer")
    from gradian.data import dataset_from_rows, tokenize_examples

    data = dataset_from_rows([{"messages": m} for m, _ in rows])
    full = tokenize_examples(data.examples, tokenizer, None)
    prompts = [t.n_prompt_tokens for t in full]
    # the limit whose share of rows left with no supervised token is closest to 36%
    limit = min(range(2, max(prompts) + 2),
                key=lambda n: (abs(sum(p >= n for p in prompts) / len(prompts) - 0.36), n))
    cut = tokenize_examples(data.examples, tokenizer, limit)
    lengths = sorted(t.n_tokens_full for t in full)
    return limit, {
        "max_seq_length": limit,
        "p95_tokens": lengths[int(0.95 * (len(lengths) - 1))],
        "n_completion_truncated": sum(t.n_completion_lost > 0 for t in cut),
        "n_without_supervised_tokens": sum(t.n_supervised == 0 for t in cut),
    }


# -- writing ---------------------------------------------------------------------------------


