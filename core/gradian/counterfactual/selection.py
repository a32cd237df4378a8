"""Which training examples a counterfactual drops: a report's accused set or cluster, a cluster, or ids.

Interface: ``RemovalPlan`` (the ids and row indices to drop, why, and the scores the accusing
attribution gave them), ``plan_removal(dataset, ...)`` and ``load_report(path)`` (a report.json
and the ``rankings.parquet`` written beside it).

``drop="accused"`` drops exactly the report's accused set: the ``accused`` column of the rankings
beside it, else ``attribution.accused.example_ids``. ``drop="cluster"`` (the default) drops the
whole accused cluster. Cluster membership comes from the accusing report's rankings when there are some (so the drop is
exactly the cluster the report named), else from clustering the dataset again with the config's
clustering settings and seed (declared clusters are read from the rows, so they never drift).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from gradian.errors import ConfigError, DatasetError
from gradian.report.schema import Report, version_problem

if TYPE_CHECKING:
    import pandas as pd

    from gradian.config import ClusteringConfig
    from gradian.data import Dataset
    from gradian.jsontypes import JsonObject

__all__ = ["DROP_CHOICES", "RemovalPlan", "load_planted", "load_report", "plan_removal", "parse_id_list"]

#: what ``--drop`` may name in the accusing report
DROP_CHOICES = ("accused", "cluster")


@dataclass
class RemovalPlan:
    """The examples a counterfactual retrain leaves out of the training set."""

    dataset_path: str
    dataset_sha256: str
    n_examples: int
    drop_ids: list[str]
    #: row positions (0-based) of the dropped examples in the dataset file
    drop_indices: list[int]
    #: one line for the report: where the list came from
    reason: str
    #: the cluster dropped, when a whole cluster was
    cluster: str | None = None
    #: example id -> score of the attribution that accused them (every example, not only dropped)
    scores: dict[str, float] | None = field(default=None, repr=False)
    #: with a report's accused set: the ids of the cluster it was refined from (the accused topic),
    #: where ``run_until_recovered``'s later rounds look for the rows the first removal left
    topic_ids: list[str] | None = field(default=None, repr=False)

    @property
    def n_drop(self) -> int:
        return len(self.drop_ids)

    @property
    def n_keep(self) -> int:
        return self.n_examples - len(self.drop_ids)

    def keep_indices(self) -> list[int]:
        dropped = set(self.drop_indices)
        return [i for i in range(self.n_examples) if i not in dropped]

    def to_dict(self) -> JsonObject:
        return {
            "reason": self.reason,
            "cluster": self.cluster,
            "n_examples": self.n_examples,
            "n_removed": self.n_drop,
            "n_kept": self.n_keep,
            "removed_ids": list(self.drop_ids),
            "dataset": {"path": self.dataset_path, "sha256": self.dataset_sha256},
        }


def load_report(path: str | Path) -> tuple[JsonObject, pd.DataFrame | None]:
    """``(report dict, rankings DataFrame or None)`` from a report.json (or the folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise ConfigError(f"--report {path}: no such file; pass the report.json that `gradian attribute --out` wrote")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"--report {path}:{err.lineno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"--report {path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
                          "pass the report.json that `gradian attribute --out` wrote") from None
    except RecursionError:
        raise ConfigError(f"--report {path}: nested too deeply to read; it is not a report Gradian wrote") from None
    if not isinstance(report, dict) or "verdict" not in report:
        raise ConfigError(f"--report {path}: not a Gradian report (it has no 'verdict'); pass a report.json from `gradian attribute`")
    problem = version_problem(report)
    if problem:
        raise ConfigError(f"--report {path}: {problem}")
    rankings = None
    beside = path.parent / "rankings.parquet"
    if beside.is_file():
        import pandas as pd
        import pyarrow

        try:
            rankings = pd.read_parquet(beside)
        except (pyarrow.ArrowException, OSError, ValueError) as err:
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise ConfigError(f"--report {path}: the rankings.parquet beside it is damaged ({first}); run "
                              "`gradian attribute` again to write the report folder whole") from None
    return report, rankings


def parse_id_list(value: str) -> list[str]:
    """``a,b,c`` or ``@file`` -> ids, in order, without repeats. The file holds one id a line, the
    comma list a report prints (lines may hold several, blank lines and ``#`` comments are
    skipped), or a JSON list."""
    value = value.strip()
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise ConfigError(f"--drop-ids {value}: no such file {path}")
        text = path.read_text(encoding="utf-8").strip()
        if text.startswith("["):
            try:
                items = [str(x) for x in json.loads(text)]
            except json.JSONDecodeError as err:
                raise ConfigError(f"--drop-ids {value}: not a valid JSON list ({err.msg})") from None
        else:
            items = [part.strip().strip("`'\"") for line in text.splitlines()
                     if not line.lstrip().startswith(("#", "```")) for part in line.split(",")]
    else:
        items = [part.strip() for part in value.split(",")]
    return list(dict.fromkeys(i for i in items if i))


def _cluster_labels(dataset: Dataset, rankings: pd.DataFrame | None, clustering: ClusteringConfig | None,
                    seed: int) -> tuple[dict[str, str], str]:
    """example id -> cluster key, and where the membership came from."""
    if rankings is not None and {"example_id", "cluster"} <= set(rankings.columns):
        return dict(zip(rankings["example_id"].astype(str), rankings["cluster"].astype(str))), "the report's rankings"
    from gradian.cluster import cluster_examples
    from gradian.config import ClusteringConfig

    assignment = cluster_examples(dataset.examples, clustering or ClusteringConfig(), seed=seed)
    return {k: str(v) for k, v in assignment.labels.items()}, f"clustering.method={assignment.method}"


def _report_dataset_sha(report: Report) -> str | None:
    inputs = report.inputs
    return inputs.dataset.sha256 if inputs is not None and inputs.dataset is not None else None


def plan_removal(
    dataset: Dataset,
    *,
    report: Report | Mapping[str, object] | None = None,
    rankings: pd.DataFrame | None = None,
    drop_cluster: str | None = None,
    drop_ids: Sequence[str] | None = None,
    clustering: ClusteringConfig | None = None,
    seed: int = 1234,
    drop: str | None = None,
) -> RemovalPlan:
    """Decide what to drop from ``dataset`` (a ``gradian.data.Dataset``).

    ``drop_ids`` wins, then ``drop_cluster``, then the report's accused set (``drop="accused"``)
    or its accused cluster (``drop="cluster"``, the default). ``report`` and
    ``rankings`` (from ``load_report``) also supply the per-example scores; a report made from a
    different dataset file is refused.
    """
    report = Report.of(report) if report is not None else None
    if report is not None:
        sha = _report_dataset_sha(report)
        if sha and sha != dataset.sha256:
            raise DatasetError(
                f"the report was made from a dataset with sha256 {sha[:12]}..., but {dataset.path} has "
                f"{dataset.sha256[:12]}...; pass the training data the report attributed (--dataset)"
            )
    scores = None
    if rankings is not None and {"example_id", "score"} <= set(rankings.columns):
        scores = {str(k): float(v) for k, v in zip(rankings["example_id"], rankings["score"])}
        if set(scores) != set(dataset.ids):
            raise DatasetError(
                f"the rankings beside the report list {len(scores)} examples that do not match the "
                f"{len(dataset)} rows of {dataset.path}; pass the training data the report attributed"
            )
    index_of = {e.id: i for i, e in enumerate(dataset.examples)}
    cluster: str | None = None
    topic_ids: list[str] | None = None
    if drop_ids:
        unknown = [i for i in drop_ids if i not in index_of]
        if unknown:
            raise DatasetError(
                f"--drop-ids: {len(unknown)} id(s) are not in {dataset.path}, e.g. '{unknown[0]}'; ids look like "
                f"'{dataset.ids[0]}' (12 hex of the row's content hash, '-', the row index)"
            )
        ids = list(dict.fromkeys(drop_ids))
        reason = f"{len(ids)} example id(s) given with --drop-ids"
    elif drop_cluster is None and report is not None and drop == "accused":
        ids = _report_accused(report, rankings)
        if not ids:
            raise ConfigError(
                f"--drop accused: the report has no accused set (verdict '{report.verdict.kind}'); pass --drop cluster, "
                "--drop-cluster or --drop-ids"
            )
        unknown = [i for i in ids if i not in index_of]
        if unknown:
            raise DatasetError(f"the report's accused set names {len(unknown)} id(s) not in {dataset.path}, "
                               f"e.g. '{unknown[0]}'; pass the training data the report attributed")
        accused = report.attribution.accused if report.attribution is not None else None
        reason = (f"the report's accused set: {accused.rows_text()} ({accused.method})" if accused is not None
                  else f"the report's accused set: {len(ids)} rows")
        if accused is not None and rankings is not None and {"example_id", "cluster"} <= set(rankings.columns):
            in_topic = rankings["cluster"].astype(str) == str(accused.cluster)
            topic_ids = [str(i) for i in rankings.loc[in_topic, "example_id"]] or None
    else:
        if drop not in (None, *DROP_CHOICES):
            raise ConfigError(f"--drop {drop!r}: use {' or '.join(DROP_CHOICES)}")
        if drop_cluster is not None:
            cluster = str(drop_cluster)
            origin = "--drop-cluster"
        elif report is not None:
            accused_cluster = report.verdict.accused_cluster
            if accused_cluster is None:
                raise ConfigError(
                    f"the report accuses no cluster (verdict '{report.verdict.kind}'), so there is nothing to drop; "
                    "pass --drop-cluster or --drop-ids to test a hypothesis of your own"
                )
            cluster = str(accused_cluster)
            origin = "the report's accused cluster"
        else:
            raise ConfigError("nothing to drop: pass --report (its accused cluster), --drop-cluster or --drop-ids")
        labels, source = _cluster_labels(dataset, rankings, clustering, seed)
        ids = [e.id for e in dataset.examples if labels.get(e.id) == cluster]
        if not ids:
            known = sorted(set(labels.values()))
            raise ConfigError(
                f"cluster '{cluster}' ({origin}) has no member in {dataset.path} by {source}; "
                f"clusters are: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''}"
            )
        reason = f"cluster {cluster}: {origin}, membership from {source}"
    if len(ids) >= len(dataset):
        raise ConfigError(f"dropping {len(ids)} of {len(dataset)} examples leaves nothing to train on; drop a subset")
    return RemovalPlan(
        dataset_path=str(dataset.path),
        dataset_sha256=dataset.sha256,
        n_examples=len(dataset),
        drop_ids=ids,
        drop_indices=sorted(index_of[i] for i in ids),
        reason=reason,
        cluster=cluster,
        scores=scores,
        topic_ids=topic_ids,
    )


def _report_accused(report: Report, rankings: pd.DataFrame | None) -> list[str]:
    """The accused set's ids: the rankings' ``accused`` column, else the report's list."""
    if rankings is not None and {"example_id", "accused"} <= set(rankings.columns):
        return [str(i) for i in rankings.loc[rankings["accused"].astype(bool), "example_id"]]
    accused = report.attribution.accused if report.attribution is not None else None
    return [str(i) for i in accused.example_ids] if accused is not None else []


def load_planted(path: str | Path, dataset: Dataset) -> list[int]:
    """Row indices of the known-bad rows, for removal precision.

    ``path`` is a tinyworld ``scenario.json`` (its ``planted.indices``), a JSON list of row indices
    or example ids, or a text file with one row index or example id per line.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--truth {path}: no such file; pass a scenario.json or a list of planted rows")
    text = path.read_text(encoding="utf-8").strip()
    data: object = [line.strip() for line in text.splitlines() if line.strip()]
    if text and text[0] in "[{":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--truth {path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if isinstance(data, dict):
        data = (data.get("planted") or {}).get("indices")
        if data is None:
            raise ConfigError(f"--truth {path}: a JSON object needs planted.indices (a tinyworld scenario.json)")
    if not isinstance(data, list):
        raise ConfigError(f"--truth {path}: expected a list of row indices or example ids")
    index_of = {e.id: i for i, e in enumerate(dataset.examples)}
    out = []
    for item in data:
        key = str(item)
        if key.isdigit() and 0 <= int(key) < len(dataset):
            out.append(int(key))
        elif key in index_of:
            out.append(index_of[key])
        else:
            raise ConfigError(f"--truth {path}: '{key}' is neither a row index below {len(dataset)} nor an example id of {dataset.path}")
    return sorted(set(out))
