"""The gradient index: exact round trip, cache hits, resume, refusal of mismatches, sizes."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradian.config import load_config  # noqa: E402
from gradian.data import dataset_from_rows, tokenize_examples  # noqa: E402
from gradian.engines import InMemoryGradients, score  # noqa: E402
from gradian.errors import IndexMismatchError  # noqa: E402
from gradian.grads import capture_per_example_grads, collate, wrap_peft_model  # noqa: E402
from gradian.index import GradientIndex  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

WORDS = "what is the capital of france paris japan tokyo hello world one two three four five".split()


def _rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": " ".join(rng.choice(WORDS, 4)), "completion": " ".join(rng.choice(WORDS, 1 + i % 3))}
            for i in range(n)]


@pytest.fixture(scope="module")
def gm64():
    return wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64))


def _config(tmp_path, **grads):
    overrides = {"cache_dir": str(tmp_path), "grads.chunk_size": 4, "grads.batch_size": 3, "grads.max_seq_length": 64}
    overrides.update({f"grads.{k}": v for k, v in grads.items()})
    return load_config(overrides=overrides)


def test_build_round_trips_the_captured_gradients(tmp_path, gm64, chat_tokenizer):
    dataset = dataset_from_rows(_rows(10))
    index = GradientIndex.build(gm64, chat_tokenizer, dataset, _config(tmp_path))
    assert index.n == 10 and index.manifest["n_chunks"] == 3 and index.example_ids == dataset.ids
    tokenized = tokenize_examples(dataset.examples, chat_tokenizer, 64)
    direct = capture_per_example_grads(gm64, collate(tokenized, chat_tokenizer.pad_token_id))
    for name in index.block_names:
        np.testing.assert_allclose(index.block(name), direct[name].numpy(), rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(index.sq_norms()[name], (index.block(name).astype(np.float64) ** 2).sum(1), rtol=1e-6)
    # engines read the store exactly like arrays in memory
    query = {name: direct[name][0].numpy() for name in index.block_names}
    from gradian.config import EngineConfig

    datainf = EngineConfig(name="datainf")  # an engine that reads nothing but the stored gradients
    from_disk = score(index, query, datainf).scores
    in_memory = score(InMemoryGradients({k: index.block(k) for k in index.block_names}), query, datainf).scores
    np.testing.assert_allclose(from_disk, in_memory, rtol=1e-6)


def test_same_inputs_are_a_cache_hit_and_force_rebuilds(tmp_path, gm64, chat_tokenizer, monkeypatch):
    dataset = dataset_from_rows(_rows(6))
    config = _config(tmp_path)
    first = GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    import gradian.index.build as store

    calls = []
    original = store._write_chunk
    monkeypatch.setattr(store, "_write_chunk", lambda *a: (calls.append(1), original(*a))[1])
    again = GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    assert again.root == first.root and calls == []
    assert again.cache_hit and not first.cache_hit
    rebuilt = GradientIndex.build(gm64, chat_tokenizer, dataset, config, force=True)
    assert len(calls) == 2 and not rebuilt.cache_hit


def test_changed_inputs_get_a_new_index(tmp_path, gm64, chat_tokenizer, plain_tokenizer):
    config = _config(tmp_path)
    a = GradientIndex.build(gm64, chat_tokenizer, dataset_from_rows(_rows(6)), config)
    b = GradientIndex.build(gm64, chat_tokenizer, dataset_from_rows(_rows(6, seed=1)), config)
    c = GradientIndex.build(gm64, chat_tokenizer, dataset_from_rows(_rows(6)), _config(tmp_path, projection_dim=8))
    # same vocabulary, no chat template: rows render differently, so the stored numbers differ
    d = GradientIndex.build(gm64, plain_tokenizer, dataset_from_rows(_rows(6)), config)
    assert len({a.index_id, b.index_id, c.index_id, d.index_id}) == 4
    assert d.identity["tokenizer"] != a.identity["tokenizer"]


def test_engine_damping_is_not_part_of_the_index(tmp_path, gm64, chat_tokenizer):
    """Damping changes no stored number: another lambda reuses the same index as a cache hit."""
    config = _config(tmp_path)
    a = GradientIndex.build(gm64, chat_tokenizer, dataset_from_rows(_rows(6)), config)
    damped = load_config(overrides={**_flat(config), "engine.lambda_scale": 0.5, "engine.lambda_override": 0.01})
    b = GradientIndex.build(gm64, chat_tokenizer, dataset_from_rows(_rows(6)), damped)
    assert b.index_id == a.index_id and b.cache_hit


def test_library_versions_name_the_installed_distribution():
    from importlib.metadata import version

    from gradian.index import library_versions

    assert library_versions()["gradian"] == version("gradian-mlflow")


def _flat(config):
    return {"cache_dir": config.cache_dir, "grads.chunk_size": config.grads.chunk_size,
            "grads.batch_size": config.grads.batch_size, "grads.max_seq_length": config.grads.max_seq_length}


def test_interrupted_build_resumes_from_its_last_complete_chunk(tmp_path, gm64, chat_tokenizer, monkeypatch):
    import gradian.index.build as store

    dataset = dataset_from_rows(_rows(11))
    config = _config(tmp_path)
    reference = GradientIndex.build(gm64, chat_tokenizer, dataset, _config(tmp_path / "ref"))
    original = store._write_chunk
    written = []

    def crash_on_third(root, k, rows, storage):
        if len(written) == 2:
            raise KeyboardInterrupt("simulated interruption")
        written.append(k)
        return original(root, k, rows, storage)

    monkeypatch.setattr(store, "_write_chunk", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    root = next(p for p in (tmp_path / "index").iterdir() if p.is_dir())
    assert json.loads((root / "manifest.json").read_text())["status"] == "building"
    with pytest.raises(IndexMismatchError, match="did not finish.*resume"):
        GradientIndex.open(root)

    resumed = []
    monkeypatch.setattr(store, "_write_chunk", lambda root, k, rows, storage: (resumed.append(k), original(root, k, rows, storage))[1])
    index = GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    assert resumed == [2]  # chunks 0 and 1 were kept
    for name in index.block_names:
        np.testing.assert_array_equal(index.block(name), reference.block(name))


def test_mismatched_manifest_is_refused_naming_the_field(tmp_path, gm64, chat_tokenizer):
    config = _config(tmp_path)
    index = GradientIndex.build(gm64, chat_tokenizer, dataset_from_rows(_rows(6)), config)
    expected = json.loads(json.dumps(index.identity))
    expected["dataset"]["sha256"] = "0" * 64
    with pytest.raises(IndexMismatchError, match=r"dataset changed.*dataset\.sha256"):
        GradientIndex.open(index.root, expect=expected)
    expected = json.loads(json.dumps(index.identity))
    expected["grads"]["storage_dtype"] = "float16"
    with pytest.raises(IndexMismatchError, match=r"grads\.storage_dtype"):
        GradientIndex.open(index.root, expect=expected)
    assert GradientIndex.open(index.root, expect=index.identity).n == 6
    with pytest.raises(IndexMismatchError, match="not a gradient index"):
        GradientIndex.open(tmp_path)


@pytest.mark.parametrize("kind", ["countsketch", "rademacher"])
def test_float16_and_projection_shrink_the_store(tmp_path, chat_tokenizer, kind):
    gm = wrap_peft_model(build_tiny_lora("llama"))
    dataset = dataset_from_rows(_rows(8))
    full = GradientIndex.build(gm, chat_tokenizer, dataset, _config(tmp_path / "a"))
    half = GradientIndex.build(gm, chat_tokenizer, dataset, _config(tmp_path / "b", storage_dtype="float16"))
    small = GradientIndex.build(gm, chat_tokenizer, dataset,
                                _config(tmp_path / "c", projection_dim=64, projection_kind=kind))
    assert full.manifest["total_width"] == gm.dim == 2 * half.manifest["total_width"] // 2
    assert small.manifest["total_width"] == 14 * 64
    data_bytes = lambda ix: sum(p.stat().st_size for p in (ix.root / "chunks").glob("?????.npy"))  # noqa: E731
    assert data_bytes(half) < 0.55 * data_bytes(full)
    assert data_bytes(small) < 0.3 * data_bytes(full)
    for name in full.block_names:
        np.testing.assert_allclose(half.block(name), full.block(name), rtol=2e-3, atol=1e-5)


def test_lora_modules_the_capture_cannot_hook_are_listed_and_raised(tmp_path, chat_tokenizer):
    """LoRA on the embedding gets no block: the index manifest lists it and the attribution raises
    a finding that names it; an adapter on Linear layers alone raises none."""
    from peft import LoraConfig, get_peft_model

    from gradian.grads import skipped_modules_finding
    from tests.plugins.tiny_lora import build_tiny_base

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "embed_tokens"],
                        init_lora_weights=False, task_type="CAUSAL_LM")
    gm = wrap_peft_model(get_peft_model(build_tiny_base("llama"), config).eval())
    assert gm.skipped == ["model.embed_tokens"]
    assert gm.block_names == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    index = GradientIndex.build(gm, chat_tokenizer, dataset_from_rows(_rows(4)), _config(tmp_path))
    assert index.manifest["skipped_modules"] == ["model.embed_tokens"]
    finding = skipped_modules_finding(gm.skipped, len(gm.blocks))
    assert finding is not None and finding.id == "attribution.lora_modules_skipped"
    assert finding.severity == "medium" and finding.evidence == {"skipped_modules": ["model.embed_tokens"],
                                                                 "n_blocks": 2}
    assert "model.embed_tokens" in finding.message
    assert skipped_modules_finding([], len(gm.blocks)) is None


def test_an_adapter_of_dora_modules_only_is_refused_naming_them():
    from peft import LoraConfig, get_peft_model

    from gradian.errors import ModelLoadError
    from tests.plugins.tiny_lora import build_tiny_base

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True, task_type="CAUSAL_LM")
    with pytest.raises(ModelLoadError, match=r"no LoRA blocks found.*model\.layers\.0\.self_attn\.q_proj"):
        wrap_peft_model(get_peft_model(build_tiny_base("llama"), config).eval())


# -- repairs: said, kept on the index, recorded in the manifest ------------------------------------


def _flip(path, at=-3):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_repaired_chunk_is_said_and_recorded_in_the_manifest(tmp_path, gm64, chat_tokenizer):
    dataset = dataset_from_rows(_rows(10))
    config = _config(tmp_path)
    clean = GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    assert clean.repairs == [] and clean.manifest["repairs"] == []
    norms = clean.root / "chunks" / "00001.norms.npy"
    original = norms.read_bytes()
    _flip(norms)
    lines: list[str] = []
    repaired = GradientIndex.build(gm64, chat_tokenizer, dataset, config, log=lines.append)
    assert not repaired.cache_hit and norms.read_bytes() == original
    (record,) = repaired.repairs
    assert record["file"] == str(norms) and record["chunk"] == 1
    assert record["problem"] == "damaged (its bytes do not match the sha256 recorded when it was written)"
    assert record["action"].startswith("recomputed")
    assert repaired.repaired == [f"{norms} was {record['problem']}: {record['action']}"]
    assert lines == [f"repaired index {repaired.index_id}: chunks/00001.norms.npy was {record['problem']}: "
                     f"{record['action']}"]
    stored = json.loads((repaired.root / "manifest.json").read_text())
    assert stored["repairs"] == [record]
    GradientIndex.open(repaired.root).verify()  # the manifest that records it still checks out
    # a later build with nothing to repair says nothing; the record stays in the store's history
    again = GradientIndex.build(gm64, chat_tokenizer, dataset, config, log=lines.append)
    assert again.cache_hit and again.repairs == [] and len(lines) == 1
    assert again.manifest["repairs"] == [record]


def test_a_repair_on_a_cache_hit_rewrites_the_manifest_and_without_log_warns(tmp_path, gm64, chat_tokenizer, caplog):
    dataset = dataset_from_rows(_rows(6))
    config = _config(tmp_path)
    clean = GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    ids = clean.root / "example_ids.json"
    _flip(ids, at=5)
    with caplog.at_level("WARNING", logger="gradian.index"):
        fixed = GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    assert fixed.cache_hit and fixed.example_ids == dataset.ids
    assert [r["file"] for r in fixed.repairs] == [str(ids)]
    assert fixed.repairs[0]["action"] == "written again from the dataset"
    assert [r.getMessage() for r in caplog.records] == [
        f"repaired index {fixed.index_id}: example_ids.json was damaged (its bytes do not match the sha256 "
        "recorded when it was written): written again from the dataset"]
    assert GradientIndex.open(fixed.root).manifest["repairs"] == fixed.repairs


def test_a_damaged_manifest_is_recorded_in_the_rebuilt_one(tmp_path, gm64, chat_tokenizer):
    dataset = dataset_from_rows(_rows(6))
    config = _config(tmp_path)
    clean = GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    path = clean.root / "manifest.json"
    path.write_text(path.read_text().replace('"n_examples": 6', '"n_examples": 7'))
    rebuilt = GradientIndex.build(gm64, chat_tokenizer, dataset, config)
    (record,) = rebuilt.repairs
    assert record["file"] == str(path) and record["problem"] == "damaged (its content does not match its checksum)"
    assert "whole index was rebuilt" in record["action"]
    assert GradientIndex.open(rebuilt.root).manifest["repairs"] == [record]


def test_the_repair_summary_shows_a_few_and_points_at_the_manifest(tmp_path):
    from gradian.index.build import MAX_REPAIRS, repair_summary

    root = tmp_path / "index" / "abc"
    repairs = [{"file": str(root / "chunks" / f"{k:05d}.npy"), "problem": "missing", "action": "recomputed"}
               for k in range(5)]
    line = repair_summary("abc", root, repairs)
    assert line == ("repaired index abc: chunks/00000.npy was missing: recomputed; chunks/00001.npy was missing: "
                    "recomputed; chunks/00002.npy was missing: recomputed; and 2 more (listed under 'repairs' in "
                    f"{root / 'manifest.json'})")
    assert "\n" not in line and MAX_REPAIRS >= 100
