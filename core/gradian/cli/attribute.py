"""``gradian attribute``: measure the capability, attribute its regression, write one report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

import typer

from gradian.cli.index import DISTRIBUTED_HELP
from gradian.cli.run_flags import INTO_RUN_HELP, TRUST_RUN_DATASET_HELP
from gradian.engines.registry import available_engines
from gradian.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from gradian.report.schema import Report

__all__ = ["register", "print_summary"]


def attribute_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d", help="Training dataset"),
    eval_dataset: Optional[str] = typer.Option(None, "--eval-dataset", "-e", help="Items describing the capability, with the answers you wanted"),
    base_model: Optional[str] = typer.Option(None, "--base-model", "-m", help="Base model id or path"),
    adapter: Optional[str] = typer.Option(None, "--adapter", "-a", help="LoRA adapter directory (required, or a run that holds one)"),
    run: Optional[str] = typer.Option(None, "--run", "-r", help="Run directory or runs:/<mlflow run id>; merges the audit into the report"),
    mlflow_run: Optional[str] = typer.Option(None, "--mlflow-run", help="MLflow run id (same as --run runs:/<id>); the report is logged as its child run"),
    no_log: bool = typer.Option(False, "--no-log", help="Read an MLflow run but do not log the report back"),
    trust_run_dataset: bool = typer.Option(False, "--trust-run-dataset", help=TRUST_RUN_DATASET_HELP),
    into_run: Optional[str] = typer.Option(None, "--into-run", help=INTO_RUN_HELP),
    capability: str = typer.Option("capability", "--capability", help="Name of the capability, used in the report"),
    engine: Optional[str] = typer.Option(None, "--engine", help="Attribution engine: " + ", ".join(available_engines()) + " (default: the config's engine.name)"),
    cross_check: str = typer.Option("auto", "--cross-check", help="Second engine for rank agreement (" + ", ".join(available_engines()) + "), none, or auto (the engine's own choice: datainf beside ekfac and kfac, graddot beside datainf); one that ranks by the same method as --engine is swapped for one that does not"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write report.json/.md/.html, plots and rankings.parquet here"),
    force: bool = typer.Option(False, "--force", help="Rebuild the gradient index even if a cached one matches"),
    distributed: Optional[bool] = typer.Option(None, "--distributed/--no-distributed", help=DISTRIBUTED_HELP + "; under torchrun with engine.store: index the index is built first, then rank 0 alone runs the rest; under stream every streamed pass is sharded the same way and rank 0 clusters and reports; under auto rank 0 chooses one of the two for every rank"),
) -> None:
    """Attribute a capability regression to training examples and write the merged report."""
    import contextlib
    import tempfile

    from rich.console import Console

    from gradian.attribution import run_attribution
    from gradian.cli.index import build_index_stage, read_run_on_ranks
    from gradian.cli.output import shown
    from gradian.cli.run_flags import check_cross_check, index_progress, publish_to_source, run_reference
    from gradian.config import load_config
    from gradian.distributed import join_shard_group
    from gradian.model_loading import check_attention_kernel
    from gradian.paths import ensure_writable_dir

    run = run_reference(run, mlflow_run)
    check_cross_check(cross_check)
    cfg = load_config(config, overrides={
        "dataset": dataset, "eval_dataset": eval_dataset, "base_model": base_model,
        "adapter_path": adapter, "run": run, "engine.name": engine,
    })
    if not cfg.adapter_path and not cfg.run:
        raise ConfigError(
            "attribute needs --adapter (the LoRA adapter you trained): attribution differentiates with "
            "respect to its parameters"
        )
    # before any model is loaded: a folder that cannot take the index or the report fails now
    ensure_writable_dir(cfg.cache_dir, "cache_dir")
    if out is not None:
        ensure_writable_dir(out, "--out")
    console = Console(stderr=True)

    def log(message: str) -> None:
        console.print(f"[dim]{shown(message)}[/]", highlight=False, soft_wrap=True)

    # without --out the report is written to a temporary folder for the sink, and removed after
    with contextlib.ExitStack() as stack:
        shard = stack.enter_context(join_shard_group(distributed))
        # under engine.store: stream or auto every rank runs the lane, which chooses the store
        streamed = shard is not None and cfg.engine.store in ("stream", "auto")
        if shard is not None and not streamed:
            # the indexing stage, sharded over every rank; the rest runs on rank 0 alone and finds
            # this index in the cache (audit and evaluation come after it, not before, here)
            check_attention_kernel(cfg.attn_implementation)
            if shard.is_main:
                console.print(f"[dim]indexing per-example gradients on {shard.world_size} processes[/]",
                              highlight=False)
            _, record = build_index_stage(cfg, trust_run_dataset, force, shard)
            stack.close()  # every rank leaves the group here
            if not shard.is_main:
                return
        else:
            record = read_run_on_ranks(cfg, trust_run_dataset, shard)
        main = shard is None or shard.is_main
        if streamed and main and shard is not None and cfg.engine.store == "stream":
            console.print(f"[dim]streaming the passes over the training rows on {shard.world_size} processes[/]",
                          highlight=False)
        out_dir = out if out is not None else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="gradian-attribute-")))
        with index_progress(console) if main else contextlib.nullcontext(None) as progress:
            # under torchrun with engine.store: stream every rank runs the lane and computes its
            # share of each streamed pass; the others return after the last of them, rank 0 reports
            outcome = run_attribution(
                cfg, capability=capability, cross_check=cross_check, run=record, force=force and shard is None,
                out_dir=out_dir if main else None,
                progress=progress, log=log if main else (lambda message: None),
                shard=shard if streamed else None,
            )
        if not main:
            return
        report = outcome.report
        assert report is not None  # rank 0 (or a single process) always reports
        print_summary(Console(), report)
        if out is not None:
            Console().print(f"wrote {out / 'report.html'} (and report.json, report.md, rankings.parquet)", highlight=False)
        # the tables were written with the report (outcome.files): the sink logs those files as they are
        publish_to_source(outcome.run, report, "attribute", outcome.files, no_log=no_log, console=Console(),
                          into_run=into_run)


def print_summary(console: Console, report: "Report | Mapping[str, object]") -> None:
    """One screen: the verdict, the capability change, the accused cluster and set, the agreement, hedges."""
    from rich.panel import Panel

    from gradian.cli.output import shown
    from gradian.report.schema import Report

    report = Report.of(report)
    verdict, cap, attr = report.verdict, report.capability, report.attribution
    lines = [f"[bold]Verdict: {verdict.kind}[/]  {shown(verdict.summary)}"]
    if cap is not None:
        lo, hi = cap.ci_bounds()
        ci = f"[{lo:+.3f}, {hi:+.3f}]" if lo is not None and hi is not None else "[?]"
        lines.append(
            f"'{shown(cap.name)}' ({shown(cap.metric)}): {cap.base:.3f} -> {cap.tuned:.3f} "
            f"(delta {cap.delta:+.3f}, CI {ci}) over {cap.n_items} items; "
            f"{cap.n_flipped} flipped, {cap.n_base_failing} already failing on the base; "
            f"status {cap.status}"
            + (f" (too few items: fewer than evaluation.min_items={cap.min_items}, so not significant)"
               if cap.too_few_items else "")
        )
    if attr is not None and attr.clusters:
        top = attr.clusters[0]
        lines.append(
            f"Most harmful cluster: {shown(top.cluster)} ({shown(top.label)}), {top.n} examples, "
            f"{100 * (top.share_of_negative or 0):.0f}% of the negative influence"
        )
    accused = attr.accused if attr is not None else None
    if accused is not None:
        lines.append(
            f"[bold]Accused set: {shown(accused.rows_text())}[/], "
            f"{100 * accused.share_of_cluster_harm:.0f}% of its harm, an estimated "
            f"{100 * accused.estimated_harmful_share:.0f}% harmful; {accused.n_left_out} left out "
            "(rankings.parquet column 'accused'; retrain without them: gradian counterfactual --drop accused)"
        )
        for span in (attr.spans if attr is not None else [])[:3]:
            lines.append(f"  {shown(span.example_id)}: harmful span \"{shown(span.span_text)}\"")
    if attr is not None and attr.engine_agreement_spearman is not None:
        lines.append(f"Engines {attr.engine} vs {attr.cross_check}: Spearman "
                     f"{attr.engine_agreement_spearman:.3f}; query {attr.query_signal}")
    critical = [f for f in report.findings if f.severity == "critical"]
    if critical:
        lines.append(f"[red]{len(critical)} critical audit finding(s): " + ", ".join(f.id for f in critical) + "[/]")
    for hedge in verdict.hedges[:4]:
        lines.append(f"[yellow]- {shown(hedge)}[/]")
    console.print(Panel("\n".join(lines), title="Gradian", expand=False), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("attribute")(attribute_command)
