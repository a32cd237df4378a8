"""Faults on the way out: exit codes, SIGTERM, a tracking server that drops, credentials in its URI.

The MLflow cases run ``gradian diagnose --mlflow-run`` in a subprocess against the session's real
server, reached through ``_FaultProxy``: a forwarding HTTP proxy that can hold one request (so
SIGTERM arrives while the child run is open, deterministically) or drop requests (the server gone
after the child run was created). The tracking URI carries ``user:s3cret@``, and no output may
show the password.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SECRET = "s3cret"
_MLFLOW = pytest.mark.integration


# -- the helper and the exit codes, in process ------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("server at http://user:s3cret@127.0.0.1:5000 did not answer", "server at http://user:***@127.0.0.1:5000 did not answer"),
    ("https://ghp_token@github.com/o/r", "https://***@github.com/o/r"),
    ("http://u:p@ss@host/x and https://a:b@c/", "http://u:***@host/x and https://a:***@c/"),
    ("http://host/api?run=1&access_token=abc&x=2", "http://host/api?run=1&access_token=***&x=2"),
    ("https://acct.blob/c/f?sv=2024&sig=Zm9v%3D", "https://acct.blob/c/f?sv=2024&sig=***"),
    ("mail user@example.com about http://host:5000/#/runs", "mail user@example.com about http://host:5000/#/runs"),
])
def test_redact_masks_uri_credentials_and_secret_query_values(text, expected):
    from gradian.redact import redact

    assert redact(text) == expected


def test_sigterm_inside_the_block_raises_terminated_and_the_handler_is_restored():
    from gradian.termination import Terminated, sigterm_raises

    with pytest.raises(Terminated):
        with sigterm_raises():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert Terminated.exit_code == 143


def _boom(exc: BaseException):
    def collect_report():
        raise exc
    return collect_report


@pytest.mark.parametrize("exc, code, line", [
    (RuntimeError("boom\nsecond line at http://u:s3cret@h"), 70,
     "error: internal error: RuntimeError: boom second line at http://u:***@h (rerun with --debug for the traceback)"),
    ("missing", 3, "error: the optional package x is not installed; pip install x"),
    ("config", 2, "error: bad key"),
])
def test_the_cli_turns_every_error_into_one_line_and_its_exit_code(monkeypatch, capsys, exc, code, line):
    from gradian.cli import main
    from gradian.errors import ConfigError, MissingDependencyError

    exc = {"missing": MissingDependencyError("the optional package x is not installed; pip install x"),
           "config": ConfigError("bad key")}.get(exc, exc)
    monkeypatch.setattr("gradian.doctor.collect_report", _boom(exc))
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor"])
    assert exit_info.value.code == code
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_debug_reraises_with_the_traceback(monkeypatch):
    from gradian.cli import main

    monkeypatch.setattr("gradian.doctor.collect_report", _boom(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        main(["--debug", "doctor"])


def test_doctor_names_the_tracking_uri_without_its_password(monkeypatch, capsys):
    from gradian.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://user:{SECRET}@mlflow.example.com/?token={SECRET}")
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--json"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "tracking URI: https://user:***@mlflow.example.com/?token=***" in out and SECRET not in out


# -- a proxy in front of the tracking server that holds or drops requests -----------------------

class _FaultProxy(ThreadingHTTPServer):
    """Forwards every request to ``upstream``, except as told.

    ``hold``: a path suffix; the first matching request waits (``held`` set) until ``release``.
    ``drop``: a path suffix or ``*``; matching requests are answered by closing the connection, ``drop_n``
    of them (``None``: all). ``drop_after``: a path suffix; the drop rule applies only once a
    request to it has been forwarded (the child run created).
    """

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.hold: str | None = None
        self.held = threading.Event()
        self.release = threading.Event()
        self.drop: str | None = None
        self.drop_n: int | None = None
        self.drop_after: str | None = None
        self.armed = False
        self.dropped: list[str] = []
        self.lock = threading.Lock()

    def uri(self, credentials: str = f"user:{SECRET}@") -> str:
        return f"http://{credentials}127.0.0.1:{self.server_address[1]}"

    def decide(self, path: str) -> str:
        route = path.split("?", 1)[0]
        with self.lock:
            if self.hold and route.endswith(self.hold) and not self.held.is_set():
                self.held.set()
                return "hold"
            matches = self.drop == "*" or (self.drop is not None and route.endswith(self.drop))
            if matches and self.armed and (self.drop_n is None or self.drop_n > 0):
                if self.drop_n is not None:
                    self.drop_n -= 1
                self.dropped.append(route)
                return "drop"
            if self.drop_after and route.endswith(self.drop_after):
                self.armed = True
            return "forward"


class _ProxyHandler(BaseHTTPRequestHandler):
    server: _FaultProxy

    def log_message(self, *args):  # keep the test output clean
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _proxy(self) -> None:
        body = self._body()
        action = self.server.decide(self.path)
        if action == "hold":
            self.server.release.wait(timeout=120)
        if action == "drop":
            self.close_connection = True
            return  # no answer at all: the client sees the connection closed
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "transfer-encoding", "connection")}
        headers["Content-Length"] = str(len(body))
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        try:
            self.send_response(resp.status)
            for key, value in resp.getheaders():
                if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away (SIGTERM while held)
            pass
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _proxy


@pytest.fixture
def proxy(mlflow_server):
    server = _FaultProxy(mlflow_server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


# -- the MLflow cases -------------------------------------------------------------------------

@pytest.fixture
def source(tracking, tmp_path):
    """A finished training run (params only) and the dataset file passed with --dataset."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    experiment = client.get_experiment_by_name("gradian-faults") or None
    experiment_id = experiment.experiment_id if experiment else client.create_experiment("gradian-faults")
    run = client.create_run(experiment_id, run_name="train")
    for key, value in {"learning_rate": "0.0002", "num_train_epochs": "2", "per_device_train_batch_size": "1",
                       "seed": "42"}.items():
        client.log_param(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id, "FINISHED")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(6)))
    return run.info.run_id, data


