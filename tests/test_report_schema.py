"""The report.json contract: the typed schema round-trips what every builder writes, every written
report validates against the published JSON Schema, old reports load, and the schema file is current."""

from __future__ import annotations

import json
import time
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from gradian.report.schema import (
    SCHEMA_VERSION,
    Accused,
    AttributeManifest,
    Attribution,
    ClusterRow,
    CounterfactualManifest,
    DiagnoseManifest,
    ExampleRow,
    IndexBuildManifest,
    OtherManifest,
    Report,
    ReportFinding,
    ReportSchemaError,
    Span,
    json_schema,
)

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "docs" / "report-schema.json"
REGENERATE = "python -m gradian.report > docs/report-schema.json"
WORDS = "paris tokyo hello world yes no one two three four five".split()


def _on_disk(report: dict) -> dict:
    """The dict as report.json holds it (non-finite floats null, tuples lists)."""
    from gradian.report.write import _jsonable

    return json.loads(json.dumps(_jsonable(report), default=str, allow_nan=False))


def assert_contract(report_obj: Report, written: dict) -> None:
    """``written`` is what the builder wrote: it is ``report_obj``'s JSON, loads back to the same object,
    and validates against the published schema."""
    assert written["schema_version"] == SCHEMA_VERSION
    assert _on_disk(report_obj.to_json()) == _on_disk(written)
    loaded = Report.from_json(written)
    assert loaded == Report.from_json(_on_disk(report_obj.to_json()))
    assert _on_disk(loaded.to_json()) == _on_disk(written)
    assert Report.from_json(report_obj.to_json()) == report_obj
    jsonschema.Draft202012Validator(json_schema()).validate(_on_disk(written))
    # nothing the builder wrote fell outside the declared fields
    assert _extras(loaded) == []


