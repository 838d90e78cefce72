"""The scheduler of multi-process jobs: placement by priority and age, whole gangs, no device given twice
under concurrent dispatchers, and refusing at submit what can never fit."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.main import create_app
from ortune.db.models import Assignment, Job, JobStatus
from ortune.db.repositories import JobRepository, NodeRepository
from ortune.db.session import advisory_xact_lock, session_scope
from ortune.settings import Settings
from tests.support import ADMIN_KEY, DEMO, job_spec, stored_job, upload
from trainer_core.spec import Distributed
from worker import scheduler


def add_nodes(settings: Settings, **devices: int) -> None:
    with session_scope(settings.database_url) as session:
        for name, count in devices.items():
            NodeRepository(session).register(
                name, kind="cpu", devices=count, address="127.0.0.1", queue=f"q.{name}", worker=f"{name}:1"
            )


def add_jobs(settings: Settings, shapes: list[tuple[int, int, int]]) -> list[str]:
    """Queued jobs of (nodes, procs_per_node, priority), oldest first."""
    ids = []
    with session_scope(settings.database_url) as session:
        for nodes, procs, priority in shapes:
            spec = job_spec(distributed=Distributed(nodes=nodes, procs_per_node=procs))
            ids.append(stored_job(session, spec=spec, priority=priority).id)
            time.sleep(0.002)  # distinct created_at, so age orders them
    return ids


def live(settings: Settings) -> list[Assignment]:
    with session_scope(settings.database_url) as session:
        return list(session.scalars(select(Assignment).where(Assignment.released_at.is_(None))))


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_concurrent_dispatchers_never_double_book_and_keep_priority(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(scheduler, "send_rank", lambda _s, _q, task: sent.append(task))
    add_nodes(settings, a=2, b=2, c=2)
    shapes = [(2, 1, 0), (1, 2, 5), (3, 1, 1), (2, 2, 9), (1, 1, 0), (3, 2, 3), (2, 1, 7), (1, 2, 2)]
    ids = add_jobs(settings, shapes)
    barrier = threading.Barrier(6)

    def dispatcher() -> None:
        barrier.wait()
        for _ in range(5):
            scheduler.dispatch(settings)

    threads = [threading.Thread(target=dispatcher) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    held = live(settings)
    assert len({(a.node_name, a.device) for a in held}) == len(held)  # no device given twice
    assert len(held) <= 6
    with session_scope(settings.database_url) as session:
        jobs = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(ids)))}
    started = [i for i in ids if jobs[i].status == JobStatus.running]
    for job_id in started:  # gang: every process of a started job placed, on distinct nodes
        mine = [a for a in held if a.job_id == job_id]
        nodes, procs, _ = shapes[ids.index(job_id)]
        assert len(mine) == nodes * procs
        per_node = Counter(a.node_name for a in mine)
        assert len(per_node) == nodes and set(per_node.values()) == {procs}
        assert {t["node_rank"] for t in sent if t["job_id"] == job_id} == set(range(nodes))
    # strict priority then age: the started jobs are a prefix of that order
    order = sorted(ids, key=lambda i: (-jobs[i].priority, jobs[i].created_at))
    assert started and set(started) == set(order[: len(started)])
    assert jobs[order[0]].status == JobStatus.running  # (2, 2, 9) went first

    # free everything: the next in line start, still without double booking
    with session_scope(settings.database_url) as session:
        for job_id in started:
            NodeRepository(session).release_attempt(job_id, 1)
    scheduler.dispatch(settings)
    again = live(settings)
    assert again and len({(a.node_name, a.device) for a in again}) == len(again)
    assert not {a.job_id for a in again} & set(started)


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_a_dispatch_round_waits_for_the_one_in_progress(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the test above can only hit by chance, made certain: a round decides on a view taken after
    the round before it committed, never beside it."""
    monkeypatch.setattr(scheduler, "send_rank", lambda *_: None)
    add_nodes(settings, a=1, b=1)
    (job_id,) = add_jobs(settings, [(2, 1, 0)])
    result: list[list[str]] = []
    with session_scope(settings.database_url) as session:  # another dispatcher mid-round
        advisory_xact_lock(session, "ortune.dispatch")
        second = threading.Thread(target=lambda: result.append(scheduler.dispatch(settings)))
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive() and live(settings) == []  # it waits rather than deciding beside us
    second.join(timeout=30)
    assert result == [[job_id]]


def test_a_gang_waits_whole_until_its_nodes_are_free(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler, "send_rank", lambda *_: None)
    add_nodes(settings, a=1)
    (job,) = add_jobs(settings, [(2, 1, 0)])
    assert scheduler.dispatch(settings) == []
    assert live(settings) == []  # nothing started partially
    add_nodes(settings, b=1)
    assert scheduler.dispatch(settings) == [job]
    assert sorted((a.node_name, a.node_rank) for a in live(settings)) == [("a", 0), ("b", 1)]