def _env(uri: str) -> dict[str, str]:
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
               MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="0", MLFLOW_HTTP_REQUEST_TIMEOUT="30")
    for key in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        env.pop(key, None)
    return env


def _diagnose(source_id: str, data: Path, cwd: Path) -> list[str]:
    return [sys.executable, "-m", "gradian", "diagnose", "--mlflow-run", source_id, "--dataset", str(data)]


def _children(tracking: str, source_id: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    experiment_id = client.get_run(source_id).info.experiment_id
    return client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{source_id}'")


@_MLFLOW
def test_sigterm_while_the_child_run_is_open_marks_it_failed_and_exits_143(tracking, proxy, source, tmp_path):
    source_id, data = source
    proxy.hold = "/runs/log-batch"  # the first request after the child run exists
    proc = subprocess.Popen(_diagnose(source_id, data, tmp_path), cwd=tmp_path, env=_env(proxy.uri()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proxy.held.wait(timeout=180), "the diagnosis never reached log-batch"
        (child,) = _children(tracking, source_id)
        assert child.info.status == "RUNNING"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proxy.release.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    (child,) = _children(tracking, source_id)
    assert child.info.status == "FAILED"
    assert err.strip().splitlines()[-2:] == [f"warning: the diagnosis run {child.info.run_id} was marked FAILED",
                                             "error: terminated by SIGTERM"]
    assert SECRET not in out + err


@_MLFLOW
@pytest.mark.parametrize("endpoint", ["/runs/log-batch", "/runs/set-tag", "/runs/update"])
def test_a_request_dropped_while_the_child_is_open_marks_it_failed(tracking, proxy, source, tmp_path, endpoint):
    """log-batch, the source run's tag, the final FINISHED: one of them gets no answer; the
    retried close goes through and the child ends FAILED, exit 3, the run named."""
    source_id, data = source
    proxy.drop, proxy.drop_n, proxy.drop_after = endpoint, 1, "/runs/create"
    proc = subprocess.run(_diagnose(source_id, data, tmp_path), cwd=tmp_path, env=_env(proxy.uri()),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert proxy.dropped == ["/api/2.0/mlflow" + endpoint]
    (child,) = _children(tracking, source_id)
    assert child.info.status == "FAILED"
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "did not answer" in last
    assert last.endswith(f"the diagnosis run {child.info.run_id} was marked FAILED")
    assert "http://user:***@127.0.0.1:" in last and SECRET not in proc.stdout + proc.stderr


@_MLFLOW
def test_a_server_gone_after_the_child_opens_names_the_run_and_the_next_run_closes_it(
        tracking, proxy, source, tmp_path):
    source_id, data = source
    proxy.drop, proxy.drop_after = "*", "/runs/create"  # every request once the child exists
    failed = subprocess.run(_diagnose(source_id, data, tmp_path), cwd=tmp_path, env=_env(proxy.uri()),
                            capture_output=True, text=True, timeout=300)
    assert failed.returncode == 3, failed.stderr
    (child,) = _children(tracking, source_id)
    assert child.info.status == "RUNNING"  # nothing could reach the server to close it
    left = child.info.run_id
    assert failed.stderr.strip().splitlines()[-1].endswith(
        f"the diagnosis run {left} could not be marked FAILED and may show as RUNNING; the next gradian run "
        "logged under the same source run marks it FAILED")

    proxy.drop = None  # the server is back
    again = subprocess.run(_diagnose(source_id, data, tmp_path), cwd=tmp_path, env=_env(proxy.uri()),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    stale = next(r for r in _children(tracking, source_id) if r.info.run_id == left)
    assert stale.info.status == "FAILED" and stale.data.tags["gradian.stale"] == "true"
    assert (f"warning: diagnosis run {left} (diagnose) of source run {source_id} was left RUNNING and its "
            f"process (pid {stale.data.tags['gradian.pid']} on {socket.gethostname()}) is gone; "
            "marked it FAILED (tag gradian.stale=true)") in again.stderr.splitlines()
    assert sum(r.info.status == "FINISHED" for r in _children(tracking, source_id)) == 1
    assert SECRET not in failed.stdout + failed.stderr + again.stdout + again.stderr


@_MLFLOW
def test_stale_children_are_the_gone_or_old_ones_gradian_created(tracking, source):
    from mlflow import MlflowClient

    from gradian_mlflow.sink import STALE_AFTER_HOURS, stale_children

    client = MlflowClient(tracking_uri=tracking)
    source_id, _ = source
    source_run = client.get_run(source_id)
    now_ms = int(time.time() * 1000)
    host, alive = socket.gethostname(), str(os.getpid())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()

    def child(name, start_ms, **tags):
        run = client.create_run(source_run.info.experiment_id, start_time=start_ms, run_name=name,
                                tags={"mlflow.parentRunId": source_id, **tags})
        return run.info.run_id

    old_ms = now_ms - int((STALE_AFTER_HOURS + 1) * 3.6e6)
    gone = child("gone", now_ms, **{"gradian.host": host, "gradian.pid": dead})
    old = child("old", old_ms, **{"gradian.host": "elsewhere", "gradian.pid": alive})
    child("fresh", now_ms, **{"gradian.host": host, "gradian.pid": alive})
    child("other-host", now_ms, **{"gradian.host": "elsewhere", "gradian.pid": dead})
    child("not-ours", old_ms)
    found = {run.info.run_id: why for run, why in stale_children(client, source_run, now_ms=now_ms)}
    assert found == {gone: f"its process (pid {dead} on {host}) is gone",
                     old: f"it started {STALE_AFTER_HOURS + 1:.0f} h ago"}


def test_an_unreachable_credentialed_server_is_exit_3_without_the_password(tmp_path):
    from tests.plugins.mlflow_server import _free_port

    uri = f"http://user:{SECRET}@127.0.0.1:{_free_port()}"
    proc = subprocess.run([sys.executable, "-m", "gradian", "diagnose", "--mlflow-run", "a" * 32],
                          cwd=tmp_path, env=_env(uri), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: reading run " + "a" * 32)
    assert "http://user:***@127.0.0.1:" in lines[0] and SECRET not in proc.stdout + proc.stderr


@_MLFLOW
def test_a_logged_diagnosis_prints_the_training_view_link_to_its_child_run(tracking, source, tmp_path):
    """On a tracking server the "logged" line is followed by the UI link that opens the child run
    in the training view; the link names the child run and its experiment, and no password."""
    from mlflow import MlflowClient

    source_id, data = source
    proc = subprocess.run(_diagnose(source_id, data, tmp_path), cwd=tmp_path, env=_env(tracking),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = [line for line in proc.stdout.splitlines() if line.startswith("logged the diagnose report")]
    (child_id,) = [run.info.run_id for run in _children(tracking, source_id)
                   if run.info.run_id in logged[0]]
    experiment_id = MlflowClient(tracking_uri=tracking).get_run(child_id).info.experiment_id
    link = f"see it at {tracking.rstrip('/')}/#/experiments/{experiment_id}/runs/{child_id}?workflowType=machine_learning"
    assert link in proc.stdout.splitlines(), proc.stdout[-2000:]


def test_a_sqlite_store_has_no_ui_address_so_no_link_is_printed(tmp_path, monkeypatch):
    import mlflow

    from gradian_mlflow.sink import run_url

    before = mlflow.get_tracking_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        assert run_url("0" * 32) is None
    finally:
        mlflow.set_tracking_uri(before)