def _extras(value, path="report") -> list[str]:
    import dataclasses

    out = []
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            child = getattr(value, f.name)
            if f.name == "extra" and child:
                out.append(f"{path}: {sorted(child)}")
            elif f.name != "extra":
                out += _extras(child, f"{path}.{f.name}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _extras(v, f"{path}[{i}]")
    return out


# -- the real builders ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attribute_inputs(tmp_path_factory, tiny_lora_dirs):
    from gradian.config import load_config

    tmp = tmp_path_factory.mktemp("schema")
    train = tmp / "train.jsonl"
    rows = [{"prompt": f"what is the capital of {WORDS[i % 3]} ?", "completion": f"{WORDS[(i * 7) % len(WORDS)]} {WORDS[i % 5]}",
             "cluster": "a" if i < 8 else "b"} for i in range(20)]
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    evals = tmp / "eval.jsonl"
    evals.write_text("\n".join(json.dumps({"prompt": f"what is the capital of {w} ?", "completion": w})
                               for w in ("paris", "tokyo", "france", "japan")) + "\n")
    base_dir, adapter_dir = tiny_lora_dirs

    def config(**extra):
        overrides = {
            "base_model": str(base_dir), "adapter_path": str(adapter_dir), "dataset": str(train),
            "eval_dataset": str(evals), "cache_dir": str(tmp / "cache"), "evaluation.metric": "contains",
            "evaluation.require_significant": False, "evaluation.max_new_tokens": 4,
            "evaluation.n_bootstrap": 200, "clustering.method": "declared", "grads.batch_size": 4,
            "grads.chunk_size": 8,
        }
        overrides.update(extra)
        return load_config(overrides=overrides)

    return tmp, config


@pytest.fixture(scope="module")
def attribute_outcome(attribute_inputs):
    from gradian.attribution import run_attribution

    tmp, config = attribute_inputs
    return run_attribution(config(), capability="capitals", out_dir=tmp / "out"), tmp / "out"


def test_the_attribute_report_is_its_typed_report(attribute_outcome):
    outcome, out = attribute_outcome
    written = json.loads((out / "report.json").read_text())
    assert isinstance(outcome.report, Report)
    assert_contract(outcome.report, written)
    report = outcome.report
    assert isinstance(report.manifest, AttributeManifest) and report.kind == "attribute"
    assert report.manifest.index is not None and report.manifest.index.n_examples == 20
    assert report.manifest.engine_state is not None and report.manifest.clustering.method == "declared"
    assert report.attribution.engine == report.manifest.config["engine"]["name"]
    query = report.attribution.query  # no item flips on this random adapter: the whole eval set, or under lost the items that lost likelihood
    assert query is not None and 1 <= query.n_items == len(query.item_ids) <= 4
    assert {c.cluster for c in report.attribution.clusters} == {"a", "b"}
    assert report.attribution.lumpiness is not None and report.skipped is not None
    assert all(isinstance(f, ReportFinding) for f in report.findings)


def test_a_gated_attribute_report_has_no_attribution_block(attribute_inputs):
    from gradian.attribution import run_attribution

    _, config = attribute_inputs
    outcome = run_attribution(config(**{"evaluation.require_significant": True}), capability="capitals",
                              cross_check="none")
    # the random adapter barely moves 4 items: the interval straddles zero (as in test_attribute_pipeline)
    assert outcome.report.attribution is None and outcome.report.capability.status != "regressed"
    assert "index" not in outcome.report.to_json()["manifest"]  # kind-specific parts are left out, not null
    assert_contract(outcome.report, outcome.report.to_json())


def test_the_index_report(attribute_inputs, attribute_outcome):
    from gradian.cli.index import _index_report
    from gradian.attribution import index_from_config

    _, config = attribute_inputs
    built = index_from_config(config())
    assert built.cache_hit  # the attribute run above built it
    started = time.time() - 2.5
    written = _index_report(built.index, "reused", started)
    report = Report.from_json(written)
    assert report.manifest.started_at == started and report.manifest.seconds >= 2.5  # the child run's duration
    assert isinstance(report.manifest, IndexBuildManifest) and report.manifest.index.index_id == built.index.index_id
    assert report.capability is None and report.attribution is None and report.verdict.kind == "inconclusive"
    assert_contract(report, written)


def test_the_diagnose_report(attribute_inputs, tmp_path):
    from gradian.audit import build_diagnosis_report, write_diagnosis
    from gradian.audit.session import diagnose

    _, config = attribute_inputs
    before = time.time()
    diagnosis = diagnose(config())
    made = diagnosis.report.to_json()
    started = made["manifest"]["started_at"]
    assert before <= started <= time.time() and made["manifest"]["seconds"] >= 0
    report = build_diagnosis_report(diagnosis.result, diagnosis.inputs.manifest(),
                                    made["manifest"]["audit_config"], started)
    rebuilt = report.to_json()
    assert rebuilt["manifest"].pop("seconds") >= made["manifest"]["seconds"]
    assert {**made, "manifest": {k: v for k, v in made["manifest"].items()
                                             if k != "seconds"}} == rebuilt
    json_path, _, _ = write_diagnosis(report, tmp_path)
    written = json.loads(json_path.read_text())
    assert isinstance(report.manifest, DiagnoseManifest) and report.manifest.inputs.dataset.n_examples == 20
    assert report.skipped is not None and report.manifest.counts.keys() == {"critical", "high", "medium", "low", "info"}
    assert_contract(report, written)


def test_the_counterfactual_report(attribute_inputs, tmp_path):
    from gradian.counterfactual import plan_removal, run_counterfactual
    from gradian.data import load_dataset

    _, config = attribute_inputs
    cfg = config(**{"train.r": 4, "train.lora_alpha": 8, "train.num_train_epochs": 1,
                    "train.per_device_train_batch_size": 8, "train.max_seq_length": 64, "evaluation.n_bootstrap": 100})
    plan = plan_removal(load_dataset(cfg.dataset), drop_cluster="a", clustering=cfg.clustering, seed=cfg.seed)
    outcome = run_counterfactual(cfg, plan, out_dir=tmp_path / "cf", capability="capitals",
                                 before={"name": "capitals", "base": 0.5, "tuned": 0.25}, planted=[0, 1, 2])
    written = json.loads((tmp_path / "cf" / "report.json").read_text())
    report = outcome.report
    assert isinstance(report.manifest, CounterfactualManifest) and report.counterfactual is not None
    assert report.counterfactual.removal.n_removed == 8 and report.counterfactual.ground_truth.n_planted_removed == 3
    assert report.verdict.accused_cluster == "a"
    assert_contract(report, written)


def test_an_accused_set_and_its_spans_go_through_the_typed_builder():
    """``build_report`` with the blocks a lumpy attribution has: the accused set and its spans."""
    from gradian.cluster import refine_accused
    from gradian.report import build_report, cluster_table, top_examples
    from gradian.report.schema import Capability
    from tests.test_verdict import capability, planted_scores

    scores, ids, clusters = planted_scores()
    members = [i for i, e in enumerate(ids) if clusters[e] == "0"]
    accused = refine_accused("0", [ids[i] for i in members], scores[members], scale=1.0)
    text = "Its capital is Brask."
    span = {"example_id": accused.example_ids[0], "item_id": "item-1", "engine": "graddot", "signal": "contrastive",
            "text": text, "token_sum": -3.0, "words": [{"text": "Brask.", "start": 15, "end": 21, "score": -3.0}],
            "sentences": [{"text": text, "start": 0, "end": 21, "score": -3.0}],
            "span": {"text": text, "start": 0, "end": 21, "score": -3.0}, "score": -3.0, "notes": [],
            "span_start": 0, "span_end": 21, "span_text": text, "span_score": -3.0}
    attribution = Attribution(
        engine="datainf", cross_check="graddot", engine_agreement_spearman=0.9, query_signal="contrastive",
        n_examples=len(ids), clusters=[ClusterRow.from_json(c) for c in cluster_table(scores, ids, clusters, None, 3)],
        top_harmful=[ExampleRow.from_json(r) for r in top_examples(scores, ids, clusters, None, 5, harmful=True)],
        accused=Accused.of(accused), spans=[Span.from_json(span)],
    )
    report = build_report(Capability.from_json(capability()), [], attribution, AttributeManifest(), assignment=clusters)
    assert report.verdict.kind == "data" and report.verdict.accused_cluster == "0"
    assert report.attribution.accused.n == report.verdict.accused_set_n == len(accused.example_ids)
    assert report.attribution.spans[0].span.text == text
    written = report.to_json()
    assert written["attribution"]["accused"]["n_left_out"] == accused.n_left_out
    assert_contract(report, written)


# -- reading: old reports, unknown keys, wrong types ---------------------------------------------


def test_a_report_without_schema_version_loads_as_version_1(attribute_outcome):
    outcome, _ = attribute_outcome
    old = outcome.report.to_json()
    del old["schema_version"]
    assert Report.from_json(old).schema_version == 1
    # the barest report an old diagnose could write
    bare = Report.from_json({"capability": None, "findings": [], "attribution": None,
                             "verdict": {"kind": "inconclusive", "summary": "s", "hedges": []},
                             "manifest": {"kind": "diagnose"}})
    assert bare.schema_version == 1 and isinstance(bare.manifest, DiagnoseManifest) and bare.skipped is None


def test_unknown_keys_are_kept_and_written_back(attribute_outcome):
    outcome, _ = attribute_outcome
    newer = json.loads(json.dumps(outcome.report.to_json()))
    newer["schema_version"] = SCHEMA_VERSION + 1
    newer["provenance"] = {"signed_by": "x"}
    newer["attribution"]["clusters"][0]["median"] = -1.5
    newer["manifest"] = {"kind": "shard", "ranks": 4}
    report = Report.from_json(newer)
    assert report.extra == {"provenance": {"signed_by": "x"}}
    assert report.attribution.clusters[0].extra == {"median": -1.5}
    assert isinstance(report.manifest, OtherManifest) and report.manifest.extra == {"ranks": 4}
    assert report.to_json() == newer


def test_a_wrong_type_or_a_missing_key_names_the_path(attribute_outcome):
    outcome, _ = attribute_outcome
    broken = json.loads(json.dumps(outcome.report.to_json()))
    broken["attribution"]["clusters"][1]["n"] = "many"
    with pytest.raises(ReportSchemaError, match=r"attribution\.clusters\[1\]\.n: expected an integer"):
        Report.from_json(broken)
    broken = json.loads(json.dumps(outcome.report.to_json()))
    del broken["verdict"]["kind"]
    with pytest.raises(ReportSchemaError, match=r"verdict: the required key 'kind' is missing"):
        Report.from_json(broken)
    with pytest.raises(ReportSchemaError, match="severity"):
        ReportFinding.from_json({"id": "x.y", "category": "x", "severity": "dire", "title": "t", "message": "m"})


def test_the_json_schema_rejects_what_the_builders_never_write(attribute_outcome):
    outcome, _ = attribute_outcome
    validator = jsonschema.Draft202012Validator(json_schema())
    for mutate in (lambda r: r["verdict"].update(kind="probably_data"),
                   lambda r: r["attribution"]["clusters"][0].pop("signed_influence"),
                   lambda r: r["manifest"].update(kind="attribute", typo=1)):
        report = _on_disk(outcome.report.to_json())
        mutate(report)
        assert not validator.is_valid(report)


# -- the published schema ------------------------------------------------------------------------


def test_the_published_schema_is_current():
    jsonschema.Draft202012Validator.check_schema(json_schema())
    published = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert published == json_schema(), f"docs/report-schema.json is stale: regenerate it with `{REGENERATE}`"


def test_the_schema_module_prints_the_schema():
    proc = subprocess.run([sys.executable, "-m", "gradian.report"], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == json_schema()
    assert proc.stdout == SCHEMA_FILE.read_text(encoding="utf-8")


def test_every_artifact_is_written_once_from_the_lane_to_the_mlflow_child_run(attribute_inputs, tracking,
                                                                             monkeypatch, tmp_path):
    """An attribution written to a folder and then logged as a child run on a real server: each
    file is written once (one all-or-nothing write of the report and its tables), each table is
    serialized once, the sink logs every written file as it is, and no artifact is logged twice."""
    from collections import Counter

    import mlflow
    import pandas as pd
    from mlflow import MlflowClient

    import gradian.report.write as write_module
    from gradian.attribution import run_attribution
    from gradian.report.sinks import publish_report
    from gradian_mlflow.sink import ArtifactKeys

    _, config = attribute_inputs
    written: Counter[str] = Counter()
    serialized: Counter[str] = Counter()
    logged: Counter[str] = Counter()
    real_write, real_parquet = write_module.write_files_atomic, pd.DataFrame.to_parquet
    real_artifact, real_dict, real_table = MlflowClient.log_artifact, MlflowClient.log_dict, MlflowClient.log_table

    def write(out, files):
        written.update(list(files))
        return real_write(out, files)

    def to_parquet(frame, *args, **kwargs):
        serialized["accused" if "accused" in frame.columns and bool(frame["accused"].all()) else "rankings"] += 1
        return real_parquet(frame, *args, **kwargs)

    inside: list[str] = []  # log_dict and log_table upload through log_artifact: count the outer call

    def log_artifact(client, run_id, local_path, artifact_path=None):
        if not inside:
            logged[f"{artifact_path}/{Path(local_path).name}"] += 1
        return real_artifact(client, run_id, local_path, artifact_path)

    def log_dict(client, run_id, dictionary, artifact_file):
        logged[artifact_file] += 1
        inside.append(artifact_file)
        try:
            return real_dict(client, run_id, dictionary, artifact_file)
        finally:
            inside.pop()

    def log_table(client, run_id, data, artifact_file):
        logged[artifact_file] += 1
        inside.append(artifact_file)
        try:
            return real_table(client, run_id, data=data, artifact_file=artifact_file)
        finally:
            inside.pop()

    monkeypatch.setattr(write_module, "write_files_atomic", write)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", to_parquet)
    monkeypatch.setattr(MlflowClient, "log_artifact", log_artifact)
    monkeypatch.setattr(MlflowClient, "log_dict", log_dict)
    monkeypatch.setattr(MlflowClient, "log_table", log_table)

    outcome = run_attribution(config(), capability="capitals", out_dir=tmp_path / "out")
    with mlflow.start_run() as source:
        pass
    child = publish_report(f"mlflow:{source.info.run_id}", outcome.report, "attribute", outcome.files,
                           rankings=outcome.rankings)
    assert child is not None and outcome.rankings is not None

    assert written and set(written.values()) == {1}, written
    assert {"report.json", "report.md", "report.html", "rankings.parquet"} <= set(written)
    tables = {name.removesuffix(".parquet") for name in written if name.endswith(".parquet")}
    assert serialized == Counter({name: 1 for name in tables}), (serialized, tables)
    assert set(logged.values()) == {1}, logged
    for name in written:  # each written file logged as it is, under plots/ or the report folder
        folder = ArtifactKeys.PLOTS if name.endswith(".png") else ArtifactKeys.ROOT
        assert logged[f"{folder}/{Path(name).name}"] == 1, (name, logged)
    assert logged[f"{ArtifactKeys.ROOT}/rankings_top.csv"] == 1 and logged[ArtifactKeys.MANIFEST] == 1
    names = {a.path for a in MlflowClient().list_artifacts(child, ArtifactKeys.ROOT)}
    assert f"{ArtifactKeys.ROOT}/rankings.parquet" in names and f"{ArtifactKeys.ROOT}/report.json" in names
