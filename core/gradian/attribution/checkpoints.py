"""The training set under each saved checkpoint: adapters loaded beside the final one, indexed.

Interface: ``CheckpointSet(gm, tokenizer, dataset, config, ...)`` is the ``CheckpointIndexer`` the
engines' ``FitContext.checkpoints`` holds: ``index(paths, verb, each, final, collect)`` loads each
``checkpoint-N`` as an extra adapter on the one base model already in memory, indexes the
training set under it through the content-addressed index cache (gathering Kronecker sums
during the build when ``collect``), and returns one ``CheckpointGradients`` per checkpoint,
weighted by the learning rate at that step. ``fit_context(...)`` builds the whole ``FitContext``
an engine fit gets. ``activate(gm, name)`` switches the active adapter; ``checkpoint_model``,
``same_adapter_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from gradian.engines.base import CheckpointGradients, FitContext, TrainGradients
from gradian.engines.tracin import checkpoint_learning_rates
from gradian.errors import ModelLoadError
from gradian.grads import fingerprint_path, wrap_peft_model
from gradian.grads.collectors import KroneckerCollector, ModelPasses
from gradian.index.stream import StoreChoice, capture_training_gradients

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from gradian.data import TokenizedExample
    from gradian.config import GradianConfig
    from gradian.data import Dataset
    from gradian.grads import GradientModel
    from gradian.runs import RunRecord

__all__ = ["CheckpointSet", "activate", "checkpoint_model", "fit_context", "same_adapter_weights"]


@dataclass
class CheckpointSet:
    """Indexes the training set under every saved checkpoint (see the module doc).

    ``gm`` holds the final adapter; ``tokenized`` is the training set as the index saw it (for
    each checkpoint's curvature passes); ``collected`` the Kronecker sums of the final index build.
    """

    gm: GradientModel
    tokenizer: PreTrainedTokenizerBase
    dataset: Dataset
    config: GradianConfig
    run: RunRecord | None
    tokenized: Sequence[TokenizedExample]
    collected: KroneckerCollector | None = None
    log: Callable[[str], None] | None = None
    #: ``index`` (each checkpoint's gradients written to its own index) or ``stream`` (recomputed
    #: under the checkpoint's adapter in each pass, nothing written), as the final adapter's
    store: str = "index"

    def index(self, paths: Sequence[str], verb: str, each: Callable[[CheckpointGradients], None] | None = None,
              final: TrainGradients | None = None, collect: bool = False) -> list[CheckpointGradients]:
        """Every checkpoint in ``paths`` loaded as an extra adapter on ``gm`` and its training
        gradients indexed, weighted by the learning rate at that checkpoint. ``each(checkpoint)``
        runs while that checkpoint's adapter is active; ``gm``'s own adapter is active again
        afterwards. ``verb`` says, in the log, what is done under each checkpoint.

        A checkpoint whose LoRA weights equal the final adapter's (the last one a run saves) is not
        indexed again when ``final`` (the final adapter's training gradients) is given: it gets
        ``final``, ``gm`` and ``collected``. ``collect=True`` gathers the Kronecker sums during
        each checkpoint's index build, so an EK-FAC fit under it needs no pass of its own when the
        index was computed rather than read from the cache.
        """
        weights = checkpoint_learning_rates(paths, self.run)
        full, gm = self.config, self.gm
        pad_id = self.tokenizer.pad_token_id
        out = []
        try:
            for path, weight in zip(paths, weights):
                label = Path(path).name
                view = checkpoint_model(gm, path, label, full)
                if final is not None and same_adapter_weights(gm.model, label, gm.adapter_name):
                    if self.log:
                        self.log(f"{verb} under {label}: the final adapter's weights, its index reused")
                    view = activate(gm, None, full)
                    checkpoint = CheckpointGradients(weight=weight, train=final, label=label, view=view,
                                                     passes=ModelPasses(view, self.tokenized, pad_id, full.grads),
                                                     collected=self.collected, is_final=True)
                else:
                    if self.log:
                        self.log(f"{verb} under {label}")
                    index, collector = capture_training_gradients(
                        view, self.tokenizer, self.dataset, full, StoreChoice(self.store, "as the final adapter's"),
                        collect=collect, tokenized=self.tokenized)
                    checkpoint = CheckpointGradients(weight=weight, train=index, label=label, view=view,
                                                     passes=ModelPasses(view, self.tokenized, pad_id, full.grads),
                                                     collected=collector)
                if each is not None:
                    each(checkpoint)
                out.append(checkpoint)
        finally:
            activate(gm, None, full)
        return out


def fit_context(config: GradianConfig, gm: GradientModel, tokenizer: PreTrainedTokenizerBase, dataset: Dataset,
                run: RunRecord | None, *, tokenized: Sequence[TokenizedExample] | None = None, collected: KroneckerCollector | None = None,
                progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] | None = None,
                needs_model: bool = True, store: str = "index") -> FitContext:
    """The ``FitContext`` of an engine fit on ``dataset`` under ``gm``: the curvature passes over
    ``tokenized`` (tokenized here when not given), the checkpoint indexer and the run. An engine
    whose fit reads only the stored gradients (``needs_model`` false) gets neither pass nor indexer."""
    from gradian.data import tokenize_examples

    if not needs_model:
        return FitContext(collected=collected, grads=config.grads, run=run, seed=config.seed,
                          cache_dir=config.cache_dir, progress=progress, log=log)
    if tokenized is None:
        tokenized = tokenize_examples(dataset.examples, tokenizer, config.grads.max_seq_length)
    checkpoints = CheckpointSet(gm, tokenizer, dataset, config, run, tokenized, collected=collected, log=log,
                                store=store)
    return FitContext(passes=ModelPasses(gm, tokenized, tokenizer.pad_token_id, config.grads), collected=collected,
                      checkpoints=checkpoints, grads=config.grads, run=run, seed=config.seed,
                      cache_dir=config.cache_dir, progress=progress, log=log)


def same_adapter_weights(model: PeftModel, first: str, second: str) -> bool:
    """Adapters ``first`` and ``second`` of a PEFT ``model`` have the same LoRA settings and weights."""
    import torch

    if first == second:
        return True
    configs = getattr(model, "peft_config", {})
    if first not in configs or second not in configs:
        return False
    keys = ("r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "fan_in_fan_out")
    a, b = configs[first], configs[second]
    if any(getattr(a, k, None) != getattr(b, k, None) for k in keys):
        return False
    mine, theirs = f".{first}.", f".{second}."
    left: dict[str, torch.Tensor] = {}
    right: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if mine in name:
            left[name.replace(mine, ".<adapter>.")] = param
        elif theirs in name:
            right[name.replace(theirs, ".<adapter>.")] = param
    if not left or left.keys() != right.keys():
        return False
    with torch.no_grad():
        return all(left[k].shape == right[k].shape and torch.equal(left[k], right[k]) for k in left)


def checkpoint_model(gm: GradientModel, path: str | Path, label: str, config: GradianConfig | None = None) -> GradientModel:
    """A ``GradientModel`` over the same base with the adapter at ``path`` loaded beside the others.

    The adapter is added to ``gm.model`` under the name ``label`` (once); the returned model
    activates it. Call ``activate(gm)`` to switch back before using another view.
    """
    model = gm.model
    if label not in getattr(model, "peft_config", {}):
        try:
            model.load_adapter(str(path), adapter_name=label, is_trainable=False)
        except (RuntimeError, ValueError, KeyError, OSError) as err:
            first = (str(err).strip().splitlines() or [""])[0]
            raise ModelLoadError(f"cannot load the TracIn checkpoint {path} as an adapter ({first}); "
                                 "check that it was saved by the same run") from None
    view = activate(gm, label, config)
    view.fingerprints = {"base": gm.fingerprints.get("base", "in-memory"), "adapter": fingerprint_path(Path(path))}
    return view


def activate(gm: GradientModel, adapter_name: str | None = None, config: GradianConfig | None = None) -> GradientModel:
    """Make ``adapter_name`` (default: ``gm``'s own) the active adapter; returns its ``GradientModel``."""
    name = adapter_name or gm.adapter_name
    gm.model.set_adapter(name)
    view = wrap_peft_model(gm.model, config)
    view.fingerprints = dict(gm.fingerprints)
    return view
