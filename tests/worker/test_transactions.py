"""No transaction of the worker spans a storage call, and none outlives a worker given up for lost.

On the embedded default SQLite has one write lock for the whole deployment: a worker that held it across a
slow put (or froze there) would stall every write of the API and of the sweep that is meant to requeue its
job. On Postgres the same transaction would hold the job's row, which the sweep's `SKIP LOCKED` passes
over; so the sweep ends a silent worker's transactions first."""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, event, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from ortune.db.base import utcnow
from ortune.db.models import File, JobStatus
from ortune.db.session import make_engine, session_scope, worker_application_name
from ortune.settings import Settings
from ortune.storage import LocalStore
from tests.support import fake_trainer, fake_trainer_spec, stored_job
from trainer_core.spec import TrainingSpec
from worker import attempt, sweep
from worker.staging import store_of
from worker.trainer_process import TrainerProcess

STORAGE_CALLS = ("put_fileobj", "put_path", "get_to_path", "stat", "iter_range", "delete")


class OpenTransactions:
    """Counts, per thread, the transactions this process's engine has open (autocommit reads hold none)."""

    def __init__(self) -> None:
        self.open: dict[int, int] = {}

    def begin(self, conn: Any) -> None:
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            self.open[threading.get_ident()] = self.open.get(threading.get_ident(), 0) + 1

    def end(self, _conn: Any) -> None:
        self.open[threading.get_ident()] = max(0, self.open.get(threading.get_ident(), 0) - 1)

    def here(self) -> int:
        return self.open.get(threading.get_ident(), 0)


