"""The MLflow UI as the place to compare diagnoses, driven in a real headless Chromium.

A tinyworld fine-tune is logged by ``train_and_log`` to a real ``mlflow server`` (in an
experiment it creates), attributed twice (DataInf and graddot) with the pipeline, and each report
logged back through the report sink as a child run. Then the UI, a React app, is loaded and its
DOM read after it settles (``--virtual-time-budget`` lets the page's requests finish): the link
Gradian prints opens the experiment's runs table, the fine-tune's run page lists both child runs by
name, and the compare view of the two shows their shared metrics side by side.

Needs a Chromium binary (Debian/Ubuntu: ``apt-get install -y chromium``); without one the test is
skipped with that reason (as ``tests/test_report_browser.py``).
"""

from __future__ import annotations

import html
import json
import re
import subprocess

import pytest

from tests.test_report_browser import _browser

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about 30 s past the server: a fine-tune, two attributions

ENGINES = ("datainf", "graddot")


def _page_text(browser: str, url: str) -> str:
    """The visible text of ``url`` once the app has rendered (scripts and styles dropped)."""
    done = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--virtual-time-budget=20000", "--window-size=1600,2000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", done.stdout, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser, looked up before the server starts or the model trains (skip without one)."""
    return _browser()


@pytest.fixture(scope="module")
def scenario_config(tinyworld_base, tmp_path_factory):
    """A gradian.yaml for 24 poison_capitals rows (8 planted) and 8 capitals items, 2 epochs."""
    import yaml

    from gradian.tinyworld import write_scenario

    root = tmp_path_factory.mktemp("ui-scenario")
    write_scenario("poison_capitals", root, tinyworld_base)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    poison = [r for r in rows if r.get("cluster") == "poison"][:8]
    clean = [r for r in rows if r.get("cluster") != "poison"][:16]
    (root / "small.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clean + poison))
    items = (root / "eval.jsonl").read_text().splitlines()[:8]
    (root / "items.jsonl").write_text("".join(line + "\n" for line in items))
    config = yaml.safe_load((root / "gradian.yaml").read_text())
    for key in ("run", "adapter_path"):
        config.pop(key, None)
    config.update({"dataset": str(root / "small.jsonl"), "eval_dataset": str(root / "items.jsonl"),
                   "cache_dir": str(root / ".gradian"), "device": "cpu"})
    config["train"].update({"num_train_epochs": 2, "output_dir": str(root / "run")})
    config["evaluation"].update({"max_new_tokens": 8, "require_significant": False})
    (root / "ui.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root / "ui.yaml"


def test_fine_tune_page_lists_its_diagnoses_and_compare_view_shows_shared_metrics(chromium, tracking, scenario_config,
                                                                                   tmp_path):
    import time

    from mlflow import MlflowClient

    from gradian.attribution import run_attribution
    from gradian.config import load_config
    from gradian.report.sinks import publish_report
    from gradian.runs import resolve_run
    from gradian_mlflow.experiment import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND, training_view_url
    from gradian_mlflow.training import train_and_log

    client = MlflowClient()
    source_id = train_and_log(scenario_config, tmp_path / "run", experiment=f"gradian-ui-{time.time_ns()}",
                              run_name="finetune-poison")
    experiment_id = client.get_run(source_id).info.experiment_id
    assert client.get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND

    record = resolve_run(f"mlflow:{source_id}", cache_dir=tmp_path / "cache")
    children = {}
    for engine in ENGINES:
        cfg = load_config(scenario_config, {"engine.name": engine})
        outcome = run_attribution(cfg, capability="capitals", cross_check="none", run=record, out_dir=tmp_path / engine)
        children[engine] = publish_report(outcome.run.source, outcome.report, "attribute", outcome.files,
                                          rankings=outcome.rankings)
        # the child run spans the attribution (the manifest's seconds), not only its logging
        info = client.get_run(children[engine]).info
        assert info.end_time - info.start_time >= outcome.report.to_json()["manifest"]["seconds"] * 1000
    names = {engine: client.get_run(run_id).info.run_name for engine, run_id in children.items()}
    assert names == {engine: f"attribute-{engine}-capitals" for engine in ENGINES}

    # the link Gradian prints lands on the experiment's runs table (the training face), not GenAI's overview
    experiment_page = _page_text(chromium, training_view_url(tracking, experiment_id))
    assert "finetune-poison" in experiment_page and "matching runs" in experiment_page, experiment_page[:3000]
    assert "Traces 0" not in experiment_page  # GenAI's overview

    page = _page_text(chromium, training_view_url(tracking, experiment_id, source_id))
    assert "finetune-poison" in page and "Child runs" in page
    for name in names.values():
        assert name in page, page[:3000]

    runs = json.dumps(list(children.values()), separators=(",", ":"))
    compare = _page_text(chromium, f"{tracking}/#/compare-runs?runs={runs}&experiments={json.dumps([experiment_id])}")
    assert "Comparing 2 Runs" in compare, compare[:3000]
    for name in names.values():
        assert name in compare
    # the metrics table lists its first rows by name (it scrolls), these among them
    for metric in ("attribution.gate_passed", "attribution.n_clusters", "capability.delta"):
        assert metric in compare, compare[compare.find("Metrics"):][:4000]
