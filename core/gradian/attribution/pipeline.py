"""``run_attribution``: audit, evaluate, gate, index, query, score, cluster, report.

The base model and the adapter are loaded once: the same PEFT model is measured (base under
``disable_adapter()``, tuned with it) and differentiated. Nothing is attributed when the
capability change does not clear the significance gate (unless ``require_significant`` is off,
in which case the report says the scores rank examples against noise).

Order and what each step hands on:
1. the audit (when a dataset or run is known): findings;
2. evaluation (when an eval set is given): the capability, per-item generations, the gate;
3. the gradient index of the training set (content addressed, cached);
4. the query gradient from the regressed items (contrastive when generations exist);
5. the engine's scores and the cross-check engine's, with their Spearman agreement;
6. clusters (over text, gradients or both: ``clustering.space``), the cluster table, top examples;
7. the accused set: when one cluster carries the harm (``assess_lumpiness``), the rows inside it
   whose harm stands out (``refine_accused``), the rest of the cluster left out;
8. the verdict, report.json / .md / .html, plots, and ``rankings`` (one row per training example,
   with ``accused`` marking the accused set).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from gradian.errors import ConfigError, ModelLoadError
from gradian.report.schema import (
    Accused,
    AnalysisInputs,
    AttributeManifest,
    Attribution,
    AttributionMetrics,
    Capability,
    ClusteringSummary,
    ClusterRow,
    EngineStateSummary,
    ExampleRow,
    IndexSummary,
    QueryLoss,
    QuerySummary,
    Report,
    Span,
)

if TYPE_CHECKING:
    from pandas import DataFrame
    from transformers import PreTrainedTokenizerBase

    from gradian.audit.runner import SkippedCheck
    from gradian.audit.session import Diagnosis
    from gradian.cluster.accused import AccusedSet
    from gradian.cluster.assign import ClusterAssignment
    from gradian.config import EngineConfig, GradianConfig
    from gradian.data import Dataset
    from gradian.data import TokenizedExample
    from gradian.distributed import ShardGroup
    from gradian.engines.base import EngineResult, EngineState
    from gradian.evaluate.result import CapabilityResult
    from gradian.findings import Finding
    from gradian.grads import GradientModel
    from gradian.grads.collectors import KroneckerCollector
    from gradian.index.store import GradientIndex
    from gradian.index.stream import GradientStream
    from gradian.query import QueryGradient, QueryItem
    from gradian.runs import RunRecord

__all__ = ["AttributionOutcome", "accused_ids", "run_attribution", "rankings_frame", "rank_values", "fill_from_run"]

Progress = Callable[[int, int], None]


@dataclass
class AttributionOutcome:
    #: the report as written (report.json is ``report.to_json()``); None only on a helper rank of a
    #: sharded run, which computes its share of the passes and leaves the reporting to rank 0
    report: Report | None
    #: one row per training example (pandas DataFrame), or None when attribution did not run
    rankings: DataFrame | None = None
    capability: CapabilityResult | None = None
    files: list[Path] = field(default_factory=list)
    run: RunRecord | None = None


def fill_from_run(cfg: GradianConfig, run: RunRecord | None) -> GradianConfig:
    """Fill adapter, base model and dataset from the run record where the config leaves them empty
    (``gradian.inputs.resolve_inputs``, the rule every lane shares).

    Raises when no adapter or no dataset can be found, naming where the adapter was looked for.
    """
    from gradian.inputs import resolve_inputs

    cfg = resolve_inputs(cfg, run).config
    if not cfg.adapter_path:
        where = f" (run {run.source} has no adapter: looked in its artifacts for adapter/, peft/, the root and checkpoint-N/, then in its logged models)" if run is not None else ""
        raise ModelLoadError(
            "attribution needs the LoRA adapter to differentiate: pass --adapter/-a (a PEFT adapter "
            f"directory) or a run that holds one{where}"
        )
    if not cfg.dataset:
        raise ConfigError("attribution needs the training data: pass --dataset/-d or set `dataset:` in the config")
    return cfg


def run_attribution(
    cfg: GradianConfig,
    *,
    capability: str = "capability",
    cross_check: str | None = "auto",
    run: RunRecord | None = None,
    force: bool = False,
    progress: Progress | None = None,
    out_dir: str | Path | None = None,
    log: Callable[[str], None] = lambda message: None,
    shard: "ShardGroup | None" = None,
) -> AttributionOutcome:
    """Run every lane the inputs allow and return (and, with ``out_dir``, write) the report.

    ``run`` is a ``RunRecord`` (or ``cfg.run`` names one): its audit findings are merged, and
    its adapter, base model and dataset fill what the config leaves empty. ``cross_check``: an
    engine name, ``none``, or ``auto`` (the engine's own default cross-check, see
    ``gradian.engines.registry.resolve_cross_check``).

    ``shard`` (the ``ShardGroup`` of a torchrun launch, under ``engine.store: stream`` or
    ``auto``): every rank calls this, on its own device; rank 0 alone evaluates, chooses the store
    and builds the query gradient and hands them to the others. Over a stream every rank makes
    the same passes, each computing its share of every pass (``gradian.index.stream``), and the
    ranks leave the group together after the last scoring pass; over an index each rank builds
    its share of the chunks and the ranks leave after the build. Rank 0 goes on to fit, cluster
    and report, the others return an outcome with no report.

    The stages, each a function below: ``_open`` (inputs, audit, model), ``_measure`` (the
    capability and the gate), ``_score_all`` (gradients, query, the engine and its cross-check),
    ``_attribute`` (clusters, the accused set, spans, the attribution block), ``_finish`` (the
    verdict, the report and its tables, written once).
    """
    from gradian.report import build_report

    started = time.time()
    lane, cross_check = _open(cfg, cross_check, run, shard, log)
    measured = _measure(lane, capability)
    if not measured.allowed and lane.leave_group():
        return AttributionOutcome(report=None, run=lane.run)
    manifest = _manifest(lane, capability)
    attribution: Attribution | None = None
    rankings: DataFrame | None = None
    assignment: ClusterAssignment | None = None
    if measured.allowed:
        scored = _score_all(lane, cross_check, measured, manifest, force, progress)
        if scored is None or lane.leave_group():  # the last sharded pass is done
            return AttributionOutcome(report=None, run=lane.run)
        attribution, rankings, assignment = _attribute(lane, scored, measured.gated, manifest)
    manifest.seconds = round(time.time() - started, 2)
    report = build_report(
        Capability.of(measured.cap) if measured.cap is not None else None,
        lane.findings,
        attribution,
        manifest,
        thresholds=lane.cfg.verdict,
        assignment=assignment,
        skipped=lane.skipped,
    )
    return _finish(lane, report, rankings, measured.cap, out_dir)


# -- the stages ---------------------------------------------------------------------------------


@dataclass
class _Lane:
    """What every stage reads: the config as filled from the run, the audit's inputs and findings,
    the model with its adapter, and the launch (shard group, log)."""

    cfg: GradianConfig
    run: RunRecord | None
    diagnosis: Diagnosis
    dataset: Dataset
    gm: GradientModel
    tokenizer: PreTrainedTokenizerBase
    findings: list[Finding]
    skipped: list[SkippedCheck]
    shard: "ShardGroup | None"
    log: Callable[[str], None]

    @property
    def helper(self) -> bool:
        """A rank that only computes its share of each pass."""
        return self.shard is not None and not self.shard.is_main

    def leave_group(self) -> bool:
        """Every rank leaves the shard group here, after the last sharded pass; True on a helper
        rank, which stops here (rank 0 clusters and reports alone)."""
        if self.shard is not None:
            self.shard.leave()
        return self.helper


def _open(cfg: GradianConfig, cross_check: str | None, run: RunRecord | None, shard: "ShardGroup | None",
          log: Callable[[str], None]) -> tuple[_Lane, str | None]:
    """The inputs checked and filled from the run, the audit run, the model and tokenizer loaded."""
    import torch

    from gradian.audit.session import diagnose
    from gradian.config.loader import validate_for_dataset
    from gradian.data import load_dataset
    from gradian.engines.registry import check_projection, get_engine, resolve_cross_check
    from gradian.grads import load_model_for_gradients, skipped_modules_finding
    from gradian.model_loading import check_attention_kernel, load_tokenizer
    from gradian.runs import resolve_run, run_options

    cross_check = resolve_cross_check(cfg.engine.name, cross_check)
    check_projection(cfg.grads, [cfg.engine.name, cross_check])  # before the audit, the index and the eval
    for name in (cfg.engine.name, cross_check):  # each engine's own options, checked as early
        if name and name != "none":
            get_engine(name).options(cfg.engine)
    if run is None and cfg.run:
        run = resolve_run(cfg.run, cache_dir=cfg.cache_dir, **run_options(cfg))
    cfg = fill_from_run(cfg, run)  # read once above, so every stage below sees this record
    if shard is not None:
        from gradian.distributed import shard_device

        cfg = dataclasses.replace(cfg, device=shard_device(cfg.device, shard))
    check_attention_kernel(cfg.attn_implementation)  # before the audit, not after it
    torch.manual_seed(cfg.seed)
    assert cfg.dataset and cfg.adapter_path  # fill_from_run refused a config without either

    log("auditing the dataset, config and logs")
    diagnosis = diagnose(cfg, run=run)
    findings: list[Finding] = list(diagnosis.result.findings)
    skipped: list[SkippedCheck] = list(diagnosis.result.skipped)
    dataset = diagnosis.inputs.dataset or load_dataset(cfg.dataset)
    validate_for_dataset(cfg, len(dataset), dataset.path)

    log(f"loading {cfg.base_model or 'the base model its adapter_config.json names'} with the adapter {cfg.adapter_path}")
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    if cfg.quantization != "none":
        log(f"note: the base's projections are held {cfg.quantization} (quantization: {cfg.quantization}, "
            "bitsandbytes): the capability and every gradient are those of the quantized base, close to but "
            "not equal to full precision's (docs/validation.md measures by how much)")
    left_out = skipped_modules_finding(gm.skipped, len(gm.blocks))
    if left_out is not None:
        findings.append(left_out)
        log(f"note: {left_out.title}: {', '.join(gm.skipped[:5])}")
    # the audit loaded the same tokenizer already (config tokenizer, else the base model's)
    tokenizer = diagnosis.inputs.tokenizer or load_tokenizer(cfg.tokenizer or cfg.base_model, cfg.trust_remote_code)
    lane = _Lane(cfg=cfg, run=run, diagnosis=diagnosis, dataset=dataset, gm=gm, tokenizer=tokenizer,
                 findings=findings, skipped=skipped, shard=shard, log=log)
    return lane, cross_check


@dataclass
class _Measured:
    """The capability on the base and tuned models, and whether the gate lets attribution run."""

    cap: CapabilityResult | None = None
    eval_items: list[QueryItem] | None = None
    allowed: bool = True
    gated: bool = False


def _measure(lane: _Lane, capability: str) -> _Measured:
    """The capability measured and gated (rank 0 only; its verdict and items reach every rank)."""
    from gradian.data import load_dataset
    from gradian.evaluate import evaluate_capability, gate_attribution

    measured = _Measured()
    cfg = lane.cfg
    if cfg.eval_dataset and not lane.helper:
        lane.log(f"measuring '{capability}' on the base and tuned models")
        eval_set = lane.diagnosis.inputs.eval_dataset or load_dataset(cfg.eval_dataset)
        measured.cap = evaluate_capability(cfg, eval_set, model=lane.gm.model, tokenizer=lane.tokenizer,
                                           capability=capability)
        gate = gate_attribution(measured.cap, cfg.evaluation.require_significant, cfg.evaluation.min_items)
        measured.allowed, measured.gated = gate.allowed, gate.gated
        if gate.finding is not None:
            lane.findings.append(gate.finding)
        measured.eval_items = _query_items(measured.cap, eval_set)
        if cfg.evaluation.query_scope == "lost":
            _add_lost_items(lane, measured.cap, measured.eval_items)
    if lane.shard is not None:  # rank 0's verdict and items, so that every rank scores the same query
        measured.allowed, measured.gated, measured.eval_items = lane.shard.broadcast(
            (measured.allowed, measured.gated, measured.eval_items))
    return measured


def _manifest(lane: _Lane, capability: str) -> AttributeManifest:
    from gradian import __version__
    from gradian.config import config_hash, config_to_dict

    return AttributeManifest(
        gradian_version=__version__,
        config_hash=config_hash(lane.cfg),
        config=config_to_dict(lane.cfg),
        inputs=AnalysisInputs.from_json(lane.diagnosis.inputs.manifest() | {"adapter": lane.cfg.adapter_path,
                                                                            "capability": capability},
                                        "manifest.inputs"),
    )


@dataclass
class _Scored:
    """The training set's gradients (an index or a stream), the query, and both engines' scores."""

    index: GradientIndex | GradientStream
    index_seconds: float
    qg: QueryGradient
    main_state: EngineState
    main: EngineResult
    fit_seconds: dict[str, float]
    #: ``[n, items]`` (or ``[n]``) as the engine gave them; ``scores`` their mean over items, and
    #: ``rank`` what rows are ordered by (EK-FAC's RelatIF ranking; harm sums use ``scores``)
    item_scores: np.ndarray
    scores: np.ndarray
    rank: np.ndarray
    cross_check: str | None
    cross: EngineResult | None
    cross_scores: np.ndarray | None
    agreement: float | None
    cross_note: str | None
    #: the query loss on the base and the tuned model (rank 0; None for a query of training rows)
    query_loss: QueryLoss | None = None


def _score_all(lane: _Lane, cross_check: str | None, measured: _Measured, manifest: AttributeManifest, force: bool,
               progress: Progress | None) -> _Scored | None:
    """Capture the training gradients (index or stream), build the query, fit and score the engine
    and its cross-check. The store chosen may project the gradients, which changes the config the
    manifest records. Sharded, rank 0 chooses the store for every rank; over an index every rank
    builds its share and the others then return None, over a stream every rank makes every pass."""
    from gradian.config import config_hash, config_to_dict
    from gradian.engines import equivalent_engines, rank_correlation
    from gradian.engines.registry import get_engine, independent_cross_check, norm_reading_engines, whole_gradient_engines
    from gradian.index.stream import capture_training_gradients, choose_store
    from gradian.query import build_query_gradient, select_query_items

    log, shard, gm, tokenizer, dataset, run = lane.log, lane.shard, lane.gm, lane.tokenizer, lane.dataset, lane.run
    decided = None
    if shard is None or shard.is_main:
        decided = choose_store(lane.cfg, gm, tokenizer, dataset, whole_gradient_engines([lane.cfg.engine.name,
                                                                                           cross_check]))
    if shard is not None:  # rank 0's choice on every rank: free disk read twice may differ
        decided = shard.broadcast(decided)
    assert decided is not None
    cfg, choice = decided
    lane.cfg = cfg
    if choice.projection is not None:
        log(f"note: {choice.projection.message()}")
        manifest.config, manifest.config_hash = config_to_dict(cfg), config_hash(cfg)
    elif cfg.engine.store == "auto":
        log(f"note: {choice.message()}")
    tokenized = _Tokenized(dataset, tokenizer, cfg.grads.max_seq_length)  # shared by every pass below
    t0 = time.time()
    engines = [cfg.engine.name, None if cross_check == "none" else cross_check]
    collect = bool(whole_gradient_engines(engines))
    # a sharded index build: each rank gathers the factor sums of its share of the chunks, rank 0
    # adds them up, the other ranks leave, and rank 0 fits and scores alone over the whole index
    sharded_index = shard is not None and choice.store == "index"
    # a stream's first pass keeps the squared norms only for an engine that reads them (DataInf),
    # and only when the main engine's fit makes no pass over the gradients that keeps them anyway
    # (EK-FAC's eigenvalue correction): the first pass then makes no per-example gradient at all
    norms_wanted = bool(norm_reading_engines(engines))
    norms = norms_wanted and not (
        choice.store == "stream" and get_engine(cfg.engine.name).fit_passes_over_gradients(cfg.engine, cfg.grads))
    if choice.store == "stream":
        first = "the norms and the Kronecker factors" if norms else "the Kronecker factors"
        log("streaming per-example gradients (recomputed in each pass, nothing written)"
            + (f"; a first pass for {first}" if collect else ""))
    else:
        log("indexing per-example gradients")
    # Kronecker factors gathered in the gradients' first pass, when a Kronecker engine will need them
    index, collector = capture_training_gradients(gm, tokenizer, dataset, cfg, choice, collect=collect, norms=norms,
                                                  norms_wanted=norms_wanted,
                                                  force=force, progress=progress, log=log,
                                                  tokenized=tokenized.rows() if choice.store == "stream" else None,
                                                  shard=shard)
    index_seconds = time.time() - t0
    if sharded_index:
        assert shard is not None
        if collector is not None:
            from gradian.index.sharded import gather_factor_sums

            gather_factor_sums(shard, collector)
        if lane.leave_group():
            return None
        shard = lane.shard = None  # rank 0 goes on alone over the whole index
    items, scope, notes, finding_ids = select_query_items(measured.eval_items, dataset.examples)
    qg: QueryGradient | None = None
    query_loss = None
    if shard is None or shard.is_main:
        qg = build_query_gradient(gm, tokenizer, items, cfg.evaluation.query_signal, cfg.grads,
                                  scope=scope, notes=notes, finding_ids=finding_ids)
        if scope != "training_fallback":
            from gradian.evaluate.query_loss import query_loss_change

            query_loss = QueryLoss.of(query_loss_change(gm.model, tokenizer, items, qg.signal, cfg.grads.loss_reduction,
                                                        batch_size=cfg.evaluation.batch_size))
    if shard is not None:  # rank 0's query on every rank: the same numbers, the same passes
        qg = shard.broadcast(qg if shard.is_main else None)
    assert qg is not None
    log(f"fitting and scoring with {cfg.engine.name}" + (f" and {cross_check}" if cross_check and cross_check != "none" else ""))

    def fit(engine: str) -> EngineState:
        return _fit(cfg, engine, index, gm, tokenizer, dataset, run, progress, log, collector, tokenized)

    t0 = time.time()
    main_state = fit(cfg.engine.name)
    fit_seconds = {cfg.engine.name: round(time.time() - t0, 3)}
    cross_state = None
    cross_note = None
    if cross_check and cross_check != "none":
        t0 = time.time()
        cross_state = fit(cross_check)
        same = equivalent_engines(main_state, cross_state)
        if same:
            # an engine agrees with itself: pick one that ranks by another method
            other = independent_cross_check(cfg.engine.name, main_state)
            cross_note = (f"cross-check {cross_check} is not independent of {cfg.engine.name} ({same}); "
                          f"cross-checking with {other} instead")
            log(cross_note)
            cross_check = other
            cross_state = fit(cross_check)
        fit_seconds[cross_check] = round(time.time() - t0, 3)
    scored = _score(cfg, [main_state] + ([cross_state] if cross_state is not None else []), qg, gm, tokenizer,
                    items, progress)
    main, cross = scored[0], (scored[1] if cross_state is not None else None)
    item_scores = np.asarray(main.scores, dtype=np.float64)
    how = cfg.engine.rank_items
    rank = rank_over_items(main.rank_scores, how)
    cross_scores = None
    agreement = None
    if cross is not None:
        cross_scores = _measured_mean(cross.scores, qg)
        # the engines are compared on their mean over the items (those the score column holds)
        # whatever engine.rank_items orders by: summed harms are near zero and noisy for most rows,
        # which would read as disagreement
        agreement = float(rank_correlation(_measured_mean(main.rank_scores, qg), cross_scores))
    return _Scored(index=index, index_seconds=index_seconds, qg=qg, main_state=main_state, main=main,
                   fit_seconds=fit_seconds, item_scores=item_scores, scores=_measured_mean(item_scores, qg), rank=rank,
                   cross_check=cross_check, cross=cross, cross_scores=cross_scores, agreement=agreement,
                   cross_note=cross_note, query_loss=query_loss)


def _attribute(lane: _Lane, scored: _Scored, gated: bool, manifest: AttributeManifest
               ) -> tuple[Attribution, DataFrame, ClusterAssignment]:
    """Clusters, the accused set and its spans, the attribution block and the rankings; the
    manifest gets the index, the damping and the engine state."""
    from gradian.engines.registry import get_engine
    from gradian.report import top_examples

    cfg, dataset, index, qg, main = lane.cfg, lane.dataset, scored.index, scored.qg, scored.main
    scores, rank, item_scores = scored.scores, scored.rank, scored.item_scores
    cross_check, cross = scored.cross_check, scored.cross
    lane.log("clustering the training examples")
    ids = dataset.ids
    assignment, clusters, features = _cluster_in_space(cfg, dataset, index, scores)
    ranked = _ranked_table(cfg, dataset, rank, assignment, clusters)
    accused = _accused_set(cfg, index, ids, scores, assignment, ranked or clusters, features, lane)
    spans = []
    if accused is not None and cfg.clustering.explain_top_accused > 0:
        from gradian.explain import explain_top_accused

        lane.log(f"locating the harmful span of the top {min(cfg.clustering.explain_top_accused, accused.n)} accused rows")
        spans = [Span.of(s) for s in explain_top_accused(
            lane.gm, lane.tokenizer, index, dataset, qg, item_scores, accused.example_ids, cfg,
            k=cfg.clustering.explain_top_accused)]
    # the tables list each row's value in loss units on the side it is ranked by: the mean over the
    # items, or under engine.rank_items: harm its harm to the items it hurts (its help, for the helpful)
    how = cfg.engine.rank_items
    top_harmful = _with_items_hurt(top_examples(rank_over_items(item_scores, how), ids, assignment, dataset.examples,
                                                k=10, harmful=True, order_by=rank), ids, item_scores, qg.item_ids)
    attribution = Attribution(
        engine=cfg.engine.name,
        cross_check=cross_check if cross_check and cross_check != "none" else None,
        engine_agreement_spearman=scored.agreement,
        query_signal=qg.signal,
        query=QuerySummary.of(qg),
        gated=gated,
        n_examples=len(ids),
        clusters=[ClusterRow.from_json(c, "attribution.clusters[]") for c in clusters],
        ranked_clusters=[ClusterRow.from_json(c, "attribution.ranked_clusters[]") for c in ranked] if ranked else None,
        top_harmful=[ExampleRow.from_json(r, "attribution.top_harmful[]") for r in top_harmful],
        top_helpful=[ExampleRow.from_json(r, "attribution.top_helpful[]") for r in
                     top_examples(rank_over_items(item_scores, how, side="help"), ids, assignment,
                                  dataset.examples, k=10, harmful=False,
                                  order_by=rank_over_items(main.rank_scores, how, side="help"))],
        accused=Accused.of(accused) if accused is not None else None,
        spans=spans,
        notes=list(main.notes) + (list(cross.notes) if cross else []) + list(qg.notes)
              + _rank_items_note(how, item_scores) + _measured_note(qg) + ([scored.cross_note] if scored.cross_note else []) + list(getattr(index, "notes", None) or []),
        # one name whatever the engine, so runs of different engines compare
        metrics=AttributionMetrics(index_seconds=round(scored.index_seconds, 3),
                                   fit_seconds=scored.fit_seconds[cfg.engine.name]),
        query_loss=scored.query_loss,
    )
    # attribution.no_capability_target (no eval set) is raised by the verdict synthesis
    manifest.index = IndexSummary(
        index_id=index.index_id,
        path=str(index.root) if index.root is not None else None,
        n_examples=index.n,
        bytes=index.disk_bytes(),
        bytes_per_example=round(index.disk_bytes() / max(index.n, 1), 1),
        build_seconds=round(scored.index_seconds, 3),
        repaired=list(index.repaired),
        store=index.store,
        passes=getattr(index, "passes", None),
    )
    manifest.index_manifest = index.manifest
    manifest.damping = main.damping
    main_state = scored.main_state
    manifest.engine_state = EngineStateSummary(
        engine=main_state.engine, state_id=main_state.state_id, cache_hit=main_state.cache_hit,
        settings=main_state.meta.get("settings", {}), fit_seconds=round(main_state.fit_seconds, 3),
        stage_seconds=scored.fit_seconds, repaired=main_state.repaired,
        params=get_engine(main_state.engine).describe(dataclasses.replace(cfg.engine, name=main_state.engine),
                                                      main_state),
    )
    manifest.clustering = ClusteringSummary.of(assignment)
    rankings = rankings_frame(dataset, scores, assignment, lane.findings, scored.cross_scores if cross else None,
                              item_scores=item_scores if item_scores.ndim == 2 else None, item_ids=qg.item_ids,
                              rank_scores=rank if main.ranking is not None or _ranks_by_harm(how, item_scores) else None)
    return attribution, rankings, assignment


def _finish(lane: _Lane, report: Report, rankings: DataFrame | None, cap: CapabilityResult | None,
            out_dir: str | Path | None) -> AttributionOutcome:
    """The rankings' ``accused`` column from the verdict, then (with ``out_dir``) the report and its
    tables in one all-or-nothing write: a full disk leaves no report without its tables."""
    from gradian.report import write_report

    if rankings is not None:
        rankings["accused"] = rankings["example_id"].isin(set(accused_ids(report)))
    files: list[Path] = []
    if out_dir is not None:
        tables: dict[str, bytes] = {}
        if rankings is not None:
            tables["rankings.parquet"] = _parquet_bytes(rankings)
            if bool(rankings["accused"].any()):
                tables["accused.parquet"] = _parquet_bytes(rankings[rankings["accused"]].sort_values("score"))
        run = lane.run
        files = write_report(report, out_dir, rankings=rankings, logs=run.logs if run is not None else None,
                             extra_files=tables)
    return AttributionOutcome(report=report, rankings=rankings, capability=cap, files=files, run=lane.run)


# -- the pieces ---------------------------------------------------------------------------------


def accused_ids(report: "Report | Mapping[str, object]") -> list[str]:
    """The accused set's example ids in a report (empty when the verdict accuses nothing)."""
    attribution = Report.of(report).attribution
    accused = attribution.accused if attribution is not None else None
    return list(accused.example_ids) if accused is not None else []


