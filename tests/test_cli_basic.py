"""CLI: version, doctor, init-config, and bad input as one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from gradian.cli import app
from gradian.config import GradianConfig, load_config
from gradian.doctor import SUPPORTED_WINDOW, collect_report, in_window

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the real console entry (so GradianError handling is exercised) in a subprocess."""
    return subprocess.run([sys.executable, "-c", "from gradian.cli import main; main()", *args],
                          capture_output=True, text=True)


def test_version():
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0 and result.stdout.startswith("gradian ")


def test_init_config_writes_a_loadable_file(tmp_path):
    out = tmp_path / "g.yaml"
    result = runner.invoke(app, ["init-config", "--out", str(out), "--base-model", "org/base"])
    assert result.exit_code == 0, result.stdout
    assert load_config(out) == GradianConfig(base_model="org/base")


def test_existing_config_is_not_overwritten(tmp_path):
    out = tmp_path / "g.yaml"
    out.write_text("seed: 1\n")
    proc = run_cli("init-config", "--out", str(out))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "already exists" in lines[0] and "--force" in lines[0]
    assert "Traceback" not in proc.stderr and out.read_text() == "seed: 1\n"


def test_doctor_runs_and_reports_the_window():
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.stdout
    assert "torch" in result.stdout and "Devices" in result.stdout
    report = collect_report()
    torch_row = next(p for p in report.packages if p.name == "torch")
    assert torch_row.status == "ok"
    assert any(f.name == "semantic clustering" for f in report.features)


def test_window_in_code_matches_constraints_file():
    parsed = {}
    for line in (ROOT / "constraints" / "window.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, spec = line.partition(">=")
        low, _, high = spec.partition(",<=")
        parsed[name] = (low, high or None)
    assert parsed == SUPPORTED_WINDOW


def test_in_window():
    assert in_window("2.13.0+cpu", "2.4", "2.14")
    assert in_window("5.24.0", "5.0", "5.24") and not in_window("5.25.0", "5.0", "5.24")
    assert not in_window("2.3.1", "2.4", None) and in_window("9.0", "2.4", None)


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a",\n')
    _one_line_error(run_cli("diagnose", "--dataset", str(bad)), "bad.jsonl:2", "not valid JSON")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _one_line_error(run_cli("diagnose", "--dataset", str(empty)), "empty.jsonl", "empty")

    no_answer = tmp_path / "q.jsonl"
    no_answer.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    _one_line_error(run_cli("diagnose", "--dataset", str(no_answer)), "q.jsonl:1", "no assistant turn")

    _one_line_error(run_cli("diagnose", "--dataset", str(tmp_path / "missing.jsonl")), "missing.jsonl", "not found")

    cfg = tmp_path / "gradian.yaml"
    cfg.write_text("grads:\n  batch_sise: 2\n")
    _one_line_error(run_cli("diagnose", "--config", str(cfg), "--dataset", str(bad)),
                    "gradian.yaml:2", "grads.batch_sise", "grads.batch_size")


def test_every_command_and_flag_is_documented():
    import typer.main

    text = (ROOT / "docs" / "cli.md").read_text()
    root = typer.main.get_command(app)
    for name, command in root.commands.items():
        subs = command.commands.items() if hasattr(command, "commands") else [(None, command)]
        for subname, sub in subs:
            title = f"gradian {name}" + (f" {subname}" if subname else "")
            assert f"## `{title}`" in text, f"{title} is missing from docs/cli.md"
            for param in sub.params:
                for opt in getattr(param, "opts", []):
                    if opt.startswith("-") and opt != "--help":
                        assert f"`{opt}`" in text, f"{title} {opt} is missing from docs/cli.md"


# -- output a script can read ----------------------------------------------------------------------

def _gradian(*args: str) -> subprocess.CompletedProcess:
    """The console entry with stdout a pipe, as in `gradian checks | grep config.`."""
    return subprocess.run([sys.executable, "-m", "gradian", *args], capture_output=True, text=True, cwd=ROOT)


def test_checks_through_a_pipe_prints_every_id_whole():
    from gradian.audit import all_checks

    proc = _gradian("checks")
    assert proc.returncode == 0, proc.stderr
    registry = all_checks()
    for category in ("config", "data", "dynamics"):
        expected = sorted(c.id for c in registry if c.category == category)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(f"{category}.")]
        assert sorted(line.split("\t")[0] for line in lines) == expected
    assert len(proc.stdout.splitlines()) == len(registry)  # rows only; the title goes to stderr
    by_id = {line.split("\t")[0]: line.split("\t") for line in proc.stdout.splitlines()}
    check = registry[0]
    assert by_id[check.id] == [check.id, check.category, check.description, ", ".join(check.needs)]
    assert "…" not in proc.stdout


def test_checks_json_matches_the_registry():
    import json

    from gradian.audit import all_checks

    proc = _gradian("checks", "--json")
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert [c["id"] for c in listed] == [c.id for c in all_checks()]
    assert set(listed[0]) == {"id", "category", "description", "needs"}


def test_doctor_json_and_plain_lines():
    import json

    proc = _gradian("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert any(p["name"] == "torch" for p in report["packages"]) and report["devices"]
    plain = _gradian("doctor").stdout.splitlines()
    torch_line = next(line for line in plain if line.startswith("torch\t"))
    assert torch_line.split("\t")[-1] == "ok"
    assert not any(c in "".join(plain) for c in "┏│━")  # no box drawing in a pipe


def test_diagnose_json_is_the_report_alone_on_stdout(tmp_path):
    import json

    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(5)))
    proc = _gradian("diagnose", "--dataset", str(rows), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {"findings", "verdict", "skipped", "manifest"} <= set(report)
    plain = _gradian("diagnose", "--dataset", str(rows))
    assert any(line.startswith("Skipped checks") for line in plain.stdout.splitlines())
    assert any(line.startswith("config.lr_too_high\t") for line in plain.stdout.splitlines())


def test_library_future_warnings_are_quiet_unless_verbose():
    import warnings

    from gradian.cli.output import quiet_libraries

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries(verbose=False)
        warnings.warn("deprecated somewhere in a library", FutureWarning)
    assert seen == []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries(verbose=True)
        warnings.warn("deprecated somewhere in a library", FutureWarning)
    assert len(seen) == 1


def test_verbose_is_a_global_flag():
    assert _gradian("--verbose", "checks", "--json").returncode == 0
