"""Place queued multi-process jobs on free devices: by priority, then age; all nodes of a job at once.

A round first takes a transaction-scoped advisory lock, so dispatchers decide one after another, each on a
fresh view of the whole queue: with row locks alone, a second dispatcher would skip the higher-priority jobs
the first one holds and start a lower one on nodes the first just let go. Jobs and nodes are then taken with
`SELECT ... FOR UPDATE SKIP LOCKED`, so a row that an API call or a heartbeat holds only delays a placement,
and the partial unique index on live assignments refuses a device given twice whatever happens. A job whose
gang does not fit now waits in `queued`, and nothing of lower priority jumps ahead of it (it would starve).
One `ortune.run_rank` task goes to each chosen node's own queue.
"""

from __future__ import annotations

import logging
import random

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ortune import lifecycle
from ortune.db.models import Assignment, Job, Node
from ortune.db.repositories import JobRepository, NodeRepository
from ortune.db.session import advisory_xact_lock, session_scope
from ortune.queue import on_commit, send_rank
from ortune.settings import Settings
from trainer_core.spec import Distributed

log = logging.getLogger(__name__)


def _place(
    nodes: list[Node], free: dict[str, list[int]], dist: Distributed
) -> list[tuple[Node, list[int]]] | None:
    fitting = [n for n in nodes if len(free[n.name]) >= dist.procs_per_node]
    if len(fitting) < dist.nodes:
        return None
    return [(n, free[n.name][: dist.procs_per_node]) for n in fitting[: dist.nodes]]


def dispatch(settings: Settings) -> list[str]:
    """One round: returns the ids of the jobs it started."""
    try:
        return _dispatch(settings)
    except IntegrityError:  # lost a race the locks should have prevented: the index held; next round
        log.warning("dispatch: a device was already taken; retrying next round")
        return []


def _dispatch(settings: Settings) -> list[str]:
    started: list[str] = []
    with session_scope(settings.database_url) as session:
        advisory_xact_lock(session, "ortune.dispatch")
        waiting = JobRepository(session).waiting_gangs()
        if not waiting:
            return started
        nodes_repo = NodeRepository(session)
        nodes = list(nodes_repo.alive(settings.heartbeat_timeout_seconds, lock=True))
        ports: set[int] = set()  # two gangs started in one round may share a master node
        taken = {(a.node_name, a.device) for a in nodes_repo.live_assignments([n.name for n in nodes])}
        free = {n.name: [d for d in range(n.devices) if (n.name, d) not in taken] for n in nodes}
        for job in waiting:
            dist = job.spec.distributed
            placement = _place(nodes, free, dist)
            if placement is None:
                break  # gang scheduling: it waits whole, and lower priorities wait behind it
            _start(session, settings, job, dist, placement, ports)
            for node, devices in placement:
                free[node.name] = [d for d in free[node.name] if d not in devices]
            started.append(job.id)
        session.flush()
    return started


def rendezvous_port(settings: Settings, used: set[int]) -> int:
    """A port for rank 0's rendezvous, from the configured range and not one this round already gave."""
    lo, hi = settings.rendezvous_port_min, settings.rendezvous_port_max
    if len(used) <= hi - lo:
        while (port := random.randint(lo, hi)) in used:
            pass
    else:  # more gangs in one round than ports: they can only be on different masters
        port = random.randint(lo, hi)
    used.add(port)
    return port


def _start(
    session: Session,
    settings: Settings,
    job: Job,
    dist: Distributed,
    placement: list[tuple[Node, list[int]]],
    ports: set[int],
) -> None:
    master, port = placement[0][0], rendezvous_port(settings, ports)
    where = ", ".join(f"{n.name} (rank {r}, devices {ds})" for r, (n, ds) in enumerate(placement))
    attempt = lifecycle.place(
        session,
        job,
        f"{master.worker} (rank 0 of {dist.nodes} nodes)",
        f"{where}: {dist.nodes} x {dist.procs_per_node} process(es), {dist.strategy}",
        {"nodes": [n.name for n, _ in placement], "strategy": dist.strategy, "master_port": port},
    )
    if attempt is None:  # the row is locked by this round; only a concurrent cancel gets here
        return
    for rank, (node, devices) in enumerate(placement):
        for device in devices:
            session.add(
                Assignment(job_id=job.id, attempt=attempt, node_name=node.name, node_rank=rank, device=device)
            )
    session.flush()  # the unique index speaks here, before anything is sent
    for rank, (node, devices) in enumerate(placement):
        task = {
            "job_id": job.id,
            "attempt": attempt,
            "node_rank": rank,
            "nnodes": dist.nodes,
            "nproc_per_node": dist.procs_per_node,
            "devices": devices,
            "master_addr": master.address,
            "master_port": port,
        }
        queue = node.queue
        on_commit(session, lambda queue=queue, task=task: send_rank(settings, queue, task))  # type: ignore[misc]