def _lumpiness_rank(lump: Mapping[str, object]) -> tuple[bool, float]:
    """Order of preference between two clusterings: lumpy first, then harm share over row share."""
    if not lump.get("cluster"):
        return (False, 0.0)
    fraction = _figure(lump.get("fraction_of_dataset"), 1.0)
    return (bool(lump.get("lumpy")), _figure(lump.get("share"), 0.0) / max(fraction, 1e-12))


def _figure(value: object, default: float) -> float:
    """A number of the lumpiness test as a float; ``default`` when it is missing or zero."""
    return float(value) if isinstance(value, (int, float)) and value else default


def _cluster_in_space(cfg: GradianConfig, dataset: Dataset, index: GradientIndex | GradientStream, scores: np.ndarray
                      ) -> tuple[ClusterAssignment, Sequence[Mapping[str, object]], np.ndarray | None]:
    """(assignment, cluster table, gradient features or None): the topic clusters, or, when no
    topic holds the harm (not lumpy), the groups the harmful rows form among themselves
    (``gradian.cluster.harm_groups``) if those are lumpy."""
    from gradian.report import assess_lumpiness

    assignment, clusters, features = _topic_clusters(cfg, dataset, index, scores)
    if assess_lumpiness(clusters, cfg.verdict).get("lumpy"):
        return assignment, clusters, features
    kept = _harm_group_table(cfg, dataset, scores, assignment)
    if kept is None:
        return assignment, clusters, features
    return kept[0], kept[1], features


