"""Multi-process jobs on real processes: DDP and ZeRO-1 (with and without ORT) across two worker processes
registered as two nodes, through torchrun with gloo; a failed rank, a lost rank-0 worker, pause and resume."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.models import Checkpoint
from ortune.db.session import session_scope
from ortune.settings import Settings
from tests.support import (
    ADMIN_KEY,
    TERMINAL,
    embedded_settings,
    events,
    rows,
    wait_event,
    wait_for,
    wait_until,
    worker_process,
    write_jsonl,
)


def node_worker(settings: Settings, tmp: Path, name: str) -> AbstractContextManager[subprocess.Popen[bytes]]:
    node = settings.model_copy(update={"node_name": name, "node_devices": 1})
    return worker_process(node, name, tmp / f"{name}.log")


@contextmanager
def two_nodes(
    settings: Settings, tmp: Path, node_b: Settings | None = None
) -> Iterator[tuple[Client, list[subprocess.Popen[bytes]]]]:
    """The API and two worker processes registered as nodes node-a and node-b, one device each."""
    with embedded.start(settings, worker=False, log_dir=tmp / "logs"), ExitStack() as stack:
        workers = [
            stack.enter_context(node_worker(settings, tmp, "node-a")),
            stack.enter_context(node_worker(node_b or settings, tmp, "node-b")),
        ]
        client = Client(settings.api_url, api_key=ADMIN_KEY)  # /v1/nodes is for platform keys
        wait_nodes(client, 2)
        yield client, workers


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Settings]]:
    """The API and nodes a and b on the embedded default, shared by the tests here that need no settings or
    processes of their own (each ends with its job done and both devices free): six start-ups fewer."""
    tmp = tmp_path_factory.mktemp("two-nodes")
    s = embedded_settings(tmp, sweep_seconds=0.5)
    with two_nodes(s, tmp) as (client, _):
        yield client, s


def wait_nodes(client: Client, n: int) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if len([x for x in client.get("/v1/nodes")["data"] if x["alive"]]) >= n:
            return
        time.sleep(0.3)
    raise AssertionError("the worker nodes did not register")


def wait_released(client: Client) -> None:
    """Every node frees its devices when its ranks exit (a follower within a second of the job's end)."""
    deadline = time.monotonic() + 30
    while any(n["free_devices"] != n["devices"] for n in client.get("/v1/nodes")["data"]):
        assert time.monotonic() < deadline, client.get("/v1/nodes")["data"]
        time.sleep(0.2)


def ranks_of(job_id: str, attempt: int, node_rank: int) -> list[psutil.Process]:
    """The rank processes (not their torchrun agent) one node runs for one attempt of a job."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if (
            "trainer_core.engine.launch" in cmdline
            and f"{job_id}/attempt-{attempt}/node-{node_rank}/" in cmdline
            and "torch.distributed.run" not in cmdline
        ):
            found.append(p)
    assert found, f"no rank process found on node rank {node_rank}"
    return found


def losses(client: Client, job_id: str) -> list[float]:
    return client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", name="train_loss")["data"]["train_loss"][
        "values"
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["production"], indirect=True)  # the other two-node tests run embedded
def test_ddp_across_two_nodes_matches_one_process(settings: Settings, tmp_path: Path) -> None:
    s = settings.model_copy(update={"sweep_seconds": 0.5})
    with two_nodes(s, tmp_path) as (client, _):
        train = client.upload(write_jsonl(tmp_path / "train.jsonl", rows(8)))
        spec = {
            "model": "tiny-bert",
            "training_file": train["id"],
            "backend": "torch",
            "seed": 3,
            "hyperparameters": {
                "max_steps": 6,
                "batch_size": 8,
                "learning_rate": 1e-3,
                "max_seq_length": 32,
            },
        }
        ddp = client.create_job(**spec, distributed={"nodes": 2, "procs_per_node": 1})
        done = wait_for(client, ddp["id"], TERMINAL)
        assert done["status"] == "succeeded", done["error"]
        said = [e["message"] for e in events(client, ddp["id"])]
        placed = next(m for m in said if m.startswith("Attempt 1 placed on"))
        assert "node-a" in placed and "node-b" in placed and "2 x 1 process(es), ddp" in placed
        wait_released(client)

        single = client.create_job(**spec)  # the same global batch in one process
        one = wait_for(client, single["id"], TERMINAL)
        assert one["status"] == "succeeded", one["error"]
        a, b = losses(client, ddp["id"]), losses(client, single["id"])
        assert len(a) == len(b) == 6
        # each step sees all 8 rows in both (4 per rank under DDP, gradients averaged); only dropout
        # masks differ, so the curves agree closely rather than exactly
        for x, y in zip(a, b, strict=True):
            assert abs(x - y) <= 0.05 * max(abs(y), 1e-3), (a, b)


@pytest.mark.e2e
@pytest.mark.parametrize(("strategy", "backend"), [("zero1", "torch"), ("ddp", "ort"), ("zero1", "ort")])
def test_zero1_and_ort_inside_across_two_nodes(
    shared: tuple[Client, Settings], tmp_path: Path, strategy: str, backend: str
) -> None:
    client, _ = shared
    train = client.upload(write_jsonl(tmp_path / "train.jsonl", rows(16)))
    job = client.create_job(
        model="tiny-bert",
        training_file=train["id"],
        backend=backend,
        seed=4,
        checkpoint_every_steps=3,
        hyperparameters={
            "max_steps": 6,
            "batch_size": 8,
            "learning_rate": 1e-3,
            "max_seq_length": 32,
        },
        distributed={"nodes": 2, "strategy": strategy},
    )
    done = wait_for(client, job["id"], TERMINAL, timeout=400)
    assert done["status"] == "succeeded", done["error"]
    assert done["backend_used"] == backend
    metrics = done["result"]["metrics"]
    if backend == "ort":
        assert metrics["ort_training_graph_nodes"] > 0  # ORT really trained, DDP or DeepSpeed around it
    # the ranks compared parameters after training: the gradients really were reduced across nodes
    # (before DDP/DeepSpeed wrapped ORTModule itself, each ORT rank trained alone and this caught it)
    assert metrics["replicas_max_rel_diff"] == 0.0
    steps = [c["step_number"] for c in client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints")["data"]]
    assert steps == [6, 3]
    assert len(losses(client, job["id"])) == 6
    wait_released(client)  # for the next test on the shared nodes


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_killing_one_rank_fails_the_attempt_with_its_error(settings: Settings, tmp_path: Path) -> None:
    s = settings.model_copy(update={"sweep_seconds": 0.5, "distributed_timeout_seconds": 30})
    with two_nodes(s, tmp_path) as (client, _):
        train = client.upload(write_jsonl(tmp_path / "train.jsonl", rows(64)))
        job = client.create_job(
            model="tiny-bert",
            training_file=train["id"],
            backend="torch",
            hyperparameters={"max_steps": 5000, "batch_size": 8, "max_seq_length": 32},
            distributed={"nodes": 2},
        )
        deadline = time.monotonic() + 120
        while client.job(job["id"])["progress"]["step"] < 3:
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.3)
        victims = ranks_of(job["id"], attempt=1, node_rank=1)
        for p in victims:
            p.send_signal(signal.SIGKILL)
        done = wait_for(client, job["id"], TERMINAL, timeout=180)
        assert done["status"] == "failed"
        assert done["error"]["code"] == "rank_failed", done["error"]
        assert "node rank 1 on node-" in done["error"]["message"]
        wait_released(client)
        left = [p for p in psutil.process_iter(["cmdline"]) if job["id"] in " ".join(p.info["cmdline"] or [])]
        assert not left, [p.info["cmdline"] for p in left]  # no orphan on either node


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_zero1_job_resumes_on_all_nodes_after_its_rank0_worker_dies(
    settings: Settings, tmp_path: Path
) -> None:
    s = settings.model_copy(
        update={"sweep_seconds": 0.5, "heartbeat_seconds": 0.5, "heartbeat_timeout_seconds": 10.0}
    )
    with two_nodes(s, tmp_path) as (client, workers):
        train = client.upload(write_jsonl(tmp_path / "train.jsonl", rows(32)))
        total, every = 80, 20
        job = client.create_job(
            model="tiny-bert",
            training_file=train["id"],
            backend="torch",
            seed=6,
            checkpoint_every_steps=every,
            hyperparameters={"max_steps": total, "batch_size": 8, "max_seq_length": 32},
            distributed={"nodes": 2, "strategy": "zero1"},
        )

        def checkpoint_steps(complete: bool) -> list[int]:
            """Steps rank 0 recorded; with `complete`, only those node-b's part was added to."""
            with session_scope(s.database_url) as session:
                found = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job["id"])).all()
                return sorted(c.step for c in found if not complete or len(c.parts or []) == 1)

        def running_first_attempt() -> bool:
            now = client.job(job["id"])
            assert (now["status"], now["attempt"]) == ("running", 1), now  # no lost attempt before the kill
            return True

        wait_for(client, job["id"], {"running"}, timeout=60)  # the scheduler places it on its next round
        wait_until(
            "rank 0 recorded a checkpoint",
            lambda: running_first_attempt() and checkpoint_steps(complete=False),
        )
        # node-b's ranks stopped hold every rank at its next collective, so the kill lands mid-training
        # however far uploads run behind the steps (CI once saw the last step checkpointed first)
        frozen = ranks_of(job["id"], attempt=1, node_rank=1)
        for p in frozen:
            p.send_signal(signal.SIGSTOP)
        # node-b's worker still adds its part: a checkpoint that both nodes stored
        wait_until(
            "a complete checkpoint", lambda: running_first_attempt() and checkpoint_steps(complete=True)
        )
        before = checkpoint_steps(complete=True)
        workers[0].kill()  # node-a held rank 0: its torchrun and ranks die with it
        workers[0].wait()
        for p in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)
        with node_worker(s, tmp_path, "node-a"):  # the node comes back
            done = wait_for(client, job["id"], TERMINAL, timeout=400)
            assert done["status"] == "succeeded", done["error"]
            assert done["attempt"] == 2
            log = events(client, job["id"])
            resumed = next(e for e in log if e["message"].startswith("Resuming from the checkpoint"))
            # the newest checkpoint complete when the new attempt staged: the last seen before the kill, or
            # one completed between that look and the kill (retention may have deleted it since)
            step = resumed["data"]["resumed_from_step"]
            assert step >= max(before) and step % every == 0 and step < total, (step, before)
            series = client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics", name="train_loss")["data"]
            assert series["train_loss"]["steps"] == list(range(1, total + 1))
            wait_released(client)


