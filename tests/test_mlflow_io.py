"""Reading training runs from, and logging diagnoses to, a real MLflow tracking server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from gradian.report.schema import (
    AttributeManifest,
    Attribution,
    Capability,
    ClusterRow,
    Counterfactual,
    CounterfactualManifest,
    DatasetSummary,
    DiagnoseManifest,
    GroundTruth,
    IndexBuildManifest,
    IndexSummary,
    PredictedSums,
    Recovery,
    Removal,
    Report,
    ReportFinding,
    Verdict,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """A real PEFT LoRA adapter of a tiny random Llama, saved to disk."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    peft_model.save_pretrained(out)
    return out


HF_PARAMS = {  # how the HF MLflowCallback logs TrainingArguments: every value a string
    "learning_rate": "0.002", "num_train_epochs": "12", "per_device_train_batch_size": "1",
    "gradient_accumulation_steps": "1", "warmup_steps": "0.03", "lr_scheduler_type": "SchedulerType.LINEAR",
    "max_grad_norm": "1.0", "seed": "42", "bf16": "False", "fp16": "False", "max_steps": "-1",
    "output_dir": "runs/x", "report_to": "['mlflow']",
}


def log_hf_style_run(mlflow, adapter_dir: Path, data_file: Path) -> str:
    with mlflow.start_run() as run:
        mlflow.log_params(HF_PARAMS)
        for step in range(1, 9):
            mlflow.log_metrics({"loss": 2.0 / step, "grad_norm": 1.0 + step, "learning_rate": 2e-3 * (1 - step / 9),
                                "epoch": step / 8}, step=step)
        for step in (4, 8):
            mlflow.log_artifacts(str(adapter_dir), artifact_path=f"checkpoint-{step}")
        dataset = mlflow.data.from_pandas(pd.read_json(data_file, lines=True), source=str(data_file), name="train")
        mlflow.log_input(dataset, context="training")
        return run.info.run_id


@pytest.fixture
def data_file(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) for i in range(5)) + "\n")
    return path


def test_read_hf_style_run(tracking, adapter_dir, data_file, tmp_path):
    import mlflow

    from gradian_mlflow.source import read_mlflow_run

    run_id = log_hf_style_run(mlflow, adapter_dir, data_file)
    # the run names its data by a local path and holds no copy: read only because we trust it
    record = read_mlflow_run(f"runs:/{run_id}", cache_dir=tmp_path / "cache", trust_run_dataset=True)
    assert record.source == f"mlflow:{run_id}"
    assert record.config.learning_rate == 0.002 and record.config.num_train_epochs == 12
    assert record.config.warmup_ratio == 0.03 and record.config.lr_scheduler_type == "linear"
    assert record.lora.r == 4 and record.lora.alpha == 8
    assert record.effective_lora_lr == pytest.approx(0.004)
    assert [s.step for s in record.logs.steps] == list(range(1, 9))
    assert record.logs.steps[0].loss == pytest.approx(2.0) and record.logs.steps[-1].grad_norm == pytest.approx(9.0)
    assert Path(record.adapter_dir, "adapter_model.safetensors").is_file()
    assert "checkpoint-8" not in record.adapter_dir or len(record.checkpoints) == 2
    assert len(record.checkpoints) == 2
    assert record.dataset.path == str(data_file)

    # the cache is reused when intact, and refetched when a file was damaged
    again = read_mlflow_run(run_id, cache_dir=tmp_path / "cache", trust_run_dataset=True)
    assert again.adapter_dir == record.adapter_dir
    assert not [n for n in again.notes if "repaired" in n]
    Path(record.adapter_dir, "adapter_config.json").write_text("{}")
    healed = read_mlflow_run(run_id, cache_dir=tmp_path / "cache", trust_run_dataset=True)
    assert json.loads(Path(healed.adapter_dir, "adapter_config.json").read_text())["r"] == 4
    # and it says so: which file, what was wrong, that it was downloaded again
    (said,) = [n for n in healed.notes if n.startswith("repaired the cached download")]
    assert (f"in {record.adapter_dir}: adapter_config.json does not match the sha256 recorded when it was "
            "downloaded; downloaded it again") in said


def test_adapter_from_logged_model_like_the_hf_callback(tracking, adapter_dir, tmp_path):
    """The HF callback logs checkpoints as pyfunc models named checkpoint-N (MLflow 3 LoggedModels)."""
    import mlflow

    from gradian_mlflow.source import read_mlflow_run

    ckpt = tmp_path / "out" / "checkpoint-6"
    ckpt.mkdir(parents=True)
    for f in adapter_dir.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    (ckpt / "trainer_state.json").write_text(json.dumps({"log_history": [
        {"step": 3, "loss": 1.5}, {"step": 6, "loss": 1.0}]}))
    with mlflow.start_run() as run:
        mlflow.log_params({"learning_rate": "0.0002"})
        mlflow.pyfunc.log_model(name="checkpoint-6", artifacts={"model_path": str(ckpt)},
                                python_model=mlflow.pyfunc.PythonModel())
    record = read_mlflow_run(run.info.run_id, cache_dir=tmp_path / "cache")
    assert record.lora.r == 4 and Path(record.adapter_dir, "adapter_config.json").is_file()
    assert [s.loss for s in record.logs.steps] == [1.5, 1.0]  # trainer_state.json fallback


