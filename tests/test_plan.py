"""`gradian plan`: the formulas, the budget proposals, both stores of the training gradients (their
pass counts checked against a real run of the engines), the command, and predictions against a
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
from gradian.plan.memory import stream_chunk_bytes, writer_buffer_bytes
from gradian.plan.planner import (HEADROOM, KRONECKER_FLOOR, Budgets, PlanSettings, kronecker_widths, make_plan,
                                  parse_size, propose_settings)
from gradian.plan.stores import GIB, auto_store, curvature_cost, engine_passes

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


#: config keys of a proposal -> ``PlanSettings`` fields
_FIELDS = {"engine.store": "store", "engine.name": "engine", "grads.batch_size": "batch_size",
           "grads.projection_dim": "projection_dim", "grads.projection_kind": "projection_kind",
           "grads.module_filter": "module_filter",
           "grads.storage_dtype": "storage_dtype", "grads.chunk_size": "chunk_size",
           "grads.max_seq_length": "max_seq_length", "grads.max_index_gb": "max_index_gb"}


def _applied(settings, proposal):
    """``settings`` with the proposal's changes, priced again from scratch (no proposal)."""
    return settings.with_changes(**{_FIELDS[k]: v for k, v in proposal.changes.items()})


def test_a_datainf_plan_over_disk_still_gets_float16_then_the_widest_projection_that_fits():
    shape, adapter, data = _plan_inputs()
    settings = PlanSettings(device="cuda", engine="datainf", capture=CaptureSettings(dtype="bfloat16", attn_implementation="sdpa"))
    budgets = Budgets(disk=parse_size("100GB"))
    plan = make_plan(shape, adapter, data, settings, budgets)
    assert plan.priced.index.disk_bytes > 100e9 and plan.fits_memory
    proposal = plan.proposal
    assert proposal.fits and proposal.index_bytes <= 100e9 and proposal.store == "index"
    assert proposal.changes["grads.storage_dtype"] == "float16" and "engine.name" not in proposal.changes
    assert "engine.store" not in proposal.changes
    p = proposal.changes["grads.projection_dim"]
    assert p & (p - 1) == 0  # a power of two, and the next one up would not fit
    wider = settings.with_changes(storage_dtype="float16", projection_dim=2 * p)
    assert make_plan(shape, adapter, data, wider, propose=False).priced.index.disk_bytes > 100e9
    # the projected index is under grads.max_index_gb, so engine.store: auto writes it
    again = make_plan(shape, adapter, data, _applied(settings, proposal), budgets, propose=False)
    assert again.priced.store == again.priced.auto_store == "index" and again.fits and again.priced.disk_bytes == again.priced.index.disk_bytes


def test_a_projected_index_over_max_index_gb_raises_the_limit_so_auto_writes_it():
    shape, adapter, data = read_model_shape("llama-3.1-8b"), AdapterShape(16, "all-linear"), DatasetShape.uniform(100_000, 1024)
    settings = PlanSettings(device="cuda", engine="datainf", capture=CaptureSettings(dtype="bfloat16"))
    budgets = Budgets(memory=parse_size("80GiB"), disk=parse_size("2TB"), host=parse_size("1TiB"))
    proposal = make_plan(shape, adapter, data, settings, budgets).proposal
    assert proposal.fits and "grads.projection_dim" in proposal.changes and "engine.name" not in proposal.changes
    again = make_plan(shape, adapter, data, _applied(settings, proposal), budgets, propose=False)
    assert again.priced.index.data_bytes > 100 * GIB  # over the default limit: auto alone would stream it
    assert proposal.changes["grads.max_index_gb"] * GIB >= again.priced.index.data_bytes
    assert again.priced.store == "index" and again.priced.disk_bytes <= budgets.disk


def test_ekfac_over_disk_streams_at_full_width_instead_of_switching_engine():
    """The engine is never changed for size: a Kronecker engine's index that does not fit the disk
    becomes ``engine.store: stream`` (no projection), and the plan prices its passes."""
    shape, adapter, data = _plan_inputs()
    settings = PlanSettings(device="cuda", capture=CaptureSettings(dtype="bfloat16", attn_implementation="sdpa"))
    budgets = Budgets(disk=parse_size("100GB"))
    plan = make_plan(shape, adapter, data, settings, budgets)
    proposal = plan.proposal
    assert proposal.changes["engine.store"] == "stream" and proposal.store == "stream"
    assert not {"engine.name", "grads.projection_dim"} & set(proposal.changes)
    assert not any("datainf" in reason for reason in proposal.reasons)
    streamed = make_plan(shape, adapter, data, _applied(settings, proposal), budgets, propose=False)
    # nothing of an index on disk: only the fitted EK-FAC state, under the budget
    assert streamed.priced.disk_bytes == streamed.priced.curvature.state_bytes <= budgets.disk
    assert streamed.priced.stream.passes == engine_passes("ekfac").stream == 3
    # where float16 is enough (and under grads.max_index_gb), the cheaper index is kept
    small = DatasetShape.uniform(1000, 1024)
    full = make_plan(shape, adapter, small, settings, propose=False)
    disk = full.priced.index.disk_bytes * 3 // 4 + full.priced.curvature.state_bytes
    half = make_plan(shape, adapter, small, settings, Budgets(disk=disk)).proposal
    assert half.changes == {"grads.storage_dtype": "float16"} and half.store == "index" and half.disk_bytes <= disk


