"""What training leaves in object storage: checkpoints (with other nodes' parts) and final models."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, select

from ortune.db.models import Artifact, Checkpoint
from ortune.db.repositories.base import Repository


class CheckpointRepository(Repository):
    def add(self, checkpoint: Checkpoint) -> None:
        existing = self.session.scalars(
            select(Checkpoint).where(
                Checkpoint.job_id == checkpoint.job_id, Checkpoint.step == checkpoint.step
            )
        ).first()
        if existing is not None:
            self.session.delete(existing)
            self.session.flush()
        self.session.add(checkpoint)
        self.session.flush()

    def newest_first(self, job_id: str) -> Sequence[Checkpoint]:
        stmt = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())
        return self.session.scalars(stmt).all()

    def add_part(self, job_id: str, step: int, key: str, sha256: str) -> bool:
        """Add another node's part to a checkpoint; False while rank 0 has not recorded the checkpoint."""
        stmt = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
        checkpoint = self.session.scalars(stmt.with_for_update()).first()
        if checkpoint is None:
            return False
        if key not in (checkpoint.parts or []):
            checkpoint.parts = [*(checkpoint.parts or []), key]
        checkpoint.part_sha256 = {**(checkpoint.part_sha256 or {}), key: sha256}
        self.session.flush()
        return True

    def delete(self, checkpoint: Checkpoint) -> None:
        self.session.delete(checkpoint)
        self.session.flush()

    def at(self, job_id: str, step: int) -> Checkpoint | None:
        stmt = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
        return self.session.scalars(stmt).first()

    def complete(self, job_id: str, nodes: int) -> list[Checkpoint]:
        """The checkpoints a resume can use, newest first: rank 0's archive and the parts of the job's
        `nodes - 1` other nodes all stored."""
        return [c for c in self.newest_first(job_id) if len(c.parts or []) >= nodes - 1]

    def list(self, job_id: str, *, after: str | None, limit: int) -> tuple[list[Checkpoint], bool]:
        stmt = select(Checkpoint).where(Checkpoint.job_id == job_id)
        if after:
            anchor = self.session.get(Checkpoint, after)
            if anchor is not None:
                stmt = stmt.where(Checkpoint.step < anchor.step)
        rows = list(self.session.scalars(stmt.order_by(Checkpoint.step.desc()).limit(limit + 1)))
        return rows[:limit], len(rows) > limit


class ArtifactRepository(Repository):
    def put(self, artifact: Artifact) -> None:
        self.session.execute(
            delete(Artifact).where(Artifact.job_id == artifact.job_id, Artifact.format == artifact.format)
        )
        self.session.add(artifact)
        self.session.flush()

    def get(self, job_id: str, fmt: str) -> Artifact | None:
        return self.session.scalars(
            select(Artifact).where(Artifact.job_id == job_id, Artifact.format == fmt)
        ).first()

    def link(self, source_job_id: str, job_id: str) -> None:
        """Give `job_id` the artifacts of another job: new rows, the same stored objects (no copy)."""
        for a in self.for_job(source_job_id):
            self.session.add(
                Artifact(
                    job_id=job_id,
                    format=a.format,
                    object_key=a.object_key,
                    bytes=a.bytes,
                    sha256=a.sha256,
                    manifest=a.manifest | {"trial_job_id": source_job_id},
                )
            )
        self.session.flush()

    def for_job(self, job_id: str) -> list[Artifact]:
        return list(self.session.scalars(select(Artifact).where(Artifact.job_id == job_id)))

    def remove_model(self, job_id: str) -> list[str]:
        """Delete a job's models and checkpoints (rows); the object keys nothing else refers to any more, for
        the caller to delete once this is committed (a search shares its best trial's objects)."""
        models = self.for_job(job_id)
        checkpoints = list(self.session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
        keys = [c.object_key for c in checkpoints] + [p for c in checkpoints for p in (c.parts or [])]
        for row in [*models, *checkpoints]:
            self.session.delete(row)
        self.session.flush()
        shared = set(
            self.session.scalars(
                select(Artifact.object_key).where(Artifact.object_key.in_([a.object_key for a in models]))
            )
        )
        return keys + [a.object_key for a in models if a.object_key not in shared]
