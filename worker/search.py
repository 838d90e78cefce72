"""Hyperparameter search on the job machinery: each trial is a child job, Optuna proposes the next one.

The study is never kept anywhere but in the jobs table: whenever a search job is created or one of its
trials ends, `advance` rebuilds an in-memory Optuna study from the trials that finished (their parameters and
metric), asks it for the next parameters and creates the next child job, which goes through the same queue
as any job; once every trial has ended, the search ends with the best one's model. A lost worker or a
restarted broker therefore loses no search state. `advance` holds the search job's row lock for the whole
step, so two workers advancing the same search at once cannot both create the same trial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from ortune import lifecycle
from ortune.db.base import new_id
from ortune.db.models import Job, JobStatus
from ortune.db.repositories import (
    ArtifactRepository,
    EventRepository,
    FileRepository,
    JobRepository,
    TenantRepository,
)
from ortune.db.session import session_scope
from ortune.queue import enqueue_job, on_commit
from ortune.search_space import HyperparameterSearch
from ortune.settings import Settings


@dataclass(frozen=True)
class Trial:
    """A child job as the study sees it: the parameters it ran with, and its metric once it succeeded."""

    job_id: str
    params: dict[str, Any]
    status: str
    value: float | None


def _distributions(search: HyperparameterSearch) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for name, dim in search.space.items():
        if dim.type == "categorical":
            out[name] = CategoricalDistribution(dim.choices or [])
        elif dim.type == "int":
            out[name] = IntDistribution(int(dim.low or 0), int(dim.high or 0), log=dim.log)
        else:
            out[name] = FloatDistribution(float(dim.low or 0), float(dim.high or 0), log=dim.log)
    return out


def suggest(search: HyperparameterSearch, seed: int, trials: list[Trial]) -> dict[str, Any]:
    """The next trial's parameters, from a study rebuilt out of the trials so far (TPE, seeded)."""
    import optuna
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = _distributions(search)
    sampler = optuna.samplers.TPESampler(
        seed=seed + len(trials), n_startup_trials=max(1, min(10, search.n_trials // 2))
    )
    study = optuna.create_study(direction=search.direction, sampler=sampler)
    for t in trials:
        if t.status == "succeeded" and t.value is not None:
            study.add_trial(create_trial(params=t.params, distributions=dists, value=t.value))
        elif t.status in ("failed", "cancelled"):
            study.add_trial(create_trial(params=t.params, distributions=dists, state=TrialState.FAIL))
    return dict(study.ask(dists).params)


def best(search: HyperparameterSearch, trials: list[Trial]) -> Trial | None:
    scored = [t for t in trials if t.status == "succeeded" and t.value is not None]
    if not scored:
        return None
    pick = min if search.direction == "minimize" else max
    return pick(scored, key=lambda t: t.value)  # type: ignore[arg-type, return-value]


def _trial(job: Job, metric: str) -> Trial:
    value = ((job.result or {}).get("metrics") or {}).get(metric)
    return Trial(
        job_id=job.id,
        params=dict(job.spec.search_params or {}),
        status=job.status.value,
        value=float(value) if isinstance(value, int | float) else None,
    )


def _shown(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _start_trial(session: Session, settings: Settings, parent: Job, params: dict[str, Any], n: int) -> Job:
    train, _ = FileRepository(session).of_job(parent)
    child = Job(
        id=new_id("ftjob"),
        model=parent.model,
        task=parent.task,
        training_file_id=parent.training_file_id,
        validation_file_id=parent.validation_file_id,
        status=JobStatus.queued,
        spec=parent.spec.trial(params, train.row_count or 0),
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


def _finish(session: Session, parent: Job, hs: HyperparameterSearch, trials: list[Trial]) -> str:
    table = [{"job_id": t.job_id, "params": t.params, "status": t.status, hs.metric: t.value} for t in trials]
    winner = best(hs, trials)
    if winner is None:
        error = {"code": "all_trials_failed", "message": f"none of the {len(trials)} trials succeeded"}
        lifecycle.search_failed(session, parent.id, error, {"trials": table})
        return "failed"
    best_job = JobRepository(session).get(winner.job_id)
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
    summary = f"best trial {winner.job_id} with {hs.metric}={winner.value:.4g} ({_shown(winner.params)})"
    if lifecycle.search_succeeded(session, parent.id, best_job, result, summary):
        ArtifactRepository(session).link(winner.job_id, parent.id)
    return "succeeded"


def advance(settings: Settings, parent_id: str) -> str:
    with session_scope(settings.database_url) as session:
        jobs = JobRepository(session)
        parent = jobs.get(parent_id, for_update=True)
        if parent is None or parent.status.terminal or parent.status == JobStatus.paused:
            return f"nothing to do ({parent.status if parent else 'no such job'})"
        hs = parent.spec.hyperparameter_search
        assert hs is not None, f"{parent_id} is not a search"
        if parent.status == JobStatus.queued:
            lifecycle.start_search(
                session,
                parent.id,
                f"{hs.n_trials} trials, {hs.direction} {hs.metric}, {hs.parallelism} at a time",
            )
        children = jobs.children(parent.id)
        trials = [_trial(c, hs.metric) for c in children]
        active = sum(1 for c in children if not c.status.terminal)
        room = _quota_room(session, settings, parent.tenant_id)  # trials count against the tenant's quota
        started = 0
        while len(children) + started < hs.n_trials and active + started < hs.parallelism and started < room:
            params = suggest(hs, parent.seed, trials)
            _start_trial(session, settings, parent, params, len(children) + started + 1)
            started += 1
        jobs.update(parent.id, step=sum(1 for c in children if c.status.terminal), total_steps=hs.n_trials)
        if started or active:
            return f"{active + started} trial(s) running, {len(children) + started}/{hs.n_trials} started"
        if len(children) < hs.n_trials:  # trials left and none running: the tenant's quota is full
            return "waiting: the tenant holds as many unfinished jobs as its quota allows"
        return _finish(session, parent, hs, trials)


def _quota_room(session: Session, settings: Settings, tenant_id: str) -> int:
    tenants = TenantRepository(session)
    tenant = tenants.get(tenant_id)
    limit = (tenant.max_concurrent_jobs if tenant else None) or settings.max_concurrent_jobs
    return max(0, limit - tenants.unfinished_jobs(tenant_id))
