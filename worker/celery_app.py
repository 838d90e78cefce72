"""`celery -A worker.celery_app worker -Q ortune.jobs --pool solo` starts a worker on this app.

Each worker process also runs the sweep (worker/sweep.py) in a thread while it is up.
"""

import functools
from typing import Any

import celery.worker.consumer
from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down

from ortune.db.session import limit_postgres_sessions, worker_application_name
from ortune.queue import celery_app, declare_queues
from ortune.settings import get_settings


class Consumer(celery.worker.consumer.Consumer):
    """Celery's consumer, whose reconnects to a lost broker wait at most `broker_reconnect_max_seconds`
    between tries (kombu's `ensure_connection` takes the intervals; Celery passes none, so 2 s growing to
    30 s). What should run meanwhile is the sweep's to re-derive from the database."""

    def ensure_connected(self, conn: Any) -> Any:
        most = get_settings().broker_reconnect_max_seconds
        conn.ensure_connection = functools.partial(
            conn.ensure_connection, interval_start=0, interval_step=most / 4, interval_max=most
        )
        return super().ensure_connected(conn)


app = celery_app()
app.conf.worker_consumer = "worker.celery_app:Consumer"

import worker.tasks  # noqa: E402,F401  (registers the tasks on app)
from worker import distributed  # noqa: E402
from worker.attempt import DRAINING, WORKER  # noqa: E402
from worker.sweep import Sweeper, reap_predecessors  # noqa: E402

_sweeper: list[Sweeper] = []


@worker_init.connect
def _declare_queues(**_: Any) -> None:
    settings = get_settings()
    limit_postgres_sessions(
        settings.database_url,
        settings.session_limits("worker"),
        application_name=worker_application_name(WORKER),
    )
    # before the consumer declares them itself, which on the embedded broker dies if it loses a race
    declare_queues(settings, settings.queue, settings.node_queue)


@worker_ready.connect
def _start_sweep(**_: Any) -> None:
    distributed.register(get_settings())
    reap_predecessors(get_settings())
    sweeper = Sweeper(get_settings())
    sweeper.start()
    _sweeper.append(sweeper)


@worker_shutting_down.connect
def _drain(**_: Any) -> None:
    DRAINING.set()  # the running job checkpoints and is requeued (worker/trainer_process.py)


@worker_shutdown.connect
def _stop_sweep(**_: Any) -> None:
    for sweeper in _sweeper:
        sweeper.stop()
