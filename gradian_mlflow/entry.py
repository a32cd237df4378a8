"""Entry points of the root ``MLproject``: thin translations of project parameters into calls.

``mlflow run`` passes every parameter; an empty string or 0 means "not given" here. Inside
``mlflow run`` the project's own run becomes the diagnosis (a child of the source run) when both
live in the same experiment; see ``gradian_mlflow.sink``. ``mlflow run`` names that run only in the
``MLFLOW_RUN_ID`` environment variable; this module passes it down as ``--into-run``, so the sink
never reads the environment.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["main"]


def _flag(argv: list[str], name: str, value: object) -> None:
    if value in (None, "", 0, 0.0):
        return
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    argv += [name, str(value)]


def _switch(text: str) -> bool:
    """A true/false project parameter (``force``): true, false, 1, 0, yes or no, any case."""
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no", ""):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def torchrun_command(argv: Sequence[str], nproc: int) -> list[str]:
    """This entry point again under ``torchrun --standalone`` with ``nproc`` processes on this
    machine, ``--nproc`` left out (each process sees WORLD_SIZE and shards the indexing)."""
    rest: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        rest.append(arg)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "gradian_mlflow.entry", *rest]


def _cli(argv: list[str]) -> None:
    from gradian.cli import main as gradian_main

    gradian_main(argv)


def _dispatch(args: argparse.Namespace) -> None:
    """Run the parsed entry point."""
    if args.command == "doctor":
        _cli(["doctor"])
    elif args.command in ("diagnose", "attribute", "index", "counterfactual"):
        # every parameter maps to the CLI flag of the same name; empty means "not given"
        cli = [args.command, "--mlflow-run", args.run_id]
        for name, value in vars(args).items():
            if name in ("command", "run_id", "nproc"):
                continue
            if isinstance(value, bool):  # a switch: its flag alone when true
                if value:
                    cli.append("--" + name.replace("_", "-"))
            else:
                _flag(cli, "--" + name.replace("_", "-"), value)
        _flag(cli, "--into-run", os.environ.get("MLFLOW_RUN_ID"))
        _cli(cli)
    elif args.command == "train":
        from gradian_mlflow.training import train_and_log

        run_id = train_and_log(args.config, args.out, args.dataset or None, experiment=args.experiment or None)
        print(f"training run: {run_id}")
    elif args.command == "demo":
        from gradian_mlflow.demo import run_demo

        run_demo(args.workdir)


def main(argv: Sequence[str] | None = None) -> None:
    from gradian.errors import GradianError
    from gradian.redact import redact
    from gradian.termination import Terminated, sigterm_raises
    from gradian_mlflow.client import quiet_credentialed_links

    parser = argparse.ArgumentParser(prog="python -m gradian_mlflow.entry")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor")
    for name in ("diagnose", "index", "attribute"):
        p = sub.add_parser(name)
        p.add_argument("--run-id", required=True)
        if name != "diagnose":
            # processes that share the indexing on this machine (one per GPU); 1: no torchrun
            p.add_argument("--nproc", type=lambda v: int(float(v)), default=1)
        p.add_argument("--dataset", default="")
        p.add_argument("--base-model", default="")
        p.add_argument("--config", default="")
        if name != "diagnose":
            p.add_argument("--adapter", default="")
            p.add_argument("--force", type=_switch, default=False)
        if name != "index":
            p.add_argument("--eval-dataset", default="")
        if name == "diagnose":
            p.add_argument("--max-seq-length", type=float, default=0)
        if name == "attribute":
            p.add_argument("--capability", default="capability")
            p.add_argument("--engine", default="")  # empty: the config's engine.name
            p.add_argument("--cross-check", default="")  # empty: the CLI's default, auto
            p.add_argument("--out", default="")
    p = sub.add_parser("counterfactual")
    p.add_argument("--run-id", required=True)
    for flag in ("--config", "--report", "--drop", "--drop-cluster", "--drop-ids", "--truth", "--max-rounds"):
        p.add_argument(flag, default="")
    p.add_argument("--until-recovered", type=_switch, default=False)
    p = sub.add_parser("train")
    p.add_argument("--config", required=True)
    p.add_argument("--dataset", default="")
    p.add_argument("--out", default="runs/finetune")
    p.add_argument("--experiment", default="")
    p = sub.add_parser("demo")
    p.add_argument("--workdir", default=".demo")
    args = parser.parse_args(argv)
    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        print(f"error: nproc is {nproc}; use 1 (one process) or the number of GPUs to share the indexing",
              file=sys.stderr)
        sys.exit(2)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        import subprocess

        # every rank keeps MLFLOW_RUN_ID; only rank 0 logs the diagnosis into it
        sys.exit(subprocess.run(torchrun_command(list(sys.argv[1:] if argv is None else argv), nproc)).returncode)
    quiet_credentialed_links()  # the training run's "View run at" link would print the password

    try:
        with sigterm_raises():
            _dispatch(args)
    except (GradianError, Terminated) as err:
        print(f"error: {redact(str(err))}", file=sys.stderr)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
