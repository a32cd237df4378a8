"""What every world's scenarios are made of: the ``Scenario`` record, planting, row shapes.

Interface: ``Scenario`` (the rows, eval items, config and ground truth one scenario writes),
``plant(clean, planted, seed)`` (planted rows mixed among the clean ones at seeded positions),
``mark_distractors`` (on-topic clean rows recorded as the controls beside the poison),
``PLANTED_CLUSTER`` / ``CLEAN_CLUSTER`` (the declared cluster ids), ``ROW_SHAPES`` and
``shape_row`` (one chat written in each supported dataset shape); ``BASELINE_TRAIN`` and
``AUDIT_THRESHOLDS``, the training and audit settings every scenario's ``gradian.yaml`` starts from. tinyworld's scenarios
(``gradian.tinyworld.scenarios``) and the bestiary's are peers built on this.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import List, TypedDict

__all__ = ["AUDIT_THRESHOLDS", "BASELINE_TRAIN", "CLEAN_CLUSTER", "PLANTED_CLUSTER", "ROW_SHAPES", "Scenario", "mark_distractors", "plant", "shape_row"]


PLANTED_CLUSTER = 0


CLEAN_CLUSTER = 100


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
    capability: dict[str, str | int]
    train_overrides: dict[str, object] = field(default_factory=dict)
    planted_indices: list[int] = field(default_factory=list)
    duplicate_indices: list[int] = field(default_factory=list)
    expected_findings: list[str] = field(default_factory=list)
    truth: dict[str, object] = field(default_factory=dict)
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


def plant(clean: list[tuple[list[dict[str, str]], int]], planted: list[list[dict[str, str]]],
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


def shape_row(messages: list[dict[str, str]], shape: str) -> dict[str, object]:
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
    row: dict[str, object] = {keys[0]: user, keys[1]: answer}
    if shape == "instruction":
        row["input"] = ""
    if system:
        row["system"] = system[0]
    return row


#: every projection of a Llama or Mistral block, what scenarios with LoRA on all linear layers adapt
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class BaselineTrain(TypedDict):
    """The keys of ``BASELINE_TRAIN``: ``train:`` fields of the config."""

    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: List[str]
    learning_rate: float
    num_train_epochs: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    warmup_ratio: float
    lr_scheduler_type: str
    max_seq_length: int
    logging_steps: int
    max_grad_norm: float
    weight_decay: float


#: the ``train:`` section every scenario starts from: a sane LoRA run for this model
BASELINE_TRAIN: BaselineTrain = {
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
