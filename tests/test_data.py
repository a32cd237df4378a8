"""Data layer: every row shape and alias, ids, file formats, errors, masks and truncation."""

from __future__ import annotations

import hashlib
import json

import pytest

from gradian.data import (
    IGNORE_INDEX,
    dataset_from_rows,
    load_dataset,
    normalize_text,
    render_prompt,
    tokenize_examples,
)
from gradian.errors import DatasetError

USER, ASSISTANT = "what is the capital of france ?", "paris"

SHAPES = [
    ({"messages": [{"role": "user", "content": USER}, {"role": "assistant", "content": ASSISTANT}]}, "messages"),
    ({"conversations": [{"from": "human", "value": USER}, {"from": "gpt", "value": ASSISTANT}]}, "messages"),
    ({"conversation": [{"role": "user", "content": USER}, {"role": "assistant", "content": ASSISTANT}]}, "messages"),
    ({"prompt": USER, "completion": ASSISTANT}, "prompt_completion"),
    ({"prompt": [{"role": "user", "content": USER}], "completion": [{"role": "assistant", "content": ASSISTANT}]},
     "prompt_completion"),
    ({"question": USER, "answer": ASSISTANT}, "question_answer"),
    ({"input": USER, "output": ASSISTANT}, "input_output"),
    ({"instruction": USER, "input": "", "output": ASSISTANT}, "instruction_input_output"),
]


@pytest.mark.parametrize("row, shape", SHAPES, ids=[s for _, s in SHAPES][:3] + ["pc", "pc-chat", "qa", "io", "iio"])
def test_row_shapes_normalize_to_the_same_chat(row, shape):
    ex = dataset_from_rows([row]).examples[0]
    assert ex.shape == shape
    assert ex.messages == [{"role": "user", "content": USER}, {"role": "assistant", "content": ASSISTANT}]
    assert ex.completion == ASSISTANT and ex.prompt_text == USER


def test_instruction_with_input_joins_them():
    ex = dataset_from_rows([{"instruction": "translate to spanish", "input": "hello", "output": "hola"}]).examples[0]
    assert ex.messages[0]["content"] == "translate to spanish\n\nhello"


def test_system_key_becomes_first_turn():
    ex = dataset_from_rows([{"system": "you are a helpful assistant", "prompt": USER, "completion": ASSISTANT}]).examples[0]
    assert ex.messages[0] == {"role": "system", "content": "you are a helpful assistant"}
    assert ex.prompt_text == USER  # system turns are not part of the user-visible prompt


def test_text_and_raw_fallback_and_clusters():
    ds = dataset_from_rows([{"text": "one two", "cluster": 3}, {"foo": "bar", "cluster_id": "c7"}, "just a string"])
    assert [e.shape for e in ds] == ["text", "raw", "raw"]
    assert ds[0].text == "one two" and ds[0].cluster == "3"
    assert ds[1].text == "bar" and ds[1].cluster == "c7"
    assert ds[2].text == "just a string" and not ds[2].is_chat


def test_example_ids_hash_the_row_content_and_index():
    row = {"prompt": "a", "completion": "b"}
    ds = dataset_from_rows([row, row])
    digest = hashlib.sha256(json.dumps(row, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    assert ds.ids == [f"{digest}-0", f"{digest}-1"]


def test_file_formats_agree(tmp_path):
    rows = [{"prompt": USER, "completion": ASSISTANT, "cluster": "a"}, {"question": "hello", "answer": "yes"}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    as_json = tmp_path / "d.json"
    as_json.write_text(json.dumps(rows))
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"data": rows}))
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    import pandas as pd

    pq.write_table(pa.Table.from_pandas(pd.DataFrame(rows)), parquet)
    from datasets import Dataset as HFDataset

    saved = tmp_path / "saved"
    HFDataset.from_pandas(pd.DataFrame(rows)).save_to_disk(str(saved))

    loaded = [load_dataset(p) for p in (jsonl, as_json, wrapped, parquet, saved)]
    for ds in loaded:
        assert [e.messages for e in ds] == [e.messages for e in loaded[0]]
        assert len(ds.sha256) == 64
    assert loaded[0].ids == loaded[1].ids  # ids depend on content, not on the file format
    assert loaded[0][0].line == 1


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", completion: }\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        load_dataset(path)


def test_empty_missing_unsupported_and_no_assistant(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="empty"):
        load_dataset(empty)
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(tmp_path / "nope.jsonl")
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported file type"):
        load_dataset(csv)
    no_answer = tmp_path / "q.jsonl"
    no_answer.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DatasetError, match=r"q.jsonl:1: row has no assistant turn"):
        load_dataset(no_answer)
    bad_role = tmp_path / "r.jsonl"
    bad_role.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    with pytest.raises(DatasetError, match="unknown role 'narrator'"):
        load_dataset(bad_role)


