"""Faults and bad input: each scenario is built to produce one outcome, and the test asserts it.

- the duplicate checks stay near-linear on data that is mostly copies (same findings as the
  pairwise versions they replace);
- the gradient index detects a flipped byte, a truncated or missing file, a damaged
  example_ids.json or manifest before any score, repairs them on build, and builds once under
  concurrency;
- a damaged or half-saved adapter (or base model) is refused with one line naming the file and
  the fix, never blamed on "another base".
"""

from __future__ import annotations

import itertools
import random

import pytest

from gradian.audit import run_audit
from gradian.data import dataset_from_rows

# -- duplicate checks on mostly-duplicated data ----------------------------------------------

_WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta") for b in ("ran", "tel", "mos", "dil", "vek")]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


class _CountingDataset:
    """A dataset whose ``examples`` list counts how often it is read."""

    def __init__(self, dataset):
        self._dataset = dataset
        self.reads = 0

    @property
    def examples(self):
        self.reads += 1
        return self._dataset.examples

    def __getattr__(self, name):
        return getattr(self._dataset, name)


def test_duplicate_checks_read_the_rows_a_fixed_number_of_times():
    """On 3,000 rows that are nearly all copies, no check walks the row list once per copy."""
    rng = random.Random(0)
    templates = [{"prompt": _sentence(rng, 12), "completion": _sentence(rng, 4)} for _ in range(5)]
    rows = [dict(rng.choice(templates)) for _ in range(3000)]
    dataset = _CountingDataset(dataset_from_rows(rows))
    result = run_audit(dataset=dataset, checks=["data.duplicates", "data.conflicting_answers",
                                                "data.near_duplicates", "data.length_outliers"])
    duplicates = next(f for f in result.findings if f.id == "data.duplicates")
    assert duplicates.evidence["n_duplicates"] == 2995 and duplicates.evidence["n_unique"] == 5
    assert dataset.reads <= 12


def test_near_duplicate_groups_are_the_planted_templates():
    """Three 120-word templates copied 40 times each with only the last word changed (word
    3-gram Jaccard about 0.98 between any two copies), among 200 distinct rows: three groups of 40."""
    from gradian.audit.data_checks import near_duplicate_groups

    rng = random.Random(1)
    texts = [_sentence(rng, 30) + f" row{i}" for i in range(200)]
    planted = []
    for t in range(3):
        stem = _sentence(rng, 120)
        planted.append(list(range(len(texts), len(texts) + 40)))
        texts += [f"{stem} copy{t}x{k}" for k in range(40)]
    assert near_duplicate_groups(texts, 0.9, 64) == planted


def _agree_pairwise(distinct):
    from gradian.audit.data_checks import _agree

    return all(_agree(a, b) for a, b in itertools.combinations(distinct, 2))


def test_one_pass_answer_agreement_equals_the_pairwise_test():
    from gradian.audit.data_checks import _all_agree

    rng = random.Random(2)
    pieces = ["paris", "the city of paris", "city of paris", "paris france", "lyon", "", "of", "the city"]
    for _ in range(2000):
        distinct = list(dict.fromkeys(rng.sample(pieces, rng.randint(2, 4))))
        assert _all_agree(distinct) == _agree_pairwise(distinct), distinct


# -- the verified gradient index ---------------------------------------------------------------

torch = pytest.importorskip("torch")

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from gradian.config import load_config  # noqa: E402
from gradian.config import EngineConfig  # noqa: E402
from gradian.engines import score  # noqa: E402
from gradian.errors import GradianError, IndexCorruptError, IndexMismatchError  # noqa: E402
from gradian.grads import wrap_peft_model  # noqa: E402
from gradian.index import GradientIndex  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

_INDEX_WORDS = "what is the capital of france paris japan tokyo hello world one two three four five".split()


def _index_rows(n):
    rng = np.random.default_rng(0)
    return [{"prompt": " ".join(rng.choice(_INDEX_WORDS, 4)), "completion": " ".join(rng.choice(_INDEX_WORDS, 1 + i % 3))}
            for i in range(n)]


