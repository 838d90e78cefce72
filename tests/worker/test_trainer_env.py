"""What a trainer process may see of the worker's environment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ortune.settings import Settings
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


def test_ranks_build_torch_extensions_once_per_node_not_once_per_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's shared-memory collective took ~35 s to compile for every ZeRO job whose node had a fresh
    work directory (every test, every new node folder): the build now lives in a per-node cache."""
    from worker import distributed

    task = {"devices": [0], "nproc_per_node": 1}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    one, two = (Settings(data_dir=tmp_path / name) for name in ("one", "two"))
    built = {distributed._env(s, task)["TORCH_EXTENSIONS_DIR"] for s in (one, two)}
    (where,) = built  # two nodes' work directories, one build
    assert Path(where).parent == tmp_path / "xdg" / "ortune" / "torch-extensions"
    assert Path(where).name == f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    monkeypatch.setenv("ORTUNE_TORCH_EXTENSIONS_DIR", str(tmp_path / "elsewhere"))
    assert Path(distributed._env(Settings(), task)["TORCH_EXTENSIONS_DIR"]).parent == tmp_path / "elsewhere"
