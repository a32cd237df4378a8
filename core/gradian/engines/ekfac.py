"""EK-FAC and K-FAC: influence with Kronecker-factored curvature over the LoRA matrices.

Each LoRA module is two linear layers, ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``);
each gets its own Kronecker factors (``gradian.engines.kronecker``), and the curvature is block
diagonal over them. The score of training example ``j`` is

    score_j = sum_layers < (F_l + lam_l I)^-1 q_l , g_j^(l) >

with ``q`` the query gradient and ``g_j`` the stored per-example gradient, so the sign
convention is the one every engine shares. ``lam_l = lambda_scale * mean(Lambda_l)`` (the layer's
mean eigenvalue), or ``lambda_override``.

``fit`` makes one pass over the training set with the hooks that capture per-example gradients,
collecting each layer's input covariance ``A`` and output-gradient covariance ``S``; then one
eigendecomposition per factor; then (``ekfac``, not ``kfac``) the eigenvalue correction from the
per-example gradients, read from the index when it holds them unchanged (empirical Fisher, no
normalization, no projection), otherwise recomputed in a second pass.

Fisher: ``empirical`` (default, deterministic) uses the training labels. ``true`` samples the
labels of the supervised positions from the model's own predictions, seeded by
``engine.fisher_seed`` (part of the state id), averaged over ``engine.fisher_samples`` draws.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import numpy as np

from gradian.engines.base import Engine, EngineResult, EngineState, FitContext, TrainGradients, as_query_matrix, check_widths
from gradian.engines.graddot import gradient_dot
from gradian.engines.kronecker import KroneckerEigen, KroneckerFactors, corrected_eigenvalues, damped_inverse, eigendecompose
from gradian.engines.registry import register_engine
from gradian.errors import ConfigError

__all__ = ["EKFACEngine", "KFACEngine", "FISHER_KINDS", "TRAIN_NORMALIZATIONS", "KroneckerCollector", "self_influence"]

FISHER_KINDS = ("empirical", "true")
#: ``engine.checkpoints``: fit under the final adapter, or under every saved checkpoint
CHECKPOINT_MODES = ("final", "all")
#: ``engine.normalize_train``: rank rows by raw influence, or by each row's influence divided by the
#: root of its self-influence (the scores stay influence either way)
TRAIN_NORMALIZATIONS = ("none", "relatif")


def _layers(gm: Any) -> list[dict[str, Any]]:
    """Every LoRA linear layer: its key, block, column offset inside the block and shape."""
    out = []
    for block in gm.blocks:
        offset = 0
        for j, (lin, (rows, cols)) in enumerate(zip(block.linears, block.shapes)):
            out.append({"key": f"{block.name}#{j}", "block": block.name, "offset": offset,
                        "out": int(rows), "in": int(cols), "id": id(lin)})
            offset += rows * cols
    return out


def _sampler(seed: int, draw: int, offset: int) -> Any:
    """Labels drawn from the model's predictions at the supervised positions (true Fisher)."""
    import torch

    digest = hashlib.sha256(f"{seed}:{draw}:{offset}".encode()).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))

    def sample(logits: Any, labels: Any) -> Any:
        keep = labels[:, 1:] != -100
        probs = torch.softmax(logits[:, :-1][keep].detach().double().cpu(), dim=-1)
        drawn = torch.multinomial(probs, 1, generator=gen).squeeze(1).to(labels.device)
        new = labels.clone()
        new[:, 1:][keep] = drawn
        return new

    return sample


def _second_moments(x: Any, g: Any, mask: Any) -> tuple[Any, Any, int]:
    """``(sum x x^T, sum g g^T, tokens)`` over the real tokens of one call (float64 torch sums).

    ``x`` is ``[rows, tokens, in]``, ``g`` ``[rows, tokens, out]``; ``mask`` marks the real
    (unpadded) tokens, or is ``None`` / of another shape when every position counts. Padded
    positions carry no gradient but do carry inputs, so they must be left out of ``A``.
    """
    import torch

    keep = mask if mask is not None and mask.shape == x.shape[:2] else \
        torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    dt = torch.promote_types(x.dtype, torch.float32)  # float64 models stay float64
    xm, gm_ = x[keep].to(dt), g[keep].to(dt)
    return (xm.T @ xm).double(), (gm_.T @ gm_).double(), int(xm.shape[0])


