"""What the service benchmarks share: the two configurations on real servers, and the report files."""

from __future__ import annotations

import json
import statistics
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ortune.db.migrate import upgrade
from ortune.settings import Settings
from tests import services


@contextmanager
def configuration(name: str, tmp: Path) -> Iterator[Settings]:
    """`embedded` (SQLite, SQLAlchemy broker, folder) or `production` (Postgres, Redis, SeaweedFS S3).

    Production uses the servers on 127.0.0.1 where they answer, else throwaway ones, as the tests do.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    queue = f"ortune.bench.{uuid.uuid4().hex[:8]}"
    if name == "embedded":
        settings = Settings(
            data_dir=tmp / "state",
            api_port=services.free_port(),
            serve_port=services.free_port(),
            queue=queue,
            min_checkpoint_seconds=0,
        )
        upgrade(settings.database_url)
        yield settings
        return
    with ExitStack() as stack:
        pg = stack.enter_context(services.postgres(tmp / "pg"))
        redis_url = stack.enter_context(services.redis(tmp / "redis"))
        s3 = stack.enter_context(services.seaweedfs(tmp / "weed"))
        db = f"ortune_bench_{uuid.uuid4().hex[:8]}"
        url = services.create_database(pg, db)
        stack.callback(services.drop_database, pg, db)
        upgrade(url)
        yield Settings(
            data_dir=tmp / "state",
            database_url=url,
            broker_url=redis_url,
            storage_url=s3.url(f"bench-{uuid.uuid4().hex[:8]}"),
            s3_access_key=s3.access_key,
            s3_secret_key=s3.secret_key,
            api_port=services.free_port(),
            serve_port=services.free_port(),
            queue=queue,
            min_checkpoint_seconds=0,  # the benches' tiny jobs checkpoint as often as they ask
        )
        from ortune.db.session import make_engine

        make_engine(url).dispose()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write(out: Path, name: str, report: dict[str, Any], md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    (out / f"{name}.md").write_text(md + "\n")
    print(md, flush=True)


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"
