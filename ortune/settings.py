"""The one settings object. Nobody else reads os.environ for configuration."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainer_core import contract

MiB = 1024 * 1024
# Every example credential the project ships (the settings' defaults, docker-compose.yml, docker/s3.json):
# production refuses them (tests/kernel/test_settings.py reads those files to keep this list whole).
PLACEHOLDERS = frozenset({"ortune", "ortune-dev-secret", "CHANGE_ME"})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ORTUNE_", env_file=".env", extra="ignore")

    environment: Literal["development", "production"] = "development"
    data_dir: Path = Field(default=Path(".ortune"), description="Embedded mode keeps everything here.")

    # Empty means the embedded default under data_dir (SQLite, kombu's SQLAlchemy transport, a folder).
    # The URLs may carry passwords: kept out of repr (a test failure or a log line prints settings).
    database_url: str = Field(default="", repr=False)
    broker_url: str = Field(default="", repr=False)
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
    # The inference process (`ortune serve`, started beside the API by `ortune up`): where the API reaches
    # it, and the bytes of ONNX models it keeps loaded (least recently used out first).
    serve_host: str = "127.0.0.1"
    serve_port: int = 8001
    serve_url: str = ""
    serve_cache_bytes: int = Field(default=2 * 1024 * MiB, ge=1 * MiB)
    # Fair use of inference, per tenant and inference process: requests generating at once, and tokens
    # (prompt + max_tokens, reserved when a request starts, the unused returned when it ends) per minute.
    # Over either: 429 with Retry-After. A request bigger than a whole minute's tokens is refused outright.
    serve_max_streams_per_tenant: int = Field(default=8, ge=1)
    serve_tokens_per_minute_per_tenant: int = Field(default=240_000, ge=1)
    serve_max_tokens: int = Field(default=4096, ge=1)  # the most any one reply may ask for
    serve_default_max_tokens: int = Field(default=256, ge=1)  # without max_tokens (never past the context)
    # A streamed reply whose reader takes nothing for this long is cut (its connection closed, its row out
    # of the batch), so a stalled client holds no connection, memory or tenant slot for ever.
    inference_send_timeout_seconds: float = Field(default=30.0, gt=0)

    # API keys. None: required in production, optional in development (an open single-user deployment,
    # where a caller without a key is the default tenant). An ortune key that is sent is always checked.
    require_api_key: bool | None = None
    admin_api_key: SecretStr | None = Field(
        default=None, description="A bootstrap admin key (default tenant) for creating tenants and keys."
    )
    api_key: SecretStr | None = Field(default=None, description="The key the CLI and client send.")
    api_key_cache_seconds: float = 30.0  # how long an API process trusts a key lookup (revocation lag)

    max_upload_bytes: int = 512 * MiB
    max_request_bytes: int = Field(default=1 * MiB, ge=1024)  # any other request body (JSON)
    max_rows: int = 2_000_000
    max_row_chars: int = Field(default=1 * MiB, ge=1024)  # one JSONL line, or one line of a CSV file
    # image and audio archives (.zip, .tar, .tar.gz): checked member by member at upload, never unpacked
    max_archive_members: int = Field(default=200_000, ge=1)
    max_archive_bytes: int = Field(default=8 * 1024 * MiB, ge=1)  # uncompressed, all members together
    max_compression_ratio: float = Field(default=200.0, gt=1)  # uncompressed / compressed: zip bombs
    max_steps: int = 1_000_000
    max_concurrent_jobs: int = Field(default=16, ge=1, description="Unfinished jobs per tenant at once.")
    # Bytes a tenant may keep in object storage (uploads, checkpoints, models); a tenant's own
    # max_storage_bytes overrides it.
    max_tenant_storage_bytes: int = Field(default=100 * 1024 * MiB, ge=MiB)
    idempotency_key_hours: float = 24.0
    # Bounds on every API connection to Postgres, so that no request can hold or wait on a lock for ever:
    # a write that waits longer than lock_timeout on another's row is answered (409/503), not stalled.
    api_lock_timeout_ms: int = Field(default=5_000, ge=1)
    api_statement_timeout_ms: int = Field(default=30_000, ge=1)
    api_idle_in_transaction_timeout_ms: int = Field(default=60_000, ge=1)
    # And on every worker connection: a worker frozen inside a transaction (SIGSTOP, a VM pause) loses it
    # after worker_idle_in_transaction_timeout_ms, so its row locks go before the heartbeat timeout, when
    # the sweep (which skips locked rows) comes to requeue its job. No worker transaction waits on anything
    # but the database, so a few seconds idle is already a frozen worker. Default: 10 s, or half the
    # heartbeat timeout where that is shorter.
    worker_lock_timeout_ms: int = Field(default=30_000, ge=1)
    worker_statement_timeout_ms: int = Field(default=60_000, ge=1)
    worker_idle_in_transaction_timeout_ms: int | None = Field(default=None, ge=1)

    # Reliability: a running attempt beats every heartbeat_seconds; one silent for heartbeat_timeout_seconds
    # is lost and its job requeued (resuming from its last checkpoint) until max_attempts attempts are lost.
    heartbeat_seconds: float = 5.0
    heartbeat_timeout_seconds: float = 60.0
    max_attempts: int = Field(default=3, ge=1)
    sweep_seconds: float = 10.0
    # A worker that lost the broker tries again every broker_reconnect_max_seconds at most (kombu's own
    # backoff grows by 2 s a try up to 30 s: workers sat idle for 20 s and more after Redis came back).
    broker_reconnect_max_seconds: float = Field(default=2.0, gt=0)
    # A queued job nobody has taken this long is sent to the broker again (a message lost with Redis).
    requeue_after_seconds: float = 300.0
    pause_grace_seconds: float = 120.0  # for the trainer to checkpoint and exit when paused
    # Fair use of the store: periodic checkpoints come at most this often, whatever checkpoint_every_steps
    # asks (a pause's and the last step's are always taken).
    min_checkpoint_seconds: float = Field(default=30.0, ge=0)

    # This worker's node, for multi-process jobs. Devices: CUDA GPUs when there are any, else `node_devices`
    # CPU slots (default 1). The address is where the other nodes of a job reach rank 0 on this one.
    node_name: str = Field(default_factory=socket.gethostname)
    node_devices: int | None = Field(default=None, ge=1, le=1024)
    node_address: str = "127.0.0.1"
    distributed_timeout_seconds: int = Field(default=120, ge=10)  # a rank that stops answering fails the rest
    # Rank 0's rendezvous port is drawn from here: below Linux's ephemeral range (32768-60999), where a port
    # can be one that an outgoing connection on that host already holds (CI met EADDRINUSE at 33944).
    rendezvous_port_min: int = Field(default=20_000, ge=1024, le=65535)
    rendezvous_port_max: int = Field(default=32_767, ge=1024, le=65535)

    # The trainer's private memory (RssAnon of its whole process tree): past it the worker kills the trainer
    # and the job fails with `out_of_memory`. Unset: 75% of this node's memory.
    trainer_memory_limit: int | None = Field(default=None, ge=64 * MiB)
    # DeepSpeed compiles its shared-memory collective on a node's first ZeRO job (~35 s on 2 cores); kept here
    # for every later job, keyed by Python and torch. Unset: $XDG_CACHE_HOME/ortune/torch-extensions.
    torch_extensions_dir: Path | None = None
    # Tokenized stores and fine-tuned base models cached on this node's disk (least recently used go first
    # past the limit).
    cache_max_bytes: int = Field(default=20 * 1024 * MiB, ge=0)

    event_flush_seconds: float = 0.5
    event_batch_size: int = 200
    trainer_python: str = sys.executable

    s3_access_key: str = "ortune"
    s3_secret_key: SecretStr = SecretStr("ortune-dev-secret")
    s3_region: str = "us-east-1"

    @model_validator(mode="after")
    def _fill_embedded_defaults(self) -> Settings:
        if self.rendezvous_port_min > self.rendezvous_port_max:
            raise ValueError(
                f"ORTUNE_RENDEZVOUS_PORT_MIN ({self.rendezvous_port_min}) is above "
                f"ORTUNE_RENDEZVOUS_PORT_MAX ({self.rendezvous_port_max})"
            )
        idle = self.worker_idle_in_transaction_timeout_ms
        if idle is not None and idle >= self.heartbeat_timeout_seconds * 1000:
            raise ValueError(
                f"ORTUNE_WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS ({idle}) must be under "
                f"ORTUNE_HEARTBEAT_TIMEOUT_SECONDS ({self.heartbeat_timeout_seconds:g} s): a frozen "
                "worker's row locks would outlast its heartbeat, and the sweep would pass its job by"
            )
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
        if not self.serve_url:
            self.serve_url = f"http://{self.serve_host}:{self.serve_port}"
        if self.environment == "production":
            self._refuse_placeholders()
        return self

    def _refuse_placeholders(self) -> None:
        """Production never runs on a credential this project ships as an example."""
        found = [
            f"ORTUNE_{name}" for name, value in self._credentials().items() if value and value in PLACEHOLDERS
        ]
        if found:
            raise ValueError(
                f"{', '.join(found)}: a placeholder credential this project ships (one of "
                f"{', '.join(sorted(PLACEHOLDERS))}); production needs real secrets"
            )

    def _credentials(self) -> dict[str, str | None]:
        creds: dict[str, str | None] = {
            "DATABASE_URL password": urlsplit(self.database_url).password,
            "BROKER_URL password": urlsplit(self.broker_url).password,
            "ADMIN_API_KEY": self.admin_api_key.get_secret_value() if self.admin_api_key else None,
        }
        if self.storage_url.startswith("s3://"):
            creds |= {
                "S3_ACCESS_KEY": self.s3_access_key,
                "S3_SECRET_KEY": self.s3_secret_key.get_secret_value(),
            }
        return creds

    @property
    def api_key_required(self) -> bool:
        return self.require_api_key if self.require_api_key is not None else self.environment == "production"

    @property
    def node_queue(self) -> str:
        return f"{self.queue}.node.{self.node_name}"

    def session_limits(self, role: str) -> dict[str, int]:
        """The Postgres session settings (ms) of every connection of `role` (`api` or `worker`)."""
        idle = getattr(self, f"{role}_idle_in_transaction_timeout_ms")
        if idle is None:  # the worker's default follows its heartbeat timeout (read now: copies change it)
            idle = int(min(10_000, self.heartbeat_timeout_seconds * 500))
        return {
            "lock_timeout": getattr(self, f"{role}_lock_timeout_ms"),
            "statement_timeout": getattr(self, f"{role}_statement_timeout_ms"),
            "idle_in_transaction_session_timeout": idle,
        }

    @property
    def embedded(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def job_work_dir(self) -> Path:
        assert self.work_dir is not None
        return self.work_dir

    @property
    def cache_dir(self) -> Path:
        """This node's cache of tokenized stores, beside the attempts' work directories."""
        return self.job_work_dir / "cache"

    @property
    def torch_extensions_path(self) -> Path:
        """Where the trainers' torch extensions are built once per node, per Python and torch."""
        root = self.torch_extensions_dir or contract.user_cache("torch-extensions")
        return (
            root
            / f"py{sys.version_info.major}{sys.version_info.minor}-torch{importlib.metadata.version('torch')}"
        )

    @property
    def trainer_memory_bytes(self) -> int:
        if self.trainer_memory_limit is not None:
            return self.trainer_memory_limit
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.75)


@lru_cache
def get_settings() -> Settings:
    return Settings()
