"""``gradian index`` (build or reuse the gradient index) and ``gradian show-index PATH``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from gradian.cli.run_flags import INTO_RUN_HELP, TRUST_RUN_DATASET_HELP
from gradian.sizes import format_size

if TYPE_CHECKING:
    from gradian.attribution.index_build import IndexBuild
    from gradian.config import GradianConfig
    from gradian.distributed import ShardGroup
    from gradian.index.store import GradientIndex
    from gradian.runs import RunRecord

__all__ = ["register", "build_index_stage", "read_run_on_ranks", "DISTRIBUTED_HELP"]

DISTRIBUTED_HELP = ("Shard the index build over the processes torchrun started (each rank computes a contiguous "
                    "share of the chunks; rank 0 commits the manifest and reports). Default: on when torchrun's "
                    "WORLD_SIZE is above 1; --no-distributed makes every process work alone")


def index_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d", help="Training dataset (.jsonl, .json or a save_to_disk dir)"),
    base_model: Optional[str] = typer.Option(None, "--base-model", "-m", help="Base model id or path"),
    adapter: Optional[str] = typer.Option(None, "--adapter", "-a", help="LoRA adapter directory"),
    run: Optional[str] = typer.Option(None, "--run", "-r", help="Run directory or runs:/<mlflow run id> holding the adapter and data"),
    mlflow_run: Optional[str] = typer.Option(None, "--mlflow-run", help="MLflow run id (same as --run runs:/<id>); the index manifest is logged as its child run"),
    no_log: bool = typer.Option(False, "--no-log", help="Read an MLflow run but do not log anything back"),
    trust_run_dataset: bool = typer.Option(False, "--trust-run-dataset", help=TRUST_RUN_DATASET_HELP),
    into_run: Optional[str] = typer.Option(None, "--into-run", help=INTO_RUN_HELP),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the same inputs are already indexed"),
    distributed: Optional[bool] = typer.Option(None, "--distributed/--no-distributed", help=DISTRIBUTED_HELP),
) -> None:
    """Compute every training example's LoRA gradient and store it in the content-addressed index."""
    from rich.console import Console

    from gradian.cli.run_flags import publish_to_source, run_reference
    from gradian.config import load_config
    from gradian.distributed import join_shard_group
    from gradian.paths import ensure_writable_dir

    import time

    started = time.time()
    run = run_reference(run, mlflow_run)
    cfg = load_config(config, {"dataset": dataset, "base_model": base_model, "adapter_path": adapter, "run": run})
    ensure_writable_dir(cfg.cache_dir, "cache_dir")  # before the model loads, not after the gradients
    with join_shard_group(distributed) as shard:
        built, record = build_index_stage(cfg, trust_run_dataset, force, shard)
    if shard is not None and not shard.is_main:
        return  # rank 0 reports and logs the one index every rank wrote into
    index = built.index
    verb = "reused" if built.cache_hit else "built"
    typer.echo(f"{verb} index {index.index_id}: {index.n} examples x {index.manifest['total_width']} values "
               f"({len(index.block_names)} blocks, {index.manifest['storage_dtype']}), {format_size(index.disk_bytes())}")
    typer.echo(str(index.root))
    skipped = index.manifest.get("skipped_modules") or []
    if skipped:
        typer.echo(f"note: {len(skipped)} LoRA module(s) have no gradient block and are not indexed "
                   f"(not Linear, or a variant such as DoRA): {', '.join(skipped[:5])}", err=True)
    publish_to_source(record, _index_report(index, verb, started), "index", [index.root / "manifest.json"],
                      no_log=no_log, console=Console(), into_run=into_run)


def build_index_stage(cfg: GradianConfig, trust_run_dataset: bool, force: bool,
                      shard: "ShardGroup | None") -> tuple[IndexBuild, RunRecord | None]:
    """``(IndexBuild, RunRecord | None)``: the run read (by rank 0 first, so the others find its
    downloads in the cache) and the index built, on this rank's share when ``shard`` is given;
    the progress bar is rank 0's alone, and so are the notes on stderr (an automatic projection,
    and ``note: repaired index <id>: <file> was <problem>: <action>`` when the build found stored
    files damaged and recomputed them)."""
    import contextlib

    from rich.console import Console

    from gradian.attribution import fill_from_run
    from gradian.cli.run_flags import index_progress
    from gradian.attribution import index_from_config

    main = shard is None or shard.is_main
    record = read_run_on_ranks(cfg, trust_run_dataset, shard)
    if record is not None:
        cfg = fill_from_run(cfg, record)
    bar = index_progress(Console(stderr=True)) if main else contextlib.nullcontext(None)
    with bar as progress:
        # one line each, as written (a repair names files, whose paths may hold brackets)
        note = (lambda message: Console(stderr=True).print(f"note: {message}", highlight=False, markup=False,
                                                           soft_wrap=True)) if main else None
        return index_from_config(cfg, force=force, progress=progress, shard=shard, log=note), record


