"""``gradian index`` (build or reuse the gradient index) and ``gradian show-index PATH``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

__all__ = ["register"]


def index_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d", help="Training dataset (.jsonl, .json or a save_to_disk dir)"),
    base_model: Optional[str] = typer.Option(None, "--base-model", "-m", help="Base model id or path"),
    adapter: Optional[str] = typer.Option(None, "--adapter", "-a", help="LoRA adapter directory"),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the same inputs are already indexed"),
) -> None:
    """Compute every training example's LoRA gradient and store it in the content-addressed index."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from gradian.config import load_config
    from gradian.index import index_from_config

    cfg = load_config(config, {"dataset": dataset, "base_model": base_model, "adapter_path": adapter})
    console = Console(stderr=True)
    columns = (TextColumn("indexing"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]} examples/s"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("index", total=None, rate="-")
        state: dict[str, float] = {}

        def progress(done: int, total: int) -> None:
            import time

            now = time.perf_counter()
            if "t0" not in state:
                state["t0"], state["d0"] = now, done
            elapsed = now - state["t0"]
            rate = (done - state["d0"]) / elapsed if elapsed > 0 else 0.0
            bar.update(task, completed=done, total=total, rate=f"{rate:.1f}")

        built = index_from_config(cfg, force=force, progress=progress)
    index = built.index
    verb = "reused" if built.cache_hit else "built"
    typer.echo(f"{verb} index {index.index_id}: {index.n} examples x {index.manifest['total_width']} values "
               f"({len(index.block_names)} blocks, {index.manifest['storage_dtype']}), {_size(index.disk_bytes())}")
    typer.echo(str(index.root))


def show_index_command(path: Path = typer.Argument(..., help="An index directory (<cache_dir>/index/<id>)")) -> None:
    """Print what an index was built from and how big it is."""
    import json

    from rich.console import Console
    from rich.table import Table

    from gradian.errors import IndexMismatchError

    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise IndexMismatchError(f"{path} is not a gradient index (no manifest.json)")
    m = json.loads(manifest_path.read_text(encoding="utf-8"))
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
        ("on disk", _size(sum(p.stat().st_size for p in (path / "chunks").glob("*.npy")))),
        ("dataset", f"{m['sources'].get('dataset')} (sha256 {ident['dataset']['sha256'][:12]})"),
        ("base model", f"{m['sources'].get('base_model') or '-'} ({ident['base'][:24]})"),
        ("adapter", f"{m['sources'].get('adapter_path') or '-'} ({ident['adapter'][:12]})"),
        ("gradients", f"{grads['strategy']}, loss {grads['loss_reduction']}, normalization {grads['normalization']}, "
                      f"max_seq_length {grads['max_seq_length']}, filter {grads['module_filter'] or 'none'}, "
                      f"{grads['block_granularity']} blocks"),
        ("damping", json.dumps(ident["damping"])),
        ("seed", str(ident["seed"])),
        ("model dtype", ident["model_dtype"]),
        ("libraries", ", ".join(f"{k} {v}" for k, v in ident["libraries"].items())),
    ]
    for field, value in rows:
        table.add_row(field, value)
    console.print(table)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def register(app: typer.Typer) -> None:
    app.command("index")(index_command)
    app.command("show-index")(show_index_command)
