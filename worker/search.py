"""Advance a hyperparameter search: start trials while slots are free, finish the search when all are done.

Called when a search job is created and whenever one of its trials ends. It holds the search job's row lock
for the whole step, so two workers advancing the same search at once cannot both create the same trial.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from ortune import search
from ortune.db.base import new_id, utcnow
from ortune.db.models import File, Job, JobStatus
from ortune.db.repositories import ArtifactRepository, EventRepository, JobRepository
from ortune.db.session import session_scope
from ortune.queue import enqueue_job, on_commit
from ortune.settings import Settings
from trainer_core.spec import Hyperparameters


def _trial(job: Job, metric: str) -> search.Trial:
    value = ((job.result or {}).get("metrics") or {}).get(metric)
    return search.Trial(
        job_id=job.id,
        params=dict(job.spec.get("search_params") or {}),
        status=job.status.value,
        value=float(value) if isinstance(value, int | float) else None,
    )


def _shown(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _start_trial(session: Session, settings: Settings, parent: Job, params: dict[str, Any], n: int) -> Job:
    train = session.get(File, parent.training_file_id)
    assert train is not None
    hp = Hyperparameters(**(parent.spec.get("requested_hyperparameters") or {}) | params)
    spec = {k: v for k, v in parent.spec.items() if k != "hyperparameter_search"} | {"search_params": params}
    child = Job(
        id=new_id("ftjob"),
        model=parent.model,
        task=parent.task,
        training_file_id=parent.training_file_id,
        validation_file_id=parent.validation_file_id,
        status=JobStatus.queued,
        spec=search.with_hyperparameters(spec, hp, train.row_count or 0),
        suffix=parent.suffix,
        seed=parent.seed,
        user_metadata={"ortune.search_job": parent.id, "ortune.trial": str(n)},
        priority=parent.priority,
        backend_requested=parent.backend_requested,
        parent_id=parent.id,
        tenant_id=parent.tenant_id,
    )
    JobRepository(session).add(child)
    shown = _shown(params)
    EventRepository(session).add(child.id, f"Trial {n} of search {parent.id}: {shown}")
    EventRepository(session).add(parent.id, f"Started trial {n} as {child.id}: {shown}")
    on_commit(session, lambda: enqueue_job(settings, child.id))
    return child


def _finish(
    session: Session, parent: Job, hs: search.HyperparameterSearch, trials: list[search.Trial]
) -> str:
    jobs, events = JobRepository(session), EventRepository(session)
    table = [{"job_id": t.job_id, "params": t.params, "status": t.status, hs.metric: t.value} for t in trials]
    winner = search.best(hs, trials)
    if winner is None:
        error = {"code": "all_trials_failed", "message": f"none of the {len(trials)} trials succeeded"}
        if jobs.transition(
            parent.id,
            JobStatus.failed,
            only_from=[JobStatus.running],
            finished_at=utcnow(),
            error=error,
            result={"trials": table},
        ):
            events.add(parent.id, f"The search failed: {error['message']}", level="error")
        return "failed"
    best_job = jobs.get(winner.job_id)
    assert best_job is not None
    result = {
        "best_job_id": winner.job_id,
        "best_params": winner.params,
        "metric": hs.metric,
        "direction": hs.direction,
        "best_value": winner.value,
        "trials": table,
        "metrics": (best_job.result or {}).get("metrics"),
    }
    if jobs.transition(
        parent.id,
        JobStatus.succeeded,
        only_from=[JobStatus.running],
        finished_at=utcnow(),
        result=result,
        fine_tuned_model=best_job.fine_tuned_model,
        backend_used=best_job.backend_used,
        backend_reason=best_job.backend_reason,
        trained_tokens=best_job.trained_tokens,
    ):
        ArtifactRepository(session).link(winner.job_id, parent.id)
        events.add(
            parent.id,
            f"The search has completed: best trial {winner.job_id} with {hs.metric}={winner.value:.4g} "
            f"({_shown(winner.params)})",
        )
    return "succeeded"


def advance(settings: Settings, parent_id: str) -> str:
    with session_scope(settings.database_url) as session:
        jobs = JobRepository(session)
        parent = jobs.get(parent_id, for_update=True)
        if parent is None or parent.status.terminal or parent.status == JobStatus.paused:
            return f"nothing to do ({parent.status if parent else 'no such job'})"
        hs = search.HyperparameterSearch(**parent.spec["hyperparameter_search"])
        if parent.status == JobStatus.queued:
            jobs.transition(parent.id, JobStatus.running, only_from=[JobStatus.queued], started_at=utcnow())
            EventRepository(session).add(
                parent.id,
                f"Hyperparameter search: {hs.n_trials} trials, {hs.direction} {hs.metric}, "
                f"{hs.parallelism} at a time",
            )
        children = jobs.children(parent.id)
        trials = [_trial(c, hs.metric) for c in children]
        active = sum(1 for c in children if not c.status.terminal)
        started = 0
        while len(children) + started < hs.n_trials and active + started < hs.parallelism:
            params = search.suggest(hs, parent.seed, trials)
            _start_trial(session, settings, parent, params, len(children) + started + 1)
            started += 1
        jobs.update(parent.id, step=sum(1 for c in children if c.status.terminal), total_steps=hs.n_trials)
        if started or active:
            return f"{active + started} trial(s) running, {len(children) + started}/{hs.n_trials} started"
        return _finish(session, parent, hs, trials)
