"""The queue both sides share: on the embedded broker, workers that start together all come up."""

from __future__ import annotations

import multiprocessing
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest
from kombu import Connection

from ortune.queue import declare_queues
from ortune.settings import Settings
from tests.support import embedded_settings


def _declare(settings: Settings, name: str, barrier: Barrier) -> None:
    barrier.wait()  # every process reaches the fresh broker file at the same moment
    declare_queues(settings, settings.queue, f"{settings.queue}.node.{name}")


@pytest.mark.parametrize("round_", range(3))
def test_workers_declaring_queues_together_on_a_fresh_broker_all_succeed(tmp_path: Path, round_: int) -> None:
    settings = embedded_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    ctx = multiprocessing.get_context("spawn")  # separate processes: kombu's own lock is per process
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_declare, args=(settings, f"n{i}", barrier)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with Connection(settings.broker_url) as conn:  # one row per queue, none lost or doubled
        session = conn.default_channel.session
        names = sorted(q.name for q in session.query(conn.default_channel.queue_cls))
    assert names == sorted([settings.queue] + [f"{settings.queue}.node.n{i}" for i in range(4)])
