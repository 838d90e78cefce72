"""The dashboard: one static page that polls the REST API; no server-side rendering, no build step."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parent.parent / "static"
router = APIRouter(prefix="/dashboard", tags=["dashboard"], include_in_schema=False)


@router.get("")
@router.get("/files")
@router.get("/compare")
@router.get("/jobs/{job_id}")
def dashboard(job_id: str | None = None) -> FileResponse:
    """The same page for the jobs, the files, a comparison and a job; its script reads the path and polls
    /v1."""
    return FileResponse(STATIC / "dashboard.html", headers={"Cache-Control": "no-cache"})
