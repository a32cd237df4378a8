"""Connecting to the tracking server with bounded retries and clear errors.

MLflow's own HTTP client retries for minutes by default; a diagnosis tool should fail within
seconds when the server is down, naming the URI and what to do. Callers can still raise the
limits through the standard ``MLFLOW_HTTP_REQUEST_*`` variables.

A server that does not answer is the environment (``TrackingUnreachableError``, exit code 3); a run
that does not exist or a request the server refuses is the input (``TrackingError``, exit code 2).
Every message names the tracking URI with its credentials redacted (``gradian.redact``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from gradian.errors import GradianEnvironmentError, GradianError
from gradian.redact import redact

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = ["TrackingError", "TrackingUnreachableError", "TrackingStoreError", "get_client", "check_tracking_uri", "tracking_uri",
           "parse_run_ref", "call", "quiet_credentialed_links"]

T = TypeVar("T")

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


class TrackingError(GradianError, ConnectionError):
    """The tracking server refused a request or does not know the run."""


class TrackingUnreachableError(TrackingError, GradianEnvironmentError):
    """The tracking server did not answer, even after the bounded retries."""


class TrackingStoreError(TrackingError, GradianEnvironmentError):
    """The tracking store's database answered with an error of its own (damaged, locked, wrong schema)."""


def _bound_retries() -> None:
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


def tracking_uri() -> str:
    """The tracking URI as it may be printed: any password or token in it replaced by ``***``."""
    import mlflow

    return redact(mlflow.get_tracking_uri())


def quiet_credentialed_links() -> None:
    """Stop MLflow printing "View run at <tracking URI>/..." when that URI carries a credential.

    MLflow writes the link, password included, to stdout whenever a run ends; Gradian prints the
    run id itself.
    """
    import mlflow

    uri = mlflow.get_tracking_uri()
    if redact(uri) != uri:
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


#: tracking URI schemes MLflow can store runs under (``databricks-uc``/``uc`` hold models only)
_SCHEMES = ("file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")


def check_tracking_uri(existing_store: bool = False) -> None:
    """Refuse a tracking URI MLflow cannot use, before any request: a misspelled scheme (exit 2),
    and with ``existing_store`` a SQLite file that is not there (MLflow would quietly create an
    empty store at a mistyped path) or is not a database."""
    import mlflow

    uri = mlflow.get_tracking_uri()
    scheme = uri.split(":", 1)[0].lower() if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", uri) else "file"
    base = scheme.split("+", 1)[0]
    if base not in _SCHEMES and not re.match(r"^[A-Za-z]$", scheme):  # C:\... is a Windows path
        raise TrackingError(
            f"MLFLOW_TRACKING_URI {redact(uri)!r}: '{scheme}' is not a tracking store scheme; use one of "
            f"{', '.join(_SCHEMES)} (e.g. http://host:5000 or sqlite:///mlflow.db)"
        )
    if base == "sqlite" and existing_store:
        path = uri.split("://", 1)[1] if "://" in uri else ""
        path = path[1:] if path.startswith("/") else path  # sqlite:///rel.db -> rel.db, sqlite:////abs -> /abs
        if path and path != ":memory:":
            db = Path(path)
            if not db.is_file():
                raise TrackingError(
                    f"MLFLOW_TRACKING_URI {redact(uri)!r}: no SQLite store at {db}; check the path (MLflow "
                    "would create a new, empty store there), or point it at the store your runs are in"
                )
            with db.open("rb") as handle:
                if handle.read(16) != b"SQLite format 3\x00":
                    raise TrackingError(
                        f"MLFLOW_TRACKING_URI {redact(uri)!r}: {db} is not an SQLite database (damaged, or "
                        "another file); restore it from a backup or point MLFLOW_TRACKING_URI at the right store"
                    )


def get_client(existing_store: bool = False) -> MlflowClient:
    """An ``MlflowClient`` with bounded retries; ``existing_store``: the runs to read must already be
    in the store, so a store that is not there is refused (``check_tracking_uri``)."""
    check_tracking_uri(existing_store)
    _bound_retries()
    quiet_credentialed_links()
    from mlflow import MlflowClient

    return call("opening the tracking store", MlflowClient)  # a database store is opened here


def parse_run_ref(ref: str) -> str:
    """A run id from ``<id>``, ``runs:/<id>[/path]`` or ``mlflow:<id>``."""
    text = ref.strip()
    for prefix in ("runs:/", "mlflow:"):
        if text.startswith(prefix):
            text = text[len(prefix):].split("/", 1)[0]
    if not _RUN_ID.match(text):
        raise GradianError(
            f"'{ref}' is not an MLflow run reference; pass a 32-character run id or runs:/<run_id>"
        )
    return text


def call(what: str, fn: Callable[[], T]) -> T:
    """Run one tracking request, turning connection and lookup failures into one-line errors."""
    from mlflow.exceptions import MlflowException

    try:
        return fn()
    except MlflowException as err:
        code = getattr(err, "error_code", "")
        text = redact(str(err).splitlines()[0][:300])
        if code == "RESOURCE_DOES_NOT_EXIST" or "not found" in text.lower():
            raise TrackingError(f"{what}: not found on {tracking_uri()} ({text})") from None
        if "max retries" in text.lower() or "connection" in text.lower():
            raise TrackingUnreachableError(
                f"{what}: the tracking server at {tracking_uri()} did not answer after bounded retries; "
                "start it or set MLFLOW_TRACKING_URI to a running server"
            ) from None
        raise TrackingError(f"{what}: {text}") from None
    except OSError as err:
        if err.filename is not None and not isinstance(err, ConnectionError):
            raise  # a local file (one we were to upload), not the server
        raise TrackingUnreachableError(
            f"{what}: cannot reach the tracking server at {tracking_uri()} ({type(err).__name__}); "
            "start it or set MLFLOW_TRACKING_URI to a running server"
        ) from None
    except Exception as err:
        if not type(err).__module__.startswith("sqlalchemy"):
            raise
        # a database-backed store (SQLite, PostgreSQL, ...) failed below MLflow: damaged, locked, foreign
        text = redact(str(getattr(err, "orig", None) or err).splitlines()[0][:200])
        raise TrackingStoreError(
            f"{what}: the tracking store at {tracking_uri()} cannot be read ({text}); restore it from a backup "
            "or point MLFLOW_TRACKING_URI at a working store"
        ) from None
