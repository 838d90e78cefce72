"""The `ortune` CLI as a user runs it: a subprocess against the real service (embedded default)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.migrate import upgrade
from tests.support import DEMO, ROOT, embedded_settings

pytestmark = pytest.mark.e2e


def ortune(*args: str, api: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ortune.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ORTUNE_API_URL": api, "COLUMNS": "160", "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture
def api(tmp_path: Path) -> Iterator[str]:
    settings = embedded_settings(tmp_path)
    upgrade(settings.database_url)
    with embedded.start(settings, log_dir=tmp_path / "logs"):
        yield settings.api_url


def test_submit_follow_jobs_download(api: str, tmp_path: Path) -> None:
    shutil.copy(DEMO / "sentiment_train.jsonl", tmp_path / "train.jsonl")
    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(
            {
                "model": "tiny-bert",
                "training_file": "train.jsonl",  # a local path, uploaded first
                "backend": "torch",
                "hyperparameters": {"max_steps": 8, "batch_size": 8, "max_seq_length": 32},
            }
        )
    )
    submitted = ortune("submit", "job.yaml", api=api, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.strip().splitlines()[-1]
    assert job_id.startswith("ftjob-")

    followed = ortune("follow", job_id, "--interval", "0.3", api=api, cwd=tmp_path)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "succeeded" in followed.stdout and "backend torch" in followed.stdout
    assert "8/8" in followed.stdout and "loss 0." in followed.stdout

    listed = ortune("jobs", api=api, cwd=tmp_path)
    assert job_id in listed.stdout and "succeeded" in listed.stdout

    got = ortune("download", job_id, "--format", "onnx", "-o", "model.tar", api=api, cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    digest = hashlib.sha256((tmp_path / "model.tar").read_bytes()).hexdigest()
    assert f"sha256 {digest}" in got.stdout and "verified" in got.stdout
    onnx = next(
        a for a in Client(api).get(f"/v1/fine_tuning/jobs/{job_id}/artifacts") if a["format"] == "onnx"
    )
    assert onnx["sha256"] == digest


def test_cli_errors_name_what_is_wrong(api: str, tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "fine", "label": "pos"}\n{"text": 3}\n')
    (tmp_path / "job.yaml").write_text("model: tiny-bert\ntraining_file: bad.jsonl\n")
    bad_rows = ortune("submit", "job.yaml", api=api, cwd=tmp_path)
    assert bad_rows.returncode == 1 and "line 2" in bad_rows.stdout
    (tmp_path / "typo.yaml").write_text("model: tiny-bert\ntraining_file: file-nope\nhyperparameter: {}\n")
    typo = ortune("submit", "typo.yaml", api=api, cwd=tmp_path)
    assert typo.returncode == 1 and "hyperparameter" in typo.stdout
    (tmp_path / "list.yaml").write_text("- model\n")
    not_a_mapping = ortune("submit", "list.yaml", api=api, cwd=tmp_path)
    assert not_a_mapping.returncode == 2 and "mapping" in not_a_mapping.stdout + not_a_mapping.stderr
    missing = ortune("download", "ftjob-nope", api=api, cwd=tmp_path)
    assert missing.returncode != 0 and "ftjob-nope" in missing.stdout + missing.stderr
    assert not (tmp_path / "ftjob-nope-pytorch.tar").exists()


def test_an_unreachable_api_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    result = ortune("jobs", api="http://127.0.0.1:9", cwd=tmp_path)
    assert result.returncode == 1
    assert "cannot reach the ortune API" in result.stdout and "127.0.0.1:9" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_up_names_the_process_that_exited(tmp_path: Path) -> None:
    """`ortune up` stops when one of its processes dies, and says which one, with its code and its log."""
    import signal

    import psutil

    from tests.support import wait_until

    settings = embedded_settings(tmp_path)
    env = {**os.environ, **embedded.child_env(settings), "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(
        [sys.executable, "-m", "ortune.cli", "up"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert up.stdout is not None
        assert "ortune is up" in up.stdout.readline()

        def inference() -> psutil.Process | None:
            found = [p for p in psutil.Process(up.pid).children() if "serve.app:app" in " ".join(p.cmdline())]
            return found[0] if found else None

        killed = wait_until("the inference process", inference)
        assert killed is not None
        killed.send_signal(signal.SIGKILL)
        out, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 1
    said = " ".join(out.split())
    assert "stopping: the inference (ortune serve) process exited with code -9" in said, out
    assert "serve.log" in said
