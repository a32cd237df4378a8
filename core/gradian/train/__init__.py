"""The optional ``gradian train`` path: a LoRA fine-tune that leaves a run Gradian can read.

Public interface: ``train_lora(config, out_dir, dataset=None, callbacks=None, report_to=None)
-> RunRecord``, ``backend_status()``, ``BACKENDS``, and the names of what a run dir holds
(``ADAPTER_SUBDIR``, ``RUN_RECORD_FILE``, ``TRAINING_ARGS_FILE``). It is a convenience for
making runs to debug (the demo, the tests, the validation suite); Gradian itself debugs runs
made by any trainer.
"""

from gradian.train.backends import BACKENDS, backend_status, require_backend
from gradian.train.lora import ADAPTER_SUBDIR, RUN_RECORD_FILE, TRAINING_ARGS_FILE, train_lora

__all__ = [
    "ADAPTER_SUBDIR",
    "BACKENDS",
    "RUN_RECORD_FILE",
    "TRAINING_ARGS_FILE",
    "backend_status",
    "require_backend",
    "train_lora",
]