@pytest.fixture
def spans(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Where a storage call ran inside an open transaction (the caller's frames), for the test to assert
    there were none."""
    engine, tracker, found = make_engine(settings.database_url), OpenTransactions(), []
    listeners = [("begin", tracker.begin), ("commit", tracker.end), ("rollback", tracker.end)]
    for name, fn in listeners:
        event.listen(engine, name, fn)

    def guarded(name: str) -> Any:
        real = getattr(LocalStore, name)

        def call(self: LocalStore, *args: Any, **kwargs: Any) -> Any:
            if tracker.here():
                frames = traceback.extract_stack(limit=6)[:-1]
                found.append(
                    f"{name} inside a transaction, from "
                    + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
                )
            return real(self, *args, **kwargs)

        return call

    for name in STORAGE_CALLS:
        monkeypatch.setattr(LocalStore, name, guarded(name))
    yield found
    for name, fn in listeners:
        event.remove(engine, name, fn)


def attempt_of(settings: Settings, tmp: Path, *, live_attempt: int) -> tuple[Any, TrainingSpec, list[str]]:
    """A running job whose live attempt is `live_attempt`, and a trainer of attempt 1 that reports a
    checkpoint, its PyTorch model and its result."""
    with session_scope(settings.database_url) as session:
        job = stored_job(session, status=JobStatus.running, attempt=live_attempt, worker=attempt.WORKER)
        session.expunge(job)
    job.attempt = 1
    out = tmp / "out"
    for part in ("pytorch", "checkpoints/checkpoint-1"):
        (out / part).mkdir(parents=True)
        (out / part / "config.json").write_text("{}")
    spec = fake_trainer_spec(job.id, tmp)
    command = fake_trainer(
        tmp,
        [
            {"type": "metrics", "step": 1, "loss": 0.5},
            {"type": "checkpoint", "step": 1, "path": str(out / "checkpoints/checkpoint-1")},
            {"type": "artifact", "format": "pytorch", "path": str(out / "pytorch"), "manifest": {}},
            {
                "type": "result",
                "metrics": {},
                "steps": 1,
                "trained_tokens": 8,
                "onnx_max_abs_diff": None,
                "failed_artifacts": {"onnx": "not exported in this test"},
            },
        ],
    )
    return job, spec, command


@pytest.mark.parametrize("config", ["embedded"], indirect=True)  # SQLite's one write lock; same code on both
def test_a_succeeding_attempt_stores_its_objects_outside_every_transaction(
    settings: Settings, tmp_path: Path, spans: list[str]
) -> None:
    job, spec, command = attempt_of(settings, tmp_path, live_attempt=1)
    outcome = TrainerProcess(settings, store_of(settings), job, spec, command=command).run()
    attempt.finish(settings, job, outcome)
    assert outcome.status == JobStatus.succeeded, outcome.error
    assert spans == []
    with session_scope(settings.database_url) as session:
        results = session.scalars(select(File).where(File.purpose == "fine-tune-results")).all()
    assert [f.filename for f in results] == ["step_metrics.csv"]  # the result file is still stored


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_superseded_attempt_deletes_what_it_stored_outside_every_transaction(
    settings: Settings, tmp_path: Path, spans: list[str]
) -> None:
    job, spec, command = attempt_of(settings, tmp_path, live_attempt=2)
    store = store_of(settings)
    outcome = TrainerProcess(settings, store, job, spec, command=command).run()
    attempt.finish(settings, job, outcome)
    assert outcome.status is None  # superseded
    assert spans == []
    assert not list((Path(settings.storage_url.removeprefix("file://")) / "jobs").rglob("*.tar"))


def test_an_idle_in_transaction_timeout_past_the_heartbeat_timeout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ORTUNE_WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS \\(60000\\) must be"):
        Settings(worker_idle_in_transaction_timeout_ms=60_000, heartbeat_timeout_seconds=60)
    assert (
        Settings(heartbeat_timeout_seconds=4).session_limits("worker")["idle_in_transaction_session_timeout"]
        == 2000
    )


@contextmanager
def open_transaction(url: str, application_name: str, sql: str = "SELECT 1") -> Iterator[Connection]:
    """A connection named `application_name` inside a transaction (a frozen worker's, or a bystander's)."""
    engine = create_engine(url, poolclass=NullPool)
    conn = engine.connect()
    try:
        conn.execute(text("SELECT set_config('application_name', :n, false)"), {"n": application_name})
        conn.commit()
        conn.begin()
        conn.execute(text(sql))
        yield conn
    finally:
        with contextlib.suppress(DBAPIError):
            conn.close()
        engine.dispose()


def alive(conn: Connection) -> bool:
    try:
        conn.execute(text("SELECT 1"))
        return True
    except DBAPIError:
        return False


def silent_job(settings: Settings, worker: str) -> str:
    with session_scope(settings.database_url) as session:
        job = stored_job(
            session,
            status=JobStatus.running,
            attempt=1,
            worker=worker,
            heartbeat_at=utcnow() - timedelta(hours=1),
        )
        return job.id


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_the_sweep_ends_a_silent_workers_transactions_and_requeues_the_row_they_held(
    settings: Settings,
) -> None:
    job_id = silent_job(settings, "ghost:1")
    holds_row = f"SELECT id FROM jobs WHERE id = '{job_id}' FOR SHARE"
    with (
        open_transaction(settings.database_url, worker_application_name("ghost:1"), holds_row) as frozen,
        open_transaction(settings.database_url, worker_application_name("live:2")) as bystander,
    ):
        reports = [sweep.sweep(settings) for _ in range(2)]  # ended in one round, requeued by the next
        assert (alive(frozen), alive(bystander)) == (False, True)
    assert reports[0].ended_transactions == {"ghost:1": 1}
    assert [job_id] in [r.requeued for r in reports]


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_a_sweep_that_may_not_end_a_workers_transactions_says_so_and_sweeps_on(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A sweep connected as a role that may not signal the worker's backends (another role, without
    pg_signal_backend): a warning naming the worker, and the rest of the sweep still runs."""
    role = f"ortune_sweeper_{uuid.uuid4().hex[:8]}"
    admin = create_engine(settings.database_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(text(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"))
        conn.execute(text(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"))
    limited = settings.model_copy(
        update={"database_url": make_url(settings.database_url).set(username=role).render_as_string(False)}
    )
    job_id = silent_job(settings, "ghost:1")
    try:
        with open_transaction(settings.database_url, worker_application_name("ghost:1")) as frozen:
            with caplog.at_level(logging.WARNING, logger="worker.sweep"):
                report = sweep.sweep(limited)
            assert alive(frozen)
    finally:
        make_engine(limited.database_url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
        admin.dispose()
    assert "could not end the transactions of silent worker ghost:1" in caplog.text
    assert report.requeued == [job_id] and report.ended_transactions == {}
