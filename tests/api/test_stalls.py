"""No request can stall the API, and none racing another ends wrong: concurrent same-key uploads, an upload
beside a tenant's job create holding the quota lock, a request stuck behind another's lock, uploads at once
against the storage quota, and deletes racing job creates, each on Postgres against a real API process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from api.caller import ANONYMOUS
from ortune.cli import embedded
from ortune.db.models import IdempotencyKey
from ortune.db.repositories import ArtifactRepository, FileRepository, JobRepository, TenantRepository
from ortune.db.session import session_scope
from ortune.settings import Settings
from ortune.storage import open_store
from tests.support import fine_tuned, rows, stored_job, wait_until, write_jsonl

pytestmark = pytest.mark.parametrize("config", ["production"], indirect=True)


@contextmanager
def api(settings: Settings, tmp: Path) -> Iterator[str]:
    with embedded.start(settings, worker=False, log_dir=tmp / "logs"):
        yield settings.api_url


def upload(url: str, path: Path, key: str | None = None) -> httpx.Response:
    with path.open("rb") as fh:
        return httpx.post(
            f"{url}/v1/files",
            files={"file": (path.name, fh)},
            data={"purpose": "fine-tune"},
            headers={"Idempotency-Key": key} if key else {},
            timeout=60,
        )


def while_healthy(url: str, work: list[Callable[[], Any]]) -> tuple[list[Any], float]:
    """Run `work` at once, polling /healthz until all of it is done; the results and the slowest poll."""
    slowest = 0.0
    with ThreadPoolExecutor(len(work)) as pool:
        futures: list[Future[Any]] = [pool.submit(w) for w in work]
        while not all(f.done() for f in futures):
            t0 = time.perf_counter()
            assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200  # a stalled loop times out here
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.05)
        return [f.result(timeout=60) for f in futures], slowest


def stored_files(settings: Settings) -> list[str]:
    store: Any = open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(),
        region=settings.s3_region,
    )
    listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix="files/")
    return [o["Key"] for o in listed.get("Contents", [])]


def test_two_uploads_with_one_key_at_once_make_one_file_and_never_stall(
    settings: Settings, tmp_path: Path
) -> None:
    """What a client retrying after a timeout does: before the fix the second request's key insert waited on
    the first one's open transaction on the event loop, and the first could never finish: both hung, and so
    did /healthz."""
    big = write_jsonl(tmp_path / "big.jsonl", rows(360) * 150)  # ~54k rows: the check and store take a while
    with api(settings, tmp_path) as url:
        (first, second), slowest = while_healthy(
            url, [lambda: upload(url, big, "retry-1"), lambda: upload(url, big, "retry-1")]
        )
        assert first.status_code == second.status_code == 200, (first.text, second.text)
        assert first.json()["id"] == second.json()["id"]
        assert [r.headers.get("idempotent-replayed") for r in (first, second)].count("true") == 1
        assert len(httpx.get(f"{url}/v1/files").json()["data"]) == 1
    assert slowest < 2.0, f"/healthz took {slowest:.1f}s while the uploads ran"
    assert stored_files(settings) == [f"files/{first.json()['id']}.jsonl"]  # the loser's copy is deleted


def test_an_upload_beside_a_job_create_holding_the_quota_lock_goes_through(
    settings: Settings, tmp_path: Path
) -> None:
    """A job create locks its tenant's row for its quota check; before the fix that lock (FOR UPDATE) also
    blocked the foreign-key check of a file insert for the same tenant, on the event loop."""
    small = write_jsonl(tmp_path / "t.jsonl", rows(32))
    held = threading.Event()
    release = threading.Event()

    def create_holding_the_lock() -> None:
        with session_scope(settings.database_url) as session:
            TenantRepository(session).lock(ANONYMOUS.tenant_id)  # what POST /v1/fine_tuning/jobs takes
            held.set()
            release.wait(10)

    with api(settings, tmp_path) as url:
        holder = threading.Thread(target=create_holding_the_lock)
        holder.start()
        try:
            assert held.wait(10)
            t0 = time.perf_counter()
            (response,), _ = while_healthy(url, [lambda: upload(url, small)])
            took = time.perf_counter() - t0
        finally:
            release.set()
            holder.join()
    assert response.status_code == 200, response.text
    assert took < 5, f"the upload waited {took:.1f}s on the quota lock"


def test_a_request_stuck_behind_anothers_lock_is_answered_within_the_lock_timeout(
    settings: Settings, tmp_path: Path
) -> None:
    """A transaction that holds a key's row and never ends (a stuck client, a crashed process) makes a
    same-key request wait at most `api_lock_timeout_ms`, then answers 409 with Retry-After."""
    s = settings.model_copy(update={"api_lock_timeout_ms": 500})
    small = write_jsonl(tmp_path / "t.jsonl", rows(32))
    with session_scope(s.database_url) as session, api(s, tmp_path) as url:
        session.add(
            IdempotencyKey(
                tenant_id=ANONYMOUS.tenant_id,
                key="stuck",
                endpoint="POST /v1/files",
                request_sha256="0" * 64,
                resource_id="file-stuck",
            )
        )
        session.flush()  # the row is written and locked, never committed while the request runs
        (response,), slowest = while_healthy(url, [lambda: upload(url, small, "stuck")])
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "idempotency_key_in_use"
        assert response.headers["retry-after"] == "1"
        session.rollback()
        limits = session.execute(text("SHOW lock_timeout")).scalar()
    assert slowest < 2.0
    assert limits == "0"  # the test's own session is not the API's: only the API's connections are bounded


def test_every_api_connection_is_bounded(settings: Settings) -> None:
    from ortune.db.session import limit_postgres_sessions

    names = ("lock_timeout", "statement_timeout", "idle_in_transaction_session_timeout")
    limit_postgres_sessions(
        settings.database_url, dict(zip(names, (1234, 5678, 9012), strict=True)), application_name="ortune-x"
    )
    with session_scope(settings.database_url) as session:
        session.execute(text("SELECT 1"))
        session.rollback()  # a SET made inside a transaction would be undone by this
        shown = [session.execute(text(f"SHOW {name}")).scalar() for name in (*names, "application_name")]
    assert shown == ["1234ms", "5678ms", "9012ms", "ortune-x"]


def test_a_write_waiting_past_the_lock_timeout_is_a_503_database_busy(
    settings: Settings, tmp_path: Path
) -> None:
    """A job create behind another create's quota lock, held longer than `api_lock_timeout_ms`: a clear,
    retryable 503, not a request left hanging (nor a 503 that says the database is down)."""
    s = settings.model_copy(update={"api_lock_timeout_ms": 500})
    with api(s, tmp_path) as url:
        file = upload(url, write_jsonl(tmp_path / "t.jsonl", rows(32))).json()
        with session_scope(s.database_url) as session:
            TenantRepository(session).lock(ANONYMOUS.tenant_id)  # held until the block ends
            (response,), slowest = while_healthy(
                url,
                [
                    lambda: httpx.post(
                        f"{url}/v1/fine_tuning/jobs",
                        json={"model": "tiny-bert", "training_file": file["id"]},
                        timeout=30,
                    )
                ],
            )
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "database_busy" and response.headers["retry-after"] == "1"
    assert slowest < 2.0


def test_a_read_behind_a_table_lock_is_a_503_not_a_hang(settings: Settings, tmp_path: Path) -> None:
    """GETs run on asyncpg (the hot reads' own pool and the async ORM reads), whose connections had no
    lock or statement timeout: behind a migration's ACCESS EXCLUSIVE lock a poll waited for ever."""
    s = settings.model_copy(update={"api_lock_timeout_ms": 500})
    with api(s, tmp_path) as url:
        file = upload(url, write_jsonl(tmp_path / "t.jsonl", rows(32))).json()
        job = httpx.post(
            f"{url}/v1/fine_tuning/jobs", json={"model": "tiny-bert", "training_file": file["id"]}
        )
        reads = [
            f"/v1/fine_tuning/jobs/{job.json()['id']}",
            "/v1/fine_tuning/jobs",
            f"/v1/files/{file['id']}",
        ]
        assert all(httpx.get(url + path).status_code == 200 for path in reads)  # the pools are open
        with session_scope(s.database_url) as session:
            session.execute(text("LOCK TABLE jobs, files IN ACCESS EXCLUSIVE MODE"))  # as ALTER TABLE takes
            responses, slowest = while_healthy(
                url, [lambda p=path: httpx.get(url + p, timeout=30) for path in reads]
            )
    for path, response in zip(reads, responses, strict=True):
        assert response.status_code == 503, (path, response.text)
        assert response.json()["error"]["code"] == "database_busy", path
    assert slowest < 2.0


def api_waiting_on_locks(s: Settings) -> int:
    # a statement of its own each time: within a transaction pg_stat_activity is read once and kept
    with session_scope(s.database_url, autocommit=True) as watch:
        sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ortune-api' AND "
        return int(watch.execute(text(sql + "wait_event_type = 'Lock'")).scalar() or 0)


def test_uploads_at_once_never_pass_the_storage_quota_together(settings: Settings, tmp_path: Path) -> None:
    """Five uploads of one tenant at once, where two fit: two are stored, three are 429
    storage_quota_exceeded, and what the tenant keeps stays within its limit. To make them race for certain,
    the test holds the files table (SHARE: inserts wait) until all five wait in the database; before the
    fix each had passed its check by then, and all five were stored (about 2.4 MiB of a 1 MiB quota)."""
    s = settings.model_copy(update={"max_tenant_storage_bytes": 2**20, "api_lock_timeout_ms": 30_000})
    uploads = [write_jsonl(tmp_path / f"u{n}.jsonl", rows(360) * 16) for n in range(5)]  # ~480 kB each
    assert 2 * uploads[0].stat().st_size < 2**20 < 3 * uploads[0].stat().st_size
    with api(s, tmp_path) as url, session_scope(s.database_url) as holder:
        holder.execute(text("LOCK TABLE files IN SHARE MODE"))
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(upload, url, path) for path in uploads]
            wait_until("all five uploads to wait in the database", lambda: api_waiting_on_locks(s) == 5, 60)
            holder.rollback()  # lets them through
            responses = [f.result(timeout=60) for f in futures]
        with session_scope(s.database_url) as session:
            kept = TenantRepository(session).storage_bytes(ANONYMOUS.tenant_id)
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 429, 429, 429], [r.text for r in responses]
    refused = [r.json()["error"] for r in responses if r.status_code == 429]
    assert {e["code"] for e in refused} == {"storage_quota_exceeded"}
    assert kept <= 2**20
    assert len(stored_files(s)) == 2  # the refused uploads' objects are deleted


