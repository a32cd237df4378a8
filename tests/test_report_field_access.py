"""No module outside the report schema reads report.json fields by string key.

Readers parse a report once (``Report.of`` / ``Report.from_json`` or a block's ``from_json``) and
read typed attributes. This test scans the source for the string-key reads that parsing replaces:
``report.get("...")`` / ``report["..."]`` on a variable named for a report, and ``.get("<key>")``
or ``["<key>"]`` with a key that names a report block or a field only report blocks carry.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("core/gradian", "gradian_mlflow", "projects/validation")
SCHEMA = "core/gradian/report/schema.py"

#: keys that name a report block, or a field that only the report's blocks carry
REPORT_KEYS = (
    "attribution", "capability", "verdict", "manifest", "findings", "skipped", "counterfactual", "schema_version",
    "clusters", "top_harmful", "top_helpful", "accused", "accused_cluster", "accused_set_n", "spans", "lumpiness",
    "engine_agreement_spearman", "cross_check", "query_signal", "gated", "deletions_withheld", "engine_state",
    "index_manifest", "clustering", "config_hash", "gradian_version", "n_flipped", "n_base_failing", "too_few_items",
    "proxy_used", "share_of_negative", "signed_influence", "mean_per_example", "share_of_cluster_harm",
    "estimated_harmful_share", "cluster_n", "n_left_out", "items_hurt", "tuned_generation", "removal", "ground_truth",
    "recovered_fraction", "hedges",
)

#: mappings that are not report.json by name: DataFrame columns and figure bytes keyed like blocks
_NOT_REPORTS = ("rankings", "plots")
_KEY = "|".join(REPORT_KEYS)
_RECEIVER = "".join(f"(?<!{name})" for name in _NOT_REPORTS)
#: a read of a report variable by key, or a read of a report key on any mapping (writes are builders)
PATTERN = re.compile(
    r"\b\w*report\w*\s*(?:\.get\(|\[)\s*[\"']"
    rf"|{_RECEIVER}\.get\(\s*[\"'](?:{_KEY})[\"']"
    rf"|{_RECEIVER}\[\s*[\"'](?:{_KEY})[\"']\s*\](?!\s*=[^=])"
)

#: files still reading report fields by key; each entry goes once its reads are typed
_PENDING: dict[str, str] = {}

#: matches that are not report.json reads, with the reason
_ALLOWED: dict[tuple[str, str], str] = {
    ("projects/validation/verdicts.py", 'cap = figures["capability"]'): "poison_verdict reads the figures dict poison.py computed from the typed report, not a report",
    ("projects/validation/verdicts.py", 'accused = figures["accused_cluster"] == planted'): "poison_verdict reads the figures dict poison.py computed from the typed report, not a report",
    ("projects/validation/verdicts.py", 'share = figures.get("share_of_negative")'): "poison_verdict reads the figures dict poison.py computed from the typed report, not a report",
    ("projects/validation/verdicts.py", 'f"verdict {figures.get(\'verdict_kind\')} accusing {figures.get(\'accused_cluster\')}")'):
        "poison_verdict reads the figures dict poison.py computed from the typed report, not a report",
    ("projects/validation/fidelity.py", 'capability = scenario.info["capability"]["name"]'):
        "a tinyworld scenario.json, not a report",
    ("projects/validation/accused.py", 'capability = str(run_.info["capability"]["name"])'):
        "a tinyworld scenario.json, not a report",
    ("core/gradian/explain/buried.py", '"capability": info["capability"]}'):
        "a tinyworld scenario.json, not a report",
    ("gradian_mlflow/demo.py", "print(f\"{info['n_train']} training rows, {planted.get('n', 0)} of them planted; "
                               "eval: {info['capability']}\")"):
        "a tinyworld scenario.json, not a report",
    ("core/gradian/index/sharded.py", 'return BuiltIndex(target.root, plan["manifest"], set(), [], cache_hit=True)'):
        "the index build plan's manifest.json (gradian.index), not a report",
    ("core/gradian/index/sharded.py", 'return BuiltIndex(target.root, result["manifest"], set(), [], cache_hit=False)'):
        "the index build result's manifest.json (gradian.index), not a report",
    ("core/gradian/report/tables.py", 'rows.sort(key=lambda r: (r["signed_influence"], -r["share_of_negative"], r["cluster"]))'):
        "cluster_table orders the rows it is building",
}


def offending_lines(path: str, text: str) -> list[str]:
    """``path:line: source`` for each string-key report read in ``text``."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if PATTERN.search(code) and (path, line.strip()) not in _ALLOWED:
            out.append(f"{path}:{number}: {line.strip()}")
    return out


def _sources() -> list[str]:
    files = []
    for top in SCANNED:
        files += [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / top).rglob("*.py"))]
    return [f for f in files if f != SCHEMA]


def test_no_module_reads_report_fields_by_string_key():
    found = []
    for path in _sources():
        if path in _PENDING:
            continue
        found += offending_lines(path, (ROOT / path).read_text(encoding="utf-8"))
    assert not found, "read report.json through gradian.report.schema, not by string key:\n" + "\n".join(found)


def test_every_pending_file_still_has_a_string_key_read():
    for path in _PENDING:
        text = (ROOT / path).read_text(encoding="utf-8")
        assert offending_lines(path, text), f"{path} reads no report field by key any more: drop it from _PENDING"


@pytest.mark.parametrize("line", [
    'cap = report.get("capability") or {}',
    'attribution = report["attribution"]',
    'fitted = (manifest.get("engine_state") or {}).get("settings") or {}',
    'metrics["capability.delta"] = cap.get("delta") if a.get("clusters") else None',
    'kind = (scenario.report.get("verdict") or {}).get("kind")',
    'top = [r["example_id"] for r in attr["top_harmful"]]',
])
def test_the_pattern_catches_report_reads(line):
    assert offending_lines("x.py", line)


@pytest.mark.parametrize("line", [
    'index_id = manifest["index_id"]  # an index manifest.json',
    'value = cfg.get("engine") or {}',
    'params = {"learning_rate": run.data.params.get("learning_rate")}',
    'report = Report.of(report)',
    'metrics["capability.regressed"] = float(cap.status == "regressed")',
    'tags.get("gradian.pid")',
])
def test_the_pattern_leaves_other_mappings_alone(line):
    assert not offending_lines("x.py", line)


def test_the_pattern_catches_the_readers_before_they_were_typed():
    old = subprocess.run(["git", "show", "d3b332e~1:core/gradian/report/markdown.py"], cwd=ROOT,
                         capture_output=True, text=True)
    if old.returncode != 0:
        pytest.skip("the git history is not available")
    found = offending_lines("core/gradian/report/markdown.py", old.stdout)
    assert len(found) >= 10
    assert any('report.get("manifest")' in f for f in found) and any('attr.get("clusters")' in f for f in found)