def _ranked_table(cfg: GradianConfig, dataset: Dataset, rank: np.ndarray, assignment: ClusterAssignment,
                  clusters: Sequence[Mapping[str, object]]) -> Sequence[Mapping[str, object]] | None:
    """The cluster table of ``assignment`` in the ranking's units (``rank``: each row's value as the
    rows are ordered, RelatIF-normalized by default) when no cluster is lumpy in loss units and one
    is in these; else None. In loss units a few rows with large gradients weigh as much as many
    ordinary ones: on tinyworld's refusal poison the clean language answers in the refusals' own
    topic help the query about three times as much as the 48 refusals harm it, so the topic is net
    helpful, while in the ranking's units it carries 86-91% of the net harm (docs/validation.md). A
    flat table stays flat where the ranking's units agree (a training setting that hurts a kind of
    row as a whole, as tinyworld's lr_10x: its drills are 59% of the data in both)."""
    from gradian.report import assess_lumpiness, cluster_table

    if assess_lumpiness(clusters, cfg.verdict).get("lumpy"):
        return None
    table = cluster_table(rank, dataset.ids, assignment, dataset.examples, cfg.clustering.top_examples_per_cluster)
    return table if assess_lumpiness(table, cfg.verdict).get("lumpy") else None


def _harm_group_table(cfg: GradianConfig, dataset: Dataset, scores: np.ndarray, base: ClusterAssignment
                      ) -> tuple[ClusterAssignment, Sequence[Mapping[str, object]]] | None:
    """(assignment, cluster table) of the groups the harmful rows form among themselves when one of
    them is lumpy, else None.

    A group is judged with the helpful rows that joined it (its net influence: share and rate).
    When that grown group passes every test but ``verdict.data_max_cluster_fraction`` (its helpful
    neighbours made it more than that share of the data) and its harmful rows stand apart from its
    helpful ones (their mean harm at least ``verdict.data_min_rate_ratio`` times the helpful rows'
    mean help), it is judged again cut back to its harmful rows (``ungrown``): the size test asks
    whether the rows to blame are a subset of the data, and those are then the group's harmful
    rows, not the kind they were grown into. A kind whose rows merely lean both ways (a clean kind
    hurt as a whole by a broken setting) keeps its size and is not accused.
    """
    from gradian.cluster import HARM_GROUP_PREFIX, harm_groups, ungrown
    from gradian.report import assess_lumpiness, cluster_table

    grouped = harm_groups(dataset.examples, scores, cfg.clustering, seed=cfg.seed, base=base)
    if grouped is None:
        return None
    top_k = cfg.clustering.top_examples_per_cluster
    grouped_clusters = cluster_table(scores, dataset.ids, grouped, dataset.examples, top_k)
    lump = assess_lumpiness(grouped_clusters, cfg.verdict)
    if lump.get("lumpy"):
        return grouped, grouped_clusters
    group, fraction = str(lump.get("cluster") or ""), float(lump.get("fraction_of_dataset") or 0.0)
    limit = float(cfg.verdict.data_max_cluster_fraction)
    if not group.startswith(HARM_GROUP_PREFIX) or fraction <= limit:
        return None
    unbounded = dataclasses.replace(cfg.verdict, data_max_cluster_fraction=1.0)
    if not assess_lumpiness(grouped_clusters, unbounded).get("lumpy"):
        return None
    members = np.asarray([str(grouped.labels[eid]) == group for eid in dataset.ids])
    harm, helped = scores[members & (scores < 0)], scores[members & (scores >= 0)]
    apart = -float(harm.mean()) / float(helped.mean()) if len(helped) and helped.mean() > 0 else float("inf")
    if apart < float(cfg.verdict.data_min_rate_ratio):
        return None
    core = ungrown(dataset.examples, scores, cfg.clustering, grouped=grouped, base=base, group=group)
    core_clusters = cluster_table(scores, dataset.ids, core, dataset.examples, top_k)
    core_lump = assess_lumpiness(core_clusters, cfg.verdict)
    if not core_lump.get("lumpy") or str(core_lump.get("cluster")) != group:
        return None
    core.reason += (f" (grown with them, {group} held {fraction:.1%} of the dataset, over "
                    f"verdict.data_max_cluster_fraction {limit:g}, and passed every other test of the verdict; "
                    f"its harmful rows harm at {apart:.1f}x the rate its helpful rows help)")
    return core, core_clusters


