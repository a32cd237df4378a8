"""The replay's states on disk: content-addressed, checksummed, resumable, reused once finished.

The reverse sweep (``gradian.replay.unrolled``) needs the state (LoRA tensors and the optimizer's
moments) at the start of every segment it visits. Held in memory they cost ``steps / k`` states on
the device; here each is written once by the forward replay and read back when its segment is
swept, so the memory holds one segment's states whatever the run's length. The same files let an
interrupted replay resume: the forward replay restarts from the last state it wrote, the sweep
after the last segment it finished (its adjoint and the row weights' gradient so far are written
after every segment), and a finished replay is read back instead of being made again.

Layout, under ``<cache_dir>/replay/<key>/`` (``key``: a digest of everything the replay computes
from, ``replay_key``):

- ``state-NNNNNNNN.pt``: the state before step ``N`` (the final one is ``N = steps``);
- ``sweep-NNNNN.pt``: the sweep after its first ``N`` segments: the adjoint of the state and the
  row weights' gradient (only the newest is kept);
- ``result.pt``: the finished replay (the measurement, the row weights' gradient, the final LoRA
  tensors); once it is written the states and the sweep records are removed;
- ``progress.json``: the sha256 of each of those files.

Every file is written atomically before ``progress.json`` names it, and checked against its
sha256 when read back; a missing or damaged file is recomputed (``repaired`` says which). A
resumed replay gives bit for bit what an uninterrupted one gives: the states and the adjoint are
stored exactly, and the sweep adds the segments' shares in the same order.

Interface: ``ReplayStates(root)``; ``forward_start(starts, steps) -> (t, state | None)``;
``save_state(t, state)``; ``load_state(t)``; ``save_sweep(n, adjoint, w_bar, value)``;
``load_sweep() -> (n, adjoint, w_bar, value) | None``; ``save_result(value, grad, names, theta)``;
``load_result()``; ``replay_key(inputs) -> str``.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence, TypeGuard

from gradian.atomic import write_bytes_atomic, write_text_atomic
from gradian.errors import ConfigError

if TYPE_CHECKING:
    import torch

    #: the replay's state between steps, as ``gradian.replay.unrolled`` holds it: ``(theta, m, v)``
    State = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]

__all__ = ["LAYOUT", "ReplayStates", "replay_key", "tensor_digest"]

#: the layout of a replay folder; part of the key, so another layout is never read
LAYOUT = 1

_PROGRESS = "progress.json"
_RESULT = "result.pt"


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``tensors`` (in name order)."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def replay_key(inputs: Mapping[str, object]) -> str:
    """The folder name of one replay: a digest of ``inputs`` (strings, numbers and nested lists,
    written as JSON with sorted keys) and the layout."""
    text = json.dumps({"layout": LAYOUT, **inputs}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _state_name(t: int) -> str:
    return f"state-{t:08d}.pt"


def _sweep_name(n: int) -> str:
    return f"sweep-{n:05d}.pt"


def _is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    import torch

    return isinstance(value, torch.Tensor)


def _state(payload: Mapping[str, object]) -> State | None:
    """``(theta, m, v)`` from a file's payload, or None when it does not hold three tensor lists."""
    parts = [payload.get(key) for key in ("theta", "m", "v")]
    lists: list[list[torch.Tensor]] = []
    for part in parts:
        if not isinstance(part, list) or not all(_is_tensor(x) for x in part):
            return None
        lists.append(part)
    return lists[0], lists[1], lists[2]