def test_a_projected_index_under_a_kronecker_engine_is_flagged():
    shape, adapter, data = _plan_inputs()
    projected = PlanSettings(projection_dim=4096, capture=CaptureSettings(projection_dim=4096))
    assert any("refuses a flat projection" in note for note in make_plan(shape, adapter, data, projected).notes)
    datainf = projected.with_changes(engine="datainf")
    assert not any("refuses" in note for note in make_plan(shape, adapter, data, datainf).notes)
    kronecker = PlanSettings(projection_dim=4096, capture=CaptureSettings(projection_dim=4096, projection_kind="kronecker"))
    assert not any("refuses" in note for note in make_plan(shape, adapter, data, kronecker).notes)


def test_block_widths_price_a_kronecker_projection_per_lora_matrix():
    """``kronecker`` stores ``min(out, w) x min(in, w)`` of each LoRA matrix (A ``(r, in)``, B ``(out, r)``)."""
    shape = read_model_shape(SMALL)
    linears = lora_linears(shape, AdapterShape(4, ("k_proj", "down_proj")))
    k, down = linears[0], linears[1]  # in 64, out 32; in 128, out 64
    w = 40
    expected_k = min(4, w) * min(64, w) + min(32, w) * min(4, w)
    expected_down = min(4, w) * min(128, w) + min(64, w) * min(4, w)
    assert block_widths(linears, "module", w, "kronecker")[:2] == [(k.dim, expected_k), (down.dim, expected_down)]
    assert block_widths(linears, "matrix", w, "kronecker")[:2] == [(4 * 64, 4 * 40), (32 * 4, 32 * 4)]
    # the flat kinds cap each block at w
    assert block_widths(linears, "module", w)[:2] == [(k.dim, w), (down.dim, w)]
    # EK-FAC's factors under it: each side at most w
    full, projected = curvature_cost("ekfac", linears), curvature_cost("ekfac", linears, w, "kronecker")
    assert full.factor_bytes == 8 * sum(i * i + o * o for lin in linears
                                        for o, i in ((lin.r, lin.in_features), (lin.out_features, lin.r)))
    assert projected.factor_bytes < full.factor_bytes
    assert curvature_cost("datainf", linears).factor_bytes == 0


def test_host_buffers_by_the_formulas():
    shape = read_model_shape(SMALL)
    linears = lora_linears(shape, AdapterShape(2, SITES))
    for storage in ("float32", "float16"):
        settings = CaptureSettings(storage_dtype=storage, chunk_size=64)
        est = estimate_memory(shape, linears, BatchShape(2, 10, 6), settings)
        widths = [w for _, w in block_widths(linears)]
        s = 2 if storage == "float16" else 4
        assert est.writer_buffer == writer_buffer_bytes(64, sum(widths), storage) == 64 * sum(widths) * (8 + 3 * s)
        assert est.stream_chunk == stream_chunk_bytes(64, sum(widths), max(widths), storage)
        assert est.stream_chunk == 64 * sum(widths) * (4 + 2 * s) + 4 * 64 * max(widths)


def test_auto_store_is_the_runs_rule():
    limit = 100.0
    assert auto_store(int(limit * GIB), limit, None)[0] == "index"
    assert auto_store(int(limit * GIB) + 1, limit, None)[0] == "stream"
    assert auto_store(10, None, 9) == ("stream", auto_store(10, None, 9)[1]) and "disk budget" in auto_store(10, None, 9)[1]
    assert auto_store(10, None, None)[0] == "index"


def _lora_sides(linears):
    """``(out, in)`` of every LoRA matrix: A is ``(r, in)``, B ``(out, r)``."""
    return [side for lin in linears for side in ((lin.r, lin.in_features), (lin.out_features, lin.r))]


def _factor_bytes(linears, width=None):
    """EK-FAC's float64 factors from the LoRA shapes alone: ``8 sum(in^2 + out^2)``, each side at
    most ``width`` under a kronecker projection."""
    cap = (lambda side: side) if width is None else (lambda side: min(side, width))
    return 8 * sum(cap(i) ** 2 + cap(o) ** 2 for o, i in _lora_sides(linears))


def _stored_values(linears, width):
    """One row's stored values under a kronecker projection: ``min(out, w) x min(in, w)`` per matrix."""
    return sum(min(o, width) * min(i, width) for o, i in _lora_sides(linears))


