"""The MLflow UI as the place to read and compare diagnoses, driven in a real headless Chromium.

A tinyworld fine-tune (24 poison_capitals rows, 8 of them planted) is logged by ``train_and_log``
to a real ``mlflow server`` (in an experiment it creates), attributed twice (DataInf and graddot)
with the pipeline, and each report logged back through the report sink as a child run; every test
of the module shares that one set-up (``diagnosed``). Then the UI, a React app, is loaded in a
fresh browser profile per page and read once it has rendered what the test waits for:

- the link Gradian prints opens the experiment's runs table; the fine-tune's page lists both
  child runs; the compare view of the two shows their shared metrics;
- a child run's page shows its two datasets (the eval set behind the "+1" overflow, opened with a
  click), the link to its parent, and its artifacts;
- the artifact viewer (``#/experiments/<id>/runs/<run>/artifacts/<path>``, the route of
  ``Routes.getRunPageRoute(experimentId, runUuid, path)`` in MLflow's UI) renders report.md's
  verdict, report.html in its frame, the rankings_top.csv table and the findings table;
- screenshots of the fine-tune, a diagnosis and the compare view are rendered pages;
- an experiment made the way a training callback makes it (no kind tag) is marked model training
  once a diagnosis is published under one of its runs, a kind the user chose is kept, and the
  printed links open the training face (runs table, run page), not GenAI's overview.

Needs a Chromium binary (Debian/Ubuntu: ``apt-get install -y chromium``); without one the test is
skipped with that reason (as ``tests/test_report_browser.py``).
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.devtools_page import DevToolsPage
from tests.test_report_browser import _browser

if TYPE_CHECKING:
    from gradian.attribution.pipeline import AttributionOutcome

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about 90 s past the server: a fine-tune, two attributions, 17 pages

ENGINES = ("datainf", "graddot")

# the closed network refuses a browser's background connections; a fresh profile per page keeps
# one page's local storage (the UI remembers its GenAI / training switch there) out of the next
_QUIET = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")
#: the window every page is laid out in (and screenshot at)
WIDTH, HEIGHT = 1600, 1200


def _cli(browser: str, *args: str) -> subprocess.CompletedProcess:
    """One headless Chromium run in a fresh profile; ``--virtual-time-budget`` lets the app's
    requests finish before the page is dumped or drawn."""
    with tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile:
        done = subprocess.run([browser, *_QUIET, f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                               f"--window-size={WIDTH},{HEIGHT}", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _dom(browser: str, url: str) -> str:
    """The DOM of ``url`` once the app has rendered."""
    return _cli(browser, "--dump-dom", url).stdout


def _visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def _page_text(browser: str, url: str) -> str:
    """The visible text of ``url`` once the app has rendered (scripts and styles dropped)."""
    return _visible_text(_dom(browser, url))


def _open(browser: str, url: str) -> DevToolsPage:
    """``url`` in a page that can be waited on and clicked (fresh profile, closed with the page)."""
    profile = tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True)
    page = DevToolsPage(browser, Path(profile.name), _QUIET, width=WIDTH, height=HEIGHT)
    page.on_close(profile.cleanup)
    page.open(url)
    return page


def _pixel_colours(png: Path) -> Counter:
    """How many pixels of ``png`` have each RGB colour."""
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.shape[:2] == (HEIGHT, WIDTH), pixels.shape
    rgb = (pixels[..., :3] * 255).round().astype("uint8").reshape(-1, 3)
    return Counter(map(bytes, rgb))


def _screenshot(browser: str, url: str, png: Path) -> Path:
    """A screenshot of ``url``, checked to be a drawn page: a blank one (or the app's bare loading
    state) is one colour with at most a spinner on it."""
    _cli(browser, f"--screenshot={png}", url)
    assert png.is_file() and png.stat().st_size > 30_000, png
    colours = _pixel_colours(png)
    background_share = colours.most_common(1)[0][1] / (WIDTH * HEIGHT)
    assert len(colours) > 200 and background_share < 0.9, (png, len(colours), background_share)
    return png


def _artifact_url(ui: str, experiment_id: str, run_id: str, path: str) -> str:
    """The artifact viewer opened at ``path`` of ``run_id``: MLflow's UI routes
    ``Routes.getRunPageRoute(experimentId, runUuid, path)`` to the run page's tab
    ``artifacts/<path>`` (routes.tsx, ``runPageWithTab``); in the training face, as Gradian's links."""
    return f"{ui}/#/experiments/{experiment_id}/runs/{run_id}/artifacts/{path}?workflowType=machine_learning"


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser, looked up before the server starts or the model trains (skip without one)."""
    return _browser()


@pytest.fixture(scope="module")
def scenario_config(tinyworld_base, tmp_path_factory):
    """A gradian.yaml for 24 poison_capitals rows (8 planted) and 8 capitals items, 2 epochs."""
    import yaml

    from gradian.tinyworld import write_scenario
    from gradian.tinyworld.scenario_kit import PLANTED_CLUSTER

    root = tmp_path_factory.mktemp("ui-scenario")
    write_scenario("poison_capitals", root, tinyworld_base)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    poison = [r for r in rows if r["cluster"] == PLANTED_CLUSTER][:8]
    clean = [r for r in rows if r["cluster"] != PLANTED_CLUSTER][:16]
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


@dataclass(frozen=True)
class Diagnosed:
    """The module's fine-tune on the server and its two diagnoses, each a child run."""

    ui: str
    experiment_id: str
    source_id: str
    #: engine name -> the child run's id
    children: dict[str, str]
    #: engine name -> what the attribution returned (report, rankings, files)
    outcomes: dict[str, AttributionOutcome]


