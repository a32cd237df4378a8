"""A real MLflow tracking server for integration tests (sqlite backend, artifact proxy).

Started once per session on a free 127.0.0.1 port; ``/health`` is polled until it answers.
Tests that use it get ``MLFLOW_TRACKING_URI`` pointing at it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    mlflow_bin = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"mlflow server did not start; log: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield uri
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


#: the variables through which MLflow hands a tracking store, experiment or run to a process
MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID")


@pytest.fixture(autouse=True)
def mlflow_env_restored():
    """Every test leaves MLflow's environment variables as it found them. ``mlflow.set_experiment``
    exports ``MLFLOW_EXPERIMENT_ID`` into this process's environment, and ``monkeypatch.delenv``
    of a variable that was not set records nothing to undo: a test that sets an experiment in
    process would hand it to every later test's subprocess, where that experiment does not exist."""
    saved = {key: os.environ.get(key) for key in MLFLOW_ENV}
    yield
    changed = False
    for key, value in saved.items():
        if os.environ.get(key) == value:
            continue
        changed = True
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if changed and "mlflow" in sys.modules:
        forget_active_experiment()


@pytest.fixture
def tracking(mlflow_server, monkeypatch):
    """Point MLflow at the session's server for one test."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    # mlflow.set_experiment exports MLFLOW_EXPERIMENT_ID: restore both afterwards, so no later
    # subprocess inherits an experiment that exists only on this server
    saved = {key: os.environ.get(key) for key in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")}
    mlflow.set_tracking_uri(mlflow_server)
    yield mlflow_server
    while mlflow.active_run() is not None:
        mlflow.end_run()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    forget_active_experiment()


def forget_active_experiment() -> None:
    """Drop the experiment mlflow.set_experiment remembered in this process."""
    import mlflow.tracking.fluent as fluent

    fluent._active_experiment_id = None