def test_the_8b_plan_keeps_ekfac_and_projects_its_factors_instead_of_cutting_layers():
    """The published 8B plan: llama-3.1-8b, r=16 all-linear, 100,000 rows x 1,024 tokens,
    ``--memory 80GiB --disk 2TB``: the engine stays ekfac and every layer is kept; the full-width
    Kronecker factors do not fit, so the proposal is the widest power-of-two kronecker projection
    that does, priced at that width (factors, stored values, stream chunk, state), on a CPU run and
    on a GPU one with the default host memory and with a 64 GiB host."""
    shape, adapter = read_model_shape("llama-3.1-8b"), AdapterShape(16, "all-linear")
    data = DatasetShape.uniform(100_000, 1024)
    memory, disk = parse_size("80GiB"), parse_size("2TB")
    linears = lora_linears(shape, adapter)
    widest = max(max(side) for side in _lora_sides(linears))
    for device, dtype, host in (("cpu", "float32", None), ("cuda", "bfloat16", None),
                                ("cuda", "bfloat16", parse_size("64GiB"))):
        budgets = Budgets(memory=memory, disk=disk, host=host)
        host_budget = budgets.host_memory(device)
        settings = PlanSettings(device=device, capture=CaptureSettings(dtype=dtype))
        plan = make_plan(shape, adapter, data, settings, budgets)
        full = plan.values_per_example
        assert plan.priced.index.data_bytes == 100_000 * full * 4 > disk  # the full-width index cannot be written
        assert plan.priced.auto_store == plan.priced.store == "stream"
        # at full width the factors alone are over the memory (a CPU run) or the device
        assert plan.priced.curvature.factor_bytes == _factor_bytes(linears) > HEADROOM * memory - plan.priced.memory.weights
        proposal = plan.proposal
        label = (device, host, proposal.changes)
        assert proposal.fits and "engine.name" not in proposal.changes, label
        assert proposal.changes["engine.store"] == "stream", label
        assert proposal.changes["grads.projection_kind"] == "kronecker", label
        assert "grads.module_filter" not in proposal.changes, label  # every layer kept
        assert not any(reason.startswith("only layer") for reason in proposal.reasons), proposal.reasons
        width = proposal.changes["grads.projection_dim"]
        assert width & (width - 1) == 0 and KRONECKER_FLOOR <= width < widest, label
        again = make_plan(shape, adapter, data, _applied(settings, proposal), budgets, propose=False)
        assert again.settings.engine == "ekfac" and again.fits, label
        assert len({lin.layer for lin in lora_linears(shape, adapter, again.settings.module_filter)}) == 32
        # everything priced at the projected width, by the formulas from the LoRA shapes
        factors, stored = _factor_bytes(linears, width), _stored_values(linears, width)
        assert again.priced.curvature.factor_bytes == again.priced.curvature.device == factors < plan.priced.curvature.factor_bytes / 10
        assert again.priced.curvature.host == 2 * factors + 5 * 8 * width**2  # the widest factor's side is now w
        assert again.stored_per_example == stored and again.values_per_example == full
        assert again.priced.curvature.state_bytes == factors + 8 * stored
        assert again.priced.index.data_bytes == 100_000 * stored * 4
        widths = [w for _, w in block_widths(linears, "module", width, "kronecker")]
        assert sum(widths) == stored
        assert again.priced.stream.host_buffer == stream_chunk_bytes(again.settings.chunk_size, stored, max(widths), "float32")
        assert again.priced.device_peak == proposal.peak_memory <= memory
        assert again.priced.disk_bytes == again.priced.curvature.state_bytes == proposal.disk_bytes <= disk
        assert again.priced.host_buffer == again.priced.stream.host_buffer <= 64 * GIB
        if device == "cuda":
            assert again.priced.host_peak == proposal.host_peak <= host_budget  # --host-memory defaults to --memory
        # the next width up does not fit even at one row per batch and per chunk: this is the widest
        wider = make_plan(shape, adapter, data, again.settings.with_changes(projection_dim=2 * width, batch_size=1,
                                                                            chunk_size=1), budgets, propose=False)
        assert (wider.priced.device_peak > HEADROOM * memory
                or (device == "cuda" and wider.priced.host_peak > HEADROOM * host_budget)), label
        # the reason says what the projection changes and where its accuracy is measured
        reason = next(r for r in proposal.reasons if "grads.projection_kind: kronecker" in r)
        for words in (f"grads.projection_dim: {width}", "model-wide side", "rank side (r=16) exact",
                      "every layer stays attributed", "the curvature is still fitted", "random projection",
                      "docs/validation.md"):
            assert words in reason, (words, reason)


def test_kronecker_widths_are_powers_of_two_from_the_floor_to_below_the_widest_side():
    shape = read_model_shape("llama-3.1-8b")
    linears = lora_linears(shape, AdapterShape(16, "all-linear"))  # sides 1,024 to 14,336
    assert kronecker_widths(linears) == [8192, 4096, 2048, 1024, 512, 256]
    assert kronecker_widths(linears, below=2048) == [1024, 512, 256]  # narrower than one configured
    # a width no narrower than every side would project nothing: q_proj and v_proj of a 512-wide model
    narrow = read_model_shape({**SMALL, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8})
    assert max(max(side) for side in _lora_sides(lora_linears(narrow, AdapterShape(4, ("q_proj",))))) == 512
    assert kronecker_widths(lora_linears(narrow, AdapterShape(4, ("q_proj",)))) == [256]
    assert kronecker_widths(lora_linears(read_model_shape(SMALL), AdapterShape(4, "all-linear"))) == []


def test_projected_factor_bytes_are_the_formula_from_the_lora_shapes():
    """At any width, ``curvature_cost`` and a plan price EK-FAC's factors as ``8 sum(min(in, w)^2 +
    min(out, w)^2)`` over A ``(r, in)`` and B ``(out, r)`` of every module, computed here apart."""
    shape, adapter = read_model_shape("llama-3.2-1b"), AdapterShape(16, "all-linear")
    linears = lora_linears(shape, adapter)
    data = DatasetShape.uniform(10, 64)
    hand = {w: 0 for w in (256, 1024, 4096)}
    for lin in linears:  # every module: A (16, in), B (out, 16); q/o 2048, k/v out 512, MLP 8192
        for w in hand:
            a = min(lin.in_features, w) ** 2 + min(lin.r, w) ** 2
            b = min(lin.r, w) ** 2 + min(lin.out_features, w) ** 2
            hand[w] += 8 * (a + b)
    for w, expected in hand.items():
        assert curvature_cost("ekfac", linears, w, "kronecker").factor_bytes == expected == _factor_bytes(linears, w)
        settings = PlanSettings(device="cuda", projection_dim=w,
                                capture=CaptureSettings(projection_dim=w, projection_kind="kronecker"))
        plan = make_plan(shape, adapter, data, settings, propose=False)
        assert plan.priced.curvature.factor_bytes == plan.priced.curvature.device == expected
        assert plan.priced.device_peak == plan.priced.memory.peak + expected
    # layer by layer at 4096: only the MLP's 8192-wide side is narrowed, the rank side never
    per_layer = 8 * (2 * (2048**2 + 16**2) + 2 * (2048**2 + 16**2 + 16**2 + 512**2) + 2 * (2048**2 + 16**2)
                     + 3 * (2048**2 + 2 * 16**2 + 4096**2))
    assert hand[4096] == shape.num_layers * per_layer


