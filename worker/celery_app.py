"""`celery -A worker.celery_app worker -Q ortune.jobs --pool solo` starts a worker on this app."""

from ortune.queue import celery_app

app = celery_app()

import worker.tasks  # noqa: E402,F401  (registers the tasks on app)