def test_deletes_and_job_creates_of_one_file_or_model_come_one_after_the_other(
    settings: Settings, tmp_path: Path
) -> None:
    """A delete of a file or a fine-tuned model and a job create on it, at once: the job is never created
    on something deleted. Each race is made certain by doing one side's writes by hand in a transaction that
    holds the tenant's lock (as the API's own create or delete would), until the API's request waits on it.
    Before, the file's delete went through beside a create writing its job (the job then staged a file
    whose bytes were gone), a create that had read the file before a delete committed made its job
    anyway, and a model was deleted under a job about to fetch it as its base."""
    s = settings.model_copy(update={"api_lock_timeout_ms": 30_000})
    archive = tmp_path / "model.tar"
    archive.write_bytes(b"a fine-tuned model's archive")
    tenant = ANONYMOUS.tenant_id

    def racing(request: Callable[[], httpx.Response], hold: Callable[[Session], Any]) -> httpx.Response:
        with ThreadPoolExecutor(1) as pool, session_scope(s.database_url) as holder:
            TenantRepository(holder).lock(tenant)
            hold(holder)
            answer = pool.submit(request)
            wait_until(
                "the API's request to wait on the other side", lambda: api_waiting_on_locks(s) == 1, 30
            )
            holder.commit()
            return answer.result(timeout=60)

    with api(s, tmp_path) as url:
        first, second = (
            upload(url, write_jsonl(tmp_path / f"{n}.jsonl", rows(32 + n))).json() for n in range(2)
        )
        model = fine_tuned(s, tenant, archive, ("pytorch", "onnx"))

        # a create under way on the file (its job written) when the file's delete comes: refused
        deleted = racing(
            lambda: httpx.delete(f"{url}/v1/files/{first['id']}", timeout=60),
            lambda holder: stored_job(holder, tenant_id=tenant, training_file_id=first["id"]),
        )
        assert deleted.status_code == 409 and deleted.json()["error"]["code"] == "file_in_use", deleted.text

        # a delete under way (the file marked deleted) when a job is created on it: the file is gone
        files = FileRepository
        created = racing(
            lambda: httpx.post(
                f"{url}/v1/fine_tuning/jobs",
                json={"model": "tiny-bert", "training_file": second["id"]},
                timeout=60,
            ),
            lambda holder: files(holder).mark_deleted(files(holder).get(second["id"])),  # type: ignore[arg-type]
        )
        assert created.status_code == 404 and created.json()["error"]["code"] == "file_not_found", (
            created.text
        )

        # a create under way on the fine-tuned model when its delete comes: refused while the job runs
        refused = racing(
            lambda: httpx.delete(f"{url}/v1/models/{model}", timeout=60),
            lambda holder: stored_job(holder, tenant_id=tenant, model=model),
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "model_in_use" and "1 unfinished job" in refused.text
        with session_scope(s.database_url) as session:
            source = JobRepository(session).by_fine_tuned_model(tenant, model)
            assert source is not None and ArtifactRepository(session).for_job(source.id)  # all kept