def _compare_url(diagnosed: Diagnosed) -> str:
    """The compare view of the two diagnoses, in the training face."""
    runs = json.dumps(list(diagnosed.children.values()), separators=(",", ":"))
    return (f"{diagnosed.ui}/#/compare-runs?runs={runs}&experiments={json.dumps([diagnosed.experiment_id])}"
            "&workflowType=machine_learning")


@pytest.fixture(scope="module")
def diagnosed(chromium, mlflow_server, scenario_config, tmp_path_factory) -> Diagnosed:
    """Train once, attribute with each engine, publish each report as a child run of the fine-tune."""
    import time

    import mlflow

    from gradian.attribution import run_attribution
    from gradian.config import load_config
    from gradian.report.sinks import publish_report
    from gradian.runs import resolve_run
    from gradian_mlflow.training import train_and_log
    from tests.plugins.mlflow_server import forget_active_experiment

    tmp = tmp_path_factory.mktemp("ui-diagnosed")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        # train_and_log's set_experiment exports these; the context puts them back afterwards
        env.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
        env.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        mlflow.set_tracking_uri(mlflow_server)
        source_id = train_and_log(scenario_config, tmp / "run", experiment=f"gradian-ui-{time.time_ns()}",
                                  run_name="finetune-poison")
        record = resolve_run(f"mlflow:{source_id}", cache_dir=tmp / "cache")
        children, outcomes = {}, {}
        for engine in ENGINES:
            cfg = load_config(scenario_config, {"engine.name": engine})
            outcomes[engine] = run_attribution(cfg, capability="capitals", cross_check="none", run=record,
                                               out_dir=tmp / engine)
            children[engine] = publish_report(outcomes[engine].run.source, outcomes[engine].report, "attribute",
                                              outcomes[engine].files, rankings=outcomes[engine].rankings)
        forget_active_experiment()
        experiment_id = mlflow.MlflowClient().get_run(source_id).info.experiment_id
    return Diagnosed(mlflow_server, experiment_id, source_id, children, outcomes)