class ReplayStates:
    """One replay's files (module doc). ``root``: the replay's own folder."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.repaired: list[str] = []
        self._files: dict[str, str] = {}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot create the replay's state folder {self.root} ({err.strerror}); "
                              "set cache_dir to a writable folder") from None
        try:
            record = json.loads((self.root / _PROGRESS).read_text())
            files = record.get("files") if isinstance(record, dict) else None
            if isinstance(files, dict) and all(isinstance(v, str) for v in files.values()):
                self._files = dict(files)
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            self.repaired.append(f"{self.root / _PROGRESS} is not readable; the replay starts over")

    # -- files --------------------------------------------------------------------------------------

    def _write(self, name: str, payload: dict[str, object]) -> None:
        import torch

        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        try:
            write_bytes_atomic(self.root / name, data)
            self._files[name] = _sha(data)
            write_text_atomic(self.root / _PROGRESS, json.dumps({"layout": LAYOUT, "files": self._files}, indent=1))
        except OSError as err:
            raise ConfigError(f"cannot write the replay's state {self.root / name} ({err.strerror}); free disk "
                              "space or set cache_dir to a folder with room") from None

    def _read(self, name: str) -> dict[str, object] | None:
        import torch

        sha = self._files.get(name)
        if sha is None:
            return None
        path = self.root / name
        try:
            data = path.read_bytes()
        except OSError:
            self.repaired.append(f"{path} is missing; recomputed")
            self._files.pop(name, None)
            return None
        if _sha(data) != sha:
            self.repaired.append(f"{path} does not match its checksum; recomputed")
            self._files.pop(name, None)
            return None
        try:
            payload = torch.load(io.BytesIO(data), weights_only=True)
        except Exception:  # noqa: BLE001 - any unreadable file is recomputed
            self.repaired.append(f"{path} is not readable; recomputed")
            self._files.pop(name, None)
            return None
        return payload if isinstance(payload, dict) else None

    def _remove(self, names: Sequence[str]) -> None:
        for name in names:
            self._files.pop(name, None)
        write_text_atomic(self.root / _PROGRESS, json.dumps({"layout": LAYOUT, "files": self._files}, indent=1))
        for name in names:
            try:
                (self.root / name).unlink()
            except OSError:
                pass

    # -- the forward replay's states ----------------------------------------------------------------

    def save_state(self, t: int, state: State) -> None:
        theta, m, v = state
        self._write(_state_name(t), {"t": t, "theta": list(theta), "m": list(m), "v": list(v)})

    def load_state(self, t: int) -> State | None:
        payload = self._read(_state_name(t))
        if payload is None or payload.get("t") != t:
            return None
        return _state(payload)

    def has_state(self, t: int) -> bool:
        return _state_name(t) in self._files

    def forward_start(self, starts: Sequence[int], steps: int) -> tuple[int, State | None]:
        """Where the forward replay resumes: the latest of the kept steps (``starts``, then the
        final ``steps``) up to which every kept state is on disk, and that state (``None`` for
        ``starts[0]``, whose state is the one the replay starts from)."""
        first = starts[0] if starts else 0
        latest = first
        for t in [*starts[1:], steps]:
            if not self.has_state(t):
                break
            latest = t
        while latest > first:
            state = self.load_state(latest)
            if state is not None:
                return latest, state
            latest = max([s for s in starts if s < latest], default=first)
        return first, None

    # -- the sweep ----------------------------------------------------------------------------------

    def save_sweep(self, segments_done: int, adjoint: State, w_bar: torch.Tensor, value: float) -> None:
        old = [name for name in self._files if name.startswith("sweep-")]
        theta, m, v = adjoint
        self._write(_sweep_name(segments_done), {"segments_done": segments_done, "theta": list(theta), "m": list(m),
                                                 "v": list(v), "w_bar": w_bar, "value": float(value)})
        self._remove([name for name in old if name != _sweep_name(segments_done)])

    def load_sweep(self) -> tuple[int, State, torch.Tensor, float] | None:
        names = sorted(name for name in self._files if name.startswith("sweep-"))
        if not names:
            return None
        payload = self._read(names[-1])
        if payload is None:
            return None
        adjoint, done, w_bar, value = _state(payload), payload.get("segments_done"), payload.get("w_bar"), \
            payload.get("value")
        if adjoint is None or not isinstance(done, int) or not _is_tensor(w_bar) or not isinstance(value, float):
            return None
        return done, adjoint, w_bar, value

    # -- the finished replay -------------------------------------------------------------------------

    def save_result(self, value: float, grad: torch.Tensor, params: Mapping[str, torch.Tensor]) -> None:
        """Write the finished replay, then remove the states and sweep records it no longer needs."""
        self._write(_RESULT, {"value": float(value), "grad": grad, "params": dict(params)})
        self._remove([name for name in self._files if name != _RESULT])

    def load_result(self) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]] | None:
        payload = self._read(_RESULT)
        if payload is None:
            return None
        value, grad, params = payload.get("value"), payload.get("grad"), payload.get("params")
        if not isinstance(value, float) or not _is_tensor(grad) or not isinstance(params, dict) \
                or not all(isinstance(k, str) and _is_tensor(v) for k, v in params.items()):
            return None
        return value, grad, params

    def disk_bytes(self) -> int:
        total = 0
        for name in self._files:
            try:
                total += (self.root / name).stat().st_size
            except OSError:
                pass
        return total