def test_a_paused_multi_process_job_resumes_only_once_every_node_let_go(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler, "send_rank", lambda *_: None)
    add_nodes(settings, a=1, b=1)
    (job_id,) = add_jobs(settings, [(2, 1, 0)])
    assert scheduler.dispatch(settings) == [job_id]
    with session_scope(settings.database_url) as session:  # rank 0 stored the checkpoint and let go
        JobRepository(session).update(job_id, status=JobStatus.paused, worker=None)
        NodeRepository(session).release(job_id, 1, "a", exit_code=0)
    with TestClient(create_app(settings)) as client:
        early = client.post(f"/v1/fine_tuning/jobs/{job_id}/resume")
        assert early.status_code == 409, early.text
        assert early.headers["Retry-After"] == "2"
        error = early.json()["error"]
        assert error["code"] == "job_pausing" and error["param"] == "fine_tuning_job_id"
        assert f"job {job_id} is still stopping on node(s) b;" in error["message"]
        with session_scope(settings.database_url) as session:  # node b stored its part
            NodeRepository(session).release(job_id, 1, "b", exit_code=0)
        resumed = client.post(f"/v1/fine_tuning/jobs/{job_id}/resume")
        assert resumed.status_code == 200 and resumed.json()["status"] == "queued", resumed.text
    assert scheduler.dispatch(settings) == [job_id]  # back to the scheduler, as attempt 2 on both nodes
    assert sorted((a.node_name, a.attempt) for a in live(settings)) == [("a", 2), ("b", 2)]


def test_a_job_that_can_never_fit_is_refused_at_submit(settings: Settings) -> None:
    add_nodes(settings, a=2)
    with TestClient(create_app(settings)) as client:
        file = upload(client, DEMO / "sentiment_train.jsonl").json()
        body = {"model": "tiny-bert", "training_file": file["id"], "hyperparameters": {"batch_size": 8}}
        refused = client.post("/v1/fine_tuning/jobs", json=body | {"distributed": {"nodes": 2}})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "cannot_fit" and error["param"] == "distributed"
        assert "needs 2 node(s) with 1 device(s) each; 1 node(s) have that many" in error["message"]
        assert "(1 registered, the largest with 2)" in error["message"] and "a (" not in error["message"]
        odd = client.post(
            "/v1/fine_tuning/jobs",
            json=body | {"distributed": {"procs_per_node": 2}, "hyperparameters": {"batch_size": 7}},
        )
        assert odd.status_code == 400 and odd.json()["error"]["param"] == "hyperparameters.batch_size"
        fits = client.post("/v1/fine_tuning/jobs", json=body | {"distributed": {"procs_per_node": 2}})
        assert fits.status_code == 200 and fits.json()["distributed"]["procs_per_node"] == 2
        nodes = client.get("/v1/nodes", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
        assert [(n["id"], n["devices"], n["free_devices"]) for n in nodes] == [("a", 2, 2)]


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_single_process_trainer_sees_only_the_gpu_it_was_given(settings: Settings) -> None:
    """Without CUDA_VISIBLE_DEVICES a one-process trainer on a 2-GPU node saw both, and the Trainer wrapped it
    in DataParallel, doubling its batch. (No GPU here: the environment the trainer would get is checked.)"""
    from worker import attempt

    with session_scope(settings.database_url) as session:
        NodeRepository(session).register(
            settings.node_name, kind="cuda", devices=2, address="127.0.0.1", queue="q", worker="w:1"
        )
    first, second, third = add_jobs(settings, [(1, 1, 0)] * 3)
    claims = [attempt.claim(settings, job_id) for job_id in (first, second)]
    assert [c.device_env if c else None for c in claims] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    assert attempt.claim(settings, third) is None  # both GPUs held: it waits
    assert attempt.device_env("cpu", [0]) == {"CUDA_VISIBLE_DEVICES": ""}  # a CPU node's trainer sees none


@pytest.mark.parametrize("config", ["embedded", "production"], indirect=True)
def test_the_sweep_frees_devices_of_attempts_that_are_over(settings: Settings) -> None:
    from worker.sweep import sweep

    add_nodes(settings, a=3)
    finished, moved_on, running = add_jobs(settings, [(1, 1, 0)] * 3)
    with session_scope(settings.database_url) as session:
        for device, job_id in enumerate((finished, moved_on, running)):
            session.add(Assignment(job_id=job_id, attempt=1, node_name="a", node_rank=0, device=device))
        for job_id, status, attempt in (
            (finished, JobStatus.succeeded, 1),
            (moved_on, JobStatus.queued, 2),  # its attempt 1 was lost without releasing its device
            (running, JobStatus.running, 1),
        ):
            job = session.get(Job, job_id)
            assert job is not None
            job.status, job.attempt = status, attempt
    assert sweep(settings).released == 2
    assert [(a.job_id, a.device) for a in live(settings)] == [(running, 2)]


def test_rendezvous_ports_stay_below_the_ephemeral_range_and_apart_within_a_round(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI once failed a two-node job with EADDRINUSE: its drawn port (33944) was in Linux's ephemeral range,
    where any outgoing connection on rank 0's host may hold it."""
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(scheduler, "send_rank", lambda _s, _q, task: sent.append(task))
    settings = settings.model_copy(update={"rendezvous_port_min": 20_000, "rendezvous_port_max": 20_003})
    add_nodes(settings, a=4, b=4)
    ids = add_jobs(settings, [(2, 1, 0)] * 4)
    assert sorted(scheduler.dispatch(settings)) == sorted(ids)
    by_job: dict[str, set[int]] = {}
    for task in sent:
        by_job.setdefault(task["job_id"], set()).add(task["master_port"])
    assert all(len(ports) == 1 for ports in by_job.values())  # every rank of a gang meets at one port
    assert sorted(p for (p,) in by_job.values()) == [20_000, 20_001, 20_002, 20_003]  # four gangs, four ports
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(scheduler.rendezvous_port(Settings(), set()) < low for _ in range(500))


def test_a_rendezvous_range_upside_down_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ORTUNE_RENDEZVOUS_PORT_MIN \\(30000\\) is above"):
        Settings(rendezvous_port_min=30_000, rendezvous_port_max=20_000)
