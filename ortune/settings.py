"""The one settings object. Nobody else reads os.environ for configuration."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ORTUNE_", env_file=".env", extra="ignore")

    environment: Literal["development", "production"] = "development"
    data_dir: Path = Field(default=Path(".ortune"), description="Embedded mode keeps everything here.")

    # Empty means the embedded default under data_dir (SQLite, kombu's SQLAlchemy transport, a folder).
    database_url: str = ""
    broker_url: str = ""
    storage_url: str = ""
    queue: str = "ortune.jobs"

    models_dir: Path | None = Field(default=None, description="Local base-model directories, one per model.")
    work_dir: Path | None = None

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # Threads for the API's sync handlers (Starlette's default is 40). Fewer cut GIL contention on a small
    # machine (p99 of polls 121 -> 89 ms at 8, bench/api_load) but must stay well above the concurrent
    # requests the database pool can serve, or handlers waiting for a connection can hold every thread.
    api_threads: int = Field(default=40, ge=1, le=256)
    api_access_log: bool = False  # per-request lines; /metrics counts requests without the cost
    api_url: str = ""

    max_upload_bytes: int = 512 * MiB
    max_rows: int = 2_000_000
    max_steps: int = 1_000_000
    default_page_limit: int = 20

    event_flush_seconds: float = 0.5
    event_batch_size: int = 200
    trainer_python: str = sys.executable

    s3_access_key: str = "ortune"
    s3_secret_key: str = "ortune-dev-secret"
    s3_region: str = "us-east-1"

    @model_validator(mode="after")
    def _fill_embedded_defaults(self) -> Settings:
        data = self.data_dir.resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{data / 'ortune.db'}"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{data / 'broker.db'}"
        if not self.storage_url:
            self.storage_url = f"file://{data / 'objects'}"
        if self.work_dir is None:
            self.work_dir = data / "work"
        if not self.api_url:
            self.api_url = f"http://{self.api_host}:{self.api_port}"
        if self.environment == "production" and self.s3_secret_key == "ortune-dev-secret":
            raise ValueError("ORTUNE_S3_SECRET_KEY is the development placeholder; set a real secret")
        return self

    @property
    def embedded(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def job_work_dir(self) -> Path:
        assert self.work_dir is not None
        return self.work_dir


@lru_cache
def get_settings() -> Settings:
    return Settings()
