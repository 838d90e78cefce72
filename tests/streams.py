"""Streams kept open through a soak: a caller that streams chat replies from a fine-tuned model, one after the
other, and sorts how each ended. What the service promises: every stream completes (`data: [DONE]`) or ends
with an error event; a request it cannot take now is a 503 or 429 with Retry-After; nothing is cut short
without a word, and no other 5xx.

Used by tests/hosts.py's soak (and so by tests/e2e/test_hosts.py and bench/soak.py)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ortune.settings import Settings
from tests.support import DECODER_TEXTS, fine_tuned, onnx_archive, tiny_decoder


def chat_model(settings: Settings, tenant_id: str, tmp: Path) -> str:
    """A tiny causal LM, exported as a job's ONNX artifact and recorded as the tenant's fine-tuned model."""
    directory = tiny_decoder(tmp / "served-decoder", DECODER_TEXTS)
    return fine_tuned(settings, tenant_id, onnx_archive(directory, tmp / "served.tar"))


@dataclass
class Streams:
    """Streams of `model` through the API at `api`, one at a time, until stopped. `ends` counts how each
    ended: completed, error_event (and its code), refused (503/429 with Retry-After), and the broken
    promises: cut (no [DONE] and no error event), no_retry_after, other_status."""

    api: str
    key: str
    model: str
    ends: Counter[str] = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)
    completed_at: list[float] = field(default_factory=list)  # monotonic times a stream completed
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Streams:
        threading.Thread(target=self._run, name="soak-streams", daemon=True).start()
        return self

    def completed_since(self, t: float) -> bool:
        return any(at > t for at in self.completed_at)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "the a jumps"}],
            "max_tokens": 32,
            "temperature": 0,
            "stream": True,
        }
        with httpx.Client(base_url=self.api, timeout=httpx.Timeout(30, connect=5), headers=headers) as http:
            while not self.stop.is_set():
                self._one(http, body)
                self.stop.wait(0.2)

    def _one(self, http: httpx.Client, body: dict[str, object]) -> None:
        events: list[str] = []
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    self._refused(response)
                    return
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
        except httpx.TransportError as exc:  # the API itself unreachable: not a stream it broke
            self.ends[f"unreachable ({type(exc).__name__})"] += 1
            return
        if events and events[-1] == "[DONE]":
            self.ends["completed"] += 1
            self.completed_at.append(time.monotonic())
        elif events and "error" in (last := json.loads(events[-1])):
            self.ends[f"error_event ({last['error'].get('code')})"] += 1
        else:
            self.ends["cut"] += 1
            self.broken.append(f"a stream cut after {len(events)} events: {events[-1:]}")

    def _refused(self, response: httpx.Response) -> None:
        code = (response.json().get("error") or {}).get("code") if response.content else None
        if response.status_code in (429, 503) and response.headers.get("retry-after"):
            self.ends[f"refused {response.status_code} ({code})"] += 1
        else:
            self.ends[f"status {response.status_code} ({code})"] += 1
            self.broken.append(f"{response.status_code} without Retry-After: {response.text[:200]}")