def test_run_without_adapter_and_unknown_run(tracking, tmp_path):
    import mlflow

    from gradian_mlflow.client import TrackingError
    from gradian_mlflow.source import read_mlflow_run

    with mlflow.start_run() as run:
        mlflow.log_param("learning_rate", "1e-4")
    record = read_mlflow_run(run.info.run_id, cache_dir=tmp_path)
    assert record.adapter_dir is None and record.config.learning_rate == 1e-4
    with pytest.raises(TrackingError, match="not found"):
        read_mlflow_run("0" * 32, cache_dir=tmp_path)


def _capability(**changes) -> Capability:
    values = dict(name="capitals", metric="contains", base=1.0, tuned=0.5, delta=-0.5, ci=[-0.75, -0.25],
                  n_items=16, n_flipped=8, n_base_failing=0, status="regressed", proxy_used=False)
    return Capability(**{**values, **changes})


REPORT = Report(
    capability=_capability(),
    findings=[ReportFinding(id="config.lr_too_high", category="config", severity="high", title="LR high",
                            message="m", evidence={"lr": 0.002}, example_ids=[], fix="lower it")],
    attribution=Attribution(engine="datainf", cross_check="graddot", engine_agreement_spearman=0.8,
                            query_signal="contrastive", gated=True,
                            clusters=[ClusterRow(cluster="poison", label="capital wrong", n=48, signed_influence=-3.0,
                                                 share_of_negative=0.7, mean_per_example=-0.06)]),
    verdict=Verdict(kind="data", summary="Cluster poison carries 70% of the harm."),
    manifest=AttributeManifest(gradian_version="0.1.0", config_hash="abc", seconds=30.0,
                               index=IndexSummary(index_id="idx123", n_examples=800, bytes=8000,
                                                  bytes_per_example=10.0)),
).to_json()


def _removal(reason: str, cluster: str | None, n_removed: int) -> Removal:
    return Removal(reason=reason, cluster=cluster, n_examples=800, n_removed=n_removed, n_kept=800 - n_removed,
                   removed_ids=[], dataset=DatasetSummary(path="kept.jsonl", sha256=None))


def _counterfactual(removal: Removal, **changes) -> Counterfactual:
    recovery = Recovery(metric="contains", n_items=16, base=1.0, before=0.25, after=0.9375, delta_before=-0.75,
                        delta_after=-0.0625, status_after="not_significant", recovered_fraction=0.92,
                        items_below_base_before=12, items_below_base_after=1, within_one_item=True)
    return Counterfactual(**{"outcome": "recovered", "removal": removal, "capability": recovery, **changes})


