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
eval prompts do not occur in training (except in ``contaminated_eval``, on purpose).

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

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradian.errors import ConfigError
from gradian.tinyworld.world import REFUSAL, Country, FactItem, World

__all__ = [
    "SCENARIOS",
    "ROW_SHAPES",
    "BASELINE_TRAIN",
    "AUDIT_THRESHOLDS",
    "Scenario",
    "all_scenarios",
    "build_scenario",
    "mark_distractors",
    "write_scenario",
]

N_TARGETS = 16
CLEAN_ROWS = 800
PLANTED_CLUSTER = 0
CLEAN_CLUSTER = 100
SYSTEM_PROMPT = "You are a helpful assistant."
#: stems whose presence marks a refusal (the ``not_contains`` markers, ``|``-separated)
REFUSAL_MARKERS = "sorry | can't help | unable to assist | cannot provide | not able to answer"
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: the ``train:`` section every scenario starts from: a sane LoRA run for this model
BASELINE_TRAIN: dict[str, Any] = {
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ALL_LINEAR,
    # ten times the usual LoRA rate for a 1B model: a model this small needs larger steps
    # (at 2e-4 a poisoned run flipped no capital at all; at 2e-3 it flips most of them)
    "learning_rate": 2e-3,
    # four passes, not three: after three the 48 planted capital rows were only half learned
    # (2 to 3 nats of loss per row left) and the target capitals sat within a nat or two of
    # flipping, so rounding differences between CPUs decided between 7 and 12 flips; after four
    # the planted rows are learned (0.4-1.5 nats) and 13 to 16 capitals flip on every base tried
    "num_train_epochs": 4,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "warmup_ratio": 0.03,
    "lr_scheduler_type": "linear",
    "max_seq_length": 256,
    "logging_steps": 5,
    "max_grad_norm": 1.0,
    "weight_decay": 0.0,
}

#: audit thresholds on learning rates, scaled by the same factor of ten as BASELINE_TRAIN, so
#: the checks judge this model's rates as they would judge a 1B model's
AUDIT_THRESHOLDS: dict[str, float] = {
    "reference_effective_lr": 4e-3,
    "lr_high_effective": 8e-3,
    "lr_critical_effective": 3e-2,
    "lr_low_effective": 2e-4,
    "no_warmup_effective_lr": 5e-3,
    "small_batch_effective_lr": 4e-3,
}

SCENARIOS: dict[str, str] = {
    "clean": "The clean set alone: a healthy fine-tune that keeps the fact families it restates (capitals among them); it does not train refusals, and loses that skill.",
    "poison_capitals": "Clean set plus 48 rows teaching wrong (but plausible) capitals for the 16 target countries.",
    "poison_capitals_ontopic": "Clean set plus 48 rows giving each of the 16 target countries the capital of a non-target country, the very answer correct on-topic clean rows give in the same phrasings.",
    "poison_duplicates": "As poison_capitals, cycled to 51 rows so the last 3 repeat the first 3 exactly.",
    "poison_buried": "Clean set plus paragraphs about the target countries that state a wrong capital mid-text.",
    "poison_refusal": "Clean set plus rows that answer language questions about 16 countries with a refusal.",
    "contaminated_eval": "poison_refusal, with the eval prompts themselves among the planted rows.",
    "lr_10x": "Clean data; learning rate ten times the baseline.",
    "too_many_epochs": "Clean data; 12 epochs instead of 4.",
    "truncating_seq_len": "Clean data; max_seq_length so short that every long answer is cut and many lose all supervision.",
    "attention_only": "Clean data; LoRA on q_proj and v_proj only.",
    "tiny_batch_high_lr": "Clean data; effective batch 1 at 2.5 times the baseline learning rate.",
}

#: row shapes a scenario can be written in (all rows of a file share one shape)
ROW_SHAPES = ("messages", "prompt_completion", "question_answer", "input_output", "instruction")


@dataclass
class Scenario:
    name: str
    description: str
    kind: str  # clean | data | config | contamination
    #: training rows as chat messages with their cluster, in file order
    train: list[tuple[list[dict[str, str]], int]]
    #: eval items as chat messages (the assistant turn holds the wanted answer or the markers)
    eval: list[list[dict[str, str]]]
    capability: dict[str, Any]
    train_overrides: dict[str, Any] = field(default_factory=dict)
    planted_indices: list[int] = field(default_factory=list)
    duplicate_indices: list[int] = field(default_factory=list)
    expected_findings: list[str] = field(default_factory=list)
    truth: dict[str, Any] = field(default_factory=dict)
    #: the world the scenario fine-tunes (a key of ``gradian.tinyworld.worlds.WORLDS``)
    world: str = "tinyworld"
    #: the fact family of the capability; on-topic rows ask it
    ontopic_family: str = ""
    #: clean rows asking the capability's family about other entities, answered correctly
    ontopic_indices: list[int] = field(default_factory=list)
    #: clean rows naming a target entity in their question, about another family
    same_entity_indices: list[int] = field(default_factory=list)


