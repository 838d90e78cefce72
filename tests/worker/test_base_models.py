"""An `ft:` job's base model: from object storage into the node's cache, checked before it is unpacked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ortune.db.models import JobStatus
from ortune.db.session import session_scope
from ortune.jobspec import BaseModelRef
from ortune.settings import Settings
from ortune.storage import pack_dir
from tests.support import job_spec, stored_job
from worker import base_models, stores
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


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_cached_base_models_count_toward_the_cache_bound_and_go_least_recent_first(
    settings: Settings, tmp_path: Path
) -> None:
    """The node's cache holds two tokenized stores and three `ft:` base models of 100 kB each, over a 350 kB
    bound: the least recently used go, models as much as stores; the attempt's own base stays, and so does a
    model still being fetched. Before, models were never evicted (nor counted): the cache grew without end."""
    s = settings.model_copy(update={"cache_max_bytes": 350_000})
    cache, when = s.cache_dir, 1_000_000.0

    def entry(path: Path, *, whole: str) -> Path:
        nonlocal when
        (path / whole).parent.mkdir(parents=True)
        (path / whole).write_text("{}")
        (path / "data.bin").write_bytes(b"\0" * 100_000)
        (path / stores.USED).touch()
        when += 60
        os.utime(path / stores.USED, (when, when))  # each entry used a minute after the one before
        return path

    old_model = entry(cache / "models" / ("a" * 64), whole="pytorch/config.json")
    old_store = entry(cache / "tokenized" / "store-1", whole="meta.json")
    newer_model = entry(cache / "models" / ("b" * 64), whole="pytorch/config.json")
    newer_store = entry(cache / "tokenized" / "store-2", whole="meta.json")
    in_use = entry(cache / "models" / ("c" * 64), whole="pytorch/config.json")  # oldest of all: first out
    os.utime(in_use / stores.USED, (0, 0))
    fetching = cache / "models" / "tmpk2j4x9" / "model"  # fetch_archive's folder, renamed once whole
    fetching.mkdir(parents=True)

    dropped = stores.evict(s, {in_use})

    assert dropped == [f"models/{'a' * 64}", "tokenized/store-1"]
    assert not old_model.exists() and not old_store.exists()
    assert newer_model.is_dir() and newer_store.is_dir() and in_use.is_dir() and fetching.is_dir()