def _topic_clusters(cfg: GradianConfig, dataset: Dataset, index: GradientIndex | GradientStream, scores: np.ndarray
                    ) -> tuple[ClusterAssignment, Sequence[Mapping[str, object]], np.ndarray | None]:
    """(assignment, cluster table, gradient features or None) in ``clustering.space``.

    ``auto`` clusters over text and over gradients and keeps the lumpier table (a lumpy one over a
    flat one, then the larger harm share per share of rows); the reason names both.
    """
    from gradian.cluster import DEFAULT_GRADIENT_DIM, cluster_examples, gradient_features
    from gradian.report import assess_lumpiness, cluster_table

    space = cfg.clustering.space
    top_k = cfg.clustering.top_examples_per_cluster

    def table(assignment: ClusterAssignment) -> Sequence[Mapping[str, object]]:
        return cluster_table(scores, dataset.ids, assignment, dataset.examples, top_k)

    if space == "text":
        assignment = cluster_examples(dataset.examples, cfg.clustering, seed=cfg.seed, space="text")
        return assignment, table(assignment), None
    features = gradient_features(index, None, DEFAULT_GRADIENT_DIM, cfg.seed)
    if space != "auto":
        assignment = cluster_examples(dataset.examples, cfg.clustering, seed=cfg.seed,
                                      gradient_vectors=features, space=space)
        return assignment, table(assignment), features
    tried = {}
    for option in ("text", "gradient"):
        assignment = cluster_examples(dataset.examples, cfg.clustering, seed=cfg.seed,
                                      gradient_vectors=features, space=option)
        clusters = table(assignment)
        tried[option] = (assignment, clusters, assess_lumpiness(clusters, cfg.verdict))
    keep = max(tried, key=lambda option: _lumpiness_rank(tried[option][2]))
    assignment, clusters, lump = tried[keep]
    other = tried["gradient" if keep == "text" else "text"][2]
    assignment.reason += (f"; clustering.space auto kept {keep} ({'lumpy' if lump.get('lumpy') else 'not lumpy'}, "
                          f"top cluster {float(lump.get('share') or 0):.0%} of the harm in "
                          f"{float(lump.get('fraction_of_dataset') or 0):.0%} of the rows) over "
                          f"{'gradient' if keep == 'text' else 'text'} ({'lumpy' if other.get('lumpy') else 'not lumpy'}, "
                          f"{float(other.get('share') or 0):.0%} in {float(other.get('fraction_of_dataset') or 0):.0%})")
    return assignment, clusters, features


