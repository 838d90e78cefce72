"""What a trainer process may see of the worker's environment."""

from __future__ import annotations

import pytest

from worker.staging import trainer_env


def test_the_trainer_gets_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {
        "ORTUNE_DATABASE_URL": "postgresql+psycopg://ortune:s3cret@db/ortune",
        "ORTUNE_ADMIN_API_KEY": "admin",
        "ORTUNE_S3_SECRET_KEY": "secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "PGPASSWORD": "s3cret",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    env = trainer_env()
    assert not secrets.keys() & env.keys()
    assert "s3cret" not in "".join(env.values())
    assert env["PATH"] and env["HF_HUB_OFFLINE"] == "1"  # what it needs is kept


def test_ranks_share_the_cores_and_never_exceed_the_workers_own_thread_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank gets cores / ranks threads, capped by the OMP_NUM_THREADS the worker was started with."""
    from worker import distributed

    monkeypatch.setattr(distributed.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert distributed._threads_per_rank(4) == 4
    assert distributed._threads_per_rank(32) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert distributed._threads_per_rank(4) == 2
    assert distributed._threads_per_rank(1) == 2
