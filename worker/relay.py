"""Relay a trainer's JSON-lines events into the database in batches."""

from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

from sqlalchemy.exc import DBAPIError, OperationalError
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from ortune.db.base import utcnow
from ortune.db.models import JobStatus
from ortune.db.repositories import EventRepository, JobRepository, MetricRepository
from ortune.db.session import session_scope

log = logging.getLogger(__name__)
SERIES = (
    "train_loss",
    "eval_loss",
    "eval_accuracy",
    "eval_wer",
    "learning_rate",
    "grad_norm",
    "samples_per_second",
    "padding_fraction",
    "reward_margin",
    "reward_accuracy",
    "eval_reward_margin",
    "eval_reward_accuracy",
    "eval_preference_accuracy",
)


def _connection_lost(exc: BaseException) -> bool:
    """The database did not answer, or ended this connection (an idle-in-transaction timeout, or the
    sweep ending the transactions of a worker it gave up for lost): a new connection may do."""
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def reader(stream: IO[str], out: queue.Queue[dict[str, Any] | None], log: IO[str]) -> threading.Thread:
    """A thread that parses lines into events; a line that is not JSON is kept in the log, not lost."""

    def loop() -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                log.write(line)
                continue
            if isinstance(event, dict):
                out.put(event)
        out.put(None)

    thread = threading.Thread(target=loop, daemon=True, name="trainer-events")
    thread.start()
    return thread


def _describe(event: dict[str, Any]) -> str:
    step, total = event.get("step"), event.get("total_steps")
    where = f"Step {step}/{total}" if total else f"Step {step}"
    parts = [f"{k}={event[k]:.4g}" for k in SERIES if isinstance(event.get(k), int | float)]
    return f"{where}: {', '.join(parts)}"


@dataclass
class Batch:
    events: list[dict[str, Any]] = field(default_factory=list)
    points: list[tuple[str, int, float]] = field(default_factory=list)
    job: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.events) + len(self.points)


class Relay:
    """Accumulates events and writes them in one transaction per flush; says whether the job was cancelled."""

    def __init__(
        self, database_url: str, job_id: str, attempt: int | None = None, *, patience_s: float = 0.0
    ) -> None:
        self.url, self.job_id, self.attempt = database_url, job_id, attempt
        self.patience_s = patience_s  # how long a flush waits out a database that does not answer
        self.batch = Batch()

    def message(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        self.batch.events.append(
            {
                "job_id": self.job_id,
                "message": message,
                "level": level,
                "type": "message",
                "data": data,
                "created_at": utcnow(),
            }
        )

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        at = (
            datetime.fromtimestamp(event["time"], UTC)
            if isinstance(event.get("time"), int | float)
            else utcnow()
        )
        if kind == "metrics":
            step = int(event.get("step") or 0)
            values = {k: float(event[k]) for k in SERIES if isinstance(event.get(k), int | float)}
            self.batch.points += [(k, step, v) for k, v in values.items()]
            self.batch.events.append(
                {
                    "job_id": self.job_id,
                    "message": _describe(event),
                    "level": "info",
                    "type": "metrics",
                    "data": {"step": step, **values},
                    "created_at": at,
                }
            )
            self.batch.job["step"] = max(step, self.batch.job.get("step", 0))
            if event.get("total_steps"):
                self.batch.job["total_steps"] = int(event["total_steps"])
        elif kind == "progress":
            self.batch.job |= {"step": int(event.get("step") or 0), "total_steps": event.get("total_steps")}
        elif kind == "message":
            self.batch.events.append(
                {
                    "job_id": self.job_id,
                    "message": str(event.get("message", "")),
                    "level": str(event.get("level", "info")),
                    "type": "message",
                    "data": event.get("data"),
                    "created_at": at,
                }
            )
        elif kind == "backend":
            self.batch.job |= {
                "backend_used": event.get("used"),
                "backend_reason": event.get("reason"),
                "precision_used": event.get("precision"),
                "precision_reason": event.get("precision_reason"),
            }
            self.message(
                f"Backend: {event.get('used')} (requested {event.get('requested')}), "
                f"optimizer {event.get('optim')}, precision {event.get('precision')}",
                data={
                    k: event.get(k)
                    for k in (
                        "requested",
                        "used",
                        "reason",
                        "optim",
                        "precision",
                        "precision_reason",
                        "figures",
                    )
                },
            )

    def flush(self) -> JobStatus | None:
        """Write what is pending and beat the heartbeat; returns the job's current status (None once the
        job has moved on to another attempt than this relay's).

        A database that does not answer (a restart, a failover) is retried with backoff for `patience_s`;
        the batch stays pending until it is written, so nothing is lost. Past that the OperationalError is
        raised: the caller gives the attempt up, as the sweep would once its heartbeat stopped."""
        retrying = Retrying(
            retry=retry_if_exception(_connection_lost),
            wait=wait_exponential(multiplier=0.2, max=5),
            stop=stop_after_delay(self.patience_s),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                status = self._write(self.batch)
        self.batch = Batch()
        return status

    def _write(self, batch: Batch) -> JobStatus | None:
        with session_scope(self.url) as session:
            jobs = JobRepository(session)
            if self.attempt is not None and not jobs.holds(self.job_id, self.attempt):
                # fenced: a superseded attempt (a worker cut off while the job went on without it) writes
                # nothing; the caller sees the status and stops its trainer
                if batch.events or batch.points:
                    log.warning(
                        "job %s: dropped %d events and %d metric points of superseded attempt %s",
                        self.job_id,
                        len(batch.events),
                        len(batch.points),
                        self.attempt,
                    )
                return jobs.status(self.job_id, attempt=self.attempt)
            EventRepository(session).add_many(batch.events)
            MetricRepository(session).add_many(self.job_id, batch.points)
            jobs.update(self.job_id, attempt=self.attempt, heartbeat_at=utcnow(), **batch.job)
            return jobs.status(self.job_id, attempt=self.attempt)