def test_factors_that_fit_get_no_projection():
    """A small model's factors fit beside the capture: the proposal lowers the batch and projects nothing."""
    shape, adapter = read_model_shape("qwen2.5-0.5b"), AdapterShape(16, "all-linear")
    data = DatasetShape.uniform(1000, 1024)
    settings = PlanSettings(batch_size=8, device="cuda", capture=CaptureSettings(dtype="bfloat16", attn_implementation="eager"))
    budgets = Budgets(memory=parse_size("28GiB"), host=parse_size("128GiB"), disk=parse_size("1TB"))
    plan = make_plan(shape, adapter, data, settings, budgets)
    assert not plan.fits_memory
    # at full width the factors fit beside a smaller batch, on the device and on the host
    smaller = make_plan(shape, adapter, data, settings.with_changes(batch_size=1), budgets, propose=False)
    assert smaller.priced.device_peak <= HEADROOM * budgets.memory and smaller.priced.host_peak <= HEADROOM * budgets.host
    proposal = plan.proposal
    assert proposal.fits and list(proposal.changes) == ["grads.batch_size"], proposal.changes
    assert not any("projection" in reason for reason in proposal.reasons)
    again = make_plan(shape, adapter, data, _applied(settings, proposal), budgets, propose=False)
    assert again.priced.curvature.factor_bytes == plan.priced.curvature.factor_bytes == _factor_bytes(lora_linears(shape, adapter))


def test_a_model_too_narrow_to_project_still_cuts_layers():
    """Every side no wider than the floor: no width would change anything, so the layers are cut."""
    shape, adapter = read_model_shape({**SMALL, "num_hidden_layers": 6}), AdapterShape(4, "all-linear")
    assert kronecker_widths(lora_linears(shape, adapter)) == []  # sides of 32 to 128
    data = DatasetShape.uniform(10, 4096)
    settings = PlanSettings(batch_size=1, max_seq_length=4096, device="cpu")
    budget = parse_size("2000MiB")
    proposal = make_plan(shape, adapter, data, settings, Budgets(memory=budget)).proposal
    # the most layers that fit: 3..5 (one more, from layer 2, would not)
    assert proposal.fits and proposal.changes == {"grads.module_filter": r"\.layers\.(3|4|5)\."}, proposal.changes
    more = settings.with_changes(module_filter=r"\.layers\.(2|3|4|5)\.")
    assert make_plan(shape, adapter, data, more, propose=False).priced.device_peak > HEADROOM * budget


def test_a_projected_index_that_fits_is_written_again_instead_of_streamed_or_halved():
    """The disk step chose the stream (or float16) for the full-width index; under the kronecker
    projection the index fits the disk and grads.max_index_gb, so engine.store: auto writes it, as
    the run's own choice would, in float32 when that fits."""
    shape, adapter = read_model_shape("llama-3.2-1b"), AdapterShape(16, "all-linear")
    settings = PlanSettings(device="cuda", capture=CaptureSettings(dtype="bfloat16", attn_implementation="sdpa"))
    budgets = Budgets(memory=parse_size("24GiB"), disk=parse_size("100GB"))
    for rows, dtype in ((3000, "float32"), (5000, "float16")):
        data = DatasetShape.uniform(rows, 1024)
        plan = make_plan(shape, adapter, data, settings, budgets)
        assert plan.priced.index.disk_bytes + plan.priced.curvature.state_bytes > budgets.disk  # the full-width index does not fit
        proposal = plan.proposal
        assert proposal.fits and proposal.changes["grads.projection_kind"] == "kronecker", proposal.changes
        assert "engine.store" not in proposal.changes and proposal.store == "index", proposal.changes
        assert proposal.changes.get("grads.storage_dtype", "float32") == dtype
        assert not any(reason.startswith(("the index (", "float16 storage")) for reason in proposal.reasons)
        assert any(reason.startswith("projected, the index (") for reason in proposal.reasons), proposal.reasons
        again = make_plan(shape, adapter, data, _applied(settings, proposal), budgets, propose=False)
        assert again.priced.store == again.priced.auto_store == "index" and again.fits
        assert again.priced.index.data_bytes <= 100 * GIB and again.priced.disk_bytes == proposal.disk_bytes <= budgets.disk
        width = proposal.changes["grads.projection_dim"]
        assert again.priced.index.data_bytes == rows * _stored_values(lora_linears(shape, adapter), width) * (
            2 if dtype == "float16" else 4)


def test_kronecker_factors_are_priced_on_the_device_and_the_host():
    shape, adapter, data = _plan_inputs()
    settings = PlanSettings(device="cuda", capture=CaptureSettings(dtype="bfloat16", attn_implementation="sdpa"))
    ekfac = make_plan(shape, adapter, data, settings, propose=False)
    datainf = make_plan(shape, adapter, data, settings.with_changes(engine="datainf"), propose=False)
    f = ekfac.priced.curvature.factor_bytes
    assert f == curvature_cost("ekfac", lora_linears(shape, adapter)).factor_bytes > 0
    assert ekfac.priced.device_peak == ekfac.priced.memory.peak + f and datainf.priced.device_peak == datainf.priced.memory.peak
    assert ekfac.priced.host_peak == ekfac.priced.host_buffer + ekfac.priced.curvature.host >= ekfac.priced.host_buffer + 2 * f
    # on a CPU run everything is the one memory
    cpu = make_plan(shape, adapter, data, settings.with_changes(device="cpu"), propose=False)
    assert cpu.priced.device_peak == cpu.priced.memory.peak + f + cpu.priced.host_peak and cpu.fits_host


