"""No stale writer: an attempt that was superseded (its worker cut off while the job was requeued and went
on) writes no events, metrics, checkpoints or artifacts, and stores its objects apart from the live one's."""

from __future__ import annotations

import pytest

from ortune.db.models import Job, JobEvent, JobStatus
from ortune.db.repositories import JobRepository, MetricRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from tests.support import stored_job
from worker.relay import Relay
from worker.trainer_process import attempt_prefix


def job_on(settings: Settings, attempt: int, status: JobStatus) -> str:
    with session_scope(settings.database_url) as session:
        return stored_job(session, status=status, attempt=attempt, worker="somewhere:1").id


def points(settings: Settings, job_id: str) -> list[tuple[int, float]]:
    with session_scope(settings.database_url) as session:
        return MetricRepository(session).series(job_id, ["train_loss"]).get("train_loss", [])


@pytest.mark.parametrize("config", ["embedded", "production"], indirect=True)
def test_a_superseded_attempts_relay_writes_nothing(settings: Settings) -> None:
    job_id = job_on(settings, 2, JobStatus.running)  # attempt 1 was requeued; attempt 2 runs elsewhere
    stale, live = Relay(settings.database_url, job_id, 1), Relay(settings.database_url, job_id, 2)
    live.add({"type": "metrics", "step": 7, "train_loss": 1.0})
    assert live.flush() == JobStatus.running
    stale.add({"type": "metrics", "step": 7, "train_loss": 9.0})  # the same step, later, from the old one
    stale.message("from the cut-off worker")
    assert stale.flush() is None  # the stale attempt learns it is over, and its trainer is stopped
    assert points(settings, job_id) == [(7, 1.0)]
    with session_scope(settings.database_url) as session:
        messages = [e.message for e in session.query(JobEvent).filter_by(job_id=job_id)]
    assert "from the cut-off worker" not in messages
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.step == 7
        # a job queued again (its attempt lost, the next not yet claimed) is not its old attempt's either
        JobRepository(session).update(job_id, status=JobStatus.queued)
        assert not JobRepository(session).holds(job_id, 2)


def test_attempts_store_their_objects_apart() -> None:
    first, second = Job(id="ftjob-x", attempt=1), Job(id="ftjob-x", attempt=2)
    assert attempt_prefix(first) != attempt_prefix(second)
    assert attempt_prefix(second) == "jobs/ftjob-x/attempt-2"
