"""Run sources are plugins chosen by the scheme of ``--run``: a third party adds one without
touching core.

The third party here is a distribution written into a temporary folder (a package and its
``*.dist-info`` with ``entry_points.txt``), found through ``PYTHONPATH`` exactly as an installed
one is. Its source answers ``myscheme:<id>`` with a local run folder holding the tiny adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gradian.errors import RunRecordError
from gradian.runs import RunRef

GRADIAN = Path(sys.executable).parent / "gradian"  # the console entry, as a user runs it

_SOURCE_MODULE = '''
"""A run source for the ``myscheme:`` scheme, as a third party would write one."""
import json
from pathlib import Path

from gradian.runs import DatasetRef, read_run_dir

_HERE = Path(__file__).parent


class MySchemeSource:
    name = "myscheme"

    def read(self, ref, cache_dir, **options):
        with open(_HERE / "calls.jsonl", "a") as log:
            log.write(json.dumps({"scheme": ref.scheme, "id": ref.id, "raw": ref.raw,
                                  "cache_dir": str(cache_dir), "options": sorted(options)}) + "\\n")
        run = json.loads((_HERE / "runs.json").read_text())[ref.id]
        record = read_run_dir(run["run_dir"])
        record.lora.base_model = record.lora.base_model or run["base_model"]
        record.dataset = DatasetRef(path=run["dataset"])
        record.source = f"myscheme:{ref.id}"
        return record


SOURCE = MySchemeSource()
'''


def write_distribution(root: Path, dist: str, package: str, scheme: str, module: str,
                       group: str = "gradian.run_sources", attribute: str = "SOURCE") -> Path:
    """A minimal installed distribution under ``root``: ``package/`` and ``<dist>-0.1.dist-info``
    registering ``package:<attribute>`` under ``scheme`` in the entry-point ``group``."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(module)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{scheme} = {package}:{attribute}\n")
    return root


def write_tiny_data(folder: Path) -> tuple[Path, Path]:
    """``train.jsonl`` (20 rows in declared clusters a and b) and ``eval.jsonl`` (4 capitals) in ``folder``."""
    words = "paris tokyo hello world yes no one two three four five".split()
    train, evals = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"what is the capital of {words[i % 3]} ?",
                                         "completion": f"{words[(i * 7) % len(words)]} {words[i % 5]}",
                                         "cluster": "a" if i < 8 else "b"}) + "\n" for i in range(20)))
    evals.write_text("".join(json.dumps({"prompt": f"what is the capital of {w} ?", "completion": w}) + "\n"
                             for w in ("paris", "tokyo", "france", "japan")))
    return train, evals


@pytest.fixture(scope="module")
def myscheme(tmp_path_factory, tiny_lora_dirs):
    """(the folder to put on PYTHONPATH, the package folder, the training data, the eval set)."""
    base_dir, adapter_dir = tiny_lora_dirs
    work = tmp_path_factory.mktemp("myscheme")
    run_dir = work / "run"
    shutil.copytree(adapter_dir, run_dir / "adapter")
    train, evals = write_tiny_data(work)
    site = write_distribution(work / "site", "gradian-myscheme", "gradian_myscheme", "myscheme", _SOURCE_MODULE)
    (site / "gradian_myscheme" / "runs.json").write_text(json.dumps(
        {"abc": {"run_dir": str(run_dir), "base_model": str(base_dir), "dataset": str(train)}}))
    return site, site / "gradian_myscheme", train, evals


@pytest.fixture
def rival(tmp_path):
    """A second distribution that also registers ``myscheme``."""
    return write_distribution(tmp_path / "rival", "gradian-rival", "gradian_rival", "myscheme",
                              _SOURCE_MODULE.replace("MySchemeSource", "RivalSource"))


def _calls(package: Path) -> list[dict]:
    log = package / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _gradian(args: list[str], cwd: Path, *site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(s) for s in site)}
    return subprocess.run([str(GRADIAN), *args], capture_output=True, text=True, cwd=cwd, env=env)


# -- the reference, parsed once -------------------------------------------------------------------

