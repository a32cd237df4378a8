"""A report folder read back (``counterfactual --report``, ``explain --report``) is checked before use:
text encoding, nesting, schema version and the rankings beside it. Each damage is one line with
exit code 2, never an internal error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradian.counterfactual import load_report
from gradian.errors import ConfigError
from gradian.report.schema import SCHEMA_VERSION

_REPORT = {"schema_version": SCHEMA_VERSION, "verdict": {"kind": "data", "summary": "x"},
           "manifest": {"kind": "attribute", "gradian_version": "9.9.9"}}


def _folder(tmp_path, report_bytes: bytes, rankings: bytes | None = None):
    folder = tmp_path / "report"
    folder.mkdir()
    (folder / "report.json").write_bytes(report_bytes)
    if rankings is not None:
        (folder / "rankings.parquet").write_bytes(rankings)
    return folder


@pytest.mark.parametrize("case, content, rankings, message", [
    ("not_utf8", json.dumps(_REPORT).replace('"x"', '"\u00e9"').encode("latin-1"), None, r"not UTF-8 text \(byte 0xe9"),
    ("deeply_nested", b"[" * 200_000 + b"]" * 200_000, None, "nested too deeply"),
    ("newer_schema", json.dumps({**_REPORT, "schema_version": 99}).encode(), None,
     r"schema_version 99 is newer than this Gradian reads \(1\); it was written by gradian 9.9.9"),
    ("bad_schema", json.dumps({**_REPORT, "schema_version": "two"}).encode(), None, "'two' is not a report version"),
    ("damaged_rankings", json.dumps(_REPORT).encode(), b"PAR1 this is not parquet PAR1", "rankings.parquet beside it is damaged"),
])
def test_a_damaged_report_folder_is_refused_naming_the_file(tmp_path, case, content, rankings, message):
    folder = _folder(tmp_path, content, rankings)
    with pytest.raises(ConfigError, match=message) as err:
        load_report(folder)
    assert str(folder / "report.json") in str(err.value) and "\n" not in str(err.value)


def test_a_current_report_still_loads(tmp_path):
    import pandas as pd

    buffer = tmp_path / "r.parquet"
    pd.DataFrame({"example_id": ["a-0"], "score": [1.0]}).to_parquet(buffer)
    report, rankings = load_report(_folder(tmp_path, json.dumps(_REPORT).encode(), buffer.read_bytes()))
    assert report["verdict"]["kind"] == "data" and list(rankings["example_id"]) == ["a-0"]


def test_explain_on_a_newer_report_exits_2_with_one_line(tmp_path):
    folder = _folder(tmp_path, json.dumps({**_REPORT, "schema_version": 99}).encode())
    proc = subprocess.run([sys.executable, "-m", "gradian", "explain", "--report", str(folder), "--example-id", "a-0"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "schema_version 99 is newer" in lines[0] and "Traceback" not in proc.stderr
