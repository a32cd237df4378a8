"""`gradian plan`: the formulas, the budget proposals, the command, and predictions against a
measured run on the ~10M shape of projects/benchmarks/bench_plan.py."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from gradian.cli import app
from gradian.errors import ConfigError
from gradian.plan import (
    AdapterShape,
    BatchShape,
    CaptureSettings,
    DatasetShape,
    adapter_shape,
    block_widths,
    estimate_memory,
    index_bytes,
    lora_linears,
    read_model_shape,
)
from gradian.plan.planner import HEADROOM, Budgets, PlanSettings, make_plan, parse_size, propose_settings

SITES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMALL = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2)


def test_published_parameter_counts_of_the_presets():
    # the counts the model cards publish: 0.49B, 1.24B, 8.03B
    assert read_model_shape("qwen2.5-0.5b").n_parameters == 494_032_768
    assert read_model_shape("llama-3.2-1b").n_parameters == 1_235_814_400
    assert read_model_shape("llama-3.1-8b").n_parameters == 8_030_261_248


def test_parameter_count_matches_a_built_model():
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    for model_type in ("llama", "qwen2"):
        values = {**SMALL, "model_type": model_type, "tie_word_embeddings": model_type == "qwen2"}
        config = AutoConfig.for_model(model_type, **{k: v for k, v in values.items() if k != "model_type"})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        assert read_model_shape(values).n_parameters == sum(p.numel() for p in model.parameters())


def test_lora_linears_follow_peft_matching_and_the_module_filter():
    shape = read_model_shape(SMALL)
    assert len(lora_linears(shape, AdapterShape(4, "all-linear"))) == 3 * 7
    qv = lora_linears(shape, AdapterShape(4, ("q_proj", "v_proj")))
    assert [lin.site for lin in qv[:2]] == ["q_proj", "v_proj"]
    assert qv[1].in_features == 64 and qv[1].out_features == 2 * 16  # kv heads x head_dim
    assert qv[0].dim == 4 * (64 + 64)
    assert [lin.layer for lin in lora_linears(shape, AdapterShape(4, SITES), r"\.layers\.2\.")] == [2] * 7
    regex = lora_linears(shape, AdapterShape(4, r".*\.mlp\.down_proj"))
    assert [lin.name for lin in regex] == [f"model.layers.{k}.mlp.down_proj" for k in range(3)]
    assert len(lora_linears(shape, AdapterShape(4, SITES, layers_to_transform=(0,)))) == 7


def test_adapter_shape_from_adapter_config(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 16, "target_modules": ["q_proj", "v_proj"]}))
    assert adapter_shape(tmp_path) == AdapterShape(16, ("q_proj", "v_proj"))
    assert adapter_shape(tmp_path, r=8).r == 8
    assert adapter_shape(None, 4, "q_proj,o_proj").target_modules == ("q_proj", "o_proj")
    with pytest.raises(ConfigError, match="rank"):
        adapter_shape(None, None, "q_proj")


def test_index_bytes_formula():
    # 10 rows x (100 + 50) float16 values, float64 norms per block, two chunk files of each kind
    assert index_bytes(10, [100, 50], "float16", 8) == 10 * 150 * 2 + 10 * 2 * 8 + 2 * 2 * 128
    assert index_bytes(0, [100], "float32", 8) == 0
    widths = block_widths(lora_linears(read_model_shape(SMALL), AdapterShape(4, ("q_proj",))), "module", 300)
    assert widths == [(512, 300)] * 3
    matrix = block_widths(lora_linears(read_model_shape(SMALL), AdapterShape(4, ("q_proj",))), "matrix")
    assert matrix[:2] == [(256, 256), (256, 256)]


def test_memory_formula_by_hand():
    """One layer, q_proj only, float32, eager: every component from the module docstring."""
    values = {**SMALL, "num_hidden_layers": 1}
    shape = read_model_shape(values)
    linears = lora_linears(shape, AdapterShape(2, ("q_proj",)))
    b, t, sup = 2, 10, 6
    n = b * t
    est = estimate_memory(shape, linears, BatchShape(b, t, sup), CaptureSettings())
    q = n * 4 * 16
    norm = n * 64 * 4 + n * 4
    attention = 3 * q * 4 + b * 4 * t * t * 4
    assert est.activations == attention + norm + 3 * n * 128 * 4 + norm  # + final norm, no input norm
    assert est.hook_inputs == n * 64 * 4 + n * 2 * 4
    assert est.logits == n * 1000 * 4
    assert est.loss_backward == n * 1000 * 4 + sup * 1000 * 4
    assert est.per_example_grads == b * 2 * (64 + 64) * 4
    assert est.weights == shape.n_parameters * 4 and est.adapter_weights == 2 * 128 * 4
    capture = est.activations + est.hook_inputs + est.per_example_grads + est.logits + est.loss_backward
    assert est.peak == est.weights + est.adapter_weights + capture
    # bfloat16: half the weights, a float32 adapter, the softmax cast kept beside the float32 probs
    half = estimate_memory(shape, linears, BatchShape(b, t, sup), CaptureSettings(dtype="bfloat16"))
    assert half.weights == shape.n_parameters * 2 and half.adapter_weights == est.adapter_weights
    assert half.logits == est.logits // 2
    # a filter on the last layer keeps no activation of the layers before it
    deep = read_model_shape({**SMALL, "num_hidden_layers": 4})
    all_layers = estimate_memory(deep, lora_linears(deep, AdapterShape(2, SITES)), BatchShape(b, t, sup), CaptureSettings())
    last = estimate_memory(deep, lora_linears(deep, AdapterShape(2, SITES), r"\.layers\.3\."), BatchShape(b, t, sup),
                           CaptureSettings())
    assert last.activations < all_layers.activations / 3


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("100GB") == 100 * 10**9
    assert parse_size("1.5tb") == int(1.5e12)
    assert parse_size("512") == 512
    with pytest.raises(ConfigError, match="--disk"):
        parse_size("lots", "--disk")


def _plan_inputs():
    shape = read_model_shape("llama-3.2-1b")
    return shape, AdapterShape(16, "all-linear"), DatasetShape.uniform(20000, 1024)


def test_proposal_for_a_disk_budget_is_float16_then_the_widest_projection_that_fits():
    shape, adapter, data = _plan_inputs()
    settings = PlanSettings(device="cuda", capture=CaptureSettings(dtype="bfloat16", attn_implementation="sdpa"))
    plan = make_plan(shape, adapter, data, settings, Budgets(disk=parse_size("100GB")))
    assert not plan.fits_disk and plan.fits_memory
    proposal = plan.proposal
    assert proposal.fits and proposal.index_bytes <= 100e9
    assert proposal.changes["grads.storage_dtype"] == "float16"
    p = proposal.changes["grads.projection_dim"]
    assert p & (p - 1) == 0  # a power of two, and the next one up would not fit
    wider = settings.with_changes(storage_dtype="float16", projection_dim=2 * p)
    assert make_plan(shape, adapter, data, wider, propose=False).index_bytes > 100e9
    # EK-FAC (the default) reads unprojected gradients: the projected index is scored with DataInf
    assert proposal.changes["engine.name"] == "datainf" and any("datainf" in r for r in proposal.reasons)
    datainf = make_plan(shape, adapter, data, settings.with_changes(engine="datainf"), Budgets(disk=parse_size("100GB")))
    assert "engine.name" not in datainf.proposal.changes


def test_a_projected_index_under_a_kronecker_engine_is_flagged():
    shape, adapter, data = _plan_inputs()
    projected = PlanSettings(projection_dim=4096, capture=CaptureSettings(projection_dim=4096))
    assert any("refuses a projected index" in note for note in make_plan(shape, adapter, data, projected).notes)
    datainf = projected.with_changes(engine="datainf")
    assert not any("refuses" in note for note in make_plan(shape, adapter, data, datainf).notes)


def test_proposal_for_a_memory_budget_lowers_the_batch_size_to_the_largest_that_fits():
    shape, adapter, data = _plan_inputs()
    settings = PlanSettings(batch_size=8, device="cuda", capture=CaptureSettings(dtype="bfloat16"))
    budget = parse_size("24GiB")
    proposal = propose_settings(shape, adapter, data, settings, Budgets(memory=budget))
    size = proposal.changes["grads.batch_size"]
    assert 1 <= size < 8 and proposal.fits
    assert make_plan(shape, adapter, data, settings.with_changes(batch_size=size), propose=False).device_peak <= HEADROOM * budget
    assert make_plan(shape, adapter, data, settings.with_changes(batch_size=size + 1), propose=False).device_peak > HEADROOM * budget


def test_proposal_restricts_layers_when_one_row_does_not_fit():
    shape, adapter, _ = _plan_inputs()
    data = DatasetShape.uniform(100, 8192)
    settings = PlanSettings(batch_size=1, max_seq_length=8192, device="cuda",
                            capture=CaptureSettings(dtype="bfloat16", attn_implementation="sdpa"))
    plan = make_plan(shape, adapter, data, settings, Budgets(memory=parse_size("12GiB")))
    assert not plan.fits
    assert plan.proposal.fits and list(plan.proposal.changes) == ["grads.module_filter"]
    kept = plan.proposal.changes["grads.module_filter"]
    first = int(kept.split("(")[1].split("|")[0])
    assert 0 < first < 15 and kept.endswith("|15)\\.")
    # one layer fewer would not fit
    earlier = settings.with_changes(module_filter=kept.replace(f"({first}|", f"({first - 1}|{first}|"))
    assert make_plan(shape, adapter, data, earlier, propose=False).device_peak > HEADROOM * parse_size("12GiB")


def test_weights_alone_over_budget_is_reported_not_fitted():
    shape, adapter, data = _plan_inputs()
    settings = PlanSettings(device="cuda", capture=CaptureSettings(dtype="float32"))
    proposal = propose_settings(shape, adapter, data, settings, Budgets(memory=parse_size("2GiB")))
    assert not proposal.fits and any("bfloat16" in reason for reason in proposal.reasons)


def test_plan_command_warns_in_one_line_and_fails_only_when_asked():
    runner = CliRunner()
    args = ["plan", "--model-config", "llama-3.1-8b", "--r", "16", "--target-modules", "all-linear",
            "--n-examples", "10000", "--tokens", "1024", "--device", "cuda", "--no-calibrate",
            "--memory", "24GiB", "--disk", "100GB"]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    warnings = [line for line in done.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "grads.projection_dim" in warnings[0]
    assert runner.invoke(app, [*args, "--fail-if-over"]).exit_code == 1
    fits = runner.invoke(app, [*args[:-4], "--memory", "200GiB", "--disk", "10TB", "--fail-if-over"])
    assert fits.exit_code == 0 and "warning:" not in fits.output
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0 and "warning:" in as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["fits"] is False and data["proposal"]["fits"] is True
    assert data["time"] is None
    # 8B is not timed from a random init (no GPU here, or too large on one): said so, not failed
    timed = json.loads(runner.invoke(app, [*[a for a in args if a != "--no-calibrate"], "--json"]).stdout)
    assert timed["time"]["seconds"] is None and timed["time"]["source"].startswith("not measured: ")


def test_plan_command_reads_a_dataset_and_times_a_random_init_model(tmp_path, chat_tokenizer, tiny_lora_dirs):
    base, adapter = tiny_lora_dirs
    rows = [{"prompt": f"question {i}", "completion": "answer " * (i + 1)} for i in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    done = CliRunner().invoke(app, ["plan", "--model-config", str(base / "config.json"), "--tokenizer", str(base),
                                    "--adapter", str(adapter), "--dataset", str(data), "--batch-size", "2",
                                    "--device", "cpu", "--json"])
    assert done.exit_code == 0, done.output
    out = json.loads(done.output)
    assert out["n_examples"] == 8 and out["time"]["source"] == "measured on the random-init model of the same config"
    assert out["time"]["seconds"] > 0
    with_weights = CliRunner().invoke(app, ["plan", "-m", str(base), "-a", str(adapter), "-d", str(data),
                                            "--batch-size", "2", "--device", "cpu", "--json"])
    assert json.loads(with_weights.output)["time"]["source"] == "measured on the real model"


def test_predictions_within_a_quarter_of_a_measured_run_at_10m():
    """The ~10M shape of bench_plan.py, measured in a fresh process (peak RSS; see its docstring)."""
    pytest.importorskip("torch")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "projects" / "benchmarks" / "bench_plan.py"
    spec = importlib.util.spec_from_file_location("bench_plan", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.run_shape("10m")
    m = result["memory"]
    assert math.isclose(m["predicted_total"], m["measured_total"], rel_tol=0.25), m
    assert math.isclose(m["predicted_work"], m["measured_work"], rel_tol=0.25), m
    for variant in result["index"].values():
        assert math.isclose(variant["predicted_bytes"], variant["measured_bytes"], rel_tol=0.25), variant
