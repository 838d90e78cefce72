"""No transaction of the worker spans a storage call. On the embedded default SQLite has one write lock for
the whole deployment: a worker that held it across a slow put (or froze there) would stall every write of
the API and of the sweep that is meant to requeue its job. On Postgres the same transaction would hold the
job's row, which the sweep's `SKIP LOCKED` passes over."""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from ortune.db.models import File, JobStatus
from ortune.db.session import make_engine, session_scope
from ortune.settings import Settings
from ortune.storage import LocalStore
from tests.support import stored_job
from trainer_core.spec import Hyperparameters, TrainingSpec
from worker import attempt
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


def fake_trainer(tmp: Path, events: list[dict[str, Any]]) -> list[str]:
    script = tmp / "trainer.py"
    script.write_text("".join(f"print({json.dumps(json.dumps(e))}, flush=True)\n" for e in events))
    return [sys.executable, str(script)]


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
    spec = TrainingSpec(
        job_id=job.id,
        task="sequence-classification",
        model="tiny-bert",
        train_file=str(tmp / "t.jsonl"),
        labels=["a", "b"],
        output_dir=str(out),
        hyperparameters=Hyperparameters().resolved(8),
    )
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
