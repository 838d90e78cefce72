"""Nodes and the devices given out on them: what the scheduler, the workers and `GET /v1/nodes` share."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import or_, select, update

from ortune.db.base import utcnow
from ortune.db.models import Assignment, Job, JobStatus, Node
from ortune.db.repositories.base import Repository


class NodeRepository(Repository):
    def register(self, name: str, *, kind: str, devices: int, address: str, queue: str, worker: str) -> Node:
        node = self.session.get(Node, name)
        if node is None:
            node = Node(name=name)
            self.session.add(node)
        node.device_kind, node.devices, node.address = kind, devices, address
        node.queue, node.worker = queue, worker
        node.heartbeat_at = utcnow()
        self.session.flush()
        return node

    def get(self, name: str) -> Node | None:
        return self.session.get(Node, name)

    def beat(self, name: str) -> None:
        self.session.execute(update(Node).where(Node.name == name).values(heartbeat_at=utcnow()))

    def all(self) -> Sequence[Node]:
        return self.session.scalars(select(Node).order_by(Node.name)).all()

    def alive(self, timeout_seconds: float, *, lock: bool = False) -> Sequence[Node]:
        stmt = select(Node).where(Node.heartbeat_at >= utcnow() - timedelta(seconds=timeout_seconds))
        if lock:  # a second dispatcher skips the nodes this one is placing jobs on
            stmt = stmt.with_for_update(skip_locked=True)
        return self.session.scalars(stmt.order_by(Node.name)).all()

    def live_assignments(self, node_names: Sequence[str] | None = None) -> Sequence[Assignment]:
        stmt = select(Assignment).where(Assignment.released_at.is_(None))
        if node_names is not None:
            stmt = stmt.where(Assignment.node_name.in_(list(node_names)))
        return self.session.scalars(stmt.order_by(Assignment.node_name, Assignment.device)).all()

    def stale(self) -> Sequence[Assignment]:
        """Live assignments of attempts that are over: their job finished, or moved on to a later attempt."""
        finished = (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)
        stmt = (
            select(Assignment)
            .join(Job, Job.id == Assignment.job_id)
            .where(
                Assignment.released_at.is_(None),
                or_(Job.status.in_(finished), Assignment.attempt < Job.attempt),
            )
        )
        return self.session.scalars(stmt).all()

    def of_attempt(self, job_id: str, attempt: int) -> Sequence[Assignment]:
        stmt = select(Assignment).where(Assignment.job_id == job_id, Assignment.attempt == attempt)
        return self.session.scalars(stmt.order_by(Assignment.node_rank, Assignment.device)).all()

    def release(
        self, job_id: str, attempt: int, node_name: str, *, exit_code: int | None, error: str | None = None
    ) -> None:
        self.session.execute(
            update(Assignment)
            .where(
                Assignment.job_id == job_id,
                Assignment.attempt == attempt,
                Assignment.node_name == node_name,
                Assignment.released_at.is_(None),
            )
            .values(released_at=utcnow(), exit_code=exit_code, error=error)
        )

    def release_attempt(self, job_id: str, attempt: int) -> None:
        self.session.execute(
            update(Assignment)
            .where(
                Assignment.job_id == job_id, Assignment.attempt == attempt, Assignment.released_at.is_(None)
            )
            .values(released_at=utcnow())
        )


def never_fits(nodes: Sequence[Node], nodes_wanted: int, procs_per_node: int) -> str | None:
    """Why a gang of `nodes_wanted` x `procs_per_node` can never run on these nodes, or None if it can."""
    big_enough = [n for n in nodes if n.devices >= procs_per_node]
    if len(big_enough) >= nodes_wanted:
        return None
    # counts, not names: a tenant learns whether its job can fit, not the cluster's inventory
    largest = max((n.devices for n in nodes), default=0)
    return (
        f"needs {nodes_wanted} node(s) with {procs_per_node} device(s) each; "
        f"{len(big_enough)} node(s) have that many ({len(nodes)} registered, the largest with {largest})"
    )
