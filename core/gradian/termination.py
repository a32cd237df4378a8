"""SIGTERM ends a command the way Ctrl-C does: as an exception in the main thread.

Schedulers (Slurm, Kubernetes, ``timeout``) stop a job with SIGTERM, whose default action ends the
process at once: no ``finally`` runs, so an MLflow run Gradian opened would stay RUNNING forever.
Inside ``sigterm_raises()`` SIGTERM raises ``Terminated`` instead, which, like
``KeyboardInterrupt``, is a ``BaseException`` that ``except Exception`` does not swallow; the
cleanups run and the CLI exits with ``Terminated.exit_code`` (143, the shell's 128 + 15).
A second SIGTERM during the cleanup ends the process at once.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["Terminated", "sigterm_raises"]


class Terminated(BaseException):
    """The process received SIGTERM while inside ``sigterm_raises()``."""

    exit_code = 128 + int(signal.SIGTERM)


def _raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM is not waited on
    raise Terminated("terminated by SIGTERM")


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises ``Terminated`` in the main thread.

    Does nothing off the main thread (signal handlers can only be set there) or when a handler
    other than the default is already installed (the application's own, or an outer block's).
    The previous handler is restored on the way out.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
