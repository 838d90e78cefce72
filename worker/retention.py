"""Checkpoint retention: a job keeps its last `keep_checkpoints` checkpoints and its best one by the job's
metric (eval_loss with a validation file, else train_loss, read at the checkpoint's step); the others are
deleted from storage and from the job's list, and an event says which."""

from __future__ import annotations

import contextlib

from ortune.db.models import Job
from ortune.db.repositories import CheckpointRepository, EventRepository, MetricRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import ObjectNotFound, ObjectStore


def apply(settings: Settings, store: ObjectStore, job: Job) -> list[int]:
    """Delete what the job no longer keeps; the steps deleted."""
    keep_last = job.spec.keep_checkpoints
    metric = "eval_loss" if job.validation_file_id else "train_loss"
    with session_scope(settings.database_url) as session:
        checkpoints = list(CheckpointRepository(session).newest_first(job.id))
        if len(checkpoints) <= keep_last:
            return []
        values = dict(MetricRepository(session).series(job.id, [metric]).get(metric, []))
        scored = [c for c in checkpoints if c.step in values]
        best = min(scored, key=lambda c: values[c.step]) if scored else None
        kept = {c.step for c in checkpoints[:keep_last]} | ({best.step} if best else set())
        gone = [c for c in checkpoints if c.step not in kept]
        keys = [key for c in gone for key in (c.object_key, *(c.parts or []))]
        for c in gone:
            CheckpointRepository(session).delete(c)
        steps = sorted(c.step for c in gone)
        why = f"the best, step {best.step} with {metric} {values[best.step]:.4g}" if best else "no best yet"
        EventRepository(session).add(
            job.id,
            f"Deleted the checkpoint(s) at step(s) {', '.join(map(str, steps))}: keeping the last "
            f"{keep_last} "
            f"and {why}",
            data={"deleted_steps": steps, "kept_steps": sorted(kept), "metric": metric},
        )
    for key in keys:  # after the rows are gone: a resume never picks a checkpoint whose bytes are going
        with contextlib.suppress(ObjectNotFound):
            store.delete(key)
    return steps
