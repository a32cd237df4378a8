"""``training_args.bin``: the HF Trainer's pickled arguments, read without a general unpickle.

Public interface: ``read_training_args(path) -> dict`` (argument name -> plain value) and
``TrainingArgsRefused`` (a ``RunRecordError`` whose message names the class that was refused).

The file is ``torch.save(TrainingArguments)``, a pickle, and unpickling runs whatever callables
the pickle names. So it is loaded only with ``torch.load(weights_only=True)``, whose unpickler
builds tensors, containers and nothing else unless a class is allowlisted through
``torch.serialization.safe_globals``. The allowlist here is the argument classes (transformers
``TrainingArguments`` and ``Seq2SeqTrainingArguments``; TRL's ``SFTConfig`` and ``DPOConfig``),
the enums their fields hold and two small records:

- transformers' own classes are rebuilt as in any pickle, by ``cls.__new__`` and filling the
  ``__dict__``, never by calling the class: a file that calls one (which would run
  ``__post_init__`` on values of the file's choosing) is refused.
- accelerate's ``PartialState`` (the process topology the arguments cache) is mapped by name to
  an inert record that keeps its fields (``num_processes`` is the world size) and runs none of
  accelerate's code.
- TRL's configs are the real classes when trl imports, else the same inert record, so a TRL run
  is readable where trl is not installed.

Before anything is loaded the pickle's globals are listed with ``pickletools``, which parses and
executes nothing, and a file naming anything else is refused with a message naming it.
``weights_only=True`` would refuse it as well; the scan is there for the message.
"""

from __future__ import annotations

import enum
import pickletools
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradian.errors import RunRecordError

if TYPE_CHECKING:
    from gradian.jsontypes import JsonObject, JsonValue

__all__ = ["read_training_args", "TrainingArgsRefused"]


class TrainingArgsRefused(RunRecordError):
    """``training_args.bin`` was not loaded: it names a class outside the allowlist, or is unreadable."""


class _InertRecord:
    """Stands in for a class we refuse to run (accelerate state, TRL configs without trl): fields only."""


def _fields_only(cls: type) -> type:
    """A subclass of ``cls`` that a pickle may rebuild but not call.

    An honest file rebuilds an argument object with ``cls.__new__`` and fills its ``__dict__``
    (pickle's NEWOBJ and BUILD). Calling the class (pickle's REDUCE) would run its
    ``__post_init__`` on whatever values the file chose, so that is refused.
    """

    def refuse(self: object, *args: object, **kwargs: object) -> None:
        import pickle

        raise pickle.UnpicklingError(f"{cls.__module__}.{cls.__qualname__} is called in the pickle; "
                                     "argument objects may only be rebuilt from their stored fields")

    return type(cls.__name__, (cls,), {"__init__": refuse, "__module__": __name__})


def _transformers_classes() -> dict[str, type]:
    from transformers import trainer_pt_utils, trainer_utils, training_args
    from transformers.debug_utils import DebugOption

    found: dict[str, type] = {
        "transformers.training_args.TrainingArguments": _fields_only(training_args.TrainingArguments),
        "transformers.training_args.OptimizerNames": training_args.OptimizerNames,
        "transformers.training_args.ParallelMode": training_args.ParallelMode,
        "transformers.trainer_pt_utils.AcceleratorConfig": _fields_only(trainer_pt_utils.AcceleratorConfig),
        "transformers.debug_utils.DebugOption": DebugOption,
    }
    for name in ("IntervalStrategy", "SaveStrategy", "HubStrategy", "SchedulerType", "FSDPOption"):
        if hasattr(trainer_utils, name):  # SaveStrategy is newer than the others
            found[f"transformers.trainer_utils.{name}"] = getattr(trainer_utils, name)
    try:
        from transformers.training_args_seq2seq import Seq2SeqTrainingArguments

        found["transformers.training_args_seq2seq.Seq2SeqTrainingArguments"] = _fields_only(Seq2SeqTrainingArguments)
    except ImportError:
        pass
    return found


#: TRL's argument classes by the name a pickle gives them
_TRL_CONFIGS = ("trl.trainer.sft_config.SFTConfig", "trl.trainer.dpo_config.DPOConfig")


def _trl_classes() -> dict[str, type]:
    try:
        from trl.trainer.dpo_config import DPOConfig
        from trl.trainer.sft_config import SFTConfig
    except Exception:  # trl missing or broken: keep the fields, run none of its code
        return {name: _InertRecord for name in _TRL_CONFIGS}
    found: dict[str, type] = {_TRL_CONFIGS[0]: _fields_only(SFTConfig), _TRL_CONFIGS[1]: _fields_only(DPOConfig)}
    # an enum older TRL releases pickle into DPOConfig; newer ones no longer have it
    import importlib

    divergence = getattr(importlib.import_module("trl.trainer.dpo_config"), "FDivergenceType", None)
    if divergence is not None:
        found["trl.trainer.dpo_config.FDivergenceType"] = divergence
    return found


