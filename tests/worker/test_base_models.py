"""An `ft:` job's base model: from object storage into the node's cache, checked before it is unpacked."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortune.db.models import JobStatus
from ortune.db.session import session_scope
from ortune.jobspec import BaseModelRef
from ortune.settings import Settings
from ortune.storage import pack_dir
from tests.support import job_spec, stored_job
from worker import base_models
from worker.staging import store_of


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_fine_tuned_base_is_fetched_once_and_only_if_its_bytes_are_the_recorded_ones(
    settings: Settings, tmp_path: Path
) -> None:
    model = tmp_path / "pytorch"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "bert"}')
    _, digest = pack_dir(model, tmp_path / "pytorch.tar")
    store = store_of(settings)
    store.put_path("jobs/src/attempt-1/artifacts/pytorch.tar", tmp_path / "pytorch.tar")

    def job_on(sha256: str) -> object:
        ref = BaseModelRef(job_id="src", object_key="jobs/src/attempt-1/artifacts/pytorch.tar", sha256=sha256)
        with session_scope(settings.database_url) as session:
            job = stored_job(
                session, status=JobStatus.running, model="ft:tiny-bert:x:src", spec=job_spec(base=ref)
            )
            session.expunge(job)
        return job

    with pytest.raises(base_models.BaseModelUnavailable, match="failed its sha256 check"):
        base_models.resolve(settings, store, job_on("0" * 64))  # type: ignore[arg-type]
    assert not (settings.cache_dir / "models" / ("0" * 64)).exists()  # nothing unpacked

    info = base_models.resolve(settings, store, job_on(digest))  # type: ignore[arg-type]
    assert (info.source, info.id) == ("local", "ft:tiny-bert:x:src")
    assert info.path is not None and (info.path / "config.json").read_text() == '{"model_type": "bert"}'
    store.delete("jobs/src/attempt-1/artifacts/pytorch.tar")
    assert base_models.resolve(settings, store, job_on(digest)).path == info.path  # from the node's cache

    with pytest.raises(base_models.BaseModelUnavailable, match="is gone"):
        base_models.resolve(settings, store, job_on("1" * 64))  # type: ignore[arg-type]
