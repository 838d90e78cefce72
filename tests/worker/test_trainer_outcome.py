"""What the worker makes of a trainer's report: a finished trainer whose ONNX export failed (and said why)
ends its attempt in success with the PyTorch model; one that reported neither is not a success."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortune.db.models import Artifact, JobStatus
from ortune.db.session import session_scope
from ortune.settings import Settings
from tests.support import fake_trainer, fake_trainer_spec, stored_job
from worker.staging import store_of
from worker.trainer_process import TrainerProcess


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
@pytest.mark.parametrize(
    ("failed", "expected"), [({"onnx": "ONNX export failed: boom"}, "succeeded"), ({}, "failed")]
)
def test_a_trainer_reporting_a_failed_onnx_export_succeeds_with_its_pytorch_model(
    settings: Settings, tmp_path: Path, failed: dict[str, str], expected: str
) -> None:
    with session_scope(settings.database_url) as session:
        job = stored_job(session, status=JobStatus.running, attempt=1)
        session.expunge(job)
    model = tmp_path / "out" / "pytorch"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    spec = fake_trainer_spec(job.id, tmp_path)
    command = fake_trainer(
        tmp_path,
        [
            {"type": "artifact", "format": "pytorch", "path": str(model), "manifest": {}},
            {"type": "result", "metrics": {}, "steps": 1, "trained_tokens": 8, "onnx_max_abs_diff": None}
            | ({"failed_artifacts": failed} if failed else {}),
        ],
    )
    outcome = TrainerProcess(settings, store_of(settings), job, spec, command=command).run()
    assert outcome.status == JobStatus(expected), outcome.error
    with session_scope(settings.database_url) as session:
        stored = {a.format for a in session.query(Artifact).filter_by(job_id=job.id)}
    assert stored == {"pytorch"}