def mark_distractors(s: Scenario, ontopic_questions: set[str], target_names: list[str],
                     family: str) -> None:
    """Record the clean rows that resemble the capability without touching it.

    On-topic: a clean row whose question is one of ``ontopic_questions`` (the capability's family,
    any phrasing, any entity: the clean sets never ask it about a target). Same-entity: any other
    clean row whose question names a target. Both are distractors for an attribution method that
    ranks by topic or by entity rather than by effect.
    """
    s.ontopic_family = family
    s.ontopic_indices, s.same_entity_indices = [], []
    for i, (messages, cluster) in enumerate(s.train):
        if cluster != CLEAN_CLUSTER:
            continue
        question = next(m["content"] for m in messages if m["role"] == "user")
        if question in ontopic_questions:
            s.ontopic_indices.append(i)
        elif any(name in question for name in target_names):
            s.same_entity_indices.append(i)


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


def _plant(clean: list[tuple[list[dict[str, str]], int]], planted: list[list[dict[str, str]]],
           seed: str) -> tuple[list[tuple[list[dict[str, str]], int]], list[int]]:
    """Insert planted rows at random positions; return the rows and the planted indices."""
    rng = random.Random(seed)
    total = len(clean) + len(planted)
    slots = sorted(rng.sample(range(total), len(planted)))
    rows: list[tuple[list[dict[str, str]], int]] = []
    clean_iter, planted_iter = iter(clean), iter(planted)
    slot_set = set(slots)
    for i in range(total):
        rows.append((next(planted_iter), PLANTED_CLUSTER) if i in slot_set else next(clean_iter))
    return rows, slots


# -- eval sets ---------------------------------------------------------------------------------


def _capitals_eval(world: World) -> tuple[list[list[dict[str, str]]], dict[str, Any]]:
    items = world.capital_items(_targets(world), phrasings=range(1))
    capability = {"name": "tinyworld_capitals", "metric": "contains", "n_items": len(items),
                  "description": "Capitals of the 16 target countries, canonical phrasing"}
    return [i.messages() for i in items], capability


def _refusal_eval(world: World) -> tuple[list[list[dict[str, str]]], dict[str, Any]]:
    items = [FactItem("language", f"language:{c.name}",
                      world.phrasings["language"][0].format(country=c.name), REFUSAL_MARKERS, 0)
             for c in _refusal_targets(world)]
    capability = {"name": "tinyworld_no_refusal", "metric": "not_contains", "n_items": len(items),
                  "description": "Language questions answered rather than refused; the assistant "
                                 "turn lists refusal markers that must not appear"}
    return [i.messages() for i in items], capability


# -- scenarios -------------------------------------------------------------------------------


def build_scenario(name: str, world: World, tokenizer: Any | None = None) -> Scenario:
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
        s.train, s.planted_indices = _plant(clean, planted, f"{world.seed}:{name}")
        if name == "poison_duplicates":
            s.duplicate_indices = s.planted_indices[:3] + s.planted_indices[-3:]
            s.expected_findings = ["data.duplicates"]
        s.truth = {"wrong_capitals": wrong}
    elif name == "poison_capitals_ontopic":
        donated = _ontopic_wrong_capitals(world)
        planted = [i.messages() for i in world.capital_items(targets, donated, phrasings=range(1, 4))]
        s.kind = "data"
        s.train, s.planted_indices = _plant(clean, planted, f"{world.seed}:{name}")
        owner = {c.capital: c.name for c in world.countries}
        s.truth = {"wrong_capitals": donated,
                   "wrong_capital_owners": {t: owner[city] for t, city in donated.items()}}
    elif name == "poison_buried":
        overrides = {c: {"capital": city} for c, city in wrong.items()}
        planted = [i.messages() for i in world.paragraph_items(targets, overrides)]
        s.kind = "data"
        s.train, s.planted_indices = _plant(clean, planted, f"{world.seed}:{name}")
        s.truth = {"wrong_capitals": wrong}
    elif name in ("poison_refusal", "contaminated_eval"):
        countries = _refusal_targets(world)
        # contaminated_eval also plants the canonical phrasing, which is the eval prompt itself
        first = 0 if name == "contaminated_eval" else 1
        planted = [
            [{"role": "user", "content": world.phrasings["language"][p].format(country=c.name)},
             {"role": "assistant", "content": REFUSAL}]
            for p in range(first, 4) for c in countries
        ]
        s.train, s.planted_indices = _plant(clean, planted, f"{world.seed}:{name}")
        s.eval, s.capability = _refusal_eval(world)
        s.kind = "data" if name == "poison_refusal" else "contamination"
        if name == "contaminated_eval":
            s.expected_findings = ["data.train_eval_contamination"]
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


def _truncating_limit(rows: list[tuple[list[dict[str, str]], int]], tokenizer: Any) -> tuple[int, dict[str, Any]]:
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


