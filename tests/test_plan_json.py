"""`gradian plan --json`: the document's keys, pinned, and its derived figures equal to the formulas.

The keys are what a script reading the plan relies on; any change to them is a change of this
list (``replay`` holds the replay's block under ``engine.name: replay``, its keys pinned in
tests/test_plan_replay.py). The figures are checked against the formulas of ``gradian.plan`` computed here from the
same shapes, so a refactor that moves where a figure is computed cannot change it unnoticed.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gradian.cli import app
from gradian.plan import AdapterShape, block_widths, index_bytes, lora_linears, read_model_shape

#: every leaf of the document, as dotted paths, in the order they are printed
KEYS = [
    "model.model_type", "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads",
    "model.head_dim", "model.intermediate_size", "model.vocab_size", "model.tie_word_embeddings", "model.saved_dtype",
    "model.name",
    "adapter.r", "adapter.target_modules", "adapter.layers_to_transform", "adapter.dtype",
    "settings.batch_size", "settings.max_seq_length", "settings.module_filter", "settings.projection_dim",
    "settings.storage_dtype", "settings.chunk_size", "settings.capture.dtype", "settings.capture.attn_implementation",
    "settings.capture.projection_dim", "settings.capture.projection_kind", "settings.capture.normalization",
    "settings.capture.storage_dtype", "settings.capture.chunk_size", "settings.capture.block_granularity",
    "settings.capture.quantization",
    "settings.device", "settings.engine", "settings.store", "settings.max_index_gb", "settings.fisher",
    "settings.fisher_samples", "settings.factor_rows", "settings.correction_rows", "settings.cross_check",
    "n_examples", "max_tokens", "total_tokens", "n_blocks", "values_per_example", "stored_per_example",
    "worst_batch.rows", "worst_batch.width", "worst_batch.supervised",
    "memory.weights", "memory.adapter_weights", "memory.activations", "memory.hook_inputs", "memory.logits",
    "memory.loss_backward", "memory.layer_backward", "memory.per_example_grads", "memory.after_pass",
    "memory.projection_cache", "memory.peak", "memory.writer_buffer", "memory.stream_chunk",
    "index_bytes",
    "budgets.memory", "budgets.disk", "budgets.host",
    "passes.engine", "passes.first", "passes.model", "passes.gradients", "passes.names", "passes.primed",
    "passes.factor_share", "passes.share_passes", "passes.index_own", "passes.correction_share",
    "passes.correction_passes", "passes.correction_index_passes",
    "cross_check.engine", "cross_check.first", "cross_check.model", "cross_check.gradients", "cross_check.names",
    "cross_check.primed", "cross_check.factor_share", "cross_check.share_passes", "cross_check.index_own",
    "cross_check.correction_share", "cross_check.correction_passes", "cross_check.correction_index_passes",
    "index.disk_bytes", "index.data_bytes", "index.host_buffer", "index.captures", "index.reads",
    "index.capture_floors",
    "stream.passes", "stream.host_buffer", "stream.floors",
    "curvature.factor_bytes", "curvature.device", "curvature.host", "curvature.state_bytes",
    "curvature.eigh_count", "curvature.eigh_widest", "curvature.eigh_cubes",
    "store", "store_reason", "auto_store", "auto_reason",
    "proposal.changes", "proposal.peak_memory", "proposal.index_bytes", "proposal.fits", "proposal.reasons",
    "proposal.store", "proposal.disk_bytes", "proposal.host_peak",
    "notes", "device_peak", "host_peak", "host_buffer", "disk_bytes", "fits", "fits_memory", "fits_host", "fits_disk",
    "replay", "time",
]

ARGS = ["plan", "--model-config", "llama-3.1-8b", "--r", "16", "--target-modules", "all-linear", "--n-examples",
        "1000", "--tokens", "512", "--device", "cuda", "--no-calibrate", "--memory", "80GiB", "--disk", "100GB",
        "--json"]


def _paths(value, prefix=""):
    # a proposal's changes are keyed by config keys (with dots): one leaf
    if isinstance(value, dict) and prefix != "proposal.changes":
        for key, inner in value.items():
            yield from _paths(inner, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix


def _plan(args):
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


def test_the_json_keys_are_pinned():
    data = _plan(ARGS)
    assert list(_paths(data)) == KEYS
    assert data["replay"] is None  # priced under engine.name: replay only (tests/test_plan_replay.py)
    # no proposal without budgets: null, in the same place
    bare = _plan([*ARGS[:-5], "--json"])
    assert bare["proposal"] is None
    folded = [k.split(".")[0] if k.startswith("proposal.") else k for k in KEYS]
    assert list(_paths(bare)) == list(dict.fromkeys(folded))


def test_the_derived_figures_are_the_formulas():
    data = _plan(ARGS)
    shape = read_model_shape("llama-3.1-8b")
    linears = lora_linears(shape, AdapterShape(16, "all-linear"))
    blocks = block_widths(linears, "module")
    assert data["n_blocks"] == len(blocks)
    assert data["values_per_example"] == data["stored_per_example"] == sum(d for d, _ in blocks)
    assert data["index_bytes"] == data["index"]["disk_bytes"] == index_bytes(1000, [w for _, w in blocks], "float32",
                                                                             256)
    host_buffer = data["stream"]["host_buffer"] if data["store"] == "stream" else data["index"]["host_buffer"]
    assert data["host_buffer"] == host_buffer
    assert data["host_peak"] == host_buffer + data["curvature"]["host"]
    # a GPU run: the host's share is not on the device
    assert data["device_peak"] == data["memory"]["peak"] + data["curvature"]["device"]
    disk = (0 if data["store"] == "stream" else data["index_bytes"]) + data["curvature"]["state_bytes"]
    assert data["disk_bytes"] == disk
    assert data["fits_memory"] is (data["device_peak"] <= 80 * 2**30)
    assert data["fits_disk"] is (disk <= 100 * 10**9)
    assert data["fits"] is (data["fits_memory"] and data["fits_host"] and data["fits_disk"])
    cpu = _plan([*ARGS[:ARGS.index("--device") + 1], "cpu", *ARGS[ARGS.index("--device") + 2:]])
    assert cpu["device_peak"] == cpu["memory"]["peak"] + cpu["curvature"]["device"] + cpu["host_peak"]
    assert cpu["fits_host"] is True
