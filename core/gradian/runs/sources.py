"""Resolve a ``--run`` value to a RunRecord, and log a report back to where the run came from.

Run sources and report sinks are plugins picked by the scheme of the run reference, the way
MLflow's own store and artifact registries pick by URI scheme: the **entry-point name is the
scheme**, and only the entry point chosen is loaded.

- ``gradian.run_sources``: ``<scheme> = "pkg.module:SOURCE"``. ``SOURCE`` has
  ``read(ref: RunRef, cache_dir: Path, **options) -> RunRecord`` (options, passed only when set:
  ``trust_run_dataset``, ``dataset_given``), and may have ``name`` (its cache folder under the
  cache dir; default: the scheme) and ``matches(text) -> bool`` to claim references written
  without a scheme (MLflow claims a bare 32-hex run id that is not a local folder). A plain
  function ``(ref: str, cache_dir, **options)`` also works: it gets the reference as written.
- ``gradian.report_sinks``: ``<scheme> = "pkg.module:publish"``, called as
  ``publish(source, report, kind=, files=, rankings=[, into_run=])`` for a record whose ``source``
  has that scheme. A source without a sink is fine: its reports are written locally only. The
  sink's module may also have ``run_url(run_id) -> str | None``: where a user sees the run it
  logged (printed after the "logged" line).

Local run directories (a path, ``file:<path>``) are read by core itself. Two installed
distributions registering one scheme is an error naming both; nothing is picked silently. The MLflow
integration registers ``mlflow`` and ``runs`` this way, so the engine never imports mlflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Callable, Sequence

from gradian.errors import RunRecordError
from gradian.runs.reader import read_run_dir
from gradian.runs.record import RunRecord
from gradian.runs.ref import LOCAL_SCHEME, RunRef

__all__ = [
    "RUN_SOURCES_GROUP",
    "REPORT_SINKS_GROUP",
    "resolve_run_ref",
    "resolve_run",
    "is_remote_run_ref",
    "installed_schemes",
    "has_report_sink",
    "publish_report",
    "report_link",
]

RUN_SOURCES_GROUP = "gradian.run_sources"
REPORT_SINKS_GROUP = "gradian.report_sinks"

_INSTALL_HINT = ("install a run source that registers it under the gradian.run_sources entry points "
                 "(gradian-mlflow registers mlflow and runs), or pass a local run directory")


@dataclass(frozen=True)
class _Plugin:
    """One registered scheme: the entry point, and the distribution that declared it."""

    scheme: str
    entry_point: EntryPoint
    distribution: str

    def load(self) -> Any:
        try:
            return self.entry_point.load()
        except Exception as err:  # noqa: BLE001 -- a broken plugin is named, not a traceback
            raise RunRecordError(
                f"the {self.entry_point.group} entry point '{self.scheme}' of {self.distribution} "
                f"({self.entry_point.value}) failed to load: {type(err).__name__}: {err}; reinstall or "
                "uninstall that package"
            ) from None


def _registry(group: str) -> dict[str, list[_Plugin]]:
    """scheme -> every distinct plugin registering it (more than one is a conflict)."""
    found: dict[str, list[_Plugin]] = {}
    for ep in entry_points(group=group):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an unnamed distribution"
        plugins = found.setdefault(ep.name.lower(), [])
        # the same distribution seen twice on sys.path (an egg-info beside its dist-info) is one
        if not any(p.entry_point.value == ep.value and p.distribution == dist for p in plugins):
            plugins.append(_Plugin(ep.name.lower(), ep, dist))
    return found


def _one(scheme: str, plugins: list[_Plugin], what: str) -> _Plugin:
    if len(plugins) > 1:
        claims = " and ".join(f"{p.distribution} ({p.entry_point.value})" for p in plugins)
        raise RunRecordError(f"{what} scheme '{scheme}:' is registered twice, by {claims}; uninstall one of them")
    return plugins[0]


def installed_schemes() -> list[str]:
    """Every scheme a ``--run`` value may use: ``file`` and the registered run sources'."""
    return sorted({LOCAL_SCHEME, *_registry(RUN_SOURCES_GROUP)})