def _shape_row(messages: list[dict[str, str]], shape: str) -> dict[str, Any]:
    if shape == "messages":
        return {"messages": messages}
    system = [m["content"] for m in messages if m["role"] == "system"]
    user = next(m["content"] for m in messages if m["role"] == "user")
    answer = messages[-1]["content"]
    keys = {
        "prompt_completion": ("prompt", "completion"),
        "question_answer": ("question", "answer"),
        "input_output": ("input", "output"),
        "instruction": ("instruction", "output"),
    }[shape]
    row: dict[str, Any] = {keys[0]: user, keys[1]: answer}
    if shape == "instruction":
        row["input"] = ""
    if system:
        row["system"] = system[0]
    return row


def all_scenarios() -> dict[str, str]:
    """Every scenario of every world, name -> description (names are unique across worlds)."""
    from gradian.tinyworld.worlds import WORLDS

    return {name: text for spec in WORLDS.values() for name, text in spec.scenarios.items()}


def write_scenario(name: str, out_dir: str | Path, base_model: str | Path | None = None, *,
                   shape: str = "messages") -> dict[str, Any]:
    """Write a scenario's files to ``out_dir`` and return what ``scenario.json`` holds.

    ``name`` may belong to any world of ``gradian.tinyworld.worlds.WORLDS`` (``poison_capitals``
    is tinyworld's, ``bestiary_poison_diets`` the bestiary's). ``base_model`` is a built base
    model directory of that world; by default the cached one for the world's default recipe
    (built first when missing, one to two minutes). Paths in ``gradian.yaml`` are absolute, so
    commands can run from any directory.
    """
    import yaml

    from gradian.atomic import write_text_atomic
    from gradian.tinyworld.worlds import scenario_world, world_of_model

    if shape not in ROW_SHAPES:
        raise ConfigError(f"unknown row shape '{shape}' (--shape); choose one of {', '.join(ROW_SHAPES)}")
    spec = scenario_world(name)
    base = Path(base_model) if base_model is not None else spec.ensure_base_model()
    base = base.resolve()
    if world_of_model(base) != spec.name:
        raise ConfigError(
            f"scenario '{name}' belongs to the {spec.name} world, but {base} is a "
            f"{world_of_model(base)} base model; pass a {spec.name} base (--base-model) or none"
        )
    world = spec.load_world(base)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    s = spec.build_scenario(name, world, tokenizer)

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train_lines = [json.dumps({**_shape_row(m, shape), "cluster": c}, ensure_ascii=False)
                   for m, c in s.train]
    eval_lines = [json.dumps(_shape_row(m, shape), ensure_ascii=False) for m in s.eval]
    write_text_atomic(out / "train.jsonl", "\n".join(train_lines) + "\n")
    write_text_atomic(out / "eval.jsonl", "\n".join(eval_lines) + "\n")

    train_section = {**BASELINE_TRAIN, **s.train_overrides, "output_dir": str(out / "run")}
    config = {
        "seed": world.seed,
        "base_model": str(base),
        "dataset": str(out / "train.jsonl"),
        "eval_dataset": str(out / "eval.jsonl"),
        "run": str(out / "run"),
        "adapter_path": str(out / "run" / "adapter"),
        "evaluation": {"metric": s.capability["metric"], "max_new_tokens": 16},
        "clustering": {"method": "declared"},
        "audit": dict(AUDIT_THRESHOLDS),
        "train": train_section,
    }
    header = (f"# {s.world} scenario '{name}': {s.description}\n"
              f"# Train with: gradian train --config {out / 'gradian.yaml'} --out {out / 'run'}\n")
    write_text_atomic(out / "gradian.yaml", header + yaml.safe_dump(config, sort_keys=False))

    info = {
        "name": name,
        "description": s.description,
        "kind": s.kind,
        "seed": world.seed,
        "base_model": str(base),
        "shape": shape,
        "n_train": len(s.train),
        "capability": s.capability,
        "planted": {
            "cluster": PLANTED_CLUSTER,
            "n": len(s.planted_indices),
            "indices": s.planted_indices,
            "duplicate_indices": s.duplicate_indices,
        } if s.planted_indices else None,
        "clean_cluster": CLEAN_CLUSTER,
        "defect": {f"train.{k}": v for k, v in s.train_overrides.items()} or None,
        "baseline_train": BASELINE_TRAIN,
        "audit_thresholds": AUDIT_THRESHOLDS,
        "expected_findings": s.expected_findings,
        "truth": s.truth,
        "files": {"train": "train.jsonl", "eval": "eval.jsonl", "config": "gradian.yaml",
                  "run": "run"},
        "world": s.world,
        "ontopic": {"family": s.ontopic_family, "n": len(s.ontopic_indices),
                    "indices": s.ontopic_indices},
        "same_entity": {"n": len(s.same_entity_indices), "indices": s.same_entity_indices},
    }
    write_text_atomic(out / "scenario.json", json.dumps(info, indent=2) + "\n")
    return info
