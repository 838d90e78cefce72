"""A job's MLflow integration: the run's params, its metrics at each flush, the stored models as artifacts,
and its end, logged by the worker that relays the trainer's events (rank 0's, in a multi-node job).

It fails soft: a tracking server that cannot be reached or refuses costs the integration, never the job. The
first failure is said in the job's events and the integration stays off for the rest of the attempt. An
attempt after a lost worker or a pause goes on in the same MLflow run (found by its `ortune.job_id` tag)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from ortune.db.models import Job, JobStatus
from ortune.integrations import MlflowIntegration
from worker.relay import SERIES, Relay

log = logging.getLogger(__name__)

# MLflow's client retries a request 7 times over minutes by default; a job's relay should not wait that out
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

END = {JobStatus.succeeded: "FINISHED", JobStatus.failed: "FAILED", JobStatus.cancelled: "KILLED"}


class MlflowRun:
    def __init__(self, job: Job, integration: MlflowIntegration, relay: Relay) -> None:
        self.job, self.options, self.relay = job, integration.mlflow, relay
        self.client: Any = None
        self.run_id: str | None = None
        self.pending: list[Any] = []
        self.off = False

    def _guard(self, what: str, call: Any) -> None:
        if self.off:
            return
        try:
            call()
        except Exception as exc:  # any client or server failure: the job goes on without it
            self.off = True
            log.warning("job %s: MLflow %s failed: %s", self.job.id, what, exc)
            self.relay.message(
                f"MLflow integration off for this attempt: {what} at {self.options.tracking_uri} failed "
                f"({type(exc).__name__}: {str(exc)[:300]}); training goes on",
                level="warn",
                data={"integration": "mlflow", "tracking_uri": self.options.tracking_uri},
            )

    def start(self) -> None:
        self._guard("starting the run", self._start)

    def _start(self) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = client = MlflowClient(tracking_uri=self.options.tracking_uri)
        experiment = client.get_experiment_by_name(self.options.experiment)
        exp_id = experiment.experiment_id if experiment else client.create_experiment(self.options.experiment)
        found = client.search_runs([exp_id], filter_string=f"tags.`ortune.job_id` = '{self.job.id}'")
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            self.relay.message(f"MLflow: going on in run {self.run_id} ({self.options.experiment})")
            return
        tags = dict(self.options.tags) | {"ortune.job_id": self.job.id, "ortune.model": self.job.model}
        run = client.create_run(exp_id, run_name=self.options.run_name or self.job.id, tags=tags)
        self.run_id = run.info.run_id
        client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in _params(self.job).items()])
        self.relay.message(
            f"MLflow: logging to run {self.run_id} in experiment {self.options.experiment!r}",
            data={"integration": "mlflow", "run_id": self.run_id, "experiment": self.options.experiment},
        )

    def add(self, event: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        if self.off or event.get("type") != "metrics":
            return
        step, at = int(event.get("step") or 0), int(1000 * float(event.get("time") or time.time()))
        self.pending += [
            Metric(k, float(event[k]), at, step) for k in SERIES if isinstance(event.get(k), int | float)
        ]

    def flush(self) -> None:
        if self.pending and self.run_id is not None:
            batch, self.pending = self.pending, []
            self._guard("logging metrics", lambda: self._log(batch))

    def _log(self, metrics: list[Any]) -> None:
        for i in range(0, len(metrics), 1000):  # the server takes at most 1000 metrics a request
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def model(self, fmt: str, path: Path) -> None:
        if self.options.log_model and self.run_id is not None and fmt in ("pytorch", "onnx", "adapter"):
            self._guard(
                f"logging the {fmt} model",
                lambda: self.client.log_artifacts(self.run_id, str(path), f"model/{fmt}"),
            )

    def end(self, status: JobStatus | None) -> None:
        """Close the run when the job ended; a paused or requeued attempt leaves it open for the next."""
        self.flush()
        if status in END and self.run_id is not None:
            self._guard("ending the run", lambda: self.client.set_terminated(self.run_id, END[status]))


def _params(job: Job) -> dict[str, Any]:
    spec = job.spec
    hp = spec.resolved_hyperparameters.model_dump(mode="json")
    params = {
        "model": job.model,
        "task": job.task,
        "method": spec.method.type,
        "backend": spec.backend,
        "precision": spec.precision,
        "seed": job.seed,
        "training_file": job.training_file_id,
        "validation_file": job.validation_file_id,
    } | {k: v for k, v in hp.items() if v is not None}
    if spec.lora is not None:
        params |= {f"lora_{k}": v for k, v in spec.lora.model_dump(mode="json").items()}
    options = spec.method.model_dump(mode="json", exclude={"type"})
    params |= {f"{spec.method.type}_{k}": v for k, v in options.items()}  # dpo_beta, supervised_packing
    return {k: v for k, v in params.items() if v is not None}


def runs_for(job: Job, relay: Relay) -> list[MlflowRun]:
    return [MlflowRun(job, integration, relay) for integration in job.spec.integrations]