def test_run_ref_parses_each_spelling(tmp_path):
    run_id = "0123456789abcdef" * 2
    assert RunRef.parse(f"mlflow:{run_id}") == RunRef("mlflow", run_id, f"mlflow:{run_id}")
    assert RunRef.parse(f" runs:/{run_id}/adapter ") == RunRef("runs", f"{run_id}/adapter", f"runs:/{run_id}/adapter")
    assert RunRef.parse("MyScheme://abc") == RunRef("myscheme", "abc", "MyScheme://abc")
    # a scheme-less value is left for the registry to place: a path, or a source's bare id
    assert RunRef.parse(run_id) == RunRef("", run_id, run_id)
    assert RunRef.parse("C:\\runs\\x").scheme == ""  # a drive letter is not a scheme
    # an existing folder is local whatever its name looks like
    odd = tmp_path / "mlflow:x"
    odd.mkdir()
    assert RunRef.parse(str(odd)) == RunRef("file", str(odd), str(odd))
    assert RunRef.parse("file:///data/run") == RunRef("file", "/data/run", "file:///data/run")
    assert RunRef.parse("file:rel/run").id == "rel/run"
    assert str(RunRef.parse(f"mlflow:{run_id}")) == f"mlflow:{run_id}" and str(RunRef.parse("file:/r")) == "/r"
    assert RunRef.parse(RunRef("mlflow", run_id, run_id)) == RunRef("mlflow", run_id, run_id)
    with pytest.raises(RunRecordError, match="names no run after 'myscheme:'"):
        RunRef.parse("myscheme:")
    with pytest.raises(RunRecordError, match="empty run reference"):
        RunRef.parse("  ")


def test_a_bare_run_id_goes_to_mlflow_unless_it_is_a_folder(tmp_path, monkeypatch):
    from gradian.runs import resolve_run_ref

    run_id = "f" * 32
    assert resolve_run_ref(run_id) == RunRef("mlflow", run_id, run_id)
    assert resolve_run_ref("not-a-run-id").is_local
    monkeypatch.chdir(tmp_path)
    (tmp_path / run_id).mkdir()
    assert resolve_run_ref(run_id) == RunRef("file", run_id, run_id)


# -- a third-party source, in process -------------------------------------------------------------

def test_the_source_registered_for_a_scheme_reads_it(myscheme, monkeypatch, tmp_path):
    from gradian.runs import installed_schemes, resolve_run

    site, package, train, _ = myscheme
    monkeypatch.syspath_prepend(str(site))
    assert {"file", "mlflow", "runs", "myscheme"} <= set(installed_schemes())
    before = len(_calls(package))
    record = resolve_run("myscheme:abc", cache_dir=tmp_path, trust_run_dataset=True)
    assert record.source == "myscheme:abc" and record.dataset.path == str(train)
    assert record.adapter_dir and Path(record.adapter_dir, "adapter_config.json").is_file()
    call = _calls(package)[before:]
    assert call == [{"scheme": "myscheme", "id": "abc", "raw": "myscheme:abc",
                     "cache_dir": str(tmp_path / "myscheme"), "options": ["trust_run_dataset"]}]


def test_an_unknown_scheme_names_the_installed_ones(myscheme, monkeypatch):
    from gradian.runs import resolve_run

    monkeypatch.syspath_prepend(str(myscheme[0]))
    with pytest.raises(RunRecordError) as err:
        resolve_run("wandb:team/run7")
    text = str(err.value)
    assert "no run source reads 'wandb:'" in text and "\n" not in text
    assert "file, mlflow, myscheme, runs" in text and "gradian.run_sources" in text


def test_two_sources_claiming_one_scheme_are_refused(myscheme, rival, monkeypatch):
    from gradian.runs import resolve_run

    monkeypatch.syspath_prepend(str(myscheme[0]))
    monkeypatch.syspath_prepend(str(rival))
    with pytest.raises(RunRecordError, match=r"'myscheme:' is registered twice, by gradian-\w+ \(gradian_\w+:SOURCE\) "
                                             r"and gradian-\w+ \(gradian_\w+:SOURCE\); uninstall one"):
        resolve_run("myscheme:abc")


# -- through the console entry, as a user runs it --------------------------------------------------