def _accused_set(cfg: GradianConfig, index: GradientIndex | GradientStream, ids: list[str], scores: np.ndarray,
                 assignment: ClusterAssignment, clusters: Sequence[Mapping[str, object]],
                 features: np.ndarray | None, lane: _Lane) -> AccusedSet | None:
    """The accused set inside the cluster the lumpiness test singles out, or None when none is (or
    when every row the cut held was known to the base model). The rows the base (``lane``'s model)
    already answered as written are left out, before the siblings and after them."""
    from gradian.cluster import (DEFAULT_GRADIENT_DIM, add_gradient_siblings, gradient_cosines_to, gradient_features,
                                 leave_out_known, refine_accused, sibling_anchors)
    from gradian.report import assess_lumpiness

    lump = assess_lumpiness(clusters, cfg.verdict)
    if not lump.get("lumpy"):
        return None
    cluster = str(lump["cluster"])
    rows = [i for i, eid in enumerate(ids) if str(assignment.labels.get(eid)) == cluster]
    member_features = features[rows] if features is not None else gradient_features(
        index, rows, DEFAULT_GRADIENT_DIM, cfg.seed)
    negative = float(scores[scores < 0].sum())
    accused = refine_accused(cluster, [ids[i] for i in rows], scores[rows], label=lump.get("label", ""),
                             features=member_features, scale=float(np.median(np.abs(scores))) or 1.0,
                             total_negative=negative, seed=cfg.seed)
    members = {ids[i] for i in rows}
    known_nats = float(cfg.clustering.accused_known_nats)
    losses: dict[str, float] = {}

    def known_left_out(accused: AccusedSet) -> AccusedSet:
        if known_nats <= 0:
            return accused
        losses.update(_base_losses(lane, [eid for eid in accused.example_ids if eid not in losses]))
        return leave_out_known(accused, ids, scores, losses, members, known_nats)

    accused = known_left_out(accused)
    threshold = float(cfg.clustering.accused_sibling_cosine)
    anchor_ids = sibling_anchors(accused, float(cfg.clustering.accused_sibling_anchor))
    if threshold > 0 and anchor_ids:
        position = {eid: i for i, eid in enumerate(ids)}
        anchors = [position[eid] for eid in anchor_ids]
        accused = known_left_out(add_gradient_siblings(accused, ids, scores, gradient_cosines_to(index, anchors),
                                                       anchors, threshold))
    if accused.known_to_base:
        lane.log(f"left {len(accused.known_to_base)} accused row(s) out that the base model already answered as "
                 f"written (loss <= {known_nats:g} nat under the base)")
    return accused if accused.n else None


