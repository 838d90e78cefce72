"""Uploaded files."""

from __future__ import annotations

from sqlalchemy import func, or_, select

from ortune.db.models import File, Job, JobStatus
from ortune.db.repositories.base import Repository, keyset_after, page_anchor


class FileRepository(Repository):
    def add(self, file: File) -> File:
        self.session.add(file)
        self.session.flush()
        return file

    def get(self, file_id: str) -> File | None:
        file = self.session.get(File, file_id)
        return None if file is None or file.deleted else file

    def of_job(self, job: Job) -> tuple[File, File | None]:
        """A job's training and validation files (a file in use is never deleted, so both exist)."""
        train = self.session.get(File, job.training_file_id)
        valid = self.session.get(File, job.validation_file_id) if job.validation_file_id else None
        assert train is not None
        return train, valid

    def list(
        self, *, tenant_id: str, after: str | None, limit: int, purpose: str | None = None
    ) -> tuple[list[File], bool]:
        stmt = select(File).where(File.tenant_id == tenant_id, File.deleted.is_(False))
        if purpose:
            stmt = stmt.where(File.purpose == purpose)
        stmt = keyset_after(stmt, File, page_anchor(self.session, File, after, tenant_id))
        rows = list(
            self.session.scalars(stmt.order_by(File.created_at.desc(), File.id.desc()).limit(limit + 1))
        )
        return rows[:limit], len(rows) > limit

    def in_use(self, file_id: str) -> bool:
        active = [s for s in JobStatus if not s.terminal]
        stmt = (
            select(func.count())
            .select_from(Job)
            .where(
                or_(Job.training_file_id == file_id, Job.validation_file_id == file_id),
                Job.status.in_(active),
            )
        )
        return bool(self.session.scalar(stmt))

    def mark_deleted(self, file: File) -> None:
        # Jobs keep a foreign key to their files, so the row stays as a tombstone; the bytes go.
        file.deleted = True
        self.session.flush()
