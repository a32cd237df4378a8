"""Build (or reuse) the index a config describes: the one call the CLI and the attribute lane share.

Interface: ``index_from_config(config, force=False, progress=None, shard=None, log=None) -> IndexBuild``
loads the dataset, the tokenizer and the model for gradients, seeds torch, turns a projection on
when the full index would pass ``grads.max_index_gb`` (said through ``log``; see
``gradian.index.sizing``), says through ``log`` what the build repaired when it found a stored
file damaged (``GradientIndex.build``; ``index.repairs`` holds the records), and returns the stored index with the model, the tokenizer and the
config it was built under (the query must be built with the same ones). With ``shard`` (a
``gradian.distributed.ShardGroup``) every rank calls it, computes on its own device
(``cuda:LOCAL_RANK`` under ``device: auto``) and writes its share of the chunks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from gradian.engines.registry import whole_gradient_engines
from gradian.errors import ConfigError
from gradian.index.sizing import auto_projection
from gradian.index.store import GradientIndex

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig
    from gradian.data import Dataset
    from gradian.distributed import ShardGroup
    from gradian.grads import GradientModel
    from gradian.index.sizing import AutoProjection

__all__ = ["IndexBuild", "index_from_config"]


@dataclass
class IndexBuild:
    index: GradientIndex
    model: GradientModel
    tokenizer: PreTrainedTokenizerBase
    dataset: Dataset
    #: True when the index came from the cache unchanged
    cache_hit: bool
    #: the config the index was built under (with an automatic projection, when one was turned on)
    config: GradianConfig | None = None
    #: why a projection was turned on, if it was
    projection_auto: "AutoProjection | None" = None


def index_from_config(config: GradianConfig, *, force: bool = False, progress: Callable[[int, int], None] | None = None,
                      shard: "ShardGroup | None" = None, log: Callable[[str], None] | None = None) -> IndexBuild:
    import torch

    from gradian.data import load_dataset
    from gradian.distributed import shard_device
    from gradian.grads import load_model_for_gradients
    from gradian.inputs import tokenizer_source
    from gradian.model_loading import load_tokenizer

    if not config.dataset:
        raise ConfigError("no training dataset; pass --dataset/-d or set `dataset:` in the config")
    adapter = config.adapter_path
    if not adapter:
        raise ConfigError("no adapter; pass --adapter/-a or set `adapter_path:` in the config")
    dataset = load_dataset(config.dataset)
    if shard is not None:
        config = dataclasses.replace(config, device=shard_device(config.device, shard))
    torch.manual_seed(config.seed)
    model = load_model_for_gradients(config.base_model, adapter, config)
    name, origin, _ = tokenizer_source(config)  # the inputs were filled from the run already
    tokenizer = load_tokenizer(name or "", config.trust_remote_code, origin)
    config, auto = auto_projection(config, model, len(dataset), whole_gradient_engines([config.engine.name]))
    if auto is not None and log is not None:
        log(auto.message())
    index = GradientIndex.build(model, tokenizer, dataset, config, force=force, progress=progress, shard=shard,
                                extra_manifest={"projection_auto": auto.manifest()} if auto else None, log=log)
    return IndexBuild(index, model, tokenizer, dataset, cache_hit=index.cache_hit, config=config,
                      projection_auto=auto)