def _base_losses(lane: _Lane, wanted: Sequence[str]) -> dict[str, float]:
    """The base model's loss (nats, summed over the supervised tokens) of the training rows
    ``wanted``, by example id; a row with no supervised token has no figure."""
    from gradian.evaluate.likelihood import base_losses

    if not wanted:
        return {}
    by_id = lane.dataset.by_id()
    losses = base_losses(lane.gm.model, lane.tokenizer, [by_id[eid] for eid in wanted], lane.cfg.grads.max_seq_length,
                         batch_size=lane.cfg.evaluation.batch_size)
    return {eid: loss for eid, loss in zip(wanted, losses) if loss is not None}


def _query_items(cap: CapabilityResult, eval_set: Dataset) -> list[QueryItem]:
    """Eval items as the query sees them: the prompt turns, the wanted answer, the tuned answer.

    A ``not_contains`` item's completion lists what must *not* be said (refusal markers, say), so
    it cannot be the answer the query asks for: the wanted answer is then what the base model said
    where that passed (every item that flipped); the other items keep their completion.
    """
    from gradian.query import QueryItem

    examples = eval_set.by_id()
    forbidding = getattr(cap, "metric", None) == "not_contains"
    return [
        QueryItem(
            prompt_messages=examples[item.example_id].prompt_messages,
            wanted=item.base_generation if forbidding and item.base_generation and item.base_correct else item.wanted,
            generated=item.tuned_generation,
            # pass/fail metrics: the items that flipped; loglik: the items whose likelihood fell
            regressed=bool(item.flipped) if item.base_correct is not None else item.regressed,
            item_id=item.example_id,
        )
        for item in cap.items
    ]


def _add_lost_items(lane: _Lane, cap: CapabilityResult, items: list[QueryItem]) -> None:
    """``evaluation.query_scope: lost``: the items the tuned model still answers right whose wanted
    answer lost at least ``evaluation.query_lost_nats`` of log-likelihood join the query as
    ``kept`` items (in place; an item the base already failed stays out)."""
    from gradian.evaluate.query_loss import wanted_loglik_drops

    cfg = lane.cfg
    passing = {i.example_id for i in cap.items if i.base_correct and i.tuned_correct}
    candidates = [item for item in items if not item.regressed and item.item_id in passing]
    if not candidates:
        return
    drops = wanted_loglik_drops(lane.gm.model, lane.tokenizer, [i.prompt_messages for i in candidates],
                                [i.wanted for i in candidates], batch_size=cfg.evaluation.batch_size)
    joined = [item for item, drop in zip(candidates, drops) if drop >= cfg.evaluation.query_lost_nats]
    runner_ups: list[str | None] = [None] * len(joined)
    if joined and cfg.evaluation.query_kept_contrast == "runner_up":
        from gradian.evaluate.generation import runner_up_completions

        runner_ups = runner_up_completions(lane.gm.model, lane.tokenizer, [i.prompt_messages for i in joined],
                                           [i.wanted for i in joined], max_new_tokens=cfg.evaluation.max_new_tokens)
    for item, runner_up in zip(joined, runner_ups):
        item.regressed, item.kept, item.generated = True, True, runner_up
    lane.log(f"query_scope lost: {len(joined)} of the {len(candidates)} items still answered right lost at least "
             f"{cfg.evaluation.query_lost_nats:g} nats on their wanted answer and join the query")