def _accelerate_classes() -> dict[str, type]:
    found: dict[str, type] = {"accelerate.state.PartialState": _InertRecord}
    try:
        from accelerate.utils.dataclasses import DistributedType

        found["accelerate.utils.dataclasses.DistributedType"] = DistributedType
    except ImportError:
        pass
    return found


def _allowlist() -> dict[str, type]:
    """Fully qualified name -> the object a pickle's reference to that name resolves to."""
    return {**_transformers_classes(), **_trl_classes(), **_accelerate_classes()}


#: globals torch's weights-only unpickler allows on its own that these files hold (the device the
#: arguments resolved, cached in ``_setup_devices``)
_TORCH_GLOBALS = {"torch.device"}

_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE",
               "SHORT_BINSTRING", "BINSTRING", "STRING"}


def _pickle_globals(data: bytes) -> list[str]:
    """Every ``module.name`` a pickle refers to, in order, found by parsing (nothing is executed)."""
    names: list[str] = []
    strings: list[str] = []
    memo: dict[int, str | None] = {}
    top: str | None = None
    for op, raw, _ in pickletools.genops(data):
        arg: Any = raw  # pickletools leaves each opcode's argument untyped: a str for the string opcodes
        if op.name in _STRING_OPS:
            top = arg
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = top
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = top
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            top = memo.get(int(arg))
            if isinstance(top, str):
                strings.append(top)
        elif op.name == "GLOBAL":
            names.append(str(arg).replace(" ", "."))
            top = None
        elif op.name == "STACK_GLOBAL":
            if len(strings) < 2:
                raise ValueError("STACK_GLOBAL without a module and a name before it")
            names.append(f"{strings[-2]}.{strings[-1]}")
            top = None
        else:
            top = None
    return names


def _scan(path: Path, allowed: set[str]) -> None:
    """Refuse ``path`` when its pickle names a global outside ``allowed``."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(pickles) != 1:
                raise TrainingArgsRefused(f"{path}: not a torch.save archive (found {len(pickles)} data.pkl)")
            data = archive.read(pickles[0])
    except zipfile.BadZipFile:
        return  # the legacy (pre-zip) format: weights_only's own refusal names the class
    try:
        names = _pickle_globals(data)
    except Exception as err:
        raise TrainingArgsRefused(f"{path}: not a readable pickle ({err})") from None
    for name in names:
        if name not in allowed and name not in _TORCH_GLOBALS:
            raise TrainingArgsRefused(f"{path}: refused to load: it names {name}, which is not a "
                                      "training-arguments class or one of their field types")


def _plain(value: object) -> JsonValue:
    """Enum members to their value, containers element-wise; other objects are dropped (None)."""
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return None


def read_training_args(path: str | Path) -> JsonObject:
    """The arguments stored in ``training_args.bin``, as plain values (enums by their value).

    ``world_size`` is added from the pickled process state when it is there. Raises
    ``TrainingArgsRefused`` for a file naming any class outside the allowlist, a file that is not
    a torch archive, or one torch cannot load with ``weights_only=True``.
    """
    import pickle

    import torch

    path = Path(path)
    try:
        allowlist = _allowlist()
    except ImportError as err:
        raise TrainingArgsRefused(f"{path}: transformers is needed to read it ({err})") from None
    _scan(path, set(allowlist))
    allowed: list[tuple[type, str]] = [(obj, name) for name, obj in allowlist.items()]
    try:
        with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notices; a refusal is reported below
            loaded = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise TrainingArgsRefused(f"{path}: refused to load ({_first_line(err)})") from None
    except Exception as err:  # a truncated file, an enum value this transformers lacks, ...
        raise TrainingArgsRefused(f"{path}: could not be read ({type(err).__name__}: {_first_line(err)})") from None
    fields = getattr(loaded, "__dict__", None)
    if not isinstance(fields, dict):
        raise TrainingArgsRefused(f"{path}: holds a {type(loaded).__name__}, not training arguments")
    out = {k: _plain(v) for k, v in fields.items() if not k.startswith("_") and not isinstance(v, _InertRecord)}
    state = fields.get("distributed_state")
    processes = getattr(state, "num_processes", None) if isinstance(state, _InertRecord) else None
    if isinstance(processes, int) and processes > 0:
        out["world_size"] = processes
    return {k: v for k, v in out.items() if v is not None}


#: the advice torch wraps around every weights-only refusal; the reason is the line that is not
_TORCH_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation",
                      "(1)", "(2)", "WeightsUnpickler error:")


def _first_line(err: BaseException) -> str:
    """The reason inside torch's multi-paragraph weights-only error, else its first line."""
    text = str(err).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        reason = line.partition("WeightsUnpickler error:")[2].strip() if "WeightsUnpickler error:" in line else line
        if reason and not reason.startswith(_TORCH_BOILERPLATE):
            return reason[:300]
    return (lines or [""])[0][:300]