def test_proposal_for_a_memory_budget_lowers_the_batch_size_to_the_largest_that_fits():
    shape, adapter, data = _plan_inputs()
    settings = PlanSettings(batch_size=8, device="cuda", engine="datainf", capture=CaptureSettings(dtype="bfloat16"))
    budget = parse_size("24GiB")
    proposal = propose_settings(shape, adapter, data, settings, Budgets(memory=budget, host=parse_size("1TiB")))
    size = proposal.changes["grads.batch_size"]
    assert 1 <= size < 8 and proposal.fits
    assert make_plan(shape, adapter, data, settings.with_changes(batch_size=size), propose=False).priced.device_peak <= HEADROOM * budget
    assert make_plan(shape, adapter, data, settings.with_changes(batch_size=size + 1), propose=False).priced.device_peak > HEADROOM * budget


def test_proposal_restricts_layers_when_one_row_does_not_fit():
    shape, adapter, _ = _plan_inputs()
    data = DatasetShape.uniform(100, 8192)
    settings = PlanSettings(batch_size=1, max_seq_length=8192, device="cuda", engine="datainf",
                            capture=CaptureSettings(dtype="bfloat16", attn_implementation="sdpa"))
    budgets = Budgets(memory=parse_size("12GiB"), host=parse_size("1TiB"))
    plan = make_plan(shape, adapter, data, settings, budgets)
    assert not plan.fits
    assert plan.proposal.fits and list(plan.proposal.changes) == ["grads.module_filter"]
    kept = plan.proposal.changes["grads.module_filter"]
    first = int(kept.split("(")[1].split("|")[0])
    assert 0 < first < 15 and kept.endswith("|15)\\.")
    # one layer fewer would not fit
    earlier = settings.with_changes(module_filter=kept.replace(f"({first}|", f"({first - 1}|{first}|"))
    assert make_plan(shape, adapter, data, earlier, propose=False).priced.device_peak > HEADROOM * parse_size("12GiB")
    # EK-FAC: even the narrowest kronecker projection of every layer does not fit (the activations
    # are over), so it falls back to cutting layers; the factors of the layers the activations allow
    # do not fit at full width either, so those are projected rather than cut further
    ekfac_settings = settings.with_changes(engine="ekfac")
    narrowest = ekfac_settings.with_changes(projection_kind="kronecker", projection_dim=KRONECKER_FLOOR)
    assert make_plan(shape, adapter, data, narrowest, propose=False).priced.device_peak > HEADROOM * budgets.memory
    ekfac = make_plan(shape, adapter, data, ekfac_settings, budgets).proposal
    assert ekfac.fits and "engine.name" not in ekfac.changes
    assert ekfac.changes["grads.module_filter"] == kept, ekfac.changes
    assert ekfac.changes["grads.projection_kind"] == "kronecker"
    cut = ekfac_settings.with_changes(module_filter=kept)
    assert make_plan(shape, adapter, data, cut, propose=False).priced.device_peak > HEADROOM * budgets.memory
    assert any("the layers kept stay attributed" in reason for reason in ekfac.reasons), ekfac.reasons


def test_weights_alone_over_budget_is_reported_not_fitted():
    shape, adapter, data = _plan_inputs()
    settings = PlanSettings(device="cuda", capture=CaptureSettings(dtype="float32"))
    proposal = propose_settings(shape, adapter, data, settings, Budgets(memory=parse_size("2GiB")))
    assert not proposal.fits and any("bfloat16" in reason for reason in proposal.reasons)


