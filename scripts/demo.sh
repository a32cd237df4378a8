#!/usr/bin/env bash
# The main job end to end on the embedded MLflow store (sqlite:///mlflow.db in this directory).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m gradian_mlflow.entry demo --workdir "${GRADIAN_DEMO_DIR:-.demo}"
