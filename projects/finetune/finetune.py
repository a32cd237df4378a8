"""Fine-tune a LoRA adapter and log the run to MLflow (the project's only step)."""

from __future__ import annotations

import argparse
import sys

from gradian.errors import GradianError
from gradian_mlflow.training import train_and_log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="gradian.yaml with a train: section")
    parser.add_argument("--dataset", default="", help="training data (default: the config's dataset)")
    parser.add_argument("--out", default="runs/finetune", help="run directory for the adapter and logs")
    args = parser.parse_args()
    try:
        run_id = train_and_log(args.config, args.out, args.dataset or None)
    except GradianError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    print(f"training run: {run_id}")


if __name__ == "__main__":
    main()