def test_pass_counts_are_what_the_engines_make_on_a_real_run(tmp_path, tiny_lora_dirs, chat_tokenizer, monkeypatch):
    """Every row differentiated is counted where it is computed (the capture of a chunk, and the
    fit's own passes over the model), and every read of an index: one fit and one scoring of each
    engine make the passes ``engine_passes`` says, under both stores. The Kronecker factors the
    collector holds and the stored state are the bytes ``curvature_cost`` says, and the index
    the plan compares with ``grads.max_index_gb`` is the one ``choose_store`` compares."""
    pytest.importorskip("torch")
    import gradian.grads
    import gradian.grads.collectors as collectors
    from gradian.attribution.checkpoints import fit_context
    from gradian.config import load_config
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.engines import get_engine
    from gradian.engines.registry import needs_whole_gradients
    from gradian.engines.state import fit_engine
    from gradian.grads import load_model_for_gradients
    from gradian.index.sizing import index_bytes as run_index_bytes
    from gradian.index.store import GradientIndex
    from gradian.index.stream import StoreChoice, capture_training_gradients, choose_store
    from tests.plugins.tiny_lora import hello_query_for

    rows = {"captured": 0, "model": 0, "read": 0}
    capture, model_pass, read = gradian.grads.iter_example_gradients, collectors.linear_inputs_and_output_grads, \
        GradientIndex.iter_chunks

    def counted_capture(*args, **kwargs):
        for offset, batch in capture(*args, **kwargs):
            rows["captured"] += len(next(iter(batch.values())))
            yield offset, batch

    def counted_model_pass(gm, batch, *args, **kwargs):
        rows["model"] += len(batch)
        return model_pass(gm, batch, *args, **kwargs)

    def counted_read(self):
        for start, chunk in read(self):
            rows["read"] += len(next(iter(chunk.values())))
            yield start, chunk

    monkeypatch.setattr(gradian.grads, "iter_example_gradients", counted_capture)
    monkeypatch.setattr(collectors, "linear_inputs_and_output_grads", counted_model_pass)
    monkeypatch.setattr(GradientIndex, "iter_chunks", counted_read)

    base, final = tiny_lora_dirs
    dataset = dataset_from_rows([{"prompt": f"q{i}", "completion": "answer " * (i % 3 + 1)} for i in range(6)])
    n = len(dataset)
    query_for = hello_query_for(chat_tokenizer)
    shape, lora = read_model_shape(base), adapter_shape(final)
    # engine.factor_rows 3 of 6 rows: the passes that only sum the Kronecker factors read the chosen rows
    factor_chosen = collectors.factor_rows_of(tokenize_examples(dataset.examples, chat_tokenizer, None), 0.5)
    assert 0 < len(factor_chosen) < n
    cases = [("ekfac", {}), ("kfac", {}), ("datainf", {}), ("graddot", {}),
             ("ekfac", {"engine.fisher": "sampled", "engine.fisher_samples": 2}), ("ekfac", {"grads.normalization": "l2"}),
             ("ekfac", {"engine.factor_rows": 3}), ("kfac", {"engine.factor_rows": 3}),
             ("ekfac", {"engine.factor_rows": 3, "engine.fisher": "sampled", "engine.fisher_samples": 2}),
             ("ekfac", {"engine.factor_rows": 3, "grads.normalization": "l2"})]
    for k, (engine, extra) in enumerate(cases):
        for store in ("stream", "index") if set(extra) <= {"engine.factor_rows"} else ("stream",):
            rows.update(captured=0, model=0, read=0)
            cfg_overrides = {"dtype": "float64", "device": "cpu", "attn_implementation": "sdpa",
                             "cache_dir": str(tmp_path / f"{k}-{store}"), "base_model": str(base),
                             "engine.name": engine, "engine.store": store, "grads.batch_size": 2,
                             "grads.chunk_size": 4, **extra}
            cfg = load_config(overrides=cfg_overrides)
            gm = load_model_for_gradients(str(base), str(final), cfg)
            tokenized = tokenize_examples(dataset.examples, chat_tokenizer, cfg.grads.max_seq_length)
            want = engine_passes(engine, cfg.engine.fisher, cfg.engine.fisher_samples, cfg.grads.normalization,
                                 factor_share=collectors.factor_share(n, cfg.engine.factor_rows))
            # as gradian attribute runs it alone: no engine reads the squared norms, so the first pass
            # gathers the factors without per-example gradients when it is the plan's "Kronecker factors"
            factors_only = want.names[:1] == ("Kronecker factors",) and want.first == 1
            train, collector = capture_training_gradients(gm, chat_tokenizer, dataset, cfg, StoreChoice(store, "test"),
                                                          collect=needs_whole_gradients(engine),
                                                          norms=not (factors_only and "engine.factor_rows" in extra),
                                                          tokenized=tokenized if store == "stream" else None)
            context = fit_context(cfg, gm, chat_tokenizer, dataset, None, tokenized=tokenized, collected=collector,
                                  store=store)
            state = fit_engine(engine, train, cfg.engine, context, cache_dir=cfg.cache_dir)
            get_engine(engine).score(state, query_for(gm), cfg.engine)
            label = (engine, extra, store)
            share_rows = len(factor_chosen) if want.factor_share < 1 else n
            if store == "stream":
                # a factors-only first pass forms no per-example gradient: its rows are the collector's
                unseen = 1 if factors_only and want.share_passes else 0
                assert rows["captured"] + rows["model"] == ((want.stream - want.share_passes) * n
                                                            + (want.share_passes - unseen) * share_rows), (label, rows)
                assert rows["read"] == 0, (label, rows)
                if unseen:
                    assert collector is not None and collector.summed_examples == share_rows, label
                assert train.passes == want.first + want.gradients, label
                assert want.stream_floors == want.stream - want.share_passes * (1 - want.factor_share)
            else:
                assert rows["captured"] + rows["model"] == ((want.index_captures - want.share_passes) * n
                                                            + want.share_passes * share_rows), (label, rows)
                assert rows["read"] == want.index_reads * n, (label, rows)
            if "engine.factor_rows" in extra:
                assert want.factor_share == 0.5 and want.stream_floors < want.stream, label
            if engine == "ekfac" and not extra and store == "stream":
                # gradian attribute's default cross-check, over the same (primed) stream
                rows.update(captured=0, model=0, read=0)
                cross = fit_engine("datainf", train, cfg.engine, context, cache_dir=cfg.cache_dir)
                get_engine("datainf").score(cross, query_for(gm), cfg.engine)
                assert rows["captured"] == engine_passes("datainf", primed=True).stream * n, rows
                # the pair as gradian attribute runs it, on a fresh stream: a first pass for the factors
                # alone (no per-example gradient), the eigenvalue correction keeping the squared norms,
                # DataInf's preconditioner, one scoring pass for both engines (the plan's shared scoring)
                from dataclasses import replace

                from gradian.engines.base import score_jointly

                rows.update(captured=0, model=0, read=0)
                pair_cfg = load_config(overrides={**cfg_overrides,
                                                  "cache_dir": str(tmp_path / "pair")})
                pair, pair_collector = capture_training_gradients(gm, chat_tokenizer, dataset, pair_cfg,
                                                                  StoreChoice("stream", "test"), collect=True,
                                                                  norms=False, tokenized=tokenized)
                pair_context = fit_context(pair_cfg, gm, chat_tokenizer, dataset, None, tokenized=tokenized,
                                           collected=pair_collector, store="stream")
                ekfac_state = fit_engine("ekfac", pair, pair_cfg.engine, pair_context, cache_dir=pair_cfg.cache_dir)
                datainf_cfg = replace(pair_cfg.engine, name="datainf")
                datainf_state = fit_engine("datainf", pair, datainf_cfg, pair_context, cache_dir=pair_cfg.cache_dir)
                score_jointly([(get_engine("ekfac"), ekfac_state, query_for(gm), pair_cfg.engine),
                               (get_engine("datainf"), datainf_state, query_for(gm), datainf_cfg)])
                shared = engine_passes("datainf", primed=True, shared_scoring=True)
                assert shared.stream == 1 and pair.passes == want.stream + shared.stream == 4, pair.passes
                assert rows["captured"] == 3 * n and rows["model"] == 0, rows  # the first pass formed none
                # the factors the collector holds, and the state stored, by the plan's formula
                cost = curvature_cost("ekfac", lora_linears(shape, lora))
                held = sum(t.numel() * t.element_size() for sums in collector._sums.values() for t in sums[:2])
                assert held == cost.factor_bytes and sum(a.nbytes for a in state.arrays.values()) == cost.state_bytes
                # the index auto compares: the plan's figure, and the same choice at limits around it
                full = run_index_bytes(gm, cfg.grads, n)
                plan = make_plan(shape, lora, DatasetShape.uniform(n, 8), PlanSettings(), propose=False)
                assert plan.priced.index.data_bytes == full
                for limit in (full / 2 / GIB, 2 * full / GIB):
                    auto = load_config(overrides={"base_model": str(base), "cache_dir": str(tmp_path / "auto"),
                                                  "grads.max_index_gb": limit})
                    _, chosen = choose_store(auto, gm, chat_tokenizer, dataset, ["ekfac"])
                    assert chosen.store == auto_store(full, limit, None)[0], limit


