"""EK-FAC and K-FAC: influence with Kronecker-factored curvature over the LoRA matrices.

Each LoRA module is two linear layers, ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``);
each gets its own Kronecker factors (``gradian.engines.kronecker``), and the curvature is block
diagonal over them. The score of training example ``j`` is

    score_j = sum_layers < (F_l + lam_l I)^-1 q_l , g_j^(l) >

with ``q`` the query gradient and ``g_j`` the stored per-example gradient, so the sign
convention is the one every engine shares. ``lam_l = lambda_scale * mean(Lambda_l)`` (the layer's
mean eigenvalue), or ``lambda_override``.

``fit`` asks ``FitContext.passes`` (``gradian.grads.collectors.ModelPasses``, built by the
attribution lane) for one pass over the training set, collecting each layer's input covariance
``A`` and output-gradient covariance ``S`` (or takes them from the index build's collector); then one
eigendecomposition per factor; then (``ekfac``, not ``kfac``) the eigenvalue correction from the
per-example gradients, read from the index when it holds them unchanged (empirical Fisher, no
normalization, no projection), otherwise recomputed in a second pass.

Fisher: ``empirical`` (default, deterministic) uses the training labels. ``sampled`` (also
accepted under its earlier name ``true``, and as YAML's bare ``true``) draws the label of every
supervised position from the model's own prediction (``gradian.grads.collectors.sample_labels``),
seeded by ``engine.fisher_seed`` (part of the state id), and averages over
``engine.fisher_samples`` draws. Under sampled labels the per-row loss is the sum over the row's
supervised tokens, whatever ``grads.loss_reduction`` the index uses: its expected gradient outer
product is then the Gauss-Newton matrix of the token-summed training loss. Each draw costs two
passes over the training set, one forward and one backward each: the factors (the input
covariance and the logits the labels are drawn from share the forward), then, in the eigenbasis
they give, the eigenvalue correction from the gradients of the same labels (the batch's draws
depend only on the seed, the draw and the batch's first row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, TypedDict

import numpy as np

from gradian.engines.base import (
    CheckpointGradients,
    ChosenRows,
    Engine,
    EngineResult,
    EngineState,
    FitContext,
    Preconditioned,
    TrainGradients,
    chunk_pass,
    row_pass,
    sum_over_checkpoints,
    train_widths,
)
from gradian.engines.kronecker import KroneckerEigen, KroneckerFactors, corrected_eigenvalues, damped_inverse, eigendecompose
from gradian.errors import ConfigError

if TYPE_CHECKING:
    import numpy.typing as npt

    from gradian.config import EngineConfig, GradsConfig
    from gradian.jsontypes import JsonScalar

__all__ = ["EKFACEngine", "KFACEngine", "FISHER_KINDS", "TRAIN_NORMALIZATIONS", "layer_eigen", "self_influence"]

FISHER_KINDS = ("empirical", "sampled")
#: earlier names of the kinds, still accepted: ``true`` (the "true Fisher", labels sampled)
FISHER_ALIASES = {"true": "sampled"}
#: how the sampled Fisher's labels and loss are made, part of the state id (so a state fitted by an
#: earlier procedure is never reused): inverse-CDF draws per supervised position, token-summed loss
SAMPLED_LABELS = "inverse-cdf per supervised token, summed loss"
#: ``engine.checkpoints``: fit under the final adapter, or under every saved checkpoint
CHECKPOINT_MODES = ("final", "all")
#: ``engine.normalize_train``: rank rows by raw influence, or by each row's influence divided by the
#: root of its self-influence (the scores stay influence either way)
TRAIN_NORMALIZATIONS = ("none", "relatif")


class KroneckerSettings(TypedDict, total=False):
    """What a Kronecker fit depends on (``Engine.settings``); the sampled Fisher's keys only under
    ``fisher: sampled``, ``checkpoints`` only when it is not the final adapter, ``factor_rows`` and
    ``correction_rows`` only when set."""

    fisher: str
    eigenvalue_correction: bool
    fisher_samples: int
    fisher_seed: int
    fisher_labels: str
    checkpoints: str
    factor_rows: int
    correction_rows: int


class _CheckpointFit(TypedDict):
    """One checkpoint's fit, kept in ``EngineState.extra["checkpoints"]``."""

    label: str
    weight: float
    state: EngineState
    gm: object
    is_final: bool