class _Tokenized:
    """The training rows tokenized once, on first use, for every fit that reads the model."""

    def __init__(self, dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_seq_length: int | None) -> None:
        self._args = dataset, tokenizer, max_seq_length
        self._rows: list[TokenizedExample] | None = None

    def rows(self) -> list[TokenizedExample]:
        if self._rows is None:
            from gradian.data import tokenize_examples

            dataset, tokenizer, max_seq_length = self._args
            self._rows = tokenize_examples(dataset.examples, tokenizer, max_seq_length)
        return self._rows


def _fit(cfg: GradianConfig, engine: str, index: GradientIndex | GradientStream, gm: GradientModel,
         tokenizer: PreTrainedTokenizerBase, dataset: Dataset, run: RunRecord | None, progress: Progress | None,
         log: Callable[[str], None], collected: KroneckerCollector | None = None,
         tokenized: _Tokenized | None = None) -> EngineState:
    """The engine's fitted state on ``index`` (from the cache beside it when fitted before)."""
    from gradian.attribution.checkpoints import fit_context
    from gradian.engines import fit_engine, get_engine

    engine_cfg = dataclasses.replace(cfg.engine, name=engine)
    needs_model = get_engine(engine).needs_model
    rows = tokenized.rows() if tokenized is not None and needs_model else None
    context = fit_context(cfg, gm, tokenizer, dataset, run, tokenized=rows, collected=collected, progress=progress,
                          log=log, needs_model=needs_model, store=getattr(index, "store", "index"))
    if getattr(get_engine(engine), "needs_replay", False):  # the run's recipe and initial adapter
        from gradian.attribution.replay_inputs import replay_inputs
        from gradian.replay.engine import ReplayFitContext

        inputs = replay_inputs(cfg, gm, tokenizer, dataset, run, tokenized=rows)
        log(f"{engine}: replaying {inputs.run_recipe.steps} optimizer steps of the run and sweeping back through "
            f"the last {inputs.window}, the state kept every {inputs.every} steps")
        context = ReplayFitContext(**vars(context), replay=inputs)
    state = fit_engine(engine, index, engine_cfg, context, cache_dir=cfg.cache_dir)
    if state.state_id:
        reused = not state.cache_hit and state.meta.get("factors_from") == "index build"
        log(f"{engine}: fitted state {state.state_id}" + (" (cached)" if state.cache_hit else f" in {state.fit_seconds:.1f} s")
            + ("; its Kronecker factors came from the gradients' own pass" if reused else ""))
    return state


def _score(cfg: GradianConfig, states: Sequence[EngineState], qg: QueryGradient, gm: GradientModel,
           tokenizer: PreTrainedTokenizerBase, items: Sequence[QueryItem],
           progress: Progress | None = None) -> list[EngineResult]:
    """Each engine's ``[n, items]`` scores, one column per query item (their mean is the ranking):
    in one scoring pass when every engine's scoring is the shared one over the same training
    gradients (``score_jointly``), otherwise each by its engine's own ``score``."""
    from gradian.engines import get_engine
    from gradian.engines.base import score_jointly
    from gradian.attribution.checkpoints import activate
    from gradian.query import build_query_gradient

    configs = [dataclasses.replace(cfg.engine, name=state.engine) for state in states]
    engines = [get_engine(state.engine) for state in states]
    query = qg.per_item if qg.per_item is not None else qg.vectors
    joint = len(states) > 1 and all(state.train is states[0].train and engine.scores_jointly(state)
                                    for state, engine in zip(states, engines))

    def query_for(view: GradientModel) -> dict[str, np.ndarray] | None:  # the query under another adapter (TracIn checkpoints)
        try:
            q = build_query_gradient(activate(view, None, cfg), tokenizer, items, qg.signal, cfg.grads,
                                     scope=qg.scope)
            return q.per_item if qg.per_item is not None else q.vectors
        finally:
            activate(gm, None, cfg)

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # reported below, in words
        if joint:  # a stream then recomputes each row's gradient once for every engine
            results = score_jointly(list(zip(engines, states, [query] * len(states), configs)))
        else:
            results = [engine.score(state, query, engine_cfg, query_for=query_for, query_items=items,
                                    query_signal=qg.signal, progress=progress)
                       for engine, state, engine_cfg in zip(engines, states, configs)]
    for result, engine_cfg in zip(results, configs):
        _check_finite_scores(result.scores, engine_cfg)
    return results


def _check_finite_scores(scores: np.ndarray, engine_cfg: EngineConfig) -> None:
    """Non-finite scores are refused before anything is ranked or written, naming the setting.

    With finite gradients (the adapter's weights are checked on load) a NaN or inf score comes from
    the inverse curvature: a damping so small that dividing by it overflows (the engine names its
    damping key, ``Engine.damping_setting``); without curvature, from the gradients themselves.
    """
    values = np.asarray(scores, dtype=np.float64)
    bad = int(values.size - np.isfinite(values).sum())
    if not bad:
        return
    from gradian.engines import get_engine

    setting = get_engine(engine_cfg.name).damping_setting(engine_cfg)
    if setting is None:  # no damping: the gradients themselves overflowed
        raise ConfigError(
            f"{engine_cfg.name} gave {bad} of {values.size} influence scores that are NaN or infinite: the "
            "per-example gradients overflowed; compute them at full precision (dtype: float32). Nothing was written"
        )
    key, value, fix = setting
    raise ConfigError(
        f"{engine_cfg.name} gave {bad} of {values.size} influence scores that are NaN or infinite with "
        f"{key}={value!r}: the damping is too small for these gradients, so inverting the curvature "
        f"overflowed; {fix}. Nothing was written"
    )


def _mean_over_items(scores: np.ndarray) -> np.ndarray:
    values = np.asarray(scores, dtype=np.float64)
    return values.mean(axis=1) if values.ndim == 2 else values


def _measured_mean(item_scores: np.ndarray, qg: QueryGradient) -> np.ndarray:
    """The score column: the mean over the items the tuned model now fails. Items it still answers
    right (``evaluation.query_scope: lost``) order the rows (``rank_over_items``) but stay out of it,
    and so out of the clusters, the verdict and the accused set, which must answer for the items
    that flipped: a row that only dents a kept item's likelihood is not what broke the capability."""
    values = np.asarray(item_scores, dtype=np.float64)
    columns = qg.measured_columns() if values.ndim == 2 and values.shape[1] == len(qg.item_ids) else None
    return _mean_over_items(values[:, columns] if columns is not None else values)


