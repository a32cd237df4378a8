"""`mlflow run` end to end against a real tracking server: fine-tune, then attribute as child runs.

The fine-tune is the `projects/finetune` MLflow project (HF Trainer + MLflowCallback, adapter and
dataset logged), the kind of run a user brings. `mlflow run . -e attribute` must then log the
diagnosis as a child of that run, in its experiment, with the report, rankings and metrics.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]


def _env(uri: str) -> dict[str, str]:
    env = dict(os.environ)
    env["MLFLOW_TRACKING_URI"] = uri
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` = this venv
    return env


def _mlflow_run(args: list[str], uri: str, cwd: Path) -> str:
    mlflow_bin = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.run([mlflow_bin, "run", *args, "--env-manager", "local"], capture_output=True, text=True,
                          env=_env(uri), cwd=cwd, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    match = re.search(r"Run \(ID '([0-9a-f]{32})'\) succeeded", output)
    assert match, output[-2000:]
    return match.group(1)


@pytest.fixture(scope="module")
def finetuned(tracking, tinyworld_base, tmp_path_factory):
    """A poisoned fine-tune logged by the projects/finetune MLflow project; returns (run id, scenario dir)."""
    from mlflow import MlflowClient

    from gradian.tinyworld import write_scenario

    work = tmp_path_factory.mktemp("mlflow-projects")
    write_scenario("poison_capitals", work / "scenario", base_model=tinyworld_base)
    client = MlflowClient()
    experiment_id = client.create_experiment(f"projects-{work.name}")
    run_id = _mlflow_run([str(ROOT / "projects" / "finetune"), "--experiment-id", experiment_id,
                          "-P", f"config={work / 'scenario' / 'gradian.yaml'}", "-P", f"out={work / 'run'}"],
                         tracking, work)
    # the diagnosis settings: the scenario's metric and clustering, but the run itself from MLflow
    config = yaml.safe_load((work / "scenario" / "gradian.yaml").read_text())
    for key in ("adapter_path", "run", "dataset"):
        config.pop(key)
    config["cache_dir"] = str(work / "cache")
    (work / "diagnosis.yaml").write_text(yaml.safe_dump(config))
    return run_id, experiment_id, work


@pytest.fixture(scope="module")
def tracking(mlflow_server):
    import mlflow

    from tests.plugins.mlflow_server import forget_active_experiment

    keys = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")
    previous = {key: os.environ.get(key) for key in keys}
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_server
    mlflow.set_tracking_uri(mlflow_server)
    yield mlflow_server
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    forget_active_experiment()


def test_finetune_project_logs_a_readable_run(finetuned):
    from mlflow import MlflowClient

    from gradian_mlflow.source import read_mlflow_run

    run_id, experiment_id, work = finetuned
    run = MlflowClient().get_run(run_id)
    assert run.info.experiment_id == experiment_id and run.info.status == "FINISHED"
    assert float(run.data.params["learning_rate"]) > 0  # logged by the HF MLflowCallback
    record = read_mlflow_run(run_id, cache_dir=work / "read")
    assert record.lora.r == 8 and record.config.max_seq_length == 256  # from training_args.json
    assert len(record.logs.steps) > 10 and Path(record.dataset.path).is_file()


def test_attribute_entry_point_logs_child_runs(finetuned, tracking):
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    run_id, experiment_id, work = finetuned
    client = MlflowClient()
    children = {}
    # the second run leaves `engine` unset: the engine of its config file is used
    import yaml

    config = yaml.safe_load((work / "diagnosis.yaml").read_text()) or {}
    config.setdefault("engine", {})["name"] = "kfac"  # not the default, so it shows the config won
    (work / "diagnosis-kfac.yaml").write_text(yaml.safe_dump(config))
    for engine, cross, config_file, params in (
            ("datainf", "graddot", "diagnosis.yaml", ["-P", "engine=datainf"]),
            ("kfac", "none", "diagnosis-kfac.yaml", [])):
        child = _mlflow_run([str(ROOT), "-e", "attribute", "--experiment-id", experiment_id,
                             "-P", f"run_id={run_id}", "-P", f"config={work / config_file}",
                             "-P", "capability=capitals", *params, "-P", f"cross_check={cross}"],
                            tracking, work)
        children[engine] = client.get_run(child)

    for engine, run in children.items():
        assert run.data.tags["mlflow.parentRunId"] == run_id
        assert run.info.experiment_id == experiment_id
        assert run.data.tags["gradian.kind"] == "attribute" and run.data.tags["gradian.source_run_id"] == run_id
        # a parameter left empty keeps MLflow's logged value; the one used sits beside it
        assert run.data.params.get("engine.resolved", run.data.params["engine"]) == engine
        assert run.data.params["damping"] == "0.1" and run.data.params["damping_kind"] == "scale"
        assert run.data.params.get("fisher") == ("empirical" if engine == "kfac" else None)
        assert run.data.params.get("ranking") == ("relatif" if engine == "kfac" else None)  # the default order
        for key in ("capability.delta", "capability.ci_low", "capability.ci_high"):
            assert key in run.data.metrics
        dst = work / f"dl-{engine}"
        report = json.loads(Path(download_artifacts(run_id=run.info.run_id, artifact_path="gradian/report.json",
                                                    dst_path=str(dst))).read_text())
        rankings = pd.read_parquet(download_artifacts(run_id=run.info.run_id,
                                                      artifact_path="gradian/rankings.parquet", dst_path=str(dst)))
        assert len(rankings) == report["attribution"]["n_examples"]
        assert run.data.metrics["capability.delta"] == pytest.approx(report["capability"]["delta"])
        top = report["attribution"]["top_harmful"]
        if top:  # the most harmful row heads the rankings too (harm over the query's items, the default order)
            row = rankings.set_index("example_id").loc[top[0]["example_id"]]
            assert row["harm_rank"] == 0 and row.get("rank_score", row["score"]) < 0 and top[0]["score"] < 0
    # both engines' diagnoses sit under the same source with the same metric keys, so the UI compares them
    assert set(children["datainf"].data.metrics) - {"attribution.engine_agreement_spearman"} == \
        set(children["kfac"].data.metrics) - {"attribution.engine_agreement_spearman"}
    source = client.get_run(run_id)
    assert source.data.tags["gradian.diagnosis.attribute"] in {r.info.run_id for r in children.values()}


def test_index_entry_point_shards_over_processes_and_logs_once(finetuned, tracking):
    """``-P nproc=2``: the entry point starts itself again under torchrun; both processes build
    one index in the shared cache, and only the first logs the index run."""
    from mlflow import MlflowClient

    run_id, experiment_id, work = finetuned
    config = yaml.safe_load((work / "diagnosis.yaml").read_text())
    config["cache_dir"] = str(work / "cache-sharded")
    (work / "diagnosis-sharded.yaml").write_text(yaml.safe_dump(config))
    child = _mlflow_run([str(ROOT), "-e", "index", "--experiment-id", experiment_id, "-P", f"run_id={run_id}",
                         "-P", f"config={work / 'diagnosis-sharded.yaml'}", "-P", "nproc=2"], tracking, work)
    run = MlflowClient().get_run(child)
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == run_id
    assert run.data.tags["gradian.kind"] == "index"
    manifests = list((work / "cache-sharded" / "index").glob("*/manifest.json"))
    assert len(manifests) == 1
    manifest = json.loads(manifests[0].read_text())
    assert manifest["status"] == "complete" and manifest["n_chunks_done"] == manifest["n_chunks"]
    assert not list(manifests[0].parent.glob("chunks/*.record.json"))  # gathered into the manifest


def test_the_entry_point_relaunches_itself_under_torchrun():
    from gradian_mlflow.entry import main, torchrun_command

    command = torchrun_command(["index", "--run-id", "abc", "--nproc", "4", "--config", "c.yaml"], 4)
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert command[5:] == ["-m", "gradian_mlflow.entry", "index", "--run-id", "abc", "--config", "c.yaml"]
    with pytest.raises(SystemExit) as exit_info:
        main(["index", "--run-id", "abc", "--nproc", "0"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("entry_point", ["attribute", "index"])
def test_the_adapter_out_and_force_parameters_reach_the_cli(monkeypatch, entry_point):
    from gradian_mlflow import entry

    spec = yaml.safe_load((ROOT / "MLproject").read_text())["entry_points"][entry_point]
    names = {"adapter", "force"} | ({"out"} if entry_point == "attribute" else set())
    for name in names:
        assert name in spec["parameters"] and f"{{{name}}}" in spec["command"]
    argv: list[str] = []
    monkeypatch.setattr(entry, "_cli", argv.extend)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    extra = ["--out", "/tmp/o"] if entry_point == "attribute" else []
    entry.main([entry_point, "--run-id", "e" * 32, "--adapter", "/tmp/a", "--force", "true", *extra])
    assert argv[argv.index("--adapter") + 1] == "/tmp/a" and "--force" in argv
    assert "true" not in argv  # a switch, not a flag with a value
    if extra:
        assert argv[argv.index("--out") + 1] == "/tmp/o"
    argv.clear()
    entry.main([entry_point, "--run-id", "e" * 32, "--adapter", "", "--force", "false"])
    assert "--force" not in argv and "--adapter" not in argv  # the defaults mean "not given"
    with pytest.raises(SystemExit) as exit_info:
        entry.main([entry_point, "--run-id", "e" * 32, "--force", "maybe"])
    assert exit_info.value.code == 2


def test_engine_and_cross_check_left_empty_are_not_passed_so_the_config_and_cli_defaults_hold(monkeypatch):
    from gradian_mlflow import entry

    spec = yaml.safe_load((ROOT / "MLproject").read_text())["entry_points"]["attribute"]["parameters"]
    assert spec["engine"]["default"] == "" and spec["cross_check"]["default"] == ""
    argv: list[str] = []
    monkeypatch.setattr(entry, "_cli", argv.extend)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    entry.main(["attribute", "--run-id", "e" * 32, "--engine", "", "--cross-check", ""])
    assert "--engine" not in argv and "--cross-check" not in argv


def test_the_counterfactual_rounds_parameters_reach_the_cli(monkeypatch):
    from gradian_mlflow import entry

    spec = yaml.safe_load((ROOT / "MLproject").read_text())["entry_points"]["counterfactual"]
    for name in ("until_recovered", "max_rounds"):
        assert name in spec["parameters"] and f"{{{name}}}" in spec["command"]
    argv: list[str] = []
    monkeypatch.setattr(entry, "_cli", argv.extend)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    entry.main(["counterfactual", "--run-id", "e" * 32, "--drop", "accused", "--until-recovered", "true",
                "--max-rounds", "4"])
    assert "--until-recovered" in argv and argv[argv.index("--max-rounds") + 1] == "4"
    argv.clear()
    entry.main(["counterfactual", "--run-id", "e" * 32, "--until-recovered", "false", "--max-rounds", ""])
    assert "--until-recovered" not in argv and "--max-rounds" not in argv
