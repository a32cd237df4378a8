"""A quantized base at attribution (``quantization: 4bit | 8bit``, bitsandbytes): loaded as asked, the
hooks still exact on it, its gradients close to the full-precision base's, its index apart from
it, its memory priced to the byte, and bad settings refused before any work."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradian.config import load_config  # noqa: E402
from gradian.data import dataset_from_rows, tokenize_examples  # noqa: E402
from gradian.errors import ConfigError, MissingDependencyError  # noqa: E402
from gradian.grads import capture_per_example_grads, collate, load_model_for_gradients  # noqa: E402
from gradian.plan import AdapterShape, DatasetShape, read_model_shape  # noqa: E402
from gradian.plan.memory import CaptureSettings, weight_bytes  # noqa: E402
from gradian.plan.planner import Budgets, PlanSettings, make_plan, parse_size  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_base, save_tiny_lora  # noqa: E402

pytest.importorskip("bitsandbytes", reason="bitsandbytes is installed by the dev extra; this file tests it")

ROWS = [
    {"prompt": "what is the capital of france ?", "completion": "paris"},
    {"prompt": "hello", "completion": "hello world you are a helpful assistant"},
    {"prompt": "say one two three", "completion": "four five"},
    {"prompt": "name a colour", "completion": "blue"},
]


@pytest.fixture(scope="module")
def wide_lora(tmp_path_factory, chat_tokenizer):
    """A tiny Llama wide enough for several NF4 blocks per projection, with its adapter, on disk."""
    return save_tiny_lora(tmp_path_factory.mktemp("quantized"), tokenizer=chat_tokenizer, hidden_size=128,
                          intermediate_size=256)


def _gm(dirs, quantization, tmp_path):
    base, adapter = dirs
    cfg = load_config(overrides={"device": "cpu", "dtype": "float32", "quantization": quantization,
                                 "cache_dir": str(tmp_path), "grads.max_seq_length": 64})
    return load_model_for_gradients(str(base), str(adapter), cfg), cfg


def _batch(tokenizer):
    return collate(tokenize_examples(dataset_from_rows(ROWS).examples, tokenizer, 64), tokenizer.pad_token_id)


@pytest.mark.parametrize("quantization, layer", [("4bit", "Linear4bit"), ("8bit", "Linear8bitLt")])
def test_the_base_is_loaded_quantized_and_the_adapter_stays_float(wide_lora, quantization, layer, tmp_path):
    gm, _ = _gm(wide_lora, quantization, tmp_path)
    q_proj = gm.model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == layer
    assert not q_proj.base_layer.weight.is_floating_point()  # packed, not a float32 copy
    assert all(p.dtype == torch.float32 for b in gm.blocks for p in b.parameters)
    assert len(gm.blocks) == 2 * 7


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_hooks_equal_the_one_row_loop_on_a_quantized_base(wide_lora, quantization, chat_tokenizer, tmp_path):
    """The hooks read the LoRA inputs and output gradients, whatever computes the base: on the
    quantized model they give each row the gradient of its own backward pass."""
    gm, _ = _gm(wide_lora, quantization, tmp_path)
    batch = _batch(chat_tokenizer)
    hooks = capture_per_example_grads(gm, batch, "hooks")
    loop = capture_per_example_grads(gm, batch, "loop")
    for block in gm.blocks:
        for row in range(len(ROWS)):
            ref = loop[block.name][row]
            assert ref.norm() > 0
            assert ((hooks[block.name][row] - ref).norm() / ref.norm()).item() < 1e-4, (block.name, row)


def test_quantized_gradients_stay_close_to_the_full_precision_ones(wide_lora, chat_tokenizer, tmp_path):
    """What quantization changes is small but not nothing: each row's whole gradient keeps a cosine
    near 1 with the float32 base's, 8-bit closer than 4-bit (the measured figures on the worlds
    are in docs/validation.md)."""
    batch = _batch(chat_tokenizer)

    def flat(quantization):
        gm, _ = _gm(wide_lora, quantization, tmp_path)
        got = capture_per_example_grads(gm, batch, "hooks")
        return torch.cat([got[b.name] for b in gm.blocks], dim=1).double()

    full, cos = flat("none"), {}
    for quantization in ("8bit", "4bit"):
        g = flat(quantization)
        assert not torch.equal(g, full)
        cos[quantization] = torch.nn.functional.cosine_similarity(g, full, dim=1)
    assert cos["4bit"].min() > 0.9 and cos["8bit"].min() > 0.99
    assert cos["8bit"].mean() > cos["4bit"].mean()


def test_a_quantized_index_has_its_own_id_and_says_so(wide_lora, chat_tokenizer, tmp_path):
    from gradian.index.build import build_target

    dataset = dataset_from_rows(ROWS)
    targets = {}
    for quantization in ("none", "4bit"):
        gm, cfg = _gm(wide_lora, quantization, tmp_path)
        targets[quantization] = build_target(gm, chat_tokenizer, dataset, cfg, tmp_path)
    assert targets["none"].index_id != targets["4bit"].index_id
    assert targets["4bit"].identity["base_quantization"] == "4bit"
    assert "base_quantization" not in targets["none"].identity  # ids of earlier indexes unchanged


@pytest.mark.parametrize("quantization", ["none", "8bit", "4bit"])
def test_the_plan_prices_the_weights_to_the_byte(quantization, tmp_path):
    """``weight_bytes`` against the tensors bitsandbytes holds: packed values, scales, the NF4
    codebooks and the double quantization's state, and what stays in the model dtype."""
    from transformers import AutoModelForCausalLM

    from gradian.model_loading import quantized_loading

    build_tiny_base("llama", 0, hidden_size=128, intermediate_size=352).save_pretrained(str(tmp_path))
    shape = read_model_shape(json.loads((tmp_path / "config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                 **quantized_loading(quantization, torch.float32, torch.device("cpu")))
    held: dict[tuple[int, int], int] = {}
    for p in model.parameters():
        tensors = [p.data]
        state = getattr(p, "quant_state", None)
        if state is not None:
            tensors += [state.absmax, state.code]
            if state.nested:
                tensors += [state.state2.absmax, state.state2.code, state.offset]
        if getattr(p, "SCB", None) is not None:
            tensors.append(p.SCB)
        for t in tensors:
            held[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    assert weight_bytes(shape, 4, quantization) == sum(held.values())


def test_a_plan_for_a_base_too_big_for_the_card_quantizes_it():
    """An 8B base in bfloat16 (16 GB) on a 24 GiB card: the weights are what does not fit, so the
    proposal holds them in 4-bit and keeps every layer; on 80 GiB nothing is quantized."""
    shape, adapter, data = read_model_shape("llama-3.1-8b"), AdapterShape(16, "all-linear"), DatasetShape.uniform(1000, 1024)
    settings = PlanSettings(device="cuda", capture=CaptureSettings(dtype="bfloat16", attn_implementation="sdpa"))
    small = make_plan(shape, adapter, data, settings, Budgets(memory=parse_size("24GiB"), host=parse_size("64GiB")))
    proposal = small.proposal
    assert proposal is not None and proposal.changes.get("quantization") in ("8bit", "4bit")
    assert "grads.module_filter" not in proposal.changes and proposal.fits
    assert any("quantization: " in reason for reason in proposal.reasons)
    applied = dataclasses.replace(settings, capture=dataclasses.replace(settings.capture,
                                                                        quantization=proposal.changes["quantization"]))
    again = make_plan(shape, adapter, data, applied, propose=False)
    assert again.priced.memory.weights < 0.5 * make_plan(shape, adapter, data, settings, propose=False).priced.memory.weights
    roomy = make_plan(shape, adapter, data, settings, Budgets(memory=parse_size("80GiB"), host=parse_size("64GiB")))
    assert roomy.proposal is not None and "quantization" not in roomy.proposal.changes


@pytest.mark.parametrize("overrides, words", [
    ({"quantization": "2bit"}, "one of none, 4bit, 8bit"),
    ({"quantization": "4bit", "dtype": "float64"}, "dtype: float64"),
    ({"quantization": "8bit", "engine.name": "replay"}, "engine.name: replay"),
])
def test_bad_quantization_settings_are_refused_when_read(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert "quantization" in str(err.value) and words in str(err.value)


def test_without_bitsandbytes_the_error_names_the_extra(monkeypatch):
    from gradian.model_loading import quantized_loading

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes now fails
    with pytest.raises(MissingDependencyError) as err:
        quantized_loading("4bit", torch.float32, torch.device("cpu"))
    assert "gradian-mlflow[quantize]" in str(err.value) and "quantization: none" in str(err.value)
    assert quantized_loading("none", torch.float32, torch.device("cpu")) == {}


def test_the_plan_cli_prices_a_quantized_base_and_refuses_an_unknown_one(tmp_path):
    from typer.testing import CliRunner

    from gradian.cli import app

    runner = CliRunner()
    args = ["plan", "--model-config", "qwen2.5-0.5b", "--r", "8", "--target-modules", "all-linear",
            "--n-examples", "100", "--tokens", "256", "--no-calibrate", "--json"]
    full = json.loads(runner.invoke(app, args).output)
    four = runner.invoke(app, args + ["--quantization", "4bit"])
    assert four.exit_code == 0, four.output
    four_json = json.loads(four.output)
    assert four_json["memory"]["weights"] < full["memory"]["weights"]
    bad = runner.invoke(app, args + ["--quantization", "3bit"])
    assert isinstance(bad.exception, ConfigError) and bad.exception.exit_code == 2
    assert "'quantization' is '3bit'" in str(bad.exception) and "4bit" in str(bad.exception)
    assert np.isfinite(four_json["memory"]["peak"])


def test_gradian_train_quantizes_its_base_as_attribution_does(tmp_path):
    """``train.load_in_4bit`` and ``quantization: 4bit`` load the same base: NF4, double-quantized
    scales, computing in the model dtype; so a run trained by ``gradian train`` in 4-bit is
    attributed against the base it was trained on."""
    from gradian.model_loading import quantized_loading
    from gradian.train.lora import _load_model

    build_tiny_base("llama", 0, hidden_size=128, intermediate_size=256).save_pretrained(str(tmp_path))
    cfg = load_config(overrides={"device": "cpu", "dtype": "float32", "train.load_in_4bit": True})
    trained = _load_model(str(tmp_path), cfg, "hf").config.quantization_config
    attributed = quantized_loading("4bit", torch.float32, torch.device("cpu"))["quantization_config"]
    for name in ("load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"):
        assert getattr(trained, name) == getattr(attributed, name), name
    assert attributed.bnb_4bit_quant_type == "nf4"


def test_a_4bit_base_of_any_width_measures_then_differentiates_on_the_cpu(tmp_path_factory, chat_tokenizer, tmp_path):
    """A 144-wide base (the bestiary's width, not a multiple of 32): a forward without gradients
    (what a generation does) and then the gradient passes, on one and the same kernel. Left to
    itself, bitsandbytes repacks a CPU 4-bit weight for inference on the first such forward and
    fails on this width."""
    dirs = save_tiny_lora(tmp_path_factory.mktemp("quantized-144"), tokenizer=chat_tokenizer, hidden_size=144,
                          intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
    gm, _ = _gm(dirs, "4bit", tmp_path)
    flags = [m.support_avx512bf16_for_cpu for m in gm.model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert flags and not any(flags)
    batch = _batch(chat_tokenizer)
    with torch.no_grad():
        before = gm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    hooks = capture_per_example_grads(gm, batch, "hooks")
    loop = capture_per_example_grads(gm, batch, "loop")
    for block in gm.blocks:
        ref = loop[block.name]
        assert ((hooks[block.name] - ref).norm(dim=1) / ref.norm(dim=1)).max() < 1e-4, block.name
    with torch.no_grad():
        after = gm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(before, after)


def test_the_mlflow_params_say_when_the_base_was_quantized():
    """The child run's params name the quantization the scores were computed on, and say nothing
    for the full-precision default."""
    from gradian.report.schema import AttributeManifest, Report, Verdict
    from gradian.report.tracker import run_params

    def params(config):
        return run_params(Report(verdict=Verdict(kind="data", summary="s"),
                                 manifest=AttributeManifest(gradian_version="0", config_hash="h", config=config)))

    assert params({"quantization": "4bit"})["quantization"] == "4bit"
    assert "quantization" not in params({"quantization": "none"}) and "quantization" not in params({})