@pytest.fixture(scope="module")
def gm():
    return wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64))


def _index_config(cache):
    return load_config(overrides={"cache_dir": str(cache), "grads.chunk_size": 4, "grads.batch_size": 3,
                                  "grads.max_seq_length": 64})


@pytest.fixture
def built(tmp_path, gm, chat_tokenizer):
    """A complete 10-row index in 3 chunks (4 + 4 + 2 rows) and what built it."""
    dataset = dataset_from_rows(_index_rows(10))
    config = _index_config(tmp_path / "cache")
    index = GradientIndex.build(gm, chat_tokenizer, dataset, config)
    reference = {name: index.block(name).copy() for name in index.block_names}
    return index, dataset, config, reference


def _flip_byte(path, at=-5):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _query(index):
    return {name: np.ones(index.manifest["blocks"][j]["width"]) for j, name in enumerate(index.block_names)}


def test_a_flipped_byte_in_a_chunk_stops_scoring_naming_the_file_and_the_rebuild(built):
    index, *_ = built
    chunk = index.root / "chunks" / "00001.npy"
    _flip_byte(chunk)
    opened = GradientIndex.open(index.root)  # same size: found when the chunk is first read
    with pytest.raises(IndexCorruptError, match=r"00001\.npy is damaged .*sha256.*gradian index .*--force"):
        score(opened, _query(opened), EngineConfig(name="datainf"))
    with pytest.raises(IndexCorruptError, match=r"00001\.npy"):
        GradientIndex.open(index.root).verify()