def test_attribute_and_diagnose_read_a_plugin_run(myscheme, tmp_path):
    site, package, train, evals = myscheme
    cfg = tmp_path / "gradian.yaml"
    cfg.write_text(
        f"cache_dir: {tmp_path / 'cache'}\nevaluation:\n  metric: contains\n  require_significant: false\n"
        "  max_new_tokens: 4\n  n_bootstrap: 100\nclustering:\n  method: declared\n"
    )
    before = len(_calls(package))
    # no --adapter, --base-model or --dataset: all three come from the plugin's run
    proc = _gradian(["attribute", "--run", "myscheme:abc", "-c", str(cfg), "-e", str(evals), "--engine", "graddot",
                     "--cross-check", "none", "-o", str(tmp_path / "o")], tmp_path, site)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [c["raw"] for c in _calls(package)[before:]] == ["myscheme:abc"]
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["attribution"]["engine"] == "graddot"
    assert "myscheme:abc" in json.dumps(report)
    assert "logged the" not in proc.stdout  # myscheme has no report sink: nothing is logged back

    proc = _gradian(["diagnose", "--run", "myscheme:abc", "--json"], tmp_path, site)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [c["raw"] for c in _calls(package)[before:]] == ["myscheme:abc"] * 2
    diagnosis = json.loads(proc.stdout)
    assert "myscheme:abc" in json.dumps(diagnosis)


def test_console_refuses_an_unknown_scheme_and_a_claimed_twice_one(myscheme, rival, tmp_path):
    site = myscheme[0]
    proc = _gradian(["diagnose", "--run", "wandb:abc"], tmp_path, site)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no run source reads 'wandb:'" in lines[0] and "myscheme" in lines[0]

    proc = _gradian(["diagnose", "--run", "myscheme:abc"], tmp_path, site, rival)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "registered twice" in proc.stderr and "gradian-rival" in proc.stderr and "gradian-myscheme" in proc.stderr


# -- reports go back by the same scheme, into the run the caller names -----------------------------

def test_the_report_sink_is_the_one_of_the_record_scheme(monkeypatch):
    """The sink of the run's scheme gets the parsed reference and the typed report, whatever the
    caller held (a report.json dict here)."""
    from gradian.report.schema import Report
    from gradian.report.sinks import ReportSink, publish_report
    from gradian.runs import RunRef, has_report_sink

    logged = []

    def sink(ref, report, **kw):
        assert isinstance(ref, RunRef) and isinstance(report, Report)
        logged.append((str(ref), report.verdict.kind, kw.get("into_run")))
        return "child-1"

    assert isinstance(sink, ReportSink)

    class SinkEntryPoint:
        name, group, value, dist = "myscheme", "gradian.report_sinks", "tests:sink", None

        def load(self):
            return sink

    monkeypatch.setattr("gradian.runs.sources.entry_points",
                        lambda group: [SinkEntryPoint()] if group == "gradian.report_sinks" else [])
    assert has_report_sink("myscheme:abc") and not has_report_sink("mlflow:" + "a" * 32)
    report = {"verdict": {"kind": "data", "summary": "s"}}
    assert publish_report("myscheme:abc", report, "diagnose", into_run="project-7") == "child-1"
    assert publish_report(RunRef.parse("myscheme:abc"), report, "diagnose") == "child-1"
    assert publish_report("mlflow:" + "a" * 32, report, "diagnose") is None  # no sink for it: nothing logged
    assert logged == [("myscheme:abc", "data", "project-7"), ("myscheme:abc", "data", None)]


def test_the_mlflow_entry_passes_the_project_run_down_explicitly(monkeypatch):
    from gradian_mlflow import entry

    argv = []
    monkeypatch.setattr(entry, "_cli", argv.extend)
    run_id = "e" * 32
    monkeypatch.setenv("MLFLOW_RUN_ID", "p" * 32)
    entry.main(["diagnose", "--run-id", run_id])
    assert argv[:3] == ["diagnose", "--mlflow-run", run_id]
    assert argv[argv.index("--into-run") + 1] == "p" * 32
    argv.clear()
    monkeypatch.delenv("MLFLOW_RUN_ID")
    entry.main(["diagnose", "--run-id", run_id])
    assert "--into-run" not in argv
