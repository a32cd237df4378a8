"""Resolve a ``--run`` value to a RunRecord through the run source of its scheme, and find the
report sink a run's reports go back through.

Run sources and report sinks are plugins picked by the scheme of the run reference, the way
MLflow's own store and artifact registries pick by URI scheme: the **entry-point name is the
scheme**, and only the entry point chosen is loaded.

- ``gradian.run_sources``: ``<scheme> = "pkg.module:SOURCE"``. ``SOURCE`` has
  ``read(ref: RunRef, cache_dir: Path, **options) -> RunRecord`` (options, passed only when set:
  ``trust_run_dataset``, ``dataset_given``, ``optimizer_states``: the checkpoints' optimizer
  states are wanted too, for the replay engine; ``run_options`` gives the last from a config),
  and may have ``name`` (its cache folder under the cache dir; default: the scheme) and
  ``matches(text) -> bool`` to claim references written without a scheme (MLflow claims a bare
  32-hex run id that is not a local folder). A plain function ``(ref: str, cache_dir, **options)``
  also works: it gets the reference as written.
- ``gradian.report_sinks``: ``<scheme> = "pkg.module:publish"``, the ``ReportSink`` of that
  scheme (``gradian.report.sinks``, which calls it, documents the contract). ``has_report_sink``
  here says whether a run's scheme has one.

``RunSource`` is the contract of a run source as a ``typing.Protocol``; ``Plugin``,
``registered_plugins`` and ``single_plugin`` are the registry both groups are read through.

Local run directories (a path, ``file:<path>``) are read by core itself. Two installed
distributions registering one scheme is an error naming both; nothing is picked silently. The MLflow
integration registers ``mlflow`` and ``runs`` this way, so the engine never imports mlflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gradian.errors import RunRecordError
from gradian.runs.reader import read_run_dir
from gradian.runs.record import RunRecord
from gradian.runs.ref import LOCAL_SCHEME, RunRef

if TYPE_CHECKING:
    from gradian.config import GradianConfig

__all__ = [
    "RUN_SOURCES_GROUP",
    "REPORT_SINKS_GROUP",
    "Plugin",
    "RunSource",
    "resolve_run_ref",
    "resolve_run",
    "run_options",
    "is_remote_run_ref",
    "installed_schemes",
    "has_report_sink",
    "registered_plugins",
    "single_plugin",
    "sink_plugin",
]

RUN_SOURCES_GROUP = "gradian.run_sources"
REPORT_SINKS_GROUP = "gradian.report_sinks"

_INSTALL_HINT = ("install a run source that registers it under the gradian.run_sources entry points "
                 "(gradian-mlflow registers mlflow and runs), or pass a local run directory")


@runtime_checkable
class RunSource(Protocol):
    """A ``gradian.run_sources`` entry point: reads the run a reference of its scheme names.

    ``cache_dir`` is this source's own folder under the cache dir (``<cache_dir>/<name>``), for
    what it downloads; ``options`` are passed only when set (``trust_run_dataset``,
    ``dataset_given``). A source may also have ``name`` (that folder's name; default: the scheme)
    and ``matches(text) -> bool``, to claim references written without a scheme.
    """

    def read(self, ref: RunRef, cache_dir: Path, **options: bool) -> RunRecord: ...


@dataclass(frozen=True)
class Plugin:
    """One registered scheme: the entry point, and the distribution that declared it."""

    scheme: str
    entry_point: EntryPoint
    distribution: str

    def load(self) -> object:
        try:
            return self.entry_point.load()
        except Exception as err:  # noqa: BLE001 -- a broken plugin is named, not a traceback
            raise RunRecordError(
                f"the {self.entry_point.group} entry point '{self.scheme}' of {self.distribution} "
                f"({self.entry_point.value}) failed to load: {type(err).__name__}: {err}; reinstall or "
                "uninstall that package"
            ) from None


def registered_plugins(group: str) -> dict[str, list[Plugin]]:
    """scheme -> every distinct plugin of entry-point ``group`` registering it (more than one is a
    conflict, which ``single_plugin`` refuses)."""
    found: dict[str, list[Plugin]] = {}
    for ep in entry_points(group=group):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an unnamed distribution"
        plugins = found.setdefault(ep.name.lower(), [])
        # the same distribution seen twice on sys.path (an egg-info beside its dist-info) is one
        if not any(p.entry_point.value == ep.value and p.distribution == dist for p in plugins):
            plugins.append(Plugin(ep.name.lower(), ep, dist))
    return found


def single_plugin(scheme: str, plugins: list[Plugin], what: str) -> Plugin:
    """The one plugin of ``scheme``; two distributions registering it is an error naming both."""
    if len(plugins) > 1:
        claims = " and ".join(f"{p.distribution} ({p.entry_point.value})" for p in plugins)
        raise RunRecordError(f"{what} scheme '{scheme}:' is registered twice, by {claims}; uninstall one of them")
    return plugins[0]


def installed_schemes() -> list[str]:
    """Every scheme a ``--run`` value may use: ``file`` and the registered run sources'."""
    return sorted({LOCAL_SCHEME, *registered_plugins(RUN_SOURCES_GROUP)})


def resolve_run_ref(text: "str | RunRef") -> RunRef:
    """``text`` as a RunRef whose scheme picks its reader: a scheme-less value that is not an
    existing path goes to the one run source that ``matches`` it, else stays local."""
    ref = RunRef.parse(text)
    if ref.scheme:
        return ref
    claims: list[Plugin] = []
    for scheme, plugins in sorted(registered_plugins(RUN_SOURCES_GROUP).items()):
        matches = getattr(single_plugin(scheme, plugins, "run source").load(), "matches", None)
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


def run_options(cfg: GradianConfig) -> dict[str, bool]:
    """The reading options ``cfg`` asks of a run source beyond the flags: ``optimizer_states`` when
    the replay engine may start from a checkpoint (``engine.replay_start: auto``)."""
    if cfg.engine.name == "replay" and cfg.engine.replay_start == "auto":
        return {"optimizer_states": True}
    return {}


def resolve_run(ref: "str | RunRef", cache_dir: str | Path = ".gradian", **options: bool) -> RunRecord:
    """Read the run ``ref`` names. ``options`` (e.g. ``trust_run_dataset``) go to a run source as
    keywords, and only when given, so a source that takes none keeps working."""
    ref = resolve_run_ref(ref)
    if ref.is_local:
        return read_run_dir(ref.id)
    registry = registered_plugins(RUN_SOURCES_GROUP)
    if ref.scheme not in registry:
        raise RunRecordError(
            f"no run source reads '{ref.scheme}:' (in '{ref.raw}'); installed schemes: "
            f"{', '.join(installed_schemes())}; {_INSTALL_HINT}"
        )
    source = single_plugin(ref.scheme, registry[ref.scheme], "run source").load()
    folder = Path(cache_dir) / str(getattr(source, "name", ref.scheme))
    record: object
    if isinstance(source, RunSource) and callable(source.read):
        record = source.read(ref, cache_dir=folder, **options)
    elif callable(source):  # the first contract: a function of the reference as written
        record = source(ref.raw, cache_dir=folder, **options)
    else:
        raise RunRecordError(f"the run source for '{ref.scheme}:' ({registry[ref.scheme][0].entry_point.value}) "
                             "has no read(ref, cache_dir, **options); fix or uninstall that package")
    if not isinstance(record, RunRecord):
        raise RunRecordError(f"the run source for '{ref.scheme}:' returned {type(record).__name__}, not a RunRecord")
    if record.ref is None:
        record.ref = ref
    return record


def sink_plugin(source: "str | RunRef | None") -> tuple[RunRef, Plugin] | None:
    """The run reference and the ``gradian.report_sinks`` plugin of its scheme, or None for a local
    run or a scheme without a sink."""
    if not source:
        return None
    ref = RunRef.parse(source)
    if ref.is_local:
        return None
    plugins = registered_plugins(REPORT_SINKS_GROUP).get(ref.scheme)
    return (ref, single_plugin(ref.scheme, plugins, "report sink")) if plugins else None


def has_report_sink(source: "str | RunRef | None") -> bool:
    """Whether a record with this ``source`` has somewhere to log its reports back to."""
    return sink_plugin(source) is not None
