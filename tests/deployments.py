"""Running deployments the end-to-end tests share: one per configuration and test process (API, worker and
inference process, with their database, broker and storage), started on first use and stopped at the end of
the session. Each test works in a tenant of its own, with its own API key, so nothing one test uploads,
trains or serves is visible to another; after each test whatever it left running is cancelled, so the next
one finds the worker free.

Starting the three processes costs seconds a test; tests that need a deployment of their own (other
settings, a process they kill) start one with `embedded.start` as before.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ortune.cli import embedded
from ortune.cli.client import APIError, Client
from ortune.settings import Settings
from tests.support import ADMIN_KEY, TERMINAL, wait_until

_names = itertools.count(1)


@dataclass
class Deployment:
    settings: Settings
    services: embedded.Services
    logs: Path
    admin: Client = field(init=False)

    def __post_init__(self) -> None:
        self.admin = Client(self.settings.api_url, api_key=ADMIN_KEY)

    def tenant_client(self, test: str) -> Client:
        """A client holding the API key of a new tenant named after the test."""
        name = f"t{next(_names)}-{uuid.uuid4().hex[:6]}"
        tenant = self.admin.post("/v1/admin/tenants", json={"name": name})
        key = self.admin.post(f"/v1/admin/tenants/{tenant['id']}/api_keys", json={"name": test[:100]})
        return Client(self.settings.api_url, api_key=key["key"])

    def log_offsets(self) -> dict[Path, int]:
        return {log: log.stat().st_size for log in self.logs.glob("*.log")}

    def print_logs_since(self, offsets: dict[Path, int]) -> None:
        """What each process logged during one test (the end of it), for the test's captured output."""
        for log in sorted(self.logs.glob("*.log")):
            with log.open("rb") as fh:
                fh.seek(offsets.get(log, 0))
                lines = fh.read().decode(errors="replace").splitlines(True)[-40:]
            print(f"--- {log.name} (this test's tail)\n" + "".join(lines))

    def settle(self, client: Client, timeout: float = 120) -> None:
        """Cancel the tenant's unfinished jobs and wait until they have ended, so the shared worker is free
        for the next test."""
        try:
            jobs = client.get("/v1/fine_tuning/jobs", limit=100)["data"]
        except APIError:
            return
        open_jobs = [j["id"] for j in jobs if j["status"] not in TERMINAL]
        for job_id in open_jobs:
            with contextlib.suppress(APIError):  # it ended meanwhile
                client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")

        def ended() -> bool:
            return all(client.job(j)["status"] in TERMINAL for j in open_jobs)

        wait_until("the test's jobs to end", ended, timeout)
        if self.services.exited() is not None:
            raise RuntimeError(f"a shared deployment's process died: {self.services.exited()}")


class Deployments:
    """The shared deployments of this test process, by configuration."""

    def __init__(self, make_settings: Callable[[str], Settings], root: Path) -> None:
        self.make_settings, self.root = make_settings, root
        self.running: dict[str, Deployment] = {}

    def get(self, config: str) -> Deployment:
        if config not in self.running:
            settings = self.make_settings(config).model_copy(update={"require_api_key": True})
            logs = self.root / config / "logs"
            services = embedded.start(settings, log_dir=logs)
            self.running[config] = Deployment(settings, services, logs)
        return self.running[config]

    def close(self) -> None:
        for deployment in self.running.values():
            deployment.services.stop()


def client_kwargs(client: Client) -> dict[str, Any]:
    """The base URL and key for another client (the openai SDK) to act as the same tenant."""
    return {"base_url": f"{client.http.base_url}/v1", "api_key": client.api_key}
