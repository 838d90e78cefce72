"""A job's MLflow integration against a real tracking server (`mlflow server`): params, per-step metrics,
the models as artifacts and the run's end; the same run after another attempt; a server that cannot be
reached costs the integration, not the job; Weights & Biases refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ortune.cli.client import APIError, Client
from ortune.db.models import JobStatus
from tests import services
from tests.support import TERMINAL, events, series, submit, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with services.mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


def mlflow(uri: str, experiment: str) -> list[dict[str, Any]]:
    return [
        {"type": "mlflow", "mlflow": {"tracking_uri": uri, "experiment": experiment, "tags": {"team": "a"}}}
    ]


# the integration is the worker's, the same on both configurations: one is enough for its two jobs
@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_job_logs_its_run_to_mlflow_and_an_unreachable_server_costs_only_the_integration(
    service: Client, tmp_path: Path, mlflow_url: str
) -> None:
    from mlflow import MlflowClient

    experiment = f"ortune-{tmp_path.name}"
    logged = submit(service, tmp_path, steps=6, every=3, integrations=mlflow(mlflow_url, experiment))
    assert logged["integrations"] == [
        {
            "type": "mlflow",
            "mlflow": {
                "tracking_uri": mlflow_url,
                "experiment": experiment,
                "run_name": None,
                "tags": {"team": "a"},
                "log_model": True,
            },
        }
    ]
    unreachable = f"http://127.0.0.1:{services.free_port()}"
    (tmp_path / "other").mkdir()
    lost = submit(service, tmp_path / "other", steps=4, every=4, integrations=mlflow(unreachable, experiment))
    for job in (logged, lost):
        assert wait_for(service, job["id"], TERMINAL)["status"] == "succeeded"

    client = MlflowClient(tracking_uri=mlflow_url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])  # the unreachable job's run is nowhere
    assert run.info.status == "FINISHED" and run.info.run_name == logged["id"]
    assert run.data.tags["ortune.job_id"] == logged["id"] and run.data.tags["team"] == "a"
    params = run.data.params
    assert (params["model"], params["batch_size"], params["max_steps"]) == ("tiny-bert", "8", "6")
    assert float(params["learning_rate"]) == pytest.approx(1e-3)
    history = client.get_metric_history(run.info.run_id, "train_loss")
    ours = series(service, logged["id"])
    assert [m.step for m in history] == ours["steps"]
    assert [m.value for m in history] == pytest.approx(ours["values"])
    models = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert models == {"model/pytorch", "model/onnx"}
    onnx = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "model/onnx")}
    assert "model.onnx" in onnx
    said = [e["message"] for e in events(service, logged["id"])]
    assert any(m.startswith(f"MLflow: logging to run {run.info.run_id}") for m in said), said

    warned = [e for e in events(service, lost["id"]) if "MLflow integration off" in e["message"]]
    assert len(warned) == 1 and warned[0]["level"] == "warn", warned
    assert unreachable in warned[0]["message"] and "training goes on" in warned[0]["message"]


def test_another_attempt_goes_on_in_the_same_run(tmp_path: Path, mlflow_url: str) -> None:
    """A resumed job (a lost worker, a pause) finds its run by its job-id tag and ends it once."""
    from mlflow import MlflowClient

    from ortune.db.migrate import upgrade
    from ortune.db.session import session_scope
    from ortune.integrations import MlflowIntegration
    from tests.support import embedded_settings, job_spec, stored_job
    from worker.integrations import MlflowRun
    from worker.relay import Relay

    settings = embedded_settings(tmp_path)
    upgrade(settings.database_url)
    integration = MlflowIntegration.model_validate(mlflow(mlflow_url, f"resume-{tmp_path.name}")[0])
    with session_scope(settings.database_url) as session:
        job = stored_job(session, spec=job_spec(integrations=[integration]))
        session.expunge(job)
    runs: list[str] = []
    for attempt, (steps, end) in enumerate([((1, 2), JobStatus.paused), ((3, 4), JobStatus.succeeded)]):
        run = MlflowRun(job, integration, Relay(settings.database_url, job.id))
        run.start()
        for step in steps:
            run.add({"type": "metrics", "step": step, "train_loss": 1.0 / step})
        run.end(end)
        assert not run.off and run.run_id is not None, attempt
        runs.append(run.run_id)
    assert runs[0] == runs[1]
    client = MlflowClient(tracking_uri=mlflow_url)
    assert [m.step for m in client.get_metric_history(runs[0], "train_loss")] == [1, 2, 3, 4]
    assert client.get_run(runs[0]).info.status == "FINISHED"


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_wandb_is_refused_by_name_and_a_bad_tracking_uri_is_named(service: Client, tmp_path: Path) -> None:
    with pytest.raises(APIError, match="wandb is not available on this server") as refused:
        submit(
            service, tmp_path, steps=2, every=2, integrations=[{"type": "wandb", "wandb": {"project": "p"}}]
        )
    assert (refused.value.status, refused.value.param) == (400, "integrations[0]")
    with pytest.raises(APIError, match="tracking_uri") as bad:
        submit(service, tmp_path, steps=2, every=2, integrations=mlflow("file:///etc", "x"))
    assert bad.value.status == 422 and bad.value.param == "integrations.0.mlflow.tracking_uri"
