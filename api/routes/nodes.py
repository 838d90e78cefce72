"""`GET /v1/nodes`: the nodes workers registered, their free devices and what runs where (admin keys)."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from api.auth import PlatformDep
from api.deps import SessionDep, SettingsDep
from api.errors import ERRORS
from api.schemas import Page, ts
from ortune.db.base import utcnow
from ortune.db.repositories import NodeRepository

router = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=ERRORS)


class Placement(BaseModel):
    job_id: str
    attempt: int
    node_rank: int
    device: int


class NodeObject(BaseModel):
    id: str
    object: Literal["node"] = "node"
    device_kind: str
    devices: int
    free_devices: int
    alive: bool
    address: str
    worker: str
    registered_at: int
    heartbeat_at: int
    running: list[Placement]


@router.get("", response_model=Page[NodeObject])
def list_nodes(session: SessionDep, settings: SettingsDep, _: PlatformDep) -> Page[NodeObject]:
    """Every registered node: devices, how many are free, whether its heartbeat is recent, and its jobs."""
    repo = NodeRepository(session)
    live = repo.live_assignments()
    cutoff = utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds)
    data = []
    for node in repo.all():
        mine = [a for a in live if a.node_name == node.name]
        data.append(
            NodeObject(
                id=node.name,
                device_kind=node.device_kind,
                devices=node.devices,
                free_devices=node.devices - len({a.device for a in mine}),
                alive=node.heartbeat_at >= cutoff,
                address=node.address,
                worker=node.worker,
                registered_at=ts(node.registered_at) or 0,
                heartbeat_at=ts(node.heartbeat_at) or 0,
                running=[
                    Placement(job_id=a.job_id, attempt=a.attempt, node_rank=a.node_rank, device=a.device)
                    for a in mine
                ],
            )
        )
    return Page(data=data)
