"""Fine-tune a LoRA and log it to MLflow the way a user's own training run would be logged.

The HF Trainer's ``MLflowCallback`` logs the trainer arguments (as strings) and the per-step
metrics into the active run; afterwards the adapter, the trainer state, the JSON training
arguments and the training data are logged as artifacts, and the data also as the run's dataset
input. This is the kind of run ``gradian diagnose`` and ``gradian attribute`` read back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    from mlflow.data.pandas_dataset import PandasDataset

__all__ = ["train_and_log", "TRAIN_DATA_ARTIFACT"]

TRAIN_DATA_ARTIFACT = "data"


def train_and_log(
    config: str | Path,
    out_dir: str | Path,
    dataset: str | Path | None = None,
    *,
    experiment: str | None = None,
    run_name: str | None = None,
    overwrite: bool = True,
) -> str:
    """Train with ``gradian.train.train_lora`` inside an MLflow run; returns the run id.

    Inside ``mlflow run`` the project's run is used; otherwise a run is started in
    ``experiment`` (or the current experiment). An ``experiment`` that does not exist yet is
    created as a model-training experiment (``gradian_mlflow.experiment``).
    """
    import mlflow
    import pandas as pd

    from gradian.config import load_config
    from gradian.train import train_lora
    from gradian_mlflow.experiment import use_training_experiment

    cfg = load_config(config)
    data_path = Path(dataset or cfg.dataset or "")
    if not data_path.is_file():
        from gradian.errors import DatasetError

        raise DatasetError(f"training data not found: {data_path or '(none)'}; pass --dataset or set dataset in {config}")
    if experiment and not os.environ.get("MLFLOW_RUN_ID"):
        use_training_experiment(experiment)
    out = Path(out_dir)
    with mlflow.start_run(run_name=run_name) as run:
        record = train_lora(cfg, out, dataset=data_path, report_to=["mlflow"], overwrite=overwrite)
        mlflow.set_tags({"gradian.base_model": str(cfg.train.base_model or cfg.base_model),
                         "gradian.kind": "finetune"})
        if record.adapter_dir:
            mlflow.log_artifacts(record.adapter_dir, artifact_path="adapter")
        for name in ("trainer_state.json", "training_args.json", "gradian_run.json"):
            if (out / name).is_file():
                mlflow.log_artifact(str(out / name))
        for checkpoint in record.checkpoints:
            ckpt = Path(checkpoint)
            for name in ("adapter_config.json", "adapter_model.safetensors", "trainer_state.json"):
                if (ckpt / name).is_file():
                    mlflow.log_artifact(str(ckpt / name), artifact_path=ckpt.name)
        mlflow.log_artifact(str(data_path), artifact_path=TRAIN_DATA_ARTIFACT)
        frame = pd.read_json(data_path, lines=data_path.suffix == ".jsonl")
        frame = frame.astype(str)  # nested chat turns: the dataset input records the text only
        mlflow.log_input(_dataset(frame, data_path), context="training")
        return run.info.run_id


def _dataset(frame: pd.DataFrame, data_path: Path) -> PandasDataset:
    """The dataset input, sourced at the logged artifact when MLflow can name it, else the file."""
    import mlflow
    from mlflow.exceptions import MlflowException

    artifact = mlflow.get_artifact_uri(f"{TRAIN_DATA_ARTIFACT}/{data_path.name}")
    try:
        return mlflow.data.from_pandas(frame, source=artifact, name=data_path.name)
    except MlflowException:  # a store whose URIs have no dataset-source resolver
        return mlflow.data.from_pandas(frame, source=str(data_path.resolve()), name=data_path.name)