class KroneckerCollector:
    """Collects the Kronecker factors while something else runs forward and backward passes.

    ``with KroneckerCollector(gm) as collector: GradientIndex.build(gm, ...)`` adds each LoRA
    layer's ``sum x x^T`` and ``sum g g^T`` over real tokens from the index build's own passes (a
    forward hook on each layer and a gradient hook on its output), so an empirical-Fisher fit
    needs no pass of its own. ``complete(n)`` says whether exactly ``n`` examples went through
    (a resumed or cached build sees fewer, and the fit then makes its own pass). The sums are the
    ones the fit's own pass would make, batch for batch, when the batch size is the same.
    """

    def __init__(self, gm: Any) -> None:
        self.gm = gm
        self.layers = _layers(gm)
        self.examples = 0
        self.real_tokens = 0
        self._sums: dict[str, list[Any]] = {}  # key -> [sum x x^T, sum g g^T, tokens], torch float64
        self._mask: Any = None
        self._handles: list[Any] = []

    @property
    def factors(self) -> dict[str, KroneckerFactors]:
        """The sums gathered so far, as ``KroneckerFactors`` (examples filled in by the fit)."""
        out = {}
        for layer in self.layers:
            key = layer["key"]
            if key in self._sums:
                xx, gg, tokens = self._sums[key]
                out[key] = KroneckerFactors(xx.cpu().numpy(), gg.cpu().numpy(), tokens, 0)
            else:
                out[key] = KroneckerFactors.zeros(layer["out"], layer["in"])
        return out

    def __enter__(self) -> "KroneckerCollector":
        self._model_handle = self.gm.model.register_forward_pre_hook(self._batch, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._model_handle.remove()
        self._remove_layer_hooks()

    def _remove_layer_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _attach_layer_hooks(self) -> None:
        # attached at the start of every forward, so they run after any hook the gradient capture
        # registered for that pass and see the output tensor that autograd differentiates
        self._remove_layer_hooks()
        modules = {id(lin): lin for block in self.gm.blocks for lin in block.linears}
        for layer in self.layers:
            self._handles.append(modules[layer["id"]].register_forward_hook(self._forward(layer["key"])))

    def complete(self, n: int) -> bool:
        """Exactly ``n`` examples went through, and every layer saw every real token of them."""
        if self.examples != n or self.real_tokens == 0:
            return False
        return all(key in self._sums and self._sums[key][2] > 0 and self._sums[key][2] % self.real_tokens == 0
                   for key in (layer["key"] for layer in self.layers))

    def _batch(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        self._attach_layer_hooks()
        if ids is not None:
            self.examples += int(ids.shape[0])
            self._mask = mask.bool() if mask is not None else None
            self.real_tokens += int(self._mask.sum()) if self._mask is not None else int(ids.numel())

    def _forward(self, key: str) -> Any:
        def hook(module: Any, inputs: tuple, output: Any) -> None:
            if not output.requires_grad:
                return
            x, mask = inputs[0].detach(), self._mask

            def on_grad(g: Any) -> None:
                x3 = x.reshape(x.shape[0], -1, x.shape[-1])
                g3 = g.detach().reshape(g.shape[0], -1, g.shape[-1])
                xx, gg, tokens = _second_moments(x3, g3, mask)
                # the batch's examples are counted once, by the model-level hook
                if key in self._sums:
                    self._sums[key][0] += xx
                    self._sums[key][1] += gg
                    self._sums[key][2] += tokens
                else:
                    self._sums[key] = [xx, gg, tokens]

            output.register_hook(on_grad)

        return hook


def _with_checkpoints(config: Any, mode: str) -> Any:
    """``config`` with ``checkpoints`` set to ``mode`` (an ``EngineConfig`` or any plain object)."""
    import copy
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.replace(config, checkpoints=mode)
    out = copy.copy(config)
    out.checkpoints = mode
    return out


class _KroneckerEngine(Engine):
    curvature = "kronecker"
    needs_model = True
    persist_state = True
    correct_eigenvalues = True

    def settings(self, config: Any) -> dict[str, Any]:
        fisher = getattr(config, "fisher", "empirical")
        if fisher not in FISHER_KINDS:
            raise ConfigError(f"engine.fisher '{fisher}' is not one of {', '.join(FISHER_KINDS)}")
        out: dict[str, Any] = {"fisher": fisher, "eigenvalue_correction": self.correct_eigenvalues}
        if fisher == "true":
            if int(config.fisher_samples) < 1:
                raise ConfigError(f"engine.fisher_samples must be at least 1, got {config.fisher_samples}")
            out.update(fisher_samples=int(config.fisher_samples), fisher_seed=int(config.fisher_seed))
        mode = getattr(config, "checkpoints", "final")
        if mode not in CHECKPOINT_MODES:
            raise ConfigError(f"engine.checkpoints '{mode}' is not one of {', '.join(CHECKPOINT_MODES)}")
        if mode != "final":
            out["checkpoints"] = mode  # absent for the final adapter, so those state ids stay as they were
        return out

    def persists(self, settings: dict[str, Any]) -> bool:
        # over checkpoints the state holds an index and an adapter per checkpoint, in memory only
        return self.persist_state and settings.get("checkpoints", "final") == "final"

    # -- fit --------------------------------------------------------------------------------------

    def fit(self, train: TrainGradients, config: Any, context: FitContext | None = None) -> EngineState:
        if getattr(config, "checkpoints", "final") == "all" and context is not None and context.gm is not None:
            paths = list(getattr(context.run, "checkpoints", None) or [])
            if paths:
                return self._fit_checkpoints(train, config, context, paths)
            state = self._fit_adapter(train, config, context)
            state.meta["checkpoints_note"] = ("engine.checkpoints is all, but the run saved no checkpoint-N; "
                                              "fitted on the final adapter alone")
            return state
        state = self._fit_adapter(train, config, context)
        saved = len(getattr(context.run, "checkpoints", None) or []) if context is not None else 0
        if saved > 1:
            state.meta["checkpoints_note"] = (
                f"fitted on the final adapter; the run saved {saved} checkpoints: engine.checkpoints: all fits "
                "under each (one index and one fit per checkpoint, kept for later runs) and catches harmful rows "
                "the final adapter scores as helpful (on the offline worlds, AUC 0.97 to 1.00 with the "
                "contrastive query, and accused sets whose removal brought every retrain back within one item; "
                "docs/validation.md)")
        return state

    def _fit_checkpoints(self, train: TrainGradients, config: Any, context: FitContext,
                         paths: list[str]) -> EngineState:
        """One fit per saved checkpoint, each on the training set's gradients under that checkpoint
        (indexed here, through the content-addressed index cache); scores are summed with the
        learning rate at each checkpoint as weight.

        Each checkpoint's fit is the fit ``engine.checkpoints: final`` would make with that
        checkpoint as the adapter, and it is stored beside that checkpoint's index the same way, so
        a second run loads it. The Kronecker factors come from the checkpoint's index build when it
        was computed (no pass of its own); the checkpoint holding the final adapter's weights reuses
        the final index and its fit."""
        import dataclasses

        from gradian.engines.state import fit_engine
        from gradian.engines.tracin import index_checkpoints

        fits: list[dict[str, Any]] = []
        single = _with_checkpoints(config, "final")
        cache_dir = getattr(context.config, "cache_dir", None)

        def fit_under(checkpoint: Any) -> None:  # runs while the checkpoint's adapter is active
            part = fit_engine(self.name, checkpoint.train, single,
                              dataclasses.replace(context, gm=checkpoint.gm, collected=checkpoint.collected, run=None),
                              cache_dir=cache_dir)
            fits.append({"label": checkpoint.label, "weight": checkpoint.weight, "state": part, "gm": checkpoint.gm,
                         "is_final": checkpoint.is_final})

        index_checkpoints(context, paths, f"{self.name}: indexing and fitting", each=fit_under, final=train,
                          collect=True)
        meta = {"layers": fits[0]["state"].meta["layers"],
                "checkpoints": [{"label": f["label"], "weight": f["weight"],
                                 "index_id": getattr(f["state"].train, "index_id", None),
                                 "state_id": f["state"].state_id, "cached": f["state"].cache_hit,
                                 "final_adapter": f["is_final"],
                                 "eigenvalues_from": f["state"].meta.get("eigenvalues_from")} for f in fits],
                "eigenvalues_from": fits[0]["state"].meta.get("eigenvalues_from")}
        return EngineState(self.name, train, meta=meta, extra={"checkpoints": fits})

    def _fit_adapter(self, train: TrainGradients, config: Any, context: FitContext | None = None) -> EngineState:
        """The curvature of the adapter ``context.gm`` has active, on its gradients ``train``."""
        if context is None or context.gm is None or context.tokenized is None:
            raise ConfigError(f"engine '{self.name}' fits its curvature on the model: it needs the model and the "
                              "tokenized training set (run it through `gradian attribute`)")
        gm, grads = context.gm, context.grads
        settings = self.settings(config)
        layers = _layers(gm)
        widths = _train_widths(train)
        for block in gm.blocks:
            if widths.get(block.name) != block.dim:
                raise ConfigError(
                    f"engine '{self.name}' needs the full per-example gradients, but block '{block.name}' is stored "
                    f"{widths.get(block.name)} wide instead of {block.dim} (grads.projection_dim is set); "
                    "set grads.projection_dim: null, or use engine.name: datainf"
                )
        draws = settings.get("fisher_samples", 1) if settings["fisher"] == "true" else 1
        factors = {layer["key"]: KroneckerFactors.zeros(layer["out"], layer["in"]) for layer in layers}
        collected = context.collected
        reuse = (settings["fisher"] == "empirical" and collected is not None
                 and collected.complete(len(context.tokenized)) and set(collected.factors) == set(factors))
        if reuse:
            for key, f in collected.factors.items():
                factors[key] = KroneckerFactors(f.a_sum.copy(), f.s_sum.copy(), f.tokens, len(context.tokenized))
            draws_to_run = 0
        else:
            draws_to_run = draws
        total_steps = max(draws_to_run * len(context.tokenized) + (draws * len(context.tokenized) if self._second_pass(settings, grads) else 0), 1)
        done = [0]

        def tick(rows: int) -> None:
            done[0] += rows
            if context.progress:
                context.progress(done[0], total_steps)

        for draw in range(draws_to_run):
            for _, sums, examples in self._passes(context, layers, settings, draw):
                for key, (xx, gg, tokens) in sums.items():
                    factors[key].add_sums(xx, gg, tokens, examples)
                tick(examples)
        eigen = {}
        for layer in layers:
            a, s = factors[layer["key"]].finish()
            eigen[layer["key"]] = eigendecompose(a, s)
        corrected = None
        if self.correct_eigenvalues:
            sums = {key: np.zeros_like(e.eigenvalues) for key, e in eigen.items()}
            n_rows = 0
            if self._second_pass(settings, grads):
                for draw in range(draws):
                    for rows, per_layer in self._per_example_pass(context, layers, settings, draw):
                        for key, g in per_layer.items():
                            sums[key] += corrected_eigenvalues(eigen[key], g)
                        n_rows += rows
                        tick(rows)
            else:
                for _, chunk in train.iter_chunks():
                    rows = next(iter(chunk.values())).shape[0]
                    for layer in layers:
                        cols = chunk[layer["block"]][:, layer["offset"]: layer["offset"] + layer["out"] * layer["in"]]
                        g = np.asarray(cols, dtype=np.float64).reshape(rows, layer["out"], layer["in"])
                        sums[layer["key"]] += corrected_eigenvalues(eigen[layer["key"]], g)
                    n_rows += rows
            corrected = {key: v / max(n_rows, 1) for key, v in sums.items()}
        arrays: dict[str, np.ndarray] = {}
        for key, e in eigen.items():
            arrays[f"{key}.q_a"] = e.q_a
            arrays[f"{key}.q_s"] = e.q_s
            arrays[f"{key}.eigenvalues"] = corrected[key] if corrected is not None else e.eigenvalues
        meta = {"layers": [{k: v for k, v in layer.items() if k != "id"} for layer in layers],
                "factors_from": "index build" if reuse else "own pass",
                "n_examples": len(context.tokenized),
                "tokens": {key: f.tokens for key, f in factors.items()},
                "eigenvalues_from": ("index" if self.correct_eigenvalues and not self._second_pass(settings, grads)
                                     else "second pass" if self.correct_eigenvalues else "kronecker product")}
        return EngineState(self.name, train, arrays=arrays, meta=meta)

    @staticmethod
    def _second_pass(settings: dict[str, Any], grads: Any) -> bool:
        """The stored gradients are not the Fisher's per-example gradients: recompute them."""
        if settings["fisher"] != "empirical":
            return True
        return grads is not None and getattr(grads, "normalization", "none") != "none"

    def _batches(self, context: FitContext) -> Any:
        from gradian.grads import collate

        size = int(context.grads.batch_size) if context.grads is not None else 4
        for offset in range(0, len(context.tokenized), size):
            rows = context.tokenized[offset: offset + size]
            yield offset, collate(rows, context.pad_id if context.pad_id is not None else 0, context.gm.device)

    def _labels(self, settings: dict[str, Any], context: FitContext, draw: int, offset: int, batch: Any) -> Any:
        if settings["fisher"] != "true":
            return None
        sample = _sampler(settings["fisher_seed"], draw, offset)
        return lambda logits: sample(logits, batch.labels)

    def _passes(self, context: FitContext, layers: list[dict[str, Any]], settings: dict[str, Any], draw: int) -> Any:
        """Per batch: ``{layer: (sum x x^T, sum g g^T, real tokens)}`` over the real tokens (float64)."""
        from gradian.grads import linear_inputs_and_output_grads

        reduction = context.grads.loss_reduction if context.grads is not None else "mean"
        by_id = {layer["id"]: layer["key"] for layer in layers}
        for offset, batch in self._batches(context):
            _, io = linear_inputs_and_output_grads(context.gm, batch, reduction,
                                                   self._labels(settings, context, draw, offset, batch))
            real = batch.attention_mask.bool()
            out = {}
            for lin_id, key in by_id.items():
                xx = gg = None
                tokens = 0
                for x, g in io[lin_id]:
                    part_x, part_g, n_tokens = _second_moments(x, g, real)
                    xx = part_x if xx is None else xx + part_x
                    gg = part_g if gg is None else gg + part_g
                    tokens += n_tokens
                if xx is not None and gg is not None:
                    out[key] = (xx.cpu().numpy(), gg.cpu().numpy(), tokens)
            yield offset, out, len(batch)

    def _per_example_pass(self, context: FitContext, layers: list[dict[str, Any]], settings: dict[str, Any],
                          draw: int) -> Any:
        """Per batch: ``(rows, {layer: G [rows, out, in]})`` under the fit's labels."""
        import torch

        from gradian.grads import linear_inputs_and_output_grads

        reduction = context.grads.loss_reduction if context.grads is not None else "mean"
        by_id = {layer["id"]: layer for layer in layers}
        for offset, batch in self._batches(context):
            _, io = linear_inputs_and_output_grads(context.gm, batch, reduction,
                                                   self._labels(settings, context, draw, offset, batch))
            out = {}
            for lin_id, layer in by_id.items():
                acc = torch.zeros((len(batch), layer["out"], layer["in"]), dtype=torch.float64)
                for x, g in io[lin_id]:
                    acc += torch.einsum("bto,bti->boi", g.double().cpu(), x.double().cpu())
                out[layer["key"]] = acc.numpy()
            yield len(batch), out

    # -- score ------------------------------------------------------------------------------------

    def score(self, state: EngineState, query: Mapping[str, Any], config: Any, query_for: Any = None,
              **context: Any) -> EngineResult:
        fits = state.extra.get("checkpoints")
        if not fits:
            result = self._score_adapter(state, query, config)
            if state.meta.get("checkpoints_note"):
                result.notes.append(f"{self.name}: {state.meta['checkpoints_note']}")
            return result
        if query_for is None:
            raise ConfigError(f"{self.name} over checkpoints measures the query under each checkpoint: "
                              "pass query_for= (run it through `gradian attribute`)")
        total: np.ndarray | None = None
        ranked: np.ndarray | None = None
        damping: dict[str, float] = {}
        notes: list[str] = []
        for fit in fits:
            if fit["state"].train.n != state.train.n:
                raise ConfigError(f"{self.name} checkpoint {fit['label']} has {fit['state'].train.n} examples, "
                                  f"the final adapter {state.train.n}; index every checkpoint on the same dataset")
            part = self._score_adapter(fit["state"], query_for(fit["gm"]), config)
            scores = fit["weight"] * np.asarray(part.scores, dtype=np.float64)
            total = scores if total is None else total + scores
            if part.ranking is not None:
                rank = fit["weight"] * np.asarray(part.ranking, dtype=np.float64)
                ranked = rank if ranked is None else ranked + rank
            damping.update({f"{fit['label']}/{k}": v for k, v in (part.damping or {}).items()})
            notes = part.notes
        assert total is not None
        notes = [n + f"; summed over {len(fits)} checkpoints weighted by their learning rates" for n in notes]
        return EngineResult(self.name, total, notes=notes, damping=damping, ranking=ranked)

    def _score_adapter(self, state: EngineState, query: Mapping[str, Any], config: Any) -> EngineResult:
        train = state.train
        q, single = as_query_matrix(query, train.block_names)
        check_widths(train, q)
        layers = state.meta["layers"]
        known = {layer["block"] for layer in layers}
        if set(train.block_names) != known:
            raise ConfigError(f"the fitted {self.name} state covers other blocks than the index; refit it")
        override = getattr(config, "lambda_override", None)
        scale = float(getattr(config, "lambda_scale", 0.1))
        if override is not None and not override > 0:
            raise ConfigError(f"engine.lambda_override must be positive, got {override}")
        if override is None and not scale > 0:
            raise ConfigError(f"engine.lambda_scale must be positive, got {scale}")
        pre = {b: np.zeros_like(v) for b, v in q.items()}
        damping: dict[str, float] = {}
        for layer in layers:
            key, b, o, i, off = layer["key"], layer["block"], layer["out"], layer["in"], layer["offset"]
            eigen = layer_eigen(state, key)
            mean = float(eigen.eigenvalues.mean())
            lam = float(override) if override is not None else (scale * mean if mean > 0 else 1.0)
            damping[key] = lam
            part = q[b][:, off: off + o * i].reshape(-1, o, i)
            pre[b][:, off: off + o * i] = damped_inverse(eigen, part, lam).reshape(part.shape[0], -1)
        scores, _ = gradient_dot(train, pre)
        fisher = state.meta.get("settings", {}).get("fisher", "empirical")
        notes = [f"{self.name}: Kronecker-factored {fisher} Fisher over {len(layers)} LoRA matrices, "
                 f"eigenvalues from {state.meta.get('eigenvalues_from', '?')}, damping "
                 + (f"{override:g} (absolute)" if override is not None else f"{scale:g} x each matrix's mean eigenvalue")]
        normalize = getattr(config, "normalize_train", "relatif")
        if normalize not in TRAIN_NORMALIZATIONS:
            raise ConfigError(f"engine.normalize_train '{normalize}' is not one of {', '.join(TRAIN_NORMALIZATIONS)}")
        ranking = None
        if normalize == "relatif":
            own = self_influence(state, damping)
            ranking = scores / np.sqrt(np.where(own > 0, own, np.inf))[:, None]
            notes[0] += ("; rows ranked by their score divided by the square root of their self-influence "
                         "(RelatIF), while the scores themselves stay influence in loss units")
        return EngineResult(self.name, scores[:, 0] if single else scores, notes=notes, damping=damping,
                            ranking=None if ranking is None else (ranking[:, 0] if single else ranking))


def layer_eigen(state: EngineState, key: str) -> KroneckerEigen:
    """The eigenbases and (corrected) eigenvalues a fitted Kronecker state holds for LoRA matrix ``key``."""
    return KroneckerEigen(state.arrays[f"{key}.q_a"], state.arrays[f"{key}.q_s"], state.arrays[f"{key}.eigenvalues"])


def self_influence(state: EngineState, damping: Mapping[str, float]) -> np.ndarray:
    """``g_j^T (F + lambda)^-1 g_j`` of every training row under a fitted Kronecker state, ``[n]``.

    Each row's matrix gradient is rotated into the layer's eigenbasis, ``R = Q_S^T G Q_A``, and
    ``sum R^2 / (Lambda + lambda_l)`` is summed over the LoRA matrices: the same inverse as scoring
    applies to the query, applied to the row itself. One read of the index.
    """
    train = state.train
    layers = state.meta["layers"]
    out = np.zeros(train.n, dtype=np.float64)
    eigen = {layer["key"]: layer_eigen(state, layer["key"]) for layer in layers}
    for start, chunk in train.iter_chunks():
        rows = next(iter(chunk.values())).shape[0]
        for layer in layers:
            key, o, i, off = layer["key"], layer["out"], layer["in"], layer["offset"]
            g = np.asarray(chunk[layer["block"]][:, off: off + o * i], dtype=np.float64).reshape(rows, o, i)
            rotated = eigen[key].rotate(g)
            out[start: start + rows] += np.einsum("boi,oi->b", rotated * rotated,
                                                  1.0 / (eigen[key].eigenvalues + damping[key]))
    return out


def _train_widths(train: TrainGradients) -> dict[str, int]:
    for _, chunk in train.iter_chunks():
        return {b: int(v.shape[1]) for b, v in chunk.items()}
    return {}


@register_engine
class EKFACEngine(_KroneckerEngine):
    name = "ekfac"
    summary = "eigenvalue-corrected Kronecker-factored curvature per LoRA matrix (EK-FAC)"
    correct_eigenvalues = True


@register_engine
class KFACEngine(_KroneckerEngine):
    name = "kfac"
    summary = "Kronecker-factored curvature per LoRA matrix, no eigenvalue correction (K-FAC)"
    correct_eigenvalues = False