@pytest.mark.parametrize("damage, file", [
    ("truncate", "chunks/00002.npy"),
    ("delete", "chunks/00000.norms.npy"),
    ("flip", "chunks/00001.norms.npy"),
    ("flip", "example_ids.json"),
    ("delete", "chunks/00001.npy"),
])
def test_damaged_files_are_refused_on_open(built, damage, file):
    index, *_ = built
    path = index.root / file
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-17])
    elif damage == "delete":
        path.unlink()
    else:
        _flip_byte(path, at=len(path.read_bytes()) // 2)
    with pytest.raises(IndexCorruptError) as err:
        GradientIndex.open(index.root)
    message = str(err.value)
    assert str(path) in message and "--force" in message and "\n" not in message
    assert isinstance(err.value, GradianError) and err.value.exit_code == 2


def test_a_damaged_manifest_is_refused_on_open(built):
    index, *_ = built
    path = index.root / "manifest.json"
    text = path.read_text()
    path.write_text(text.replace('"n_examples": 10', '"n_examples": 11'))  # still valid JSON
    with pytest.raises(IndexCorruptError, match=r"manifest\.json is damaged \(its content does not match its checksum\)"):
        GradientIndex.open(index.root)
    path.write_text(text[: len(text) // 2])
    with pytest.raises(IndexCorruptError, match=r"manifest\.json is damaged \(not valid JSON"):
        GradientIndex.open(index.root)


def test_build_recomputes_only_the_damaged_chunk(built, gm, chat_tokenizer, monkeypatch):
    import gradian.index.build as store

    index, dataset, config, reference = built
    _flip_byte(index.root / "chunks" / "00001.npy")
    written = []
    original = store._write_chunk
    monkeypatch.setattr(store, "_write_chunk", lambda root, k, rows, s: (written.append(k), original(root, k, rows, s))[1])
    repaired = GradientIndex.build(gm, chat_tokenizer, dataset, config)
    assert written == [1] and not repaired.cache_hit
    assert [note.split(" ")[0] for note in repaired.repaired] == [str(index.root / "chunks" / "00001.npy")]
    for name in repaired.block_names:
        np.testing.assert_array_equal(repaired.block(name), reference[name])
    again = GradientIndex.build(gm, chat_tokenizer, dataset, config)
    assert again.cache_hit and written == [1]
    GradientIndex.open(index.root).verify()


def test_build_replaces_a_damaged_manifest_and_example_ids(built, gm, chat_tokenizer, monkeypatch):
    import gradian.index.build as store

    index, dataset, config, reference = built
    _flip_byte(index.root / "example_ids.json", at=10)
    written = []
    original = store._write_chunk
    monkeypatch.setattr(store, "_write_chunk", lambda root, k, rows, s: (written.append(k), original(root, k, rows, s))[1])
    fixed = GradientIndex.build(gm, chat_tokenizer, dataset, config)
    assert written == [] and fixed.cache_hit and fixed.example_ids == dataset.ids
    (index.root / "manifest.json").write_text("{\"index_id\": ")
    rebuilt = GradientIndex.build(gm, chat_tokenizer, dataset, config)
    assert written == [0, 1, 2] and not rebuilt.cache_hit
    for name in rebuilt.block_names:
        np.testing.assert_array_equal(rebuilt.block(name), reference[name])


def test_build_removes_leftovers_of_a_killed_write(built, gm, chat_tokenizer):
    index, dataset, config, _ = built
    leftovers = [index.root / ".manifest.json.k2j4.tmp", index.root / "chunks" / ".00001.npy.x8a1.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a write")
    again = GradientIndex.build(gm, chat_tokenizer, dataset, config)
    assert again.cache_hit and not any(p.exists() for p in leftovers)
    assert len(again.repaired) == 2


def test_two_concurrent_builds_of_one_index_do_the_work_once(tmp_path, gm, chat_tokenizer, monkeypatch):
    import gradian.index.build as store

    dataset = dataset_from_rows(_index_rows(10))
    config = _index_config(tmp_path / "cache")
    written = []
    first_chunk = threading.Event()
    original = store._write_chunk

    def slow_write(root, k, rows, s):
        written.append(k)
        first_chunk.set()
        time.sleep(0.3)  # the second build starts while this one holds the lock
        return original(root, k, rows, s)

    monkeypatch.setattr(store, "_write_chunk", slow_write)
    results = {}

    def build(name):
        results[name] = GradientIndex.build(gm, chat_tokenizer, dataset, config)

    one = threading.Thread(target=build, args=("one",))
    one.start()
    assert first_chunk.wait(60)
    two = threading.Thread(target=build, args=("two",))
    two.start()
    one.join(120)
    two.join(120)
    assert written == [0, 1, 2]
    assert not results["one"].cache_hit and results["two"].cache_hit
    assert results["two"].root == results["one"].root


def test_an_index_of_the_previous_format_is_refused_with_the_rebuild(built):
    index, *_ = built
    path = index.root / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["checksum"]
    manifest["identity"]["format_version"] = 1
    manifest["sources"] = {"dataset": "train.jsonl", "base_model": "models/base", "adapter_path": "out/adapter"}
    path.write_text(json.dumps(manifest))
    with pytest.raises(IndexMismatchError, match=r"index format 1, which records no checksums") as info:
        GradientIndex.open(index.root)
    assert ("run `gradian index -c <its config> -d train.jsonl -m models/base -a out/adapter` to recompute "
            "what is damaged, or the same with --force") in str(info.value)


# -- damaged adapters and base models ----------------------------------------------------------

import shutil  # noqa: E402

from gradian.config import GradianConfig  # noqa: E402
from gradian.errors import AdapterWeightsError, ModelLoadError  # noqa: E402
from gradian.model_loading import load_peft_model  # noqa: E402


@pytest.fixture
def adapter_copy(tmp_path, tiny_lora_dirs):
    """A private copy of the saved tiny adapter to damage, and the intact base."""
    base, adapter = tiny_lora_dirs
    copy = tmp_path / "adapter"
    shutil.copytree(adapter, copy)
    return base, copy


def _resave(path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _load(base, adapter):
    return load_peft_model(str(base), str(adapter), GradianConfig(device="cpu"))


def _set_config(adapter, change):
    path = adapter / "adapter_config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data)))


def _drop_first_lora_b(tensors):
    del tensors[next(k for k in sorted(tensors) if ".lora_B." in k)]


def _poison(tensors):
    key = sorted(tensors)[3]
    tensors[key][0, 0] = float("nan")


def _damage(adapter, kind):
    weights = adapter / "adapter_model.safetensors"
    if kind == "config_not_an_object":
        (adapter / "adapter_config.json").write_text("[\"q_proj\", \"v_proj\"]")
    elif kind == "no_peft_type":
        _set_config(adapter, lambda d: {k: v for k, v in d.items() if k != "peft_type"})
    elif kind == "no_weights_file":
        weights.unlink()
    elif kind == "empty_weights":
        weights.write_bytes(b"")
    elif kind == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:-64])
    elif kind == "missing_tensor":
        _resave(weights, _drop_first_lora_b)
    elif kind == "nan_weights":
        _resave(weights, _poison)
    elif kind == "rank_disagrees":
        _set_config(adapter, lambda d: {**d, "r": 8})


_EXPECTED = {
    "config_not_an_object": (ModelLoadError, r"adapter_config\.json: holds a JSON list, not an object"),
    "no_peft_type": (ModelLoadError, r"adapter_config\.json: no peft_type.*\"peft_type\": \"LORA\""),
    "no_weights_file": (AdapterWeightsError, r"no adapter_model\.safetensors \(or \.bin\).*save_pretrained"),
    "empty_weights": (AdapterWeightsError, r"adapter_model\.safetensors is empty \(0 bytes\)"),
    "truncated_weights": (AdapterWeightsError, r"adapter_model\.safetensors is damaged or truncated"),
    "missing_tensor": (AdapterWeightsError, r"adapter_model\.safetensors: 1 of the 28 LoRA tensors .* not saved "
                                            r"\(first: base_model\.model\.model\.layers\.0\..*lora_B\.weight\)"),
    "nan_weights": (AdapterWeightsError, r"adapter_model\.safetensors: .* has 1 NaN or infinite value"),
    "rank_disagrees": (AdapterWeightsError, r"has rank 4 but .*adapter_config\.json says r=8"),
}


@pytest.mark.parametrize("kind", sorted(_EXPECTED))
def test_a_damaged_adapter_is_one_clear_error(adapter_copy, kind):
    base, adapter = adapter_copy
    _damage(adapter, kind)
    error, pattern = _EXPECTED[kind]
    with pytest.raises(error, match=pattern) as info:
        _load(base, adapter)
    message = str(info.value)
    assert str(adapter) in message and "another base" not in message and "\n" not in message


@pytest.mark.parametrize("keep", ["nothing", "all but 100 bytes"])
def test_a_truncated_base_model_is_one_clear_error(tmp_path, tiny_lora_dirs, keep):
    base, adapter = tiny_lora_dirs
    damaged = tmp_path / "base"
    shutil.copytree(base, damaged)
    weights = damaged / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"" if keep == "nothing" else data[:-100])
    with pytest.raises(ModelLoadError, match=r"base/model\.safetensors is damaged or truncated.*--base-model"):
        _load(damaged, adapter)


def test_the_intact_adapter_still_loads(tiny_lora_dirs):
    base, adapter = tiny_lora_dirs
    model = _load(base, adapter)
    assert sum(1 for name, _ in model.named_parameters() if ".lora_" in name) == 28


def test_the_cli_exits_2_with_one_line_for_a_half_saved_adapter(adapter_copy, tmp_path, capsys):
    from gradian.cli import main

    base, adapter = adapter_copy
    _damage(adapter, "missing_tensor")
    dataset = tmp_path / "train.jsonl"
    dataset.write_text(json.dumps({"prompt": "what is the capital of france ?", "completion": "paris"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["index", "-d", str(dataset), "-m", str(base), "-a", str(adapter)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "not saved" in err and "another base" not in err