def read_run_on_ranks(cfg: GradianConfig, trust_run_dataset: bool, shard: "ShardGroup | None") -> RunRecord | None:
    """The RunRecord ``cfg.run`` names (``read_run``), read by rank 0 first and by the other ranks
    after it, so they find its downloads in the cache."""
    from gradian.cli.run_flags import read_run

    main = shard is None or shard.is_main
    record = read_run(cfg, trust_run_dataset) if main else None
    if shard is not None:
        shard.barrier()
        if not main:
            record = read_run(cfg, trust_run_dataset)
    return record


def _index_report(index: GradientIndex, verb: str, started_at: float | None = None) -> dict[str, object]:
    """The report.json of an index build: only the manifest and a one-line summary."""
    import time

    from gradian.report.schema import IndexBuildManifest, IndexSummary, Report, Verdict

    size = index.disk_bytes()
    summary = f"{verb.capitalize()} gradient index {index.index_id}: {index.n} examples, {format_size(size)}"
    return Report(
        verdict=Verdict(kind="inconclusive", summary=summary),
        manifest=IndexBuildManifest(
            index=IndexSummary(index_id=index.index_id, n_examples=index.n, bytes=size,
                               bytes_per_example=round(size / max(index.n, 1), 1),
                               repaired=list(getattr(index, "repaired", []))),
            index_manifest=index.manifest,
            started_at=started_at,
            seconds=round(time.time() - started_at, 3) if started_at is not None else None,
        ),
    ).to_json()


def show_index_command(
    path: Path = typer.Argument(..., help="An index directory (<cache_dir>/index/<id>), or <cache_dir>/index to list them"),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON"),
) -> None:
    """Print what an index was built from and how big it is."""
    import json

    from rich.console import Console
    from rich.table import Table

    from gradian.errors import IndexMismatchError

    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        found = sorted(p.parent for p in path.glob("*/manifest.json")) if path.is_dir() else []
        if len(found) == 1:
            path, manifest_path = found[0], found[0] / "manifest.json"
        elif found:
            listing = Table(title=f"{len(found)} indexes in {path}")
            for col in ("index id", "examples", "status", "dataset"):
                listing.add_column(col)
            for folder in found:
                m = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
                listing.add_row(m["index_id"], str(m["n_examples"]), m["status"], str(m["sources"].get("dataset")))
            Console().print(listing)
            return
        else:
            raise IndexMismatchError(f"{path} is not a gradient index (no manifest.json); pass <cache_dir>/index/<id>")
    m = json.loads(manifest_path.read_text(encoding="utf-8"))
    if as_json:
        typer.echo(json.dumps(m, indent=2, sort_keys=True))
        return
    ident = m["identity"]
    grads = ident["grads"]
    console = Console()
    table = Table(title=f"index {m['index_id']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    projection = (f"{grads['projection_kind']} to {grads['projection_dim']} per block (seed {grads['projection_seed']})"
                  if grads.get("projection_dim") else "none")
    rows = [
        ("status", f"{m['status']} ({m.get('n_chunks_done', 0)}/{m['n_chunks']} chunks)"),
        ("examples", str(m["n_examples"])),
        ("blocks", f"{len(m['blocks'])} ({m['blocks'][0]['name']} ... {m['blocks'][-1]['name']})" if m["blocks"] else "0"),
        ("values per example", str(m["total_width"])),
        ("storage", f"{m['storage_dtype']}, chunks of {m['chunk_size']}"),
        ("projection", projection),
        ("on disk", format_size(sum(p.stat().st_size for p in (path / "chunks").glob("*.npy")))),
        ("dataset", f"{m['sources'].get('dataset')} (sha256 {ident['dataset']['sha256'][:12]})"),
        ("base model", f"{m['sources'].get('base_model') or '-'} ({ident['base'][:24]})"),
        ("adapter", f"{m['sources'].get('adapter_path') or '-'} ({ident['adapter'][:12]})"),
        ("gradients", f"{grads['strategy']}, loss {grads['loss_reduction']}, normalization {grads['normalization']}, "
                      f"max_seq_length {grads['max_seq_length']}, filter {grads['module_filter'] or 'none'}, "
                      f"{grads['block_granularity']} blocks"),
        ("tokenizer", str(ident.get("tokenizer", "-"))[:24]),
        ("seed", str(ident["seed"])),
        ("model dtype", ident["model_dtype"]),
        ("libraries", ", ".join(f"{k} {v}" for k, v in ident["libraries"].items())),
    ]
    for field, value in rows:
        table.add_row(field, value)
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("index")(index_command)
    app.command("show-index")(show_index_command)
