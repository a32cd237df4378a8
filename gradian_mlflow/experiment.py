"""The experiments Gradian creates: marked as model-training experiments for the MLflow UI.

MLflow 3's UI has two faces, GenAI (traces, evaluations) and model training (runs, metrics,
nested runs). An experiment records which one it is in the tag ``mlflow.experimentKind``
(``custom_model_development`` is what the UI calls "Machine learning"), and the UI's
experiment settings show and edit it. Gradian sets that tag on an experiment it creates, and on
the experiment of a run it logs a diagnosis under when the tag is unset and the experiment holds no
traces (``mark_training_experiment``: a training callback's experiment, which would otherwise open
in the GenAI face); a kind the user set is never changed.

The UI of recent releases (3.17 checked) also keeps one switch for the whole browser, GenAI or
model training (in local storage, GenAI until the user flips it), and opens every experiment in
that face whatever its tag; the query parameter ``workflowType=machine_learning`` in a link
selects the training face, so the links Gradian prints carry it (``training_view_url``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradian_mlflow.client import call, get_client

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = ["EXPERIMENT_KIND_TAG", "MODEL_TRAINING_KIND", "mark_training_experiment", "run_url", "training_view_url",
           "use_training_experiment"]

#: the experiment tag MLflow 3's UI reads for the experiment's kind
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
#: its value for a model-training ("Machine learning") experiment
MODEL_TRAINING_KIND = "custom_model_development"


def use_training_experiment(name: str) -> str:
    """Make experiment ``name`` the active one, creating it (tagged as model training) when it
    does not exist; returns its id. An existing experiment is used as it is."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = get_client()
    existing = call(f"looking up experiment '{name}'", lambda: client.get_experiment_by_name(name))
    if existing is not None:
        experiment_id = existing.experiment_id
    else:
        def create() -> str:
            try:
                return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
            except MlflowException as err:
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                # another process created it between our lookup and our create: it is theirs
                return client.get_experiment_by_name(name).experiment_id

        experiment_id = call(f"creating experiment '{name}'", create)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def mark_training_experiment(client: "MlflowClient", experiment_id: str) -> bool:
    """Tag ``experiment_id`` as model training when it has no kind yet and holds no traces; True
    when it was tagged. An experiment whose traces cannot be listed is left as it is."""
    experiment = call(f"reading experiment {experiment_id}", lambda: client.get_experiment(experiment_id))
    if EXPERIMENT_KIND_TAG in (experiment.tags or {}):
        return False
    try:
        traces = client.search_traces(locations=[experiment_id], max_results=1, include_spans=False)
    except Exception:  # noqa: BLE001 -- a store without traces support: say nothing about its kind
        return False
    if len(traces):
        return False
    call(f"marking experiment {experiment_id} as model training",
         lambda: client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND))
    return True


def training_view_url(ui_url: str, experiment_id: str, run_id: str | None = None) -> str:
    """The UI link that opens ``experiment_id`` (or one of its runs) in the model-training face."""
    path = f"experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{ui_url.rstrip('/')}/#/{path}?workflowType=machine_learning"


def run_url(run_id: str, client: MlflowClient | None = None) -> str | None:
    """The training-view link to ``run_id`` when the tracking URI is a server's http(s) address
    (credentials removed), else None: a file or database store has no UI address of its own."""
    import mlflow

    from gradian_mlflow.client import redact

    uri = mlflow.get_tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return None
    store = client or get_client(existing_store=True)
    run = call(f"reading run {run_id}", lambda: store.get_run(run_id))
    return training_view_url(redact(uri), run.info.experiment_id, run_id)
