"""Plan a gradient run before it starts: peak memory per device and on the host, both stores of
the training gradients (index bytes on disk, or a stream's passes), the engine's curvature, time.

Public interface: ``read_model_shape`` / ``adapter_shape`` / ``lora_linears`` (shapes from
config files, no weights), ``estimate_memory``, ``index_bytes`` and ``stream_chunk_bytes`` (the
formulas), ``engine_passes`` and ``curvature_cost`` (an engine's passes over the data and its
Kronecker factors, ``gradian.plan.stores``), ``make_plan(...) -> Plan`` (one settings set, every
batch of the dataset), ``propose_settings`` (the settings that fit memory and disk budgets),
``calibrate_time`` (a short measured run), ``parse_size``; under ``engine.name: replay``,
``gradian.plan.replay.replay_cost`` (the replay of the run's recipe: steps, work, memory) and
``calibrate_replay`` (a timed differentiated step). ``gradian plan`` prints a ``Plan``.
"""

from gradian.plan.memory import (CaptureSettings, MemoryEstimate, block_widths, estimate_memory, index_bytes,
                                 stream_chunk_bytes)
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
from gradian.plan.stores import CurvatureCost, Passes, curvature_cost, engine_passes

__all__ = [
    "AdapterShape",
    "BatchShape",
    "CaptureSettings",
    "CurvatureCost",
    "DatasetShape",
    "LoraLinear",
    "MemoryEstimate",
    "ModelShape",
    "Passes",
    "adapter_shape",
    "block_widths",
    "curvature_cost",
    "engine_passes",
    "estimate_memory",
    "index_bytes",
    "lora_linears",
    "preset_names",
    "read_model_shape",
    "stream_chunk_bytes",
]