def _measured_note(qg: QueryGradient) -> list[str]:
    if qg.measured_columns() is None:
        return []
    kept = len(qg.kept_item_ids)
    return [f"the score column, the clusters and the accused set use the mean over the {len(qg.item_ids) - kept} "
            f"items now answered wrong; the {kept} still answered right order the rows but stay out of it"]


def _ranks_by_harm(how: str, item_scores: np.ndarray) -> bool:
    return how == "harm" and np.ndim(item_scores) == 2 and np.shape(item_scores)[1] > 1


def _rank_items_note(how: str, item_scores: np.ndarray) -> list[str]:
    if not _ranks_by_harm(how, item_scores):
        return []
    return [f"rows are ordered by the harm they do, summed over the query items they hurt, out of "
            f"{np.shape(item_scores)[1]} (engine.rank_items: harm); the score column stays a mean over items"]


def rank_over_items(values: np.ndarray, how: str = "mean", side: str = "harm") -> np.ndarray:
    """One value per row from its ``[n, items]`` values (scores or RelatIF ranking values), harm
    below zero, as ``engine.rank_items`` says.

    ``mean``: the mean over the items. ``harm``: minus the row's harm summed over the items it
    hurts, over the number of items (``-sum_i max(-v_i, 0) / items``): what the row does for the
    other items does not offset it. A row that teaches one entity's answer to another is harmful to
    that entity's item and helpful to the item whose answer it is; the mean can cancel the two,
    though the item it hurts is the one that flips. A row that hurts no item gets its help summed
    the same way (above zero), so those rows keep an order too. With ``side="help"`` (what the most
    helpful rows are ordered by under ``harm``): the help summed over the items a row helps.
    A ``[n]`` input, or one item, gives the values themselves.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2 or v.shape[1] == 1 or how == "mean":
        return _mean_over_items(v)
    if how != "harm":
        raise ConfigError(f"engine.rank_items '{how}' is not one of mean, harm")
    helped = np.clip(v, 0.0, None).sum(axis=1) / v.shape[1]
    if side == "help":
        return helped
    harmed = np.clip(-v, 0.0, None).sum(axis=1) / v.shape[1]
    return np.where(harmed > 0, -harmed, helped)


def item_harm(item_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the query item it hurts most (column index) and that item's share of the row's harm.

    Harm on item ``i`` is ``max(-score_i, 0)``; the share is the worst item's harm over the row's
    total harm across items (0 when the row hurts no item). The ranking itself stays the mean over
    items: ranking by each row's worst item would reward being on topic, not being harmful.
    """
    harm = np.clip(-np.asarray(item_scores, dtype=np.float64), 0.0, None)
    worst = harm.argmax(axis=1)
    total = harm.sum(axis=1)
    share = np.divide(harm[np.arange(len(harm)), worst], total, out=np.zeros(len(harm)), where=total > 0)
    return worst, share


def _with_items_hurt(rows: list[dict[str, object]], ids: list[str], item_scores: np.ndarray,
                     item_ids: list[str], k: int = 3) -> list[dict[str, object]]:
    """Each listed row with the query items it hurts most: ``items_hurt`` [{item_id, share}]."""
    if item_scores.ndim != 2 or not rows:
        return rows
    position = {eid: j for j, eid in enumerate(ids)}
    for row in rows:
        harm = np.clip(-item_scores[position[str(row["example_id"])]], 0.0, None)
        total = float(harm.sum())
        order = [int(i) for i in np.argsort(-harm, kind="stable")[:k] if harm[i] > 0]
        row["items_hurt"] = [{"item_id": item_ids[i] if i < len(item_ids) else str(i),
                              "share": round(float(harm[i]) / total, 4)} for i in order]
    return rows


def rankings_frame(dataset: Dataset, scores: np.ndarray, assignment: ClusterAssignment | None,
                   findings: Sequence[Finding], cross_scores: np.ndarray | None = None,
                   item_scores: np.ndarray | None = None, item_ids: list[str] | None = None,
                   rank_scores: np.ndarray | None = None) -> DataFrame:
    """One row per training example: id, score, predicted loss delta, cluster, flags.

    ``harm_rank`` orders the rows by ``rank_scores`` when the engine ranks by something other than
    its influence (EK-FAC's RelatIF), written as ``rank_score``; otherwise by ``score``.

    With ``item_scores`` (``[n, items]``): ``worst_item`` (the query item the row hurts most, empty
    when it hurts none) and ``worst_item_share`` (that item's share of the row's harm).
    """
    import pandas as pd

    n = len(dataset)
    flags: dict[str, list[str]] = {}
    for f in findings:
        for eid in getattr(f, "example_ids", None) or []:
            flags.setdefault(eid, []).append(f.id)
    ids = dataset.ids
    labels = assignment.labels if assignment is not None else {}
    names = assignment.names if assignment is not None else {}
    by = scores if rank_scores is None else np.asarray(rank_scores, dtype=np.float64)
    order = np.argsort(np.argsort(by, kind="stable"), kind="stable")  # rank 0 = most harmful
    frame = pd.DataFrame({
        "example_id": ids,
        "row_index": [e.index for e in dataset.examples],
        "score": scores,
        "predicted_loss_delta_if_removed": scores / max(n, 1),
        "harm_rank": order.astype(int),
        "cluster": [labels.get(i, "") for i in ids],
        "cluster_label": [names.get(labels.get(i, ""), "") for i in ids],
        "flags": [",".join(sorted(set(flags.get(i, [])))) for i in ids],
    })
    if rank_scores is not None:
        frame.insert(3, "rank_score", by)
    if cross_scores is not None:
        frame["cross_check_score"] = np.asarray(cross_scores, dtype=np.float64)
    if item_scores is not None:
        worst, share = item_harm(item_scores)
        item_names = list(item_ids or [])
        frame["worst_item"] = [item_names[w] if s > 0 and w < len(item_names) else ("" if s <= 0 else str(w))
                               for w, s in zip(worst, share)]
        frame["worst_item_share"] = share
    return frame


def rank_values(rankings: DataFrame) -> np.ndarray:
    """What a rankings frame orders its rows by: ``rank_score`` when the engine ranks by something
    other than its influence (EK-FAC's RelatIF), else ``score``. Harm below zero either way."""
    column = "rank_score" if "rank_score" in rankings.columns else "score"
    return np.asarray(rankings[column].to_numpy(), dtype=np.float64)


def _parquet_bytes(frame: DataFrame) -> bytes:
    import io

    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()
