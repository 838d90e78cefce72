"""Inference under hostile load, against the real API and inference processes: a tenant past its streams or
its tokens a minute is told when to come back (429 + Retry-After, through the official `openai` client)
while another tenant's stream goes on; replies are bounded by the model's context and the server's most; a
huge prompt is refused before it is tokenized; and the model cache stays within its bytes while a model it
would evict is in use."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.settings import Settings
from tests.support import (
    ADMIN_KEY,
    DECODER_TEXTS,
    embedded_settings,
    fine_tuned,
    onnx_archive,
    tiny_decoder,
    wait_until,
)

pytestmark = pytest.mark.e2e

LONG = 900  # tokens of a reply that keeps its slot for a few seconds (the model never ends one early)
HI = [{"role": "user", "content": "the a jumps"}]


@dataclass
class Served:
    settings: Settings
    models: dict[str, str]  # tenant -> its fine-tuned model's name (a: model one, others: model one or two)
    keys: dict[str, str]
    tenants: dict[str, str]  # tenant -> its id

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.settings.api_url}/v1", api_key=self.keys[tenant], max_retries=0)

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.settings.serve_url}/healthz").json())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served")
    # 2 MB wide: over the least cache ORTUNE_SERVE_CACHE_BYTES allows
    model = tiny_decoder(root / "model", DECODER_TEXTS, width=128, never_ends=True)
    size = sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
    (root / "two.txt").write_text("a second archive of the same model: another digest")
    one = onnx_archive(model, root / "one.tar")
    two = onnx_archive(model, root / "two.tar", root / "two.txt")
    settings = embedded_settings(
        root,
        serve_max_streams_per_tenant=2,
        serve_tokens_per_minute_per_tenant=2_000,
        serve_max_tokens=950,
        serve_cache_bytes=int(size * 1.5),  # room for one model, not two
    )
    with embedded.start(settings, worker=False, log_dir=root / "logs"):
        admin = Client(settings.api_url, api_key=ADMIN_KEY)
        models, keys, tenants = {}, {}, {}
        for tenant, archive in [("a", one), ("b", one), ("c", one), ("d", one), ("e", two), ("f", one)]:
            made = admin.post("/v1/admin/tenants", json={"name": f"serve-{tenant}"})
            keys[tenant] = admin.post(f"/v1/admin/tenants/{made['id']}/api_keys", json={"name": tenant})[
                "key"
            ]
            models[tenant], tenants[tenant] = fine_tuned(settings, made["id"], archive), made["id"]
        yield Served(settings, models, keys, tenants)
    shutil.rmtree(root, ignore_errors=True)


def stream(served: Served, tenant: str, max_tokens: int, model: str | None = None) -> Iterator[Any]:
    """A streamed chat reply, started: its chunks as they come (the first already taken)."""
    chunks = served.client(tenant).chat.completions.create(
        model=model or served.models[tenant],
        messages=HI,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    first = next(iter(chunks))
    assert first.choices[0].delta.role == "assistant"
    return iter(chunks)


def test_a_tenant_past_its_streams_is_told_when_to_retry_and_another_tenant_streams_on(
    served: Served,
) -> None:
    busy = [stream(served, "a", LONG) for _ in range(2)]  # tenant a's two, generating
    assert served.health()["requests_under_way"] == {served.tenants["a"]: 2}
    with pytest.raises(openai.RateLimitError) as refused:
        served.client("a").chat.completions.create(model=served.models["a"], messages=HI, max_tokens=5)  # type: ignore[arg-type]
    assert refused.value.code == "rate_limit_exceeded"
    assert "ORTUNE_SERVE_MAX_STREAMS_PER_TENANT=2" in refused.value.message
    assert int(refused.value.response.headers["retry-after"]) >= 1

    # another tenant's reply, meanwhile, runs whole (it shares the batch with a's two)
    other = served.client("b").chat.completions.create(
        model=served.models["b"],
        messages=HI,
        temperature=0,
        max_tokens=20,  # type: ignore[arg-type]
    )
    assert other.choices[0].finish_reason == "length" and other.usage and other.usage.completion_tokens == 20
    ends = []
    for chunks in busy:
        *_, usage = list(chunks)
        ends.append(usage.usage.completion_tokens if usage.usage else None)
    assert ends == [LONG, LONG]  # the refusal came while both were still generating
    wait_until("a's slots free", lambda: not served.health()["requests_under_way"], timeout=30)
    again = served.client("a").chat.completions.create(model=served.models["a"], messages=HI, max_tokens=5)  # type: ignore[arg-type]
    assert again.choices[0].finish_reason == "length"


def test_tokens_a_minute_count_what_was_reserved_less_what_went_unused(served: Served) -> None:
    """2,000 a minute: a reply that stops early gives back what it did not use, so two full ones fit after it;
    a third waits, and Retry-After says for how long."""
    client, model = served.client("c"), served.models["c"]
    early = client.chat.completions.create(
        model=model,
        messages=HI,
        temperature=0,
        max_tokens=LONG,
        stop=[_first_piece(served)],  # type: ignore[arg-type]
    )
    assert early.choices[0].finish_reason == "stop" and early.usage and early.usage.completion_tokens <= 2
    started = time.monotonic()
    for _ in range(2):
        full = client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=LONG)  # type: ignore[arg-type]
        assert full.usage and full.usage.completion_tokens == LONG
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=LONG)  # type: ignore[arg-type]
    prompt = full.usage.prompt_tokens
    assert "ORTUNE_SERVE_TOKENS_PER_MINUTE_PER_TENANT" in refused.value.message
    # what is left after two full replies, refilled at 2,000/60 a second since they started, falls short of
    # one more by about Retry-After's seconds of refill
    short = (prompt + LONG) - (2_000 - 2 * (prompt + LONG))
    retry = int(refused.value.response.headers["retry-after"])
    waited = time.monotonic() - started
    assert short * 60 / 2_000 - waited - 2 <= retry <= short * 60 / 2_000 + 1


def test_replies_are_bounded_by_the_context_and_the_servers_most(served: Served) -> None:
    client, model = served.client("d"), served.models["d"]
    with pytest.raises(openai.BadRequestError) as over:
        client.chat.completions.create(model=model, messages=HI, max_tokens=951)  # type: ignore[arg-type]
    assert over.value.param == "max_tokens" and "ORTUNE_SERVE_MAX_TOKENS" in over.value.message
    long_prompt = [{"role": "user", "content": "the a jumps over the lazy w " * 110}]
    with pytest.raises(openai.BadRequestError) as context:
        client.chat.completions.create(model=model, messages=long_prompt, max_tokens=900)  # type: ignore[arg-type]
    assert (
        context.value.code == "context_length_exceeded" and "context is 1024 tokens" in context.value.message
    )
    # without max_tokens a reply gets what the context has room for, up to the default
    fitted = client.chat.completions.create(model=model, messages=long_prompt, temperature=0)  # type: ignore[arg-type]
    assert fitted.usage and fitted.usage.prompt_tokens + fitted.usage.completion_tokens == 1024
    assert fitted.choices[0].finish_reason == "length"

    # a prompt the context cannot hold however it is tokenized is refused by its bytes, before tokenizing
    huge = "jumps " * 150_000  # 900 kB: under the API's 1 MiB body limit
    refused = httpx.post(
        f"{served.settings.api_url}/v1/completions",
        json={"model": model, "prompt": huge, "max_tokens": 5},
        headers={"Authorization": f"Bearer {served.keys['d']}"},
        timeout=30,
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "the prompt is 900,000 bytes" in error["message"]


def test_the_model_cache_stays_in_its_bytes_while_a_model_it_would_evict_is_in_use(served: Served) -> None:
    bound = served.settings.serve_cache_bytes
    held = stream(served, "d", LONG)  # model one, held for the length of the reply
    with pytest.raises(openai.APIStatusError) as busy:
        served.client("e").chat.completions.create(model=served.models["e"], messages=HI, max_tokens=5)  # type: ignore[arg-type]
    assert busy.value.status_code == 503 and busy.value.code == "model_cache_busy"
    assert busy.value.response.headers["retry-after"] == "1"
    health = served.health()
    assert health["cache_bytes"] <= bound and health["models_in_use"] == 1
    *_, last = list(held)
    assert last.usage and last.usage.completion_tokens == LONG  # the held reply was never disturbed
    # once it is done, model one is evicted for model two
    answer = served.client("e").chat.completions.create(model=served.models["e"], messages=HI, max_tokens=5)  # type: ignore[arg-type]
    assert answer.choices[0].finish_reason == "length"
    health = served.health()
    assert health["models"] == 1 and health["cache_bytes"] <= bound


def test_a_model_deleted_while_it_streams_finishes_the_stream_and_is_gone_after(served: Served) -> None:
    held = stream(served, "f", 300)
    deleted = httpx.delete(
        f"{served.settings.api_url}/v1/models/{served.models['f']}",
        headers={"Authorization": f"Bearer {served.keys['f']}"},
    )
    assert deleted.status_code == 200, deleted.text
    *_, last = list(held)
    assert last.usage and last.usage.completion_tokens == 300  # the reply under way runs to its end
    with pytest.raises(openai.NotFoundError) as gone:
        served.client("f").chat.completions.create(model=served.models["f"], messages=HI, max_tokens=5)  # type: ignore[arg-type]
    assert gone.value.code == "model_not_found"


def _first_piece(served: Served) -> str:
    """The text the never-ending model writes first (it writes the same token every step)."""
    reply = served.client("b").chat.completions.create(
        model=served.models["b"],
        messages=HI,
        temperature=0,
        max_tokens=1,  # type: ignore[arg-type]
    )
    return str(reply.choices[0].message.content)