def test_normalize_text():
    assert normalize_text("  What is the Capital of FRANCE?! ") == "what is the capital of france"


# -- tokenization ------------------------------------------------------------------------------


def supervised_tokens(tok, te):
    return tok.convert_ids_to_tokens([i for i, l in zip(te.input_ids, te.labels) if l != IGNORE_INDEX])


def test_mask_covers_the_assistant_turn_and_its_eos(chat_tokenizer):
    ds = dataset_from_rows([{"system": "you are a helpful assistant", "prompt": USER, "completion": "paris and tokyo"}])
    (te,) = tokenize_examples(ds, chat_tokenizer, max_seq_length=None)
    assert supervised_tokens(chat_tokenizer, te) == ["paris", "and", "tokyo", "<|end|>"]
    assert te.input_ids[0] == chat_tokenizer.bos_token_id  # the template's BOS, added once
    assert te.input_ids.count(chat_tokenizer.bos_token_id) == 1
    assert te.ends_with_eos and not te.whole_sequence and te.prefix_stable
    assert te.n_completion_tokens == 4 and te.n_completion_lost == 0 and not te.truncated
    assert te.prompt_tokens_in_mask == 0
    # the prompt is exactly what generation sees
    prompt_ids = chat_tokenizer(render_prompt(chat_tokenizer, ds[0].prompt_messages), add_special_tokens=False)["input_ids"]
    assert te.input_ids[: len(prompt_ids)] == prompt_ids and te.n_prompt_tokens == len(prompt_ids)


def test_multi_turn_supervises_every_assistant_turn(chat_tokenizer):
    row = {"messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": USER}, {"role": "assistant", "content": "paris"},
    ]}
    (te,) = tokenize_examples(dataset_from_rows([row]), chat_tokenizer, None)
    assert supervised_tokens(chat_tokenizer, te) == ["hello", "world", "<|end|>", "paris", "<|end|>"]


def test_truncation_bookkeeping(chat_tokenizer):
    ds = dataset_from_rows([{"prompt": USER, "completion": "one two three four five"}])
    (full,) = tokenize_examples(ds, chat_tokenizer, None)
    cut = full.n_tokens_full - 3
    (te,) = tokenize_examples(ds, chat_tokenizer, cut)
    assert te.truncated and len(te.input_ids) == cut == len(te.labels)
    assert te.n_completion_tokens == 6 and te.n_completion_lost == 3 and te.n_supervised == 3
    assert supervised_tokens(chat_tokenizer, te) == ["one", "two", "three"]
    assert te.ends_with_eos  # the untruncated target ends with EOS; the loss just never sees it
    (gone,) = tokenize_examples(ds, chat_tokenizer, full.n_prompt_tokens)
    assert gone.n_supervised == 0 and gone.n_completion_lost == 6


def test_no_chat_template_falls_back_to_whole_sequence(plain_tokenizer):
    ds = dataset_from_rows([{"prompt": "hello", "completion": "hello world"}])
    (te,) = tokenize_examples(ds, plain_tokenizer, None)
    assert te.whole_sequence and all(l != IGNORE_INDEX for l in te.labels)
    assert supervised_tokens(plain_tokenizer, te) == ["hello", "hello", "world", "<|end|>"]
    assert te.prompt_tokens_in_mask == 1 and te.ends_with_eos


def test_text_rows_are_supervised_whole(chat_tokenizer):
    (te,) = tokenize_examples(dataset_from_rows([{"text": "one two three"}]), chat_tokenizer, None)
    assert te.whole_sequence and supervised_tokens(chat_tokenizer, te) == ["one", "two", "three", "<|end|>"]


def test_template_without_eos_is_reported(chat_tokenizer):
    import copy

    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = tok.chat_template.replace("<|end|>", "")
    (te,) = tokenize_examples(dataset_from_rows([{"prompt": USER, "completion": "paris"}]), tok, None)
    assert not te.ends_with_eos and supervised_tokens(tok, te) == ["paris"]


def test_batched_tokenization_matches_one_by_one(chat_tokenizer):
    rows = [{"prompt": f"{USER} " + "one " * i, "completion": "two " * (i % 3 + 1)} for i in range(7)]
    ds = dataset_from_rows(rows)
    batched = tokenize_examples(ds, chat_tokenizer, 16, batch_size=3)
    single = [tokenize_examples([e], chat_tokenizer, 16)[0] for e in ds]
    assert batched == single


def test_slow_tokenizer_is_refused():
    class Slow:
        is_fast = False

    with pytest.raises(DatasetError, match="slow tokenizer"):
        tokenize_examples(dataset_from_rows([{"prompt": "a", "completion": "b"}]), Slow(), 8)