def test_the_printed_link_opens_the_runs_table_and_the_fine_tune_lists_its_diagnoses(diagnosed, tracking, chromium):
    from mlflow import MlflowClient

    from gradian_mlflow.experiment import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND, training_view_url

    client = MlflowClient()
    assert client.get_experiment(diagnosed.experiment_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    names = {engine: client.get_run(run_id).info.run_name for engine, run_id in diagnosed.children.items()}
    assert names == {engine: f"attribute-{engine}-capitals" for engine in ENGINES}
    for engine, run_id in diagnosed.children.items():
        # the child run spans the attribution (the manifest's seconds), not only its logging
        info = client.get_run(run_id).info
        assert info.end_time - info.start_time >= diagnosed.outcomes[engine].report.manifest.seconds * 1000

    # the training face's runs table, not GenAI's overview (which opens on "Traces 0")
    experiment_page = _page_text(chromium, training_view_url(diagnosed.ui, diagnosed.experiment_id))
    assert "finetune-poison" in experiment_page and "3 matching runs" in experiment_page, experiment_page[:3000]
    assert "Traces 0" not in experiment_page

    page = _page_text(chromium, training_view_url(diagnosed.ui, diagnosed.experiment_id, diagnosed.source_id))
    assert "finetune-poison" in page and "Child runs" in page
    for name in names.values():
        assert name in page, page[:3000]


def test_the_compare_view_shows_the_diagnoses_shared_metrics_side_by_side(diagnosed, chromium):
    compare = _page_text(chromium, _compare_url(diagnosed))
    assert "Comparing 2 Runs" in compare, compare[:3000]
    for engine in ENGINES:
        assert f"attribute-{engine}-capitals" in compare
    # the metrics table lists its first 17 rows by name, in order (it scrolls), these among them
    for metric in ("attribution.gate_passed", "attribution.n_clusters", "attribution.query_loss_rise", "capability.base"):
        assert metric in compare, compare[compare.find("Metrics"):][:4000]


def test_a_diagnosis_page_shows_its_datasets_its_parent_and_its_artifacts(diagnosed, chromium):
    from gradian_mlflow.experiment import training_view_url

    child = diagnosed.children["datainf"]
    inputs = diagnosed.outcomes["datainf"].report.manifest.inputs
    training, evaluation = (f"{Path(ref.path).name} ({ref.sha256[:16]})" for ref in (inputs.dataset, inputs.eval_dataset))
    assert training.startswith("small.jsonl") and evaluation.startswith("items.jsonl")
    with _open(chromium, training_view_url(diagnosed.ui, diagnosed.experiment_id, child)) as page:
        page.wait_for_text("attribute-datainf-capitals", "Datasets", training, "Parent run", "finetune-poison")
        # the overview names the first dataset and folds the other into "+1"; a click lists it
        page.click_text("+1")
        text = page.wait_for_text(evaluation)
        assert re.search(re.escape(training) + r"\s+Training\b", text), text[text.find("Datasets"):][:500]
        assert re.search(re.escape(evaluation) + r"\s+Evaluation\b", text), text[text.find(evaluation) - 200:][:500]
        assert ("finetune-poison", f"#/experiments/{diagnosed.experiment_id}/runs/{diagnosed.source_id}") in page.links()

    # the artifact tree, opened at one file, lists what the child run logged beside it
    with _open(chromium, _artifact_url(diagnosed.ui, diagnosed.experiment_id, child, "gradian/manifest.json")) as page:
        page.wait_for_text("gradian/manifest.json", "report.md", "report.html", "rankings_top.csv", "findings.json",
                           "clusters.json", "rankings.parquet", "plots")
    findings = [finding.id for finding in diagnosed.outcomes["datainf"].report.findings]
    assert "data.tiny_dataset" in findings  # 24 rows
    with _open(chromium, _artifact_url(diagnosed.ui, diagnosed.experiment_id, child, "gradian/findings.json")) as page:
        page.wait_for_text("View as table", "severity", *findings)


def test_the_artifact_viewer_renders_the_report_and_previews_the_rankings_as_a_table(diagnosed, chromium):
    outcome = diagnosed.outcomes["datainf"]
    child = diagnosed.children["datainf"]
    verdict = outcome.report.verdict
    # 2 epochs over 24 rows leave 'capitals' where it was (8 of 8 right before and after), and no
    # row scores as harmful; the rankings still order every row
    assert verdict.kind == "no_regression" and not outcome.report.attribution.top_harmful, verdict.summary
    top = outcome.rankings.sort_values("harm_rank").iloc[0]  # the most harmful row
    with _open(chromium, _artifact_url(diagnosed.ui, diagnosed.experiment_id, child, "gradian/report.md")) as page:
        # report.md's first lines, rendered: the verdict, its kind in words, and what it does not establish
        page.wait_for_text("Gradian report", f"Verdict (no_regression): {verdict.summary}",
                           "What this verdict does not establish", *verdict.hedges)
    with _open(chromium, _artifact_url(diagnosed.ui, diagnosed.experiment_id, child, "gradian/report.html")) as page:
        # the viewer renders the page in a sandboxed frame of its own: the report's own words are in there
        assert page.wait_for_element("iframe.mlflow-html-iframe[sandbox='allow-scripts']") == 1
        page.wait_for_frame_text(verdict.summary, "What this verdict does not establish",
                                 "Top harmful examples", "No example has a negative score.")

    with _open(chromium, _artifact_url(diagnosed.ui, diagnosed.experiment_id, child, "gradian/rankings_top.csv")) as page:
        text = page.wait_for_text("Previewing the first", "example_id", "harm_rank", str(top["example_id"]))
    table = text[text.find("example_id"):]
    # the most harmful row comes first: no other row's id appears before it
    shown = {eid: table.find(eid) for eid in outcome.rankings["example_id"] if eid in table}
    assert min(shown, key=shown.get) == top["example_id"], table[:1500]


def test_screenshots_of_the_fine_tune_a_diagnosis_and_the_compare_view_are_drawn_pages(diagnosed, chromium, tmp_path):
    from gradian_mlflow.experiment import training_view_url

    pages = {
        "finetune.png": training_view_url(diagnosed.ui, diagnosed.experiment_id, diagnosed.source_id),
        "diagnosis.png": training_view_url(diagnosed.ui, diagnosed.experiment_id, diagnosed.children["datainf"]),
        "compare.png": _compare_url(diagnosed),
    }
    shots = [_screenshot(chromium, url, tmp_path / name) for name, url in pages.items()]
    # three different pages, not one page (or one error screen) three times
    assert len({shot.read_bytes() for shot in shots}) == 3


def test_a_users_own_experiment_opens_in_the_training_view_once_a_diagnosis_is_published(diagnosed, tracking, chromium):
    """An experiment as a training callback makes it (``mlflow.set_experiment``, no kind tag, no
    traces) is marked model training when a report is published under its run; one whose kind the
    user set keeps it; the links printed for the diagnosis open the training face."""
    import time

    import mlflow
    from mlflow import MlflowClient

    from gradian.report.sinks import publish_report, report_link
    from gradian_mlflow.experiment import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND, training_view_url
    from tests.plugins.mlflow_server import forget_active_experiment

    client = MlflowClient()
    stamp = time.time_ns()
    mlflow.set_experiment(f"trl-sft-{stamp}")  # what the HF / TRL MLflow callback does
    with mlflow.start_run(run_name="sft-user") as run:
        mlflow.log_params({"learning_rate": "0.0002", "num_train_epochs": "2"})
        mlflow.log_metric("loss", 1.25, step=1)
    forget_active_experiment()
    users = run.info.experiment_id
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(users).tags
    chosen = client.create_experiment(f"genai-by-choice-{stamp}", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    chosen_run = client.create_run(chosen, run_name="chosen-user").info.run_id
    client.set_terminated(chosen_run)

    outcome = diagnosed.outcomes["datainf"]
    child = publish_report(f"mlflow:{run.info.run_id}", outcome.report, "attribute", outcome.files,
                           rankings=outcome.rankings)
    publish_report(f"mlflow:{chosen_run}", outcome.report, "attribute", outcome.files, rankings=outcome.rankings)
    assert client.get_experiment(users).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"

    link = report_link(f"mlflow:{run.info.run_id}", child)
    assert link == training_view_url(tracking, users, child)
    with _open(chromium, link) as page:
        # the training face's run page: its parent, its metrics; GenAI's sidebar (Observability, Judges) absent
        text = page.wait_for_text("attribute-datainf-capitals", "Parent run", "sft-user", "Model metrics",
                                  "capability.delta")
        assert "Observability" not in text and "Judges" not in text, text[:2000]
    with _open(chromium, training_view_url(tracking, users)) as page:
        text = page.wait_for_text("sft-user", "2 matching runs")
        assert "Observability" not in text and "Traces\n0" not in text, text[:2000]