def test_plan_command_warns_in_one_line_and_fails_only_when_asked():
    runner = CliRunner()
    args = ["plan", "--model-config", "llama-3.1-8b", "--r", "16", "--target-modules", "all-linear",
            "--n-examples", "10000", "--tokens", "1024", "--device", "cuda", "--no-calibrate",
            "--memory", "80GiB", "--disk", "100GB"]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    warnings = [line for line in done.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "engine.store: stream" in warnings[0] and "engine.name" not in warnings[0]
    assert "grads.projection_kind: kronecker" in warnings[0] and "grads.module_filter" not in warnings[0]
    assert "  index: " in done.output and "  stream: nothing on disk; 3 forward+backward passes" in done.output
    assert "engine.store auto chooses the stream" in done.output
    # the cross-check's scores come from EK-FAC's scoring pass: its preconditioner is its one pass
    assert ("cross-check datainf adds 1 pass (preconditioner; its scores come from the engine's scoring pass)"
            in done.output), done.output
    assert runner.invoke(app, [*args, "--fail-if-over"]).exit_code == 1
    roomy = ["--memory", "300GiB", "--host-memory", "600GiB", "--disk", "10TB", "--fail-if-over"]
    fits = runner.invoke(app, [*args[:-4], *roomy])
    assert fits.exit_code == 0 and "warning:" not in fits.output, fits.output
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0 and "warning:" in as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["fits"] is False and data["proposal"]["fits"] is True
    assert data["time"] is None
    assert data["store"] == "stream" and data["stream"]["passes"] == data["passes"]["first"] + data["passes"]["gradients"]
    assert data["index"]["reads"] == 2 and data["cross_check"]["engine"] == "datainf"
    assert data["cross_check"]["gradients"] == 1 and data["cross_check"]["names"] == ["preconditioner"]
    # 8B is not timed from a random init (no GPU here, or too large on one): said so, not failed
    timed = json.loads(runner.invoke(app, [*[a for a in args if a != "--no-calibrate"], "--json"]).stdout)
    assert timed["time"]["seconds"] is None and timed["time"]["source"].startswith("not measured: ")


def test_plan_command_refuses_bad_flags_naming_them():
    runner = CliRunner()
    base = ["plan", "--model-config", "llama-3.2-1b", "--r", "16", "--target-modules", "all-linear",
            "--n-examples", "100", "--no-calibrate"]
    for flag, value in (("--store", "disk"), ("--engine", "magic"), ("--host-memory", "lots"),
                        ("--projection-kind", "flat")):
        done = runner.invoke(app, [*base, flag, value])
        # the entry point prints a ConfigError's message and exits with its code
        assert isinstance(done.exception, ConfigError) and done.exception.exit_code == 2, (flag, done.output)
        assert flag in str(done.exception)
    chosen = runner.invoke(app, [*base, "--store", "index", "--engine", "datainf", "--json"])
    data = json.loads(chosen.stdout)
    assert data["store"] == "index" and data["settings"]["engine"] == "datainf" and data["curvature"]["device"] == 0
    # a proposed kronecker projection is planned as given: ekfac accepts it, priced at its width
    projected = json.loads(runner.invoke(app, [*base, "--projection-kind", "kronecker", "--projection-dim", "256",
                                               "--json"]).stdout)
    linears = lora_linears(read_model_shape("llama-3.2-1b"), AdapterShape(16, "all-linear"))
    assert projected["settings"]["capture"]["projection_kind"] == "kronecker"
    assert not any("refuses" in note for note in projected["notes"])
    assert projected["stored_per_example"] == _stored_values(linears, 256)
    assert projected["curvature"]["factor_bytes"] == _factor_bytes(linears, 256)


def test_plan_prices_the_factor_share_of_engine_factor_rows():
    runner = CliRunner()
    base = ["plan", "--model-config", "qwen2.5-0.5b", "--r", "16", "--target-modules", "all-linear",
            "--n-examples", "10000", "--tokens", "512", "--no-calibrate"]
    every = json.loads(runner.invoke(app, [*base, "--json"]).stdout)
    quarter = runner.invoke(app, [*base, "--factor-rows", "2500", "--json"])
    data = json.loads(quarter.stdout)
    assert data["settings"]["factor_rows"] == 2500
    # the stream's first pass reads a quarter of the rows; the index adds a pass of the fit's own over them
    assert (every["stream"]["passes"], every["stream"]["floors"]) == (3, 3.0)
    assert (data["stream"]["passes"], data["stream"]["floors"]) == (3, 2.25)
    assert (every["index"]["captures"], data["index"]["captures"], data["index"]["capture_floors"]) == (1, 2, 1.25)
    text = runner.invoke(app, [*base, "--factor-rows", "2500"]).output
    assert "stream: nothing on disk; 3 forward+backward passes (1 over about 25% of the rows: engine.factor_rows)" in text
    # at least the rows there are: every row, priced as such
    whole = json.loads(runner.invoke(app, [*base, "--factor-rows", "20000", "--json"]).stdout)
    assert whole["stream"]["floors"] == 3.0 and whole["index"]["captures"] == 1
    refused = runner.invoke(app, [*base, "--factor-rows", "0"])
    assert isinstance(refused.exception, ConfigError) and "engine.factor_rows" in str(refused.exception)


def test_plan_prices_the_correction_share_of_engine_correction_rows():
    """A stream's eigenvalue correction runs over the share, unless it keeps every row's squared
    norm for a DataInf cross-check; the index reads it whole either way, and a correction
    recomputed from the model (sampled Fisher) runs over the share under both stores."""
    runner = CliRunner()
    base = ["plan", "--model-config", "qwen2.5-0.5b", "--r", "16", "--target-modules", "all-linear",
            "--n-examples", "10000", "--tokens", "512", "--no-calibrate", "--correction-rows", "2500"]
    alone = json.loads(runner.invoke(app, [*base, "--cross-check", "none", "--json"]).stdout)
    assert alone["settings"]["correction_rows"] == 2500 and alone["passes"]["correction_share"] == 0.25
    assert (alone["stream"]["passes"], alone["stream"]["floors"]) == (3, 2.25)
    assert (alone["index"]["captures"], alone["index"]["capture_floors"]) == (1, 1.0)
    paired = json.loads(runner.invoke(app, [*base, "--json"]).stdout)
    assert paired["cross_check"]["engine"] == "datainf" and paired["stream"]["floors"] == 3.0
    text = runner.invoke(app, [*base, "--cross-check", "none"]).output
    assert "stream: nothing on disk; 3 forward+backward passes (1 over about 25% of the rows: engine.correction_rows)" in text
    sampled = engine_passes("ekfac", fisher="sampled", fisher_samples=2, correction_share=0.25)
    assert (sampled.correction_passes, sampled.correction_index_passes) == (2, 2)
    assert sampled.stream_floors == sampled.stream - 1.5 and sampled.index_floors == sampled.index_captures - 1.5
    assert engine_passes("kfac", correction_share=0.25).correction_passes == 0
    for flags, key in ((["--correction-rows", "0"], "engine.correction_rows"), (["--cross-check", "bogus"], "--cross-check")):
        refused = runner.invoke(app, [*base[:-2], *flags])
        assert isinstance(refused.exception, ConfigError) and key in str(refused.exception), refused.output


def test_the_eigendecompositions_are_counted_from_the_lora_shapes_and_timed_on_the_cpu():
    linears = lora_linears(read_model_shape("qwen2.5-0.5b"), AdapterShape(16, "all-linear"))
    sides = _lora_sides(linears)
    cost = curvature_cost("ekfac", linears)
    assert cost.eigh_count == 2 * len(sides) and cost.eigh_widest == max(max(o, i) for o, i in sides)
    assert cost.eigh_cubes == sum(o**3 + i**3 for o, i in sides)
    assert curvature_cost("ekfac", linears, 64, "kronecker").eigh_cubes == sum(min(o, 64) ** 3 + min(i, 64) ** 3
                                                                               for o, i in sides)
    assert curvature_cost("datainf", linears).eigh_cubes == 0
    from gradian.plan.timing import calibrate_eigh

    assert calibrate_eigh(64, repeats=1) > 0
    runner = CliRunner()
    base = ["plan", "--model-config", "qwen2.5-0.5b", "--r", "16", "--target-modules", "all-linear",
            "--n-examples", "100", "--tokens", "64"]
    timed = json.loads(runner.invoke(app, [*base, "--json"]).stdout)
    # the capture is not timed for a model this size on a CPU; the eigendecompositions still are
    assert timed["time"]["seconds"] is None and timed["time"]["eigendecompositions"] > 0
    assert timed["time"]["eigh_timed_side"] == 1024 and timed["curvature"]["eigh_cubes"] == cost.eigh_cubes
    text = runner.invoke(app, base).output
    assert "ekfac's 672 eigendecompositions of its factors (widest 4,864)" in text, text
    datainf = json.loads(runner.invoke(app, [*base, "--engine", "datainf", "--json"]).stdout)
    assert datainf["time"]["eigendecompositions"] is None
    assert json.loads(runner.invoke(app, [*base, "--no-calibrate", "--json"]).stdout)["time"] is None


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
