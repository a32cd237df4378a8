"""The audit's 41 checks: each one trips on a fixture built to trip it and stays quiet on a clean one.

Fixtures are built here, in memory: a healthy run (sane config, a normal loss curve), a clean
dataset of varied rows, and a small byte-level BPE tokenizer with a chat template whose end of
turn is its EOS. Each case changes exactly one thing from the healthy baseline.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Callable

import pytest

from gradian.audit import all_checks, run_audit
from gradian.config.audit import AuditConfig
from gradian.data import dataset_from_rows
from gradian.errors import ConfigError
from gradian.runs import LogStep, LoraSettings, RunRecord, RunRef, TrainingLogs, normalize_trainer_config

# -- fixtures ---------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|' ~ m['role'] ~ '|>' ~ m['content'] ~ '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
#: closes assistant turns with <|eot|>, which is not the EOS token
NO_EOS_TEMPLATE = CHAT_TEMPLATE.replace(
    "'<|end|>'", "('<|eot|>' if m['role'] == 'assistant' else '<|end|>')"
)
#: the generation prompt differs from how an assistant turn opens, so prefixes do not line up
UNSTABLE_TEMPLATE = CHAT_TEMPLATE.replace("'<|assistant|>' -}}{%- endif", "'<|assistant|> ' -}}{%- endif")

_WORDS = (
    "river stone lantern harbor meadow violet copper orchard falcon glacier ember willow canyon "
    "thistle marble beacon saffron tundra quill prism cobalt juniper dune basalt sparrow ivory "
    "cedar lagoon mosaic pepper summit walnut zephyr atlas bramble cinder delta fable garnet "
    "hazel indigo jasper kettle lumen maple nectar onyx pebble quartz raven sable timber umber "
    "vessel wren yarrow zinc anchor bristle cobble dapple ferric gossamer hollow inkwell jetty "
    "kindle loom mantle nimbus oaken plume quiver russet spindle trellis velvet wicker"
).split()


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def clean_rows(n: int = 300, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"messages": [
            {"role": "user", "content": f"Question {i}: {_sentence(rng, 8, 14)}?"},
            {"role": "assistant", "content": _sentence(rng, 3, 9) + "."},
        ]}
        for i in range(n)
    ]


def _build_tokenizer(template: str | None = CHAT_TEMPLATE, pad: str = "<|pad|>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|eot|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(_WORDS)] * 4 + ["Question 0123456789 ? . { } [ ] \" : ,"] * 4
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token=pad,
                                   additional_special_tokens=specials[2:])
    if template is not None:
        fast.chat_template = template
    return fast


_TOKENIZERS: dict[tuple, Any] = {}


def tokenizer(template: str | None = CHAT_TEMPLATE, pad: str = "<|pad|>"):
    key = (template, pad)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _build_tokenizer(template, pad)
    return _TOKENIZERS[key]


def healthy_logs(n_steps: int = 100, peak_lr: float = 2e-4, warmup: int = 5) -> list[LogStep]:
    rng = random.Random(1)
    steps = []
    for s in range(1, n_steps + 1):
        lr = peak_lr * s / warmup if s <= warmup else peak_lr * (n_steps - s) / (n_steps - warmup)
        steps.append(LogStep(
            step=s,
            loss=0.6 + 1.8 * math.exp(-s / 30) + rng.uniform(-0.03, 0.03),
            grad_norm=0.5 + rng.uniform(-0.1, 0.1),
            learning_rate=lr,
            epoch=2 * s / n_steps,
            eval_loss=(0.8 + 1.5 * math.exp(-s / 35)) if s % 20 == 0 else None,
        ))
    return steps


HEALTHY_ARGS: dict[str, Any] = {
    # as the HF MLflow callback logs them: every value a string
    "learning_rate": "0.0002",
    "num_train_epochs": "2",
    "per_device_train_batch_size": "4",
    "gradient_accumulation_steps": "2",
    "warmup_steps": "0.05",
    "lr_scheduler_type": "SchedulerType.LINEAR",
    "max_grad_norm": "1.0",
    "weight_decay": "0.0",
    "seed": "42",
    "max_length": "512",
    "packing": "False",
    "completion_only_loss": "True",
    "bf16": "True",
    "fp16": "False",
    "eval_strategy": "IntervalStrategy.STEPS",
    "max_steps": "-1",
}
HEALTHY_LORA = {
    "r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "use_rslora": False,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "base_model_name_or_path": "org/tiny-base",
}


def make_run(args: dict | None = None, lora: dict | None = None, logs: list[LogStep] | None = None) -> RunRecord:
    raw = {**HEALTHY_ARGS, **(args or {})}
    raw = {k: v for k, v in raw.items() if v is not None}
    return RunRecord(
        config=normalize_trainer_config(raw),
        lora=LoraSettings.from_adapter_config({**HEALTHY_LORA, **(lora or {})}),
        logs=TrainingLogs(steps=healthy_logs() if logs is None else logs),
        ref=RunRef.parse("memory"),
    )


_CLEAN = clean_rows()
_EVAL = clean_rows(40, seed=99)


def inputs(rows: list | None = None, run: RunRecord | None = None, tok: Any = "default",
           eval_rows: list | None = None, **extra: Any) -> dict[str, Any]:
    """run_audit keyword arguments: the healthy baseline with the given parts replaced."""
    return {
        "dataset": dataset_from_rows(copy.deepcopy(rows if rows is not None else _CLEAN)),
        "run": run if run is not None else make_run(),
        "tokenizer": tokenizer() if tok == "default" else tok,
        "eval_dataset": dataset_from_rows(copy.deepcopy(eval_rows if eval_rows is not None else _EVAL)),
        "base_model": "org/tiny-base",
        **extra,
    }


def _logs_with(**changes: Callable[[LogStep], None]) -> list[LogStep]:
    steps = healthy_logs()
    for step in steps:
        for change in changes.values():
            change(step)
    return steps


def _set(step_no: int, **values: Any) -> Callable[[LogStep], None]:
    def change(step: LogStep) -> None:
        if step.step == step_no:
            for k, v in values.items():
                setattr(step, k, v)
    return change


def _conflicting_rows() -> list:
    rows = copy.deepcopy(_CLEAN)
    for i in range(10):
        extra = copy.deepcopy(rows[i])
        extra["messages"][1]["content"] = "walnut zephyr atlas."
        rows.append(extra)
    return rows


def _json_rows(odd: int) -> list:
    rows = copy.deepcopy(_CLEAN)
    for i, row in enumerate(rows):
        if i >= odd:
            row["messages"][1]["content"] = '{"answer": "%s"}' % row["messages"][1]["content"]
    return rows


def _near_dup_rows() -> list:
    rows = copy.deepcopy(_CLEAN)
    rng = random.Random(5)
    long_prompt = " ".join(rng.choice(_WORDS) for _ in range(120))
    for k in range(3):
        words = long_prompt.split()
        words[-1] = ["prism", "cobalt", "juniper"][k]
        rows.append({"messages": [{"role": "user", "content": " ".join(words)},
                                  {"role": "assistant", "content": "cedar lagoon."}]})
    return rows


def _with(rows_fn: Callable[[list], None]) -> list:
    rows = copy.deepcopy(_CLEAN)
    rows_fn(rows)
    return rows


def _set_answer(i: int, text: str) -> Callable[[list], None]:
    def change(rows: list) -> None:
        rows[i]["messages"][1]["content"] = text
    return change


def _echo(rows: list) -> None:
    for row in rows[:10]:
        row["messages"][1]["content"] = row["messages"][0]["content"]


def _long_row(rows: list) -> None:
    rows[3]["messages"][1]["content"] = " ".join(_WORDS * 15)


def _overfit_logs() -> list[LogStep]:
    steps = healthy_logs()
    for s in steps:
        if s.eval_loss is not None and s.step > 40:
            s.eval_loss = 1.2 + 0.01 * s.step  # rises from step 60 while train loss falls
    return steps


def _stopped_early_logs() -> list[LogStep]:
    steps = healthy_logs()[:40]  # a linear schedule planned for 100 steps, stopped at 40
    return steps


# check id -> (tripping inputs, clean inputs), each a zero-argument builder
CASES: dict[str, tuple[Callable[[], dict], Callable[[], dict]]] = {
    # config
    "config.attention_only_targets": (
        lambda: inputs(run=make_run(lora={"target_modules": ["q_proj", "v_proj"]})),
        lambda: inputs(),
    ),
    "config.base_model_mismatch": (
        lambda: inputs(base_model="org/other-model"),
        lambda: inputs(base_model="/models/local/tiny-base"),
    ),
    "config.capacity_vs_data": (
        lambda: inputs(run=make_run(lora={"r": 64, "lora_alpha": 128})),
        lambda: inputs(),
    ),
    "config.fp16_precision": (
        lambda: inputs(run=make_run({"fp16": "True", "bf16": "False"})),
        lambda: inputs(),
    ),
    "config.grad_clip_disabled": (
        lambda: inputs(run=make_run({"max_grad_norm": "0.0"})),
        lambda: inputs(),
    ),
    "config.high_lora_dropout": (
        lambda: inputs(run=make_run(lora={"lora_dropout": 0.3})),
        lambda: inputs(),
    ),
    "config.lr_too_high": (
        lambda: inputs(run=make_run({"learning_rate": "0.002"})),
        lambda: inputs(),
    ),
    "config.lr_too_low": (
        lambda: inputs(run=make_run({"learning_rate": "5e-6"})),
        lambda: inputs(),
    ),
    "config.max_seq_length_vs_data": (
        lambda: inputs(max_seq_length=12),
        lambda: inputs(),
    ),
    "config.no_eval_set": (
        lambda: inputs(run=make_run({"eval_strategy": "no"}, logs=_logs_with(e=lambda s: setattr(s, "eval_loss", None)))),
        lambda: inputs(),
    ),
    "config.no_warmup": (
        lambda: inputs(run=make_run({"learning_rate": "5e-4", "warmup_steps": "0"})),
        lambda: inputs(run=make_run({"learning_rate": "5e-4"})),
    ),
    "config.overtraining": (
        lambda: inputs(run=make_run({"num_train_epochs": "12"})),
        lambda: inputs(),
    ),
    "config.packing_with_completion_loss": (
        lambda: inputs(run=make_run({"packing": "True"})),
        lambda: inputs(),
    ),
    "config.pad_equals_eos": (
        lambda: inputs(tok=tokenizer(pad="<|end|>")),
        lambda: inputs(),
    ),
    "config.seed_unset": (
        lambda: inputs(run=make_run({"seed": None})),
        lambda: inputs(),
    ),
    "config.small_effective_batch": (
        lambda: inputs(run=make_run({"per_device_train_batch_size": "1", "gradient_accumulation_steps": "1",
                                     "learning_rate": "5e-4"})),
        lambda: inputs(run=make_run({"learning_rate": "5e-4"})),
    ),
    "config.undertrained": (
        lambda: inputs(run=make_run({"max_steps": "10"})),
        lambda: inputs(),
    ),
    # data
    "data.completion_truncated": (lambda: inputs(max_seq_length=20), lambda: inputs()),
    "data.conflicting_answers": (lambda: inputs(rows=_conflicting_rows()), lambda: inputs()),
    "data.duplicates": (lambda: inputs(rows=_CLEAN + copy.deepcopy(_CLEAN[:5])), lambda: inputs()),
    "data.empty_or_degenerate_targets": (
        lambda: inputs(rows=_with(_set_answer(0, " ... "))),
        lambda: inputs(),
    ),
    "data.format_inconsistency": (lambda: inputs(rows=_json_rows(odd=10)), lambda: inputs(rows=_json_rows(odd=0))),
    "data.length_outliers": (lambda: inputs(rows=_with(_long_row)), lambda: inputs()),
    "data.loss_mask_coverage": (lambda: inputs(tok=tokenizer(template=None)), lambda: inputs()),
    "data.missing_eos": (lambda: inputs(tok=tokenizer(template=NO_EOS_TEMPLATE)), lambda: inputs()),
    "data.near_duplicates": (lambda: inputs(rows=_near_dup_rows()), lambda: inputs()),
    "data.no_chat_template": (lambda: inputs(tok=tokenizer(template=None)), lambda: inputs()),
    "data.no_supervised_tokens": (lambda: inputs(max_seq_length=6), lambda: inputs()),
    "data.prompt_equals_target": (lambda: inputs(rows=_with(_echo)), lambda: inputs()),
    "data.template_prefix_mismatch": (lambda: inputs(tok=tokenizer(template=UNSTABLE_TEMPLATE)), lambda: inputs()),
    "data.tiny_dataset": (lambda: inputs(rows=_CLEAN[:20]), lambda: inputs()),
    "data.train_eval_contamination": (lambda: inputs(eval_rows=_CLEAN[:10] + _EVAL), lambda: inputs()),
    "data.truncated": (lambda: inputs(max_seq_length=30), lambda: inputs()),
    # dynamics
    "dynamics.always_clipping": (
        lambda: inputs(run=make_run(logs=_logs_with(g=lambda s: setattr(s, "grad_norm", 1.7)))),
        lambda: inputs(),
    ),
    "dynamics.grad_norm_explosion": (
        lambda: inputs(run=make_run(logs=_logs_with(x=_set(50, grad_norm=40.0)))),
        lambda: inputs(),
    ),
    "dynamics.loss_plateau": (
        lambda: inputs(run=make_run(logs=_logs_with(flat=lambda s: setattr(s, "loss", 2.0 + 0.001 * (s.step % 3))))),
        lambda: inputs(),
    ),
    "dynamics.loss_spike": (
        lambda: inputs(run=make_run(logs=_logs_with(x=_set(60, loss=9.0)))),
        lambda: inputs(),
    ),
    "dynamics.lr_schedule_incomplete": (
        lambda: inputs(run=make_run(logs=_stopped_early_logs())),
        lambda: inputs(),
    ),
    "dynamics.nan_loss": (
        lambda: inputs(run=make_run(logs=_logs_with(x=_set(70, loss=0.0, grad_norm=float("nan"))))),
        lambda: inputs(),
    ),
    "dynamics.overfitting": (lambda: inputs(run=make_run(logs=_overfit_logs())), lambda: inputs()),
    "dynamics.too_few_steps": (lambda: inputs(run=make_run(logs=healthy_logs()[:3])), lambda: inputs()),
}


# -- the per-check cases -----------------------------------------------------------------------

def test_every_registered_check_has_cases():
    assert sorted(CASES) == sorted(c.id for c in all_checks())
    assert len(CASES) == 41


@pytest.mark.parametrize("check_id", sorted(CASES))
def test_check_trips(check_id):
    result = run_audit(checks=[check_id], **CASES[check_id][0]())
    assert not result.skipped, result.skipped
    fired = [f for f in result.findings if f.id == check_id]
    assert fired, f"{check_id} did not fire"
    for f in fired:
        assert f.category == check_id.split(".")[0]
        assert f.title and f.message and f.fix


@pytest.mark.parametrize("check_id", sorted(CASES))
def test_check_stays_quiet(check_id):
    result = run_audit(checks=[check_id], **CASES[check_id][1]())
    assert result.ran == [check_id], result.skipped
    assert not result.findings, [f.title for f in result.findings]


# -- numbers in the messages -------------------------------------------------------------------

def test_lr_too_high_reports_the_effective_rate():
    result = run_audit(checks=["config.lr_too_high"], **inputs(run=make_run({"learning_rate": "0.002"})))
    (f,) = result.findings
    assert f.severity == "critical"
    assert "lr=0.002 x alpha/r=2 = 0.004" in f.title
    assert f.evidence["effective_lr"] == pytest.approx(0.004)


def test_lr_too_high_uses_rslora_scaling():
    run = make_run({"learning_rate": "0.0005"}, lora={"use_rslora": True, "r": 16, "lora_alpha": 16})
    (f,) = run_audit(checks=["config.lr_too_high"], **inputs(run=run)).findings
    assert "alpha/sqrt(r)=4" in f.title and f.evidence["effective_lr"] == pytest.approx(0.002)


def test_nan_hidden_behind_zero_loss_is_named():
    run = make_run(logs=_logs_with(x=_set(70, loss=0.0, grad_norm=float("nan"))))
    (f,) = run_audit(checks=["dynamics.nan_loss"], **inputs(run=run)).findings
    assert f.severity == "critical" and f.evidence["zero_loss_nan_grad_steps"] == [70]
    assert "loss 0.0" in f.message


def test_findings_carry_example_ids():
    result = run_audit(checks=["data.duplicates"], **inputs(rows=_CLEAN + copy.deepcopy(_CLEAN[:5])))
    (f,) = result.findings
    assert len(f.example_ids) == 5 and all(e.endswith(str(300 + i)) for i, e in enumerate(f.example_ids))
    assert f.evidence["n_duplicates"] == 5


def test_example_ids_are_capped():
    cfg = AuditConfig(max_example_ids=3)
    result = run_audit(checks=["data.completion_truncated"], config=cfg, **inputs(max_seq_length=20))
    (f,) = result.findings
    assert len(f.example_ids) == 3 and f.evidence["n_example_ids"] == 300


# -- the false-positive guard ------------------------------------------------------------------

def test_healthy_run_has_no_high_or_critical_finding():
    result = run_audit(**inputs())
    assert not result.skipped, result.skipped
    assert len(result.ran) == 41
    serious = [(f.id, f.title) for f in result.at_least("high")]
    assert not serious, serious
    assert result.verdict()["kind"] == "inconclusive"


# -- config validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, key", [
    ({"clipping_share": 1.5}, "audit.clipping_share"),
    ({"spike_window": 0}, "audit.spike_window"),
    ({"lr_high_effective": -1.0}, "audit.lr_high_effective"),
    ({"lr_critical_effective": 1e-4}, "audit.lr_critical_effective"),
])
def test_audit_config_rejects_bad_values(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        AuditConfig(**kwargs)


def test_every_threshold_has_help_text():
    import dataclasses

    for f in dataclasses.fields(AuditConfig):
        assert f.metadata.get("help"), f.name


# -- near-duplicate estimator against the exact Jaccard --------------------------------------

def test_minhash_estimates_track_exact_jaccard():
    from gradian.audit.data_checks import minhash_signatures, near_duplicate_groups

    rng = random.Random(3)
    base = [rng.choice(_WORDS) for _ in range(200)]
    texts = [" ".join(base)]
    for changed in (2, 20, 80):
        words = list(base)
        for i in rng.sample(range(200), changed):
            words[i] = f"x{i}"
        texts.append(" ".join(words))

    def grams(t):
        w = t.split()
        return {tuple(w[i:i + 3]) for i in range(len(w) - 2)}

    sig = minhash_signatures(texts, 256)
    for j in range(1, 4):
        exact = len(grams(texts[0]) & grams(texts[j])) / len(grams(texts[0]) | grams(texts[j]))
        estimate = float((sig[0] == sig[j]).mean())
        assert abs(estimate - exact) < 0.1, (j, exact, estimate)
    assert near_duplicate_groups(texts, 0.9, 64) == [[0, 1]]
    assert near_duplicate_groups(["a b", "a b", "c"], 0.9, 64) == [[0, 1]]


def test_isolated_clipped_grad_spike_is_medium_and_sustained_is_high():
    """One blowup that clipping caught is worth a look; repeated ones explain a regression."""
    from gradian.audit import run_audit
    from gradian.runs import RunRecord, TrainingLogs, normalize_trainer_config

    def run_with(spikes, clip):
        history = [{"step": s, "loss": 1.0, "grad_norm": 30.0 if s in spikes else 1.0} for s in range(1, 41)]
        return RunRecord(config=normalize_trainer_config({"max_grad_norm": clip}),
                         logs=TrainingLogs.from_log_history(history))

    def severity(run):
        found = {f.id: f.severity for f in run_audit(run=run, checks=["dynamics.grad_norm_explosion"]).findings}
        return found.get("dynamics.grad_norm_explosion")

    assert severity(run_with({20}, 1.0)) == "medium"
    assert severity(run_with({10, 20, 30}, 1.0)) == "high"
    assert severity(run_with({20}, 0.0)) == "high"


# -- config.overtraining at the reference's figures --------------------------------------------

_ROWS_800 = clean_rows(800, seed=7)


@pytest.mark.parametrize("epochs, rows, expected", [
    ("3", _ROWS_800, "medium"),  # the reference's run: 3 epochs over 800 rows is flagged medium
    ("12", _ROWS_800, "high"),
    ("2", _ROWS_800, None),
    ("3", clean_rows(5000, seed=8), None),  # a large set takes the default 3 epochs unflagged
])
def test_overtraining_follows_epochs_and_dataset_size(epochs, rows, expected):
    run = make_run({"num_train_epochs": epochs})
    result = run_audit(checks=["config.overtraining"], dataset=dataset_from_rows(copy.deepcopy(rows)), run=run)
    assert result.ran == ["config.overtraining"], result.skipped
    found = {f.id: f.severity for f in result.findings}
    assert found.get("config.overtraining") == expected