def resolve_run_ref(text: "str | RunRef") -> RunRef:
    """``text`` as a RunRef whose scheme picks its reader: a scheme-less value that is not an
    existing path goes to the one run source that ``matches`` it, else stays local."""
    ref = RunRef.parse(text)
    if ref.scheme:
        return ref
    claims: list[_Plugin] = []
    for scheme, plugins in sorted(_registry(RUN_SOURCES_GROUP).items()):
        matches = getattr(_one(scheme, plugins, "run source").load(), "matches", None)
        if callable(matches) and matches(ref.raw):
            claims.append(plugins[0])
    # one source registered under several schemes (mlflow, runs) is one claim
    owners = {p.entry_point.value: p for p in claims}
    if len(owners) > 1:
        names = ", ".join(f"{p.scheme}: ({p.distribution})" for p in owners.values())
        raise RunRecordError(f"'{ref.raw}' has no scheme and several run sources claim it ({names}); "
                             "write the scheme in front of it")
    if claims:
        return RunRef(claims[0].scheme, ref.id, ref.raw)
    return ref


def is_remote_run_ref(ref: "str | RunRef") -> bool:
    """Whether ``ref`` is read by a run source rather than as a local run directory."""
    return not resolve_run_ref(ref).is_local


def resolve_run(ref: "str | RunRef", cache_dir: str | Path = ".gradian", **options: bool) -> RunRecord:
    """Read the run ``ref`` names. ``options`` (e.g. ``trust_run_dataset``) go to a run source as
    keywords, and only when given, so a source that takes none keeps working."""
    ref = resolve_run_ref(ref)
    if ref.is_local:
        return read_run_dir(ref.id)
    registry = _registry(RUN_SOURCES_GROUP)
    if ref.scheme not in registry:
        raise RunRecordError(
            f"no run source reads '{ref.scheme}:' (in '{ref.raw}'); installed schemes: "
            f"{', '.join(installed_schemes())}; {_INSTALL_HINT}"
        )
    source = _one(ref.scheme, registry[ref.scheme], "run source").load()
    folder = Path(cache_dir) / str(getattr(source, "name", ref.scheme))
    read: Callable[..., RunRecord] | None = getattr(source, "read", None)
    if callable(read):
        record = read(ref, cache_dir=folder, **options)
    elif callable(source):  # the first contract: a function of the reference as written
        record = source(ref.raw, cache_dir=folder, **options)
    else:
        raise RunRecordError(f"the run source for '{ref.scheme}:' ({registry[ref.scheme][0].entry_point.value}) "
                             "has no read(ref, cache_dir, **options); fix or uninstall that package")
    if not isinstance(record, RunRecord):
        raise RunRecordError(f"the run source for '{ref.scheme}:' returned {type(record).__name__}, not a RunRecord")
    if not record.source:
        record.source = str(ref)
    return record


def _sink_for(source: str | None) -> tuple[RunRef, _Plugin] | None:
    if not source:
        return None
    ref = RunRef.parse(source)
    if ref.is_local:
        return None
    plugins = _registry(REPORT_SINKS_GROUP).get(ref.scheme)
    return (ref, _one(ref.scheme, plugins, "report sink")) if plugins else None


def has_report_sink(source: str | None) -> bool:
    """Whether a record with this ``source`` has somewhere to log its reports back to."""
    return _sink_for(source) is not None


def publish_report(
    source: str | None,
    report: Any,
    kind: str,
    files: Sequence[Path] = (),
    rankings: object = None,
    *,
    into_run: str | None = None,
) -> str | None:
    """Log ``report`` back to where the run came from; returns the new run id, or None.

    The sink is the ``gradian.report_sinks`` entry point named by the scheme of ``source`` (the
    RunRecord's ``source``, e.g. ``mlflow:<id>``); a local run, or a scheme with no sink, returns
    None. ``into_run`` is a run already open for this work (the project run under ``mlflow run``)
    for the sink to log into instead of creating one; it is passed only when given.
    """
    found = _sink_for(source)
    if found is None:
        return None
    ref, plugin = found
    sink = plugin.load()
    publish = getattr(sink, "publish", sink)
    extra = {"into_run": into_run} if into_run else {}
    return publish(str(ref), report, kind=kind, files=list(files), rankings=rankings, **extra)


def report_link(source: str | None, run_id: str) -> str | None:
    """Where to see ``run_id`` (logged by the sink of ``source``'s scheme), when that sink's module
    has ``run_url``; None otherwise, or when the link cannot be made (it is only a convenience)."""
    import importlib

    found = _sink_for(source)
    if found is None:
        return None
    module = importlib.import_module(found[1].entry_point.module)
    make = getattr(module, "run_url", None)
    if not callable(make):
        return None
    try:
        url = make(run_id)
    except Exception:  # noqa: BLE001 -- the report is already logged; a missing link is not an error
        return None
    return url if isinstance(url, str) and url else None
