"""Plan a gradient run before it starts: peak memory per device, index bytes on disk, time.

Public interface: ``read_model_shape`` / ``adapter_shape`` / ``lora_linears`` (shapes from
config files, no weights), ``estimate_memory`` and ``index_bytes`` (the formulas),
``make_plan(...) -> Plan`` (one settings set, every batch of the dataset), ``propose_settings``
(the settings that fit memory and disk budgets), ``calibrate_time`` (a short measured run),
``parse_size``. ``gradian plan`` prints a ``Plan``.
"""

from gradian.plan.memory import CaptureSettings, MemoryEstimate, block_widths, estimate_memory, index_bytes
from gradian.plan.shapes import (
    AdapterShape,
    BatchShape,
    DatasetShape,
    LoraLinear,
    ModelShape,
    adapter_shape,
    lora_linears,
    preset_names,
    read_model_shape,
)

__all__ = [
    "AdapterShape",
    "BatchShape",
    "CaptureSettings",
    "DatasetShape",
    "LoraLinear",
    "MemoryEstimate",
    "ModelShape",
    "adapter_shape",
    "block_widths",
    "estimate_memory",
    "index_bytes",
    "lora_linears",
    "preset_names",
    "read_model_shape",
]