@pytest.mark.e2e
def test_pause_and_resume_a_zero1_job_across_two_nodes(
    shared: tuple[Client, Settings], tmp_path: Path
) -> None:
    client, s = shared
    train = client.upload(write_jsonl(tmp_path / "train.jsonl", rows(32)))
    total = 150  # enough that the pause at step 5 lands long before the end
    job = client.create_job(
        model="tiny-bert",
        training_file=train["id"],
        backend="torch",
        seed=8,
        checkpoint_every_steps=1000,  # no scheduled checkpoint: the pause saves the only one
        hyperparameters={"max_steps": total, "batch_size": 8, "max_seq_length": 32},
        distributed={"nodes": 2, "strategy": "zero1"},
    )
    deadline = time.monotonic() + 300
    while client.job(job["id"])["progress"]["step"] < 5:
        assert time.monotonic() < deadline, client.job(job["id"])
        time.sleep(0.2)
    paused = client.post(f"/v1/fine_tuning/jobs/{job['id']}/pause")
    assert paused["status"] == "paused"
    log = wait_event(client, job["id"], "Paused; the worker is free", timeout=120)
    stopped = next(e for e in log if e["message"].startswith("Training stopped on request at step"))
    step = stopped["data"]["step"]
    assert 5 <= step < total
    wait_released(client)  # both nodes free while paused: node-b lets go once its part is stored
    with session_scope(s.database_url) as session:  # rank 0's checkpoint, and node-b's ZeRO shard
        ckpt = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job["id"])).one()
    assert ckpt.step == step and len(ckpt.parts or []) == 1, (ckpt.step, ckpt.parts)
    assert client.job(job["id"])["status"] == "paused"

    resumed = client.post(f"/v1/fine_tuning/jobs/{job['id']}/resume")
    assert resumed["status"] == "queued"
    done = wait_for(client, job["id"], TERMINAL, timeout=400)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempt"] == 2
    assert done["result"]["metrics"]["replicas_max_rel_diff"] == 0.0
    log = events(client, job["id"])
    again = next(e for e in log if e["message"].startswith("Resuming from the checkpoint"))
    assert again["data"]["resumed_from_step"] == step
    series = client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics", name="train_loss")["data"]
    assert series["train_loss"]["steps"] == list(range(1, total + 1))  # nothing lost, nothing redone
    wait_released(client)


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_node_that_cannot_stage_fails_the_attempt_at_once(settings: Settings, tmp_path: Path) -> None:
    s = settings.model_copy(update={"sweep_seconds": 0.5})
    broken = s.model_copy(update={"work_dir": Path("/dev/null/work")})  # node-b cannot make its folder
    with two_nodes(s, tmp_path, node_b=broken) as (client, _):
        train = client.upload(write_jsonl(tmp_path / "train.jsonl", rows(16)))
        job = client.create_job(
            model="tiny-bert",
            training_file=train["id"],
            backend="torch",
            hyperparameters={"max_steps": 5, "batch_size": 8, "max_seq_length": 32},
            distributed={"nodes": 2},
        )
        done = wait_for(client, job["id"], TERMINAL, timeout=120)  # not torchrun's rendezvous timeout
        assert done["status"] == "failed"
        assert done["error"]["code"] == "rank_failed"
        assert "node rank 1 on node-b" in done["error"]["message"]
        assert "staging failed" in done["error"]["message"]
        wait_released(client)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("kind", "strategy", "backend"),
    [("image", "ddp", "torch"), ("audio", "zero1", "ort"), ("speech", "ddp", "torch")],
)
def test_image_audio_and_speech_jobs_across_two_nodes(
    shared: tuple[Client, Settings], tmp_path: Path, kind: str, strategy: str, backend: str
) -> None:
    """Media stores reach the other node like token stores, and the classifiers and the speech recognizer
    train under DDP and ZeRO-1 (ORT inside) with the replicas equal at the end; audio batches are padded
    clips with their masks, speech batches padded transcripts with the decoder's."""
    from ortune import media_demo

    make = {"image": media_demo.image_rows, "audio": media_demo.audio_rows, "speech": media_demo.melody_rows}
    column = "transcription" if kind == "speech" else "label"
    client, _ = shared
    rows = make[kind](48, 1)
    train = client.upload(
        media_demo.write_archive(tmp_path / "t.zip", rows, layout="metadata", column=column)
    )
    job = client.create_job(
        model={"image": "tiny-vit", "audio": "tiny-audio", "speech": "tiny-whisper"}[kind],
        training_file=train["id"],
        backend=backend,
        precision="fp32",
        seed=4,
        hyperparameters={"max_steps": 4, "batch_size": 8, "learning_rate": 1e-3},
        distributed={"nodes": 2, "strategy": strategy},
    )
    done = wait_for(client, job["id"], TERMINAL, timeout=400)
    assert done["status"] == "succeeded", done["error"]
    task = "automatic-speech-recognition" if kind == "speech" else f"{kind}-classification"
    assert done["backend_used"] == backend and done["task"] == task
    metrics = done["result"]["metrics"]
    assert metrics["replicas_max_rel_diff"] == 0.0
    if backend == "ort":
        assert metrics["ort_training_graph_nodes"] > 0
    said = [e["message"] for e in events(client, job["id"])]
    assert any("node-a" in m and "node-b" in m and strategy in m for m in said if m.startswith("Attempt 1"))
    assert len(losses(client, job["id"])) == 4
    wait_released(client)