def _with_checkpoints(config: EngineConfig, mode: str) -> EngineConfig:
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

    def settings(self, config: EngineConfig) -> KroneckerSettings:
        fisher = getattr(config, "fisher", "empirical")
        # YAML reads a bare `fisher: true` as a boolean: the user wrote the alias of sampled
        fisher = FISHER_ALIASES.get(str(fisher).lower(), fisher) if isinstance(fisher, (bool, str)) else fisher
        if fisher not in FISHER_KINDS:
            raise ConfigError(f"engine.fisher '{fisher}' is not one of {', '.join(FISHER_KINDS)}")
        out: KroneckerSettings = {"fisher": fisher, "eigenvalue_correction": self.correct_eigenvalues}
        if fisher == "sampled":
            if int(config.fisher_samples) < 1:
                raise ConfigError(f"engine.fisher_samples must be at least 1, got {config.fisher_samples}")
            out.update({"fisher_samples": int(config.fisher_samples), "fisher_seed": int(config.fisher_seed),
                        "fisher_labels": SAMPLED_LABELS})
        factor_rows = getattr(config, "factor_rows", None)
        if factor_rows is not None:
            if isinstance(factor_rows, bool) or not isinstance(factor_rows, int) or factor_rows < 1:
                raise ConfigError(f"engine.factor_rows must be a whole number of rows, at least 1, or null (every "
                                  f"row), got {factor_rows!r}")
            out["factor_rows"] = int(factor_rows)  # absent when unset, so those state ids stay as they were
        correction_rows = getattr(config, "correction_rows", None)
        if correction_rows is not None:
            if isinstance(correction_rows, bool) or not isinstance(correction_rows, int) or correction_rows < 1:
                raise ConfigError(f"engine.correction_rows must be a whole number of rows, at least 1, or null "
                                  f"(every row), got {correction_rows!r}")
            if not self.correct_eigenvalues:
                raise ConfigError(f"engine.correction_rows is set ({correction_rows}), but {self.name} makes no "
                                  "eigenvalue correction: remove it, or use engine.name: ekfac")
            out["correction_rows"] = int(correction_rows)  # absent when unset, as factor_rows
        mode = getattr(config, "checkpoints", "final")
        if mode not in CHECKPOINT_MODES:
            raise ConfigError(f"engine.checkpoints '{mode}' is not one of {', '.join(CHECKPOINT_MODES)}")
        if mode != "final":
            out["checkpoints"] = mode  # absent for the final adapter, so those state ids stay as they were
        return out

    def persists(self, settings: Mapping[str, object]) -> bool:
        # over checkpoints the state holds an index and an adapter per checkpoint, in memory only
        return self.persist_state and settings.get("checkpoints", "final") == "final"

    # -- fit --------------------------------------------------------------------------------------

    def fit(self, train: TrainGradients, config: EngineConfig, context: FitContext | None = None) -> EngineState:
        if getattr(config, "checkpoints", "final") == "all" and context is not None and context.checkpoints is not None:
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

    def _fit_checkpoints(self, train: TrainGradients, config: EngineConfig, context: FitContext,
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

        fits: list[_CheckpointFit] = []
        single = _with_checkpoints(config, "final")

        def fit_under(checkpoint: CheckpointGradients) -> None:  # runs while the checkpoint's adapter is active
            part = fit_engine(self.name, checkpoint.train, single,
                              dataclasses.replace(context, passes=checkpoint.passes, collected=checkpoint.collected,
                                                  run=None, checkpoints=None),
                              cache_dir=context.cache_dir)
            fits.append({"label": checkpoint.label, "weight": checkpoint.weight, "state": part, "gm": checkpoint.view,
                         "is_final": checkpoint.is_final})

        assert context.checkpoints is not None
        context.checkpoints.index(paths, f"{self.name}: indexing and fitting", each=fit_under, final=train, collect=True)
        meta = {"layers": fits[0]["state"].meta["layers"],
                "checkpoints": [{"label": f["label"], "weight": f["weight"],
                                 "index_id": getattr(f["state"].train, "index_id", None),
                                 "state_id": f["state"].state_id, "cached": f["state"].cache_hit,
                                 "final_adapter": f["is_final"],
                                 "eigenvalues_from": f["state"].meta.get("eigenvalues_from")} for f in fits],
                "eigenvalues_from": fits[0]["state"].meta.get("eigenvalues_from")}
        return EngineState(self.name, train, meta=meta, extra={"checkpoints": fits})

    def _fit_adapter(self, train: TrainGradients, config: EngineConfig,
                     context: FitContext | None = None) -> EngineState:
        """The curvature of the adapter ``context.passes`` runs under, on its gradients ``train``."""
        if context is None or context.passes is None:
            raise ConfigError(f"engine '{self.name}' fits its curvature on the model: it needs the model and the "
                              "tokenized training set (run it through `gradian attribute`)")
        passes, grads = context.passes, context.grads
        settings = self.settings(config)
        layers = passes.layers
        n_examples = passes.n_examples
        widths = train_widths(train)
        for block, dim in passes.block_dims.items():
            if widths.get(block) != dim:
                raise ConfigError(
                    f"engine '{self.name}' needs the full per-example gradients, but block '{block}' is stored "
                    f"{widths.get(block)} wide instead of {dim} (grads.projection_dim is set with a flat "
                    "grads.projection_kind); set grads.projection_kind: kronecker (a projection that keeps the "
                    "curvature), grads.projection_dim: null, or use engine.name: datainf"
                )
        draws = settings.get("fisher_samples", 1) if settings["fisher"] == "sampled" else 1
        seed = settings.get("fisher_seed") if settings["fisher"] == "sampled" else None
        factors = {layer["key"]: KroneckerFactors.zeros(layer["out"], layer["in"]) for layer in layers}
        share = passes.factor_share(settings.get("factor_rows"))
        collected = context.collected
        reuse = (settings["fisher"] == "empirical" and collected is not None
                 and float(collected.share) == share
                 and collected.complete(n_examples) and set(collected.sums) == set(factors))
        if reuse:
            assert collected is not None
            summed = int(collected.summed_examples)
            for key, (a_sum, s_sum, tokens) in collected.sums.items():
                factors[key] = KroneckerFactors(a_sum.copy(), s_sum.copy(), tokens, summed)
            draws_to_run = 0
        else:
            draws_to_run = draws
        factor_steps = n_examples if share >= 1.0 else int(round(share * n_examples))
        # the eigenvalue correction over a share of the rows (engine.correction_rows, which settings
        # refuses where there is no correction): the factors' hash chooses them, so the choices nest
        correction_share = passes.factor_share(settings.get("correction_rows"))
        chosen = ChosenRows(correction_share, passes.chosen_rows(correction_share)) if correction_share < 1.0 else None
        if chosen is not None and not chosen.count:
            raise ConfigError(f"engine.correction_rows {settings['correction_rows']} chose none of the {n_examples} "
                              "training rows to average the eigenvalue correction over (rows are chosen by a hash "
                              "of their tokens, about that many); raise it, or set it to null for every row")
        correction_steps = n_examples if chosen is None else chosen.count
        total_steps = max(draws_to_run * factor_steps
                          + (draws * correction_steps if self._second_pass(settings, grads) else 0), 1)
        done = [0]

        def tick(rows: int) -> None:
            done[0] += rows
            if context.progress:
                context.progress(done[0], total_steps)

        for draw in range(draws_to_run):
            for key, (xx, gg, tokens, rows) in passes.factor_totals(seed, draw, tick, share).items():
                factors[key].add_sums(xx, gg, tokens, rows)
        if share < 1.0 and not any(f.tokens for f in factors.values()):
            raise ConfigError(f"engine.factor_rows {settings['factor_rows']} chose none of the {n_examples} training "
                              "rows to sum the Kronecker factors over (rows are chosen by a hash of their tokens, "
                              "about that many); raise it, or set it to null for every row")
        eigen = {}
        for layer in layers:
            a, s = factors[layer["key"]].finish()
            eigen[layer["key"]] = eigendecompose(a, s, layer["key"])
        corrected = None
        if self.correct_eigenvalues:
            sums = {key: np.zeros_like(e.eigenvalues) for key, e in eigen.items()}
            n_rows = 0
            if self._second_pass(settings, grads):
                for draw in range(draws):
                    for rows, per_layer in passes.layer_gradients(seed, draw, 1.0 if chosen is None else chosen.share):
                        for key, g in per_layer.items():
                            sums[key] += corrected_eigenvalues(eigen[key], g)
                        n_rows += rows
                        tick(rows)
            else:
                def of_chunk(start: int, chunk: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                    rows = next(iter(chunk.values())).shape[0]
                    part = {"rows": np.asarray(rows, dtype=np.int64)}
                    for layer in layers:
                        cols = chunk[layer["block"]][:, layer["offset"]: layer["offset"] + layer["out"] * layer["in"]]
                        g = np.asarray(cols, dtype=np.float64).reshape(rows, layer["out"], layer["in"])
                        part[layer["key"]] = corrected_eigenvalues(eigen[layer["key"]], g)
                    return part

                # one pass over the stored (or streamed) gradients, in the eigenbases just computed
                bases = {f"{key}.{side}": getattr(e, side) for key, e in eigen.items() for side in ("q_a", "q_s")}
                folded = chunk_pass(train, "eigenvalue-correction", bases, of_chunk, sums=("rows", *sums), chosen=chosen)
                for key in sums:
                    sums[key] = sums[key] + folded.get(key, 0.0)
                n_rows = int(folded.get("rows", 0))
            corrected = {key: v / max(n_rows, 1) for key, v in sums.items()}
        arrays: dict[str, np.ndarray] = {}
        for key, e in eigen.items():
            arrays[f"{key}.q_a"] = e.q_a
            arrays[f"{key}.q_s"] = e.q_s
            arrays[f"{key}.eigenvalues"] = corrected[key] if corrected is not None else e.eigenvalues
        meta = {"layers": [{k: v for k, v in layer.items() if k != "id"} for layer in layers],
                "factors_from": "index build" if reuse else "own pass",
                "n_examples": n_examples,
                "factor_rows": max((f.examples for f in factors.values()), default=0) // max(draws_to_run, 1),
                "tokens": {key: f.tokens for key, f in factors.items()},
                **({} if chosen is None else {"correction_rows": chosen.count}),
                "eigenvalues_from": ("index" if self.correct_eigenvalues and not self._second_pass(settings, grads)
                                     else "second pass" if self.correct_eigenvalues else "kronecker product")}
        return EngineState(self.name, train, arrays=arrays, meta=meta)

    def fit_passes_over_gradients(self, config: EngineConfig, grads: GradsConfig | None) -> bool:
        # the eigenvalue correction over the stored (or streamed) gradients; the sampled Fisher and
        # normalized gradients make their passes over the model instead, and a fit over
        # checkpoints over each checkpoint's own gradients
        settings = self.settings(config)
        return (self.correct_eigenvalues and not self._second_pass(settings, grads)
                and settings.get("checkpoints", "final") == "final")

    @staticmethod
    def _second_pass(settings: KroneckerSettings, grads: GradsConfig | None) -> bool:
        """The stored gradients are not the Fisher's per-example gradients: recompute them."""
        if settings["fisher"] != "empirical":
            return True
        return grads is not None and getattr(grads, "normalization", "none") != "none"

    # -- score ------------------------------------------------------------------------------------

    def score(self, state: EngineState, query: Mapping[str, npt.ArrayLike], config: EngineConfig,
              query_for: Callable[[object], Mapping[str, npt.ArrayLike]] | None = None,
              **context: object) -> EngineResult:
        fits = state.extra.get("checkpoints")
        if not fits:
            return self.score_under(state, query, config)
        if query_for is None:
            raise ConfigError(f"{self.name} over checkpoints measures the query under each checkpoint: "
                              "pass query_for= (run it through `gradian attribute`)")
        parts: list[tuple[float, EngineResult]] = []
        damping: dict[str, float] = {}
        for fit in fits:
            if fit["state"].train.n != state.train.n:
                raise ConfigError(f"{self.name} checkpoint {fit['label']} has {fit['state'].train.n} examples, "
                                  f"the final adapter {state.train.n}; index every checkpoint on the same dataset")
            part = self.score_under(fit["state"], query_for(fit["gm"]), config)
            parts.append((fit["weight"], part))
            damping.update({f"{fit['label']}/{k}": v for k, v in (part.damping or {}).items()})
        total, ranked = sum_over_checkpoints(parts)
        notes = [n + f"; summed over {len(fits)} checkpoints weighted by their learning rates" for n in parts[-1][1].notes]
        return EngineResult(self.name, total, notes=notes, damping=damping, ranking=ranked)

    def precondition(self, state: EngineState, query: dict[str, np.ndarray], config: EngineConfig) -> Preconditioned:
        """``(F_l + lam_l I)^-1 q_l`` per LoRA matrix, in its Kronecker eigenbasis."""
        train = state.train
        q = query
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
        fisher = state.meta.get("settings", {}).get("fisher", "empirical")
        notes = [f"{self.name}: Kronecker-factored {fisher} Fisher over {len(layers)} LoRA matrices, "
                 f"eigenvalues from {state.meta.get('eigenvalues_from', '?')}, damping "
                 + (f"{override:g} (absolute)" if override is not None else f"{scale:g} x each matrix's mean eigenvalue")]
        if state.meta.get("checkpoints_note"):
            notes.append(f"{self.name}: {state.meta['checkpoints_note']}")
        return Preconditioned(pre, damping=damping, notes=notes)

    @classmethod
    def shared_scoring(cls) -> bool:
        return True  # the final adapter's state is scored by score_under (see score)

    def scores_jointly(self, state: EngineState) -> bool:
        # a state over checkpoints scores each checkpoint under its own query
        return not state.extra.get("checkpoints")

    def describe(self, config: EngineConfig, state: EngineState | None = None) -> dict[str, JsonScalar]:
        settings = (state.meta.get("settings") if state is not None else None) or self.settings(config)
        out = super().describe(config, state) | {"fisher": settings.get("fisher"),
                                                 "ranking": getattr(config, "normalize_train", "relatif")}
        if settings.get("checkpoints"):  # only when not the final adapter alone
            out["checkpoints"] = settings["checkpoints"]
        return out

    def ranks_by_self_influence(self, config: EngineConfig) -> bool:
        normalize = getattr(config, "normalize_train", "relatif")
        if normalize not in TRAIN_NORMALIZATIONS:
            raise ConfigError(f"engine.normalize_train '{normalize}' is not one of {', '.join(TRAIN_NORMALIZATIONS)}")
        return bool(normalize == "relatif")

    def self_influence_rows(self, state: EngineState,
                            pre: Preconditioned) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
        assert pre.damping is not None
        return self_influence_rows(state, pre.damping)


def layer_eigen(state: EngineState, key: str) -> KroneckerEigen:
    """The eigenbases and (corrected) eigenvalues a fitted Kronecker state holds for LoRA matrix ``key``."""
    return KroneckerEigen(state.arrays[f"{key}.q_a"], state.arrays[f"{key}.q_s"], state.arrays[f"{key}.eigenvalues"])


def self_influence(state: EngineState, damping: Mapping[str, float]) -> np.ndarray:
    """``g_j^T (F + lambda)^-1 g_j`` of every training row under a fitted Kronecker state, ``[n]``.

    Each row's matrix gradient is rotated into the layer's eigenbasis, ``R = Q_S^T G Q_A``, and
    ``sum R^2 / (Lambda + lambda_l)`` is summed over the LoRA matrices: the same inverse as scoring
    applies to the query, applied to the row itself. One pass over the training gradients.
    """
    return row_pass(state.train, self_influence_rows(state, damping))


def self_influence_rows(state: EngineState, damping: Mapping[str, float]) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """The self-influence of one chunk's rows ``[rows]`` (see ``self_influence``)."""
    layers = state.meta["layers"]
    eigen = {layer["key"]: layer_eigen(state, layer["key"]) for layer in layers}

    def of_chunk(chunk: dict[str, np.ndarray]) -> np.ndarray:
        rows = next(iter(chunk.values())).shape[0]
        out = np.zeros(rows, dtype=np.float64)
        for layer in layers:
            key, o, i, off = layer["key"], layer["out"], layer["in"], layer["offset"]
            g = np.asarray(chunk[layer["block"]][:, off: off + o * i], dtype=np.float64).reshape(rows, o, i)
            rotated = eigen[key].rotate_rows(g)  # [out, rows, in]
            out += np.einsum("obi,oi->b", rotated * rotated, 1.0 / (eigen[key].eigenvalues + damping[key]))
        return out

    return of_chunk


class EKFACEngine(_KroneckerEngine):
    name = "ekfac"
    correct_eigenvalues = True


class KFACEngine(_KroneckerEngine):
    name = "kfac"
    correct_eigenvalues = False
