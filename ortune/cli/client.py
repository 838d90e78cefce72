"""A small httpx client for the REST API, used by the CLI and the demo (the openai SDK works too)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential


class APIError(RuntimeError):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.status, self.code, self.param = status, err.get("code"), err.get("param")
        where = f" (param {self.param})" if self.param else ""
        super().__init__(f"HTTP {status} {self.code}: {err.get('message', body)}{where}")


_transient = retry(
    retry=retry_if_exception_type(httpx.TransportError),
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=0.2, max=3),
    reraise=True,
)


class Client:
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 60.0) -> None:
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, headers=headers)

    def _json(self, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {"error": {"message": response.text}}
            raise APIError(response.status_code, body)
        return response.json()

    @_transient
    def get(self, path: str, **params: Any) -> Any:
        return self._json(self.http.get(path, params={k: v for k, v in params.items() if v is not None}))

    @_transient
    def post(self, path: str, json: dict[str, Any] | None = None) -> Any:
        return self._json(self.http.post(path, json=json))

    def upload(self, path: Path, purpose: str = "fine-tune") -> dict[str, Any]:
        with path.open("rb") as fh:
            return self._json(
                self.http.post("/v1/files", files={"file": (path.name, fh)}, data={"purpose": purpose})
            )

    def create_job(self, **spec: Any) -> dict[str, Any]:
        return self.post("/v1/fine_tuning/jobs", json=spec)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/v1/fine_tuning/jobs/{job_id}")

    def events_since(self, job_id: str, last_id: int) -> list[dict[str, Any]]:
        """Events newer than `last_id`, oldest first."""
        page = self.get(f"/v1/fine_tuning/jobs/{job_id}/events", limit=100)
        return sorted(
            (e for e in page["data"] if int(e["id"].split("-")[1]) > last_id),
            key=lambda e: int(e["id"].split("-")[1]),
        )

    def download(
        self, job_id: str, fmt: str, dest: Path, progress: Callable[[int, int], None] | None = None
    ) -> str:
        """Stream an artifact to dest, resuming a partial file with Range; returns the verified sha256."""
        url = f"/v1/fine_tuning/jobs/{job_id}/artifacts/{fmt}"
        have = dest.stat().st_size if dest.exists() else 0
        for start in dict.fromkeys([have, 0]):
            headers = {"Range": f"bytes={start}-"} if start else {}
            with self.http.stream("GET", url, headers=headers) as response:
                if response.status_code == 416:  # the partial file is not a prefix we can extend
                    continue
                if response.status_code >= 400:
                    response.read()
                    self._json(response)
                expected = response.headers["x-ortune-sha256"]
                partial = response.status_code == 206
                total = (
                    int(response.headers["content-range"].rsplit("/", 1)[1])
                    if partial
                    else int(response.headers["content-length"])
                )
                done = start if partial else 0
                with dest.open("ab" if partial else "wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        out.write(chunk)
                        done += len(chunk)
                        if progress:
                            progress(done, total)
            break
        digest = hashlib.sha256()
        with dest.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != expected:
            dest.unlink()
            raise RuntimeError(
                f"checksum mismatch for {dest.name}: got {digest.hexdigest()}, expected {expected}"
            )
        return expected