def test_log_diagnosis_as_child_run(tracking, adapter_dir, data_file, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    from gradian_mlflow.sink import log_diagnosis

    mlflow.set_experiment("gradian-sink-test")
    source_id = log_hf_style_run(mlflow, adapter_dir, data_file)
    report_md = tmp_path / "report.md"
    report_md.write_text("# report")
    rankings = pd.DataFrame({"example_id": ["a-0", "b-1"], "score": [-1.0, 0.5],
                             "predicted_loss_delta_if_removed": [-0.5, 0.25], "cluster": ["poison", "clean"]})
    child = log_diagnosis(REPORT, source_id, kind="attribute", files=[report_md], rankings=rankings)

    client = MlflowClient()
    run = client.get_run(child)
    source = client.get_run(source_id)
    assert run.data.tags["mlflow.parentRunId"] == source_id
    assert run.info.experiment_id == source.info.experiment_id
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "attribute-datainf-capitals"
    # the run spans the 30 s of work the report records, not just the logging
    assert run.info.end_time - run.info.start_time >= 30_000 and run.data.metrics["gradian.total_seconds"] == 30.0
    assert run.data.metrics["capability.delta"] == -0.5 and run.data.metrics["capability.ci_low"] == -0.75
    # the report says the gate failed (scores computed anyway): gate_passed is 0, the old key is gone
    assert run.data.metrics["attribution.gate_passed"] == 0.0 and "attribution.gated" not in run.data.metrics
    assert run.data.metrics["audit.n_high"] == 1.0
    assert run.data.tags["gradian.verdict"] == "data" and run.data.tags["gradian.index_id"] == "idx123"
    assert run.data.tags["mlflow.note.content"].startswith("Cluster poison")
    assert source.data.tags["gradian.diagnosis_run_id"] == child
    # the training run's experiment had no kind and no traces: it now opens in the training view
    assert client.get_experiment(source.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    names = {a.path for a in client.list_artifacts(child, "gradian")}
    assert {"gradian/report.md", "gradian/manifest.json", "gradian/rankings.parquet",
            "gradian/clusters.json", "gradian/findings.json"} <= names
    local = mlflow.artifacts.download_artifacts(run_id=child, artifact_path="gradian/rankings.parquet",
                                                dst_path=str(tmp_path / "dl"))
    assert pd.read_parquet(local)["score"].tolist() == [-1.0, 0.5]
    # the most harmful rows also as CSV, which the artifact viewer previews
    top = mlflow.artifacts.download_artifacts(run_id=child, artifact_path="gradian/rankings_top.csv",
                                              dst_path=str(tmp_path / "dl"))
    assert pd.read_csv(top)["example_id"].tolist() == ["a-0", "b-1"]


def test_child_runs_are_named_for_what_they_hold():
    from gradian.report.tracker import child_run_name

    cap = _capability()
    index = IndexSummary(index_id="0123456789abcdef", n_examples=800, bytes=8000, bytes_per_example=10.0)
    assert child_run_name(REPORT, "attribute") == "attribute-datainf-capitals"
    assert child_run_name(Report(capability=cap, attribution=None), "attribute") == "attribute-capitals"  # gated
    assert child_run_name(Report(manifest=DiagnoseManifest()).to_json(), "diagnose") == "diagnose"
    assert child_run_name(Report(manifest=IndexBuildManifest(index=index)).to_json(), "index") == "index-0123456789ab"
    removal = _removal("the report's accused set: 40 of cluster 0's 48 rows (gmm)", None, 40)
    assert child_run_name(Report(capability=cap, counterfactual=_counterfactual(removal)), "counterfactual") \
        == "counterfactual-accused-capitals"
    removal = _removal("cluster poison/2: --drop-cluster", "poison/2", 40)
    assert child_run_name(Report(capability=cap, counterfactual=_counterfactual(removal)), "counterfactual") \
        == "counterfactual-clusterpoison_2-capitals"
    removal = _removal("3 example id(s) given with --drop-ids", None, 3)
    assert child_run_name(Report(capability=cap, counterfactual=_counterfactual(removal)).to_json(),
                          "counterfactual") == "counterfactual-3ids-capitals"


def test_the_work_starts_when_the_report_says():
    from gradian.report.tracker import work_started_ms

    def report(manifest) -> dict:
        return Report(manifest=manifest).to_json()

    now_ms = 1_800_000_000_000
    assert work_started_ms(report(AttributeManifest(seconds=42.5)), now_ms) == now_ms - 42_500
    assert work_started_ms(report(DiagnoseManifest(seconds=42.5, started_at=1_799_999_000.0)), now_ms) \
        == 1_799_999_000_000
    assert work_started_ms(report(IndexBuildManifest(started_at=1_799_999_200)), now_ms) == 1_799_999_200_000
    assert work_started_ms(report(AttributeManifest(seconds=42.5)), now_ms, started_at=1_799_999_990.0) \
        == now_ms - 10_000
    assert work_started_ms(report(IndexBuildManifest()), now_ms) == now_ms  # nothing recorded: now
    assert work_started_ms(report(DiagnoseManifest(started_at=2e9)), now_ms) == now_ms  # the future is ignored


def test_experiments_gradian_creates_are_training_experiments_and_others_keep_their_tags(tracking):
    from mlflow import MlflowClient

    from gradian_mlflow.experiment import EXPERIMENT_KIND_TAG, use_training_experiment

    client = MlflowClient()
    created = use_training_experiment(f"gradian-created-{time.time_ns()}")
    assert client.get_experiment(created).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    users = client.create_experiment(f"users-own-{time.time_ns()}")
    name = client.get_experiment(users).name
    assert use_training_experiment(name) == users
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(users).tags


def test_failed_logging_marks_the_child_failed(tracking, adapter_dir, data_file, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    from gradian_mlflow.sink import log_diagnosis

    source_id = log_hf_style_run(mlflow, adapter_dir, data_file)
    with pytest.raises(Exception):
        log_diagnosis(REPORT, source_id, kind="attribute", files=[tmp_path / "missing.md"])
    client = MlflowClient()
    children = client.search_runs([client.get_run(source_id).info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{source_id}'")
    assert children and all(r.info.status == "FAILED" for r in children)


def test_server_down_is_a_clear_bounded_error(monkeypatch, tmp_path):
    import mlflow

    from gradian_mlflow.client import TrackingError
    from gradian_mlflow.source import read_mlflow_run
    from tests.plugins.mlflow_server import _free_port

    uri = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    mlflow.set_tracking_uri(uri)
    start = time.time()
    with pytest.raises(TrackingError, match="did not answer|cannot reach"):
        read_mlflow_run("a" * 32, cache_dir=tmp_path)
    assert time.time() - start < 60


def test_diagnose_cli_reads_an_mlflow_run_and_logs_a_child(tracking, adapter_dir, data_file, tmp_path):
    import subprocess
    import sys

    import mlflow
    from mlflow import MlflowClient

    source_id = log_hf_style_run(mlflow, adapter_dir, data_file)
    proc = subprocess.run(
        [sys.executable, "-c", "from gradian.cli import main; main()", "diagnose", "--mlflow-run", source_id,
         "--trust-run-dataset", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient()
    child = client.get_run(source_id).data.tags["gradian.diagnosis.diagnose"]
    run = client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == source_id and run.data.tags["gradian.kind"] == "diagnose"
    # lr 0.002 x alpha/r 2 and 12 epochs over 5 rows: the audit read the run's params from MLflow
    findings = json.loads((tmp_path / "out" / "diagnose.json").read_text())["findings"]
    assert {"config.lr_too_high", "config.overtraining"} <= {f["id"] for f in findings}
    assert run.data.metrics["audit.n_findings"] == len(findings)

    proc = subprocess.run(
        [sys.executable, "-c", "from gradian.cli import main; main()", "diagnose", "--mlflow-run", source_id,
         "--trust-run-dataset", "--no-log"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0
    assert client.get_run(source_id).data.tags["gradian.diagnosis.diagnose"] == child  # nothing new logged


def test_run_logged_by_a_plain_hf_trainer_is_read(tracking, tmp_path, monkeypatch, chat_tokenizer):
    """A user's own run: HF Trainer + its MLflowCallback, checkpoints logged as models, nothing of ours."""
    import mlflow
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from gradian_mlflow.source import read_mlflow_run

    monkeypatch.setenv("HF_MLFLOW_LOG_ARTIFACTS", "1")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "plain-hf-trainer")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(chat_tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    ids = chat_tokenizer("hello world , what is the capital of france ? paris")["input_ids"]
    rows = [{"input_ids": ids, "labels": ids} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_train_epochs=2,
                             learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=4,
                             report_to=["mlflow"], warmup_steps=0.1, use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows).train()
    run_id = mlflow.last_active_run().info.run_id
    mlflow.end_run()

    record = read_mlflow_run(run_id, cache_dir=tmp_path / "cache")
    assert record.config.learning_rate == pytest.approx(1e-3) and record.config.num_train_epochs == 2
    assert record.config.warmup_ratio == pytest.approx(0.1)
    assert record.lora.r == 4 and record.lora.alpha == 16  # from the checkpoint's adapter_config.json
    assert record.effective_lora_lr == pytest.approx(4e-3)
    assert Path(record.adapter_dir, "adapter_model.safetensors").is_file()
    assert not any(p.name in ("training_args.bin", "optimizer.pt") for p in Path(record.adapter_dir).iterdir())
    assert [s.step for s in record.logs.steps if s.loss is not None] == list(range(1, 9))
    assert len(record.checkpoints) == 2  # checkpoint-4 and checkpoint-8, oldest first


def test_attribute_on_a_run_without_adapter_exits_2_naming_the_search(tracking, data_file, tmp_path):
    import subprocess
    import sys

    import mlflow

    with mlflow.start_run() as run:
        mlflow.log_param("learning_rate", "1e-4")
    proc = subprocess.run(
        [sys.executable, "-m", "gradian", "attribute", "--mlflow-run", run.info.run_id, "--dataset", str(data_file)],
        capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "has no adapter" in lines[0] and "logged models" in lines[0] and "checkpoint-N" in lines[0]


def test_report_metrics_cover_counterfactual_reports():
    from gradian.report.tracker import report_metrics, run_tags

    counterfactual = _counterfactual(
        _removal("cluster poison: --drop-cluster", "poison", 48),
        ground_truth=GroundTruth(n_removed=48, n_planted=48, n_planted_removed=48, precision=1.0, recall=1.0),
        predicted=PredictedSums(n=800, sum_all=-268.3, sum_removed=-893.7, sum_kept=625.4,
                                predicted_loss_delta_if_removed=-0.34, sign_all=-1, sign_kept=1, sign_changed=True))
    counterfactual.capability.before_source = "the accusing report"
    report = Report(manifest=CounterfactualManifest(), counterfactual=counterfactual).to_json()
    report["counterfactual"]["capability"]["note"] = "x"
    metrics = report_metrics(report)
    assert metrics["counterfactual.after"] == 0.9375 and metrics["counterfactual.recovered_fraction"] == 0.92
    assert metrics["counterfactual.removal_precision"] == 1.0 and metrics["counterfactual.n_removed"] == 48
    assert metrics["counterfactual.predicted.sign_changed"] == 1.0 and "counterfactual.note" not in metrics
    assert "counterfactual.before_source" not in metrics
    assert run_tags(Report.of(report), "a" * 32, "counterfactual")["gradian.counterfactual_outcome"] == "recovered"


def test_a_regression_read_from_too_few_items_is_not_logged_as_one():
    from gradian.report.tracker import report_metrics

    capability = _capability(name="c", delta=-1.0, n_items=1, min_items=5)
    assert report_metrics(Report(capability=capability).to_json())["capability.regressed"] == 1.0
    capability.too_few_items = True
    few = report_metrics(Report(capability=capability).to_json())
    assert few["capability.regressed"] == 0.0 and few["capability.delta"] == -1.0


@pytest.mark.parametrize("case", ["misspelled scheme", "not a database", "no store at the path"])
def test_a_tracking_uri_that_cannot_hold_the_run_is_one_line_naming_it(tmp_path, case):
    garbage = tmp_path / "garbage.db"
    garbage.write_text("not a database\n")
    uri, expected = {
        "misspelled scheme": ("htp://127.0.0.1:5000", "'htp' is not a tracking store scheme"),
        "not a database": (f"sqlite:///{garbage}", "is not an SQLite database"),
        "no store at the path": (f"sqlite:///{tmp_path / 'typo' / 'mlflow.db'}", "no SQLite store at"),
    }[case]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    proc = subprocess.run([sys.executable, "-m", "gradian", "diagnose", "--mlflow-run", "0" * 32],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert expected in lines[0] and "MLFLOW_TRACKING_URI" in lines[0]
    assert not (tmp_path / "typo").exists()  # no empty store was created at the mistyped path


@pytest.mark.parametrize("marker", [b"{not json", b"\xff\xfe\x00binary", b"[1, 2]"])
def test_a_damaged_download_marker_means_download_again(tmp_path, marker):
    from gradian_mlflow.source import _MARKER, _cached_download

    source = tmp_path / "artifacts" / "adapter"
    source.mkdir(parents=True)
    (source / "adapter_config.json").write_text('{"r": 8}')
    cache = tmp_path / "cache"
    first = _cached_download(str(source), cache)
    assert (first / "adapter_config.json").read_text() == '{"r": 8}'
    (first / _MARKER).write_bytes(marker)
    (first / "adapter_config.json").write_text('{"r": 999}')  # what a damaged cache would hand out
    notes: list[str] = []
    again = _cached_download(str(source), cache, notes=notes)
    assert again == first and (again / "adapter_config.json").read_text() == '{"r": 8}'
    assert notes == [f"repaired the cached download of {source} in {first}: its record of the files is damaged; "
                     "downloaded it again"]


def test_a_damaged_sqlite_store_is_one_line_exit_3(tmp_path):
    good = tmp_path / "good.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{good}"}
    made = subprocess.run([sys.executable, "-c", "import mlflow\nmlflow.set_experiment('x')\n"
                           "with mlflow.start_run() as r: print(r.info.run_id)"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    run_id = made.stdout.strip().splitlines()[-1]
    data = bytearray(good.read_bytes())
    for i in range(200, len(data), 7):  # the header stays valid, the pages do not
        data[i] = 0xAB
    bad = tmp_path / "bad.db"
    bad.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "gradian", "diagnose", "--mlflow-run", run_id], capture_output=True,
                          text=True, env={**env, "MLFLOW_TRACKING_URI": f"sqlite:///{bad}"}, cwd=tmp_path, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 3 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "the tracking store at" in lines[0] and "cannot be read" in lines[0]


def test_a_run_logged_without_its_learning_rate_gets_it_from_the_logged_rates(tmp_path, monkeypatch):
    """Per-step metrics and the run's length, no learning rate: the peak rate, the schedule and the
    warmup are fitted to the logged rates and labelled as inferred, as for a run folder."""
    import mlflow

    from gradian_mlflow.source import read_mlflow_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = client.create_experiment("no-args")
        run_id = client.create_run(experiment).info.run_id
        total, warmup, peak = 100, 10, 3e-4
        client.log_param(run_id, "max_steps", total)  # the length is known, the rate is not
        for step in range(1, total + 1):
            done = step - 1  # as the Trainer logs it: the rate set after step - 1 scheduler steps
            rate = peak * done / warmup if done < warmup else peak * (total - done) / (total - warmup)
            client.log_metric(run_id, "learning_rate", rate, step=step)
            client.log_metric(run_id, "loss", 2.0 - step / total, step=step)
        client.set_terminated(run_id)
        record = read_mlflow_run(run_id, cache_dir=tmp_path / "cache", client=client)
    finally:
        mlflow.set_tracking_uri(previous)
    assert record.config.learning_rate == pytest.approx(peak, rel=0.02)
    assert record.config.lr_scheduler_type == "linear" and record.config.warmup_steps == warmup
    assert "fitted to 100 logged learning rates" in record.inferred["learning_rate"]


def _params_only_run(mlflow, base: str) -> str:
    """A run as the HF / TRL callback logs it by default: params and metrics, no artifact."""
    with mlflow.start_run() as run:
        mlflow.log_params({**HF_PARAMS, "_name_or_path": base, "max_length": "64", "packing": "False",
                           "completion_only_loss": "None"})
        for step in range(1, 5):
            mlflow.log_metrics({"loss": 2.0 - 0.1 * step, "learning_rate": 2e-4, "grad_norm": 1.0}, step=step)
    return run.info.run_id


def test_a_params_only_run_names_its_base_model_and_the_audit_uses_its_tokenizer(tracking, tiny_lora_dirs, tmp_path):
    """No artifacts, no --base-model: the base model (and so the tokenizer) comes from the run's
    ``_name_or_path`` param; one that is not a folder here is named in the skip lines with the flag."""
    import mlflow

    from gradian.config import load_config
    from gradian.audit.session import diagnose
    from gradian_mlflow.source import read_mlflow_run

    base, _ = tiny_lora_dirs
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i} ?", "completion": f"{i}"}) + "\n" for i in range(8)))
    run_id = _params_only_run(mlflow, str(base))
    record = read_mlflow_run(run_id, cache_dir=tmp_path / "cache")
    assert record.lora.base_model == str(base) and record.inferred["base_model"] == "the run's param _name_or_path"
    assert record.config.max_seq_length == 64
    cfg = load_config(None, {"run": f"mlflow:{run_id}", "dataset": str(data), "cache_dir": str(tmp_path / "cache")})
    result = diagnose(cfg).result
    assert not [s for s in result.skipped if "tokenizer" in s.reason], result.skipped
    assert "data.truncated" in result.ran

    elsewhere = _params_only_run(mlflow, "/models/not-here/qwen")
    cfg = load_config(None, {"run": f"mlflow:{elsewhere}", "dataset": str(data), "cache_dir": str(tmp_path / "cache")})
    reasons = {s.reason for s in diagnose(cfg).result.skipped if "tokenizer" in s.reason}
    assert reasons == {"no tokenizer: the run's param _name_or_path names /models/not-here/qwen, which is not a "
                       "folder on this machine (pass --base-model DIR, or set `tokenizer` in the config)"}


def test_an_experiment_kind_the_user_set_or_one_with_traces_is_left_alone(tracking):
    import mlflow
    from mlflow import MlflowClient

    from gradian_mlflow.experiment import mark_training_experiment

    client = MlflowClient()
    chosen = client.create_experiment("genai-by-choice", tags={"mlflow.experimentKind": "genai_development"})
    assert not mark_training_experiment(client, chosen)
    assert client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"
    traced = client.create_experiment("with-traces")
    mlflow.set_experiment(experiment_id=traced)

    @mlflow.trace
    def answer(question: str) -> str:
        return question.upper()

    answer("hello")
    mlflow.flush_trace_async_logging() if hasattr(mlflow, "flush_trace_async_logging") else None
    assert not mark_training_experiment(client, traced)
    assert "mlflow.experimentKind" not in client.get_experiment(traced).tags
    plain = client.create_experiment("plain")
    assert mark_training_experiment(client, plain) and not mark_training_experiment(client, plain)
    assert client.get_experiment(plain).tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_child_run_lists_the_data_it_read_as_dataset_inputs(tracking, adapter_dir, data_file, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    from gradian.report.schema import AnalysisInputs, DatasetSummary
    from gradian_mlflow.sink import log_diagnosis

    source_id = log_hf_style_run(mlflow, adapter_dir, data_file)
    report = Report.of(REPORT)
    report.manifest.inputs = AnalysisInputs(
        dataset=DatasetSummary(path=str(data_file), sha256="ab" * 32, n_examples=48),
        eval_dataset=DatasetSummary(path=str(tmp_path / "eval.jsonl"), sha256="cd" * 32, n_examples=16))
    child = log_diagnosis(report, source_id, kind="attribute")
    inputs = MlflowClient().get_run(child).inputs.dataset_inputs
    seen = {(d.dataset.name, d.dataset.digest, {t.key: t.value for t in d.tags}["mlflow.data.context"],
             json.loads(d.dataset.source)["uri"], json.loads(d.dataset.profile)["num_rows"]) for d in inputs}
    assert seen == {(data_file.name, "ab" * 8, "training", str(data_file), 48),
                    ("eval.jsonl", "cd" * 8, "evaluation", str(tmp_path / "eval.jsonl"), 16)}


def test_a_counterfactual_report_gives_the_kept_rows_and_the_eval_file_as_inputs(tmp_path):
    from gradian.report.schema import CounterfactualInputs, CounterfactualManifest, DatasetSummary, Report, Verdict
    from gradian_mlflow.sink import dataset_inputs

    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"prompt": "q", "completion": "a"}\n')
    inputs = CounterfactualInputs(dataset=DatasetSummary(path="train.jsonl", sha256="ab" * 32, n_examples=848),
                                  kept_dataset=DatasetSummary(path="kept.jsonl", sha256="cd" * 32, n_examples=800),
                                  eval_dataset=str(evals), base_model=None, adapter_before=None, adapter_after=None,
                                  capability="capitals", seed=0)
    report = Report(verdict=Verdict(kind="data", summary=""), manifest=CounterfactualManifest(inputs=inputs))
    import hashlib

    seen = [(d.dataset.name, d.dataset.digest, d.tags[0].value) for d in dataset_inputs(report)]
    assert seen == [("kept.jsonl", "cd" * 8, "training"),
                    ("eval.jsonl", hashlib.sha256(evals.read_bytes()).hexdigest()[:16], "evaluation")]


def _log_logged_model_run(mlflow, adapter_dir: Path, tmp_path: Path) -> str:
    """A run whose only adapter is a LoggedModel, as the HF callback logs checkpoints in MLflow 3."""
    ckpt = tmp_path / "out" / "checkpoint-6"
    ckpt.mkdir(parents=True)
    for f in adapter_dir.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    with mlflow.start_run() as run:
        mlflow.log_params({"learning_rate": "0.0002"})
        mlflow.pyfunc.log_model(name="checkpoint-6", artifacts={"model_path": str(ckpt)},
                                python_model=mlflow.pyfunc.PythonModel())
    return run.info.run_id


def _attribute_report(adapter: str | None, data_file: Path, eval_file: Path) -> Report:
    from gradian.report.schema import AnalysisInputs, DatasetSummary

    report = Report.of(REPORT)
    report.manifest.inputs = AnalysisInputs(
        dataset=DatasetSummary(path=str(data_file), sha256=None, n_examples=5),
        eval_dataset=DatasetSummary(path=str(eval_file), sha256=None, n_examples=1), adapter=adapter)
    return report


def test_the_child_run_names_the_logged_model_it_analyzed_and_ties_the_capability_to_it(tracking, adapter_dir,
                                                                                          data_file, tmp_path):
    """An adapter read from a LoggedModel is the child's model input, and the capability metrics are
    logged against that model and the eval set (so they show on the model's page); an adapter from a
    local folder names no model."""
    import mlflow
    from mlflow import MlflowClient

    from gradian_mlflow.sink import log_diagnosis
    from gradian_mlflow.source import read_mlflow_run

    client = MlflowClient()
    source_id = _log_logged_model_run(mlflow, adapter_dir, tmp_path)
    (model_output,) = client.get_run(source_id).outputs.model_outputs
    record = read_mlflow_run(source_id, cache_dir=tmp_path / "cache")
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"prompt": "q", "completion": "a"}\n')

    child = log_diagnosis(_attribute_report(record.adapter_dir, data_file, eval_file), source_id, kind="attribute")
    inputs = client.get_run(child).inputs
    assert [m.model_id for m in inputs.model_inputs] == [model_output.model_id]
    on_model = {m.key: m for m in client.get_logged_model(model_output.model_id).metrics}
    assert on_model["capability.delta"].value == -0.5 and on_model["capability.delta"].run_id == child
    eval_input = next(d.dataset for d in inputs.dataset_inputs if d.dataset.name == "eval.jsonl")
    assert (on_model["capability.delta"].dataset_name, on_model["capability.delta"].dataset_digest) == (
        "eval.jsonl", eval_input.digest)
    assert not any(k.startswith("attribution.") for k in on_model)  # only the capability is the model's
    assert client.get_run(child).data.metrics["capability.delta"] == -0.5  # still a metric of the run

    local = log_diagnosis(_attribute_report(str(adapter_dir), data_file, eval_file), source_id, kind="attribute")
    assert client.get_run(local).inputs.model_inputs == []
    assert all(m.run_id != local for m in client.get_logged_model(model_output.model_id).metrics)


def test_the_child_run_says_whether_the_training_data_is_the_one_the_run_logged(tracking, adapter_dir, data_file,
                                                                                 tmp_path, capsys):
    import hashlib

    import mlflow
    from mlflow import MlflowClient

    from gradian_mlflow.sink import log_diagnosis

    client = MlflowClient()
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"prompt": "q", "completion": "a"}\n')
    source_id = log_hf_style_run(mlflow, adapter_dir, data_file)  # a pandas dataset input, digest by MLflow
    same = log_diagnosis(_attribute_report(None, data_file, eval_file), source_id, kind="attribute")
    assert client.get_run(same).data.tags["gradian.training_data"] == "same"
    assert "changed since training" not in capsys.readouterr().err

    data_file.write_text(data_file.read_text() + json.dumps({"prompt": "q9", "completion": "a9"}) + "\n")
    changed = log_diagnosis(_attribute_report(None, data_file, eval_file), source_id, kind="attribute")
    tags = client.get_run(changed).data.tags
    assert tags["gradian.training_data"] == "changed" and str(data_file) in tags["gradian.training_data_note"]
    assert "changed since training" in capsys.readouterr().err

    # a run trained through Gradian records the file's sha256, which decides alone
    with mlflow.start_run() as run:
        mlflow.set_tag("gradian.dataset_sha256", hashlib.sha256(data_file.read_bytes()).hexdigest())
    recorded = log_diagnosis(_attribute_report(None, data_file, eval_file), run.info.run_id, kind="attribute")
    assert client.get_run(recorded).data.tags["gradian.training_data"] == "same"
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "x", "completion": "y"}\n')
    moved = log_diagnosis(_attribute_report(None, other, eval_file), run.info.run_id, kind="attribute")
    assert client.get_run(moved).data.tags["gradian.training_data"] == "changed"

    # a run that logged no training data has nothing to compare with: no claim either way
    with mlflow.start_run() as bare:
        mlflow.log_param("learning_rate", "1e-4")
    quiet = log_diagnosis(_attribute_report(None, data_file, eval_file), bare.info.run_id, kind="attribute")
    assert "gradian.training_data" not in client.get_run(quiet).data.tags


def test_a_base_model_the_run_names_but_this_machine_lacks_is_named_with_the_flag(tracking, data_file, tmp_path):
    """A params-only run (the TRL / HF callback's defaults) whose _name_or_path is a path of the
    training machine: every check that needs the tokenizer says which param named what, and which
    flag brings it back; the diagnosis itself still runs."""
    import subprocess
    import sys

    import mlflow

    with mlflow.start_run() as run:
        mlflow.log_params({"_name_or_path": "/training-box/models/qwen-0.5b", "learning_rate": "2e-4"})
    proc = subprocess.run(
        [sys.executable, "-c", "from gradian.cli import main; main()", "diagnose", "--mlflow-run", run.info.run_id,
         "--dataset", str(data_file), "--out", str(tmp_path / "out"), "--no-log"],
        capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skipped = json.loads((tmp_path / "out" / "diagnose.json").read_text())["skipped"]
    reasons = {s["reason"] for s in skipped if "tokenizer" in s["reason"]}
    assert reasons, skipped
    for reason in reasons:
        assert "_name_or_path" in reason and "/training-box/models/qwen-0.5b" in reason and "--base-model" in reason


def test_the_checkpoints_optimizer_states_are_downloaded_for_the_replay_only(tracking, adapter_dir, data_file,
                                                                               tmp_path):
    """A run that logged its checkpoints with optimizer.pt: read for the replay engine (its
    run_options), each checkpoint comes with it; read otherwise, only the adapter files come."""
    import shutil

    import mlflow

    from gradian.config import load_config
    from gradian.runs import run_options
    from gradian_mlflow.source import read_mlflow_run

    folder = tmp_path / "checkpoint"
    shutil.copytree(adapter_dir, folder)
    (folder / "optimizer.pt").write_bytes(b"moments")
    with mlflow.start_run() as run:
        mlflow.log_params(HF_PARAMS)
        mlflow.log_artifacts(str(adapter_dir), artifact_path="adapter")
        mlflow.log_artifacts(str(folder), artifact_path="checkpoint-4")
    assert run_options(load_config(None, {"engine.name": "replay"})) == {"optimizer_states": True}
    assert run_options(load_config(None, {"engine.name": "replay", "engine.replay_start": "beginning"})) == {}
    assert run_options(load_config(None, {})) == {}
    plain = read_mlflow_run(run.info.run_id, cache_dir=tmp_path / "cache", dataset_given=True)
    (checkpoint,) = plain.checkpoints
    assert Path(checkpoint, "adapter_model.safetensors").is_file() and not Path(checkpoint, "optimizer.pt").exists()
    full = read_mlflow_run(run.info.run_id, cache_dir=tmp_path / "cache", dataset_given=True,
                           **run_options(load_config(None, {"engine.name": "replay"})))
    (checkpoint,) = full.checkpoints
    assert Path(checkpoint, "optimizer.pt").read_bytes() == b"moments"
    assert Path(checkpoint, "adapter_model.safetensors").is_file()
