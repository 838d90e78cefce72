"""Decoding in the inference process: with the export's KV cache and without one (an artifact from before the
cache was exported), stop texts, seeds, and the cache's byte bound."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ortune.storage import open_store, sha256_file
from serve.cache import MANIFEST, CacheBusy, ModelCache, Ref, TooLarge, load
from serve.models import Decoder, Sampling
from tests.support import DECODER_TEXTS, onnx_archive, wait_until
from trainer_core import export
from trainer_core.export import decoder as export_decoder
from trainer_core.models import modeling


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny untrained GPT-2 exported both ways: logits only (the old layout) and with its cache."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("decoders")
    tokenizer = modeling.train_tokenizer("tiny-gpt2", DECODER_TEXTS * 5)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2)).eval()
    manifest = {"task": "causal-lm"}
    export.export_texts(model, tokenizer, root / "plain", DECODER_TEXTS, manifest, max_len=64)
    export_decoder.export_texts(model, tokenizer, root / "cached", DECODER_TEXTS, manifest, max_len=64)
    return root / "plain", root / "cached"


def decoded(directory: Path, prompt: str, sampling: Sampling) -> tuple[str, str | None, int]:
    decoder = load(directory)
    assert isinstance(decoder, Decoder)
    text, last = "", ("", None, 0)
    for last in decoder.generate(decoder.encode(prompt), sampling):
        text += last[0]
    return text, last[1], last[2]


def test_an_artifact_without_a_cache_decodes_the_same_tokens_more_slowly(exported: tuple[Path, Path]) -> None:
    plain, cached = exported
    assert json.loads((plain / MANIFEST).read_text()).get("kv_cache") is None
    assert not load(plain).kv_cache and load(cached).kv_cache  # type: ignore[union-attr]
    greedy = Sampling(12, temperature=0)
    assert decoded(plain, "the a jumps", greedy) == decoded(cached, "the a jumps", greedy)
    seeded = Sampling(12, temperature=1.0, top_p=0.9, seed=3)
    assert decoded(cached, "the b", seeded) == decoded(plain, "the b", seeded)  # same seed, same sample


def test_a_stop_text_ends_the_reply_and_is_not_returned(exported: tuple[Path, Path]) -> None:
    _, cached = exported
    full, _, _ = decoded(cached, "the a jumps", Sampling(12, temperature=0))
    stop = full[3:6]
    assert stop.strip(), full
    text, reason, _ = decoded(cached, "the a jumps", Sampling(12, temperature=0, stop=[stop]))
    assert (text, reason) == (full[: full.index(stop)], "stop")
    _, reason, count = decoded(cached, "the a jumps", Sampling(5, temperature=0))
    assert reason in ("length", "stop") and count <= 5


def two_models(cached: Path, tmp: Path) -> tuple[Any, list[Ref], int]:
    """A store holding the export twice, as two archives with two digests: the store, their refs, and the
    unpacked model's bytes."""
    store = open_store(f"file://{tmp / 'objects'}")
    refs = []
    for name in ("one", "two"):
        (tmp / f"{name}.txt").write_text(name)
        archive = onnx_archive(cached, tmp / f"{name}.tar", tmp / f"{name}.txt")
        store.put_path(f"models/{name}.tar", archive)
        refs.append(Ref(name, f"models/{name}.tar", sha256_file(archive)))
    return store, refs, sum(p.stat().st_size for p in cached.rglob("*") if p.is_file())


def test_the_cache_holds_models_within_its_bytes(exported: tuple[Path, Path], tmp_path: Path) -> None:
    """Archives fetched and checked, loaded once, the least recently used evicted to make room, and a model
    over the whole bound refused by name."""
    store, refs, size = two_models(exported[1], tmp_path)
    cache = ModelCache(store, tmp_path / "serve", max_bytes=int(size * 1.5))
    with cache.use(refs[0]) as first, cache.use(refs[0]) as again:
        assert again.model is first.model and len(cache.entries) == 1  # loaded once
    cache.use(refs[1]).close()
    assert list(cache.entries) == [refs[1].sha256] and not (tmp_path / "serve" / refs[0].sha256).exists()
    small = ModelCache(store, tmp_path / "small", max_bytes=size // 2)
    with pytest.raises(TooLarge, match=r"one is .* more than this server's whole model cache"):
        small.use(refs[0])


def test_a_model_in_use_is_never_evicted_and_the_bound_holds(
    exported: tuple[Path, Path], tmp_path: Path
) -> None:
    """While a request holds model one, model two does not fit beside it: CacheBusy (503 with Retry-After),
    not a load past the bound; once the request is done, one is evicted for two."""
    store, refs, size = two_models(exported[1], tmp_path)
    cache = ModelCache(store, tmp_path / "serve", max_bytes=int(size * 1.5))
    lease = cache.use(refs[0])
    with pytest.raises(CacheBusy, match="does not fit beside the models in use now"):
        cache.use(refs[1])
    assert list(cache.entries) == [refs[0].sha256] and cache.used <= cache.max_bytes
    lease.close()
    lease.close()  # once only
    cache.use(refs[1]).close()
    assert list(cache.entries) == [refs[1].sha256] and cache.entries[refs[1].sha256].users == 0


def test_a_reply_that_fails_midway_ends_its_stream_with_an_error_event() -> None:
    import json

    from serve.app import _events

    def steps() -> Iterator[tuple[str, str | None, int]]:
        yield "the", None, 1
        yield " a", None, 2
        raise RuntimeError("the batch's ONNX Runtime call failed")

    ended: list[int] = []
    body = b"".join(_events(steps(), {"id": "x"}, True, 4, ended.append)).decode()
    events = [json.loads(e[len("data: ") :]) for e in body.strip().split("\n\n")]
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["the", " a"]
    assert (
        events[-1]["error"]["code"] == "server_error"
        and "failed after 2 tokens" in events[-1]["error"]["message"]
    )
    assert ended == [2]  # the slot and the model are given back


def test_concurrent_requests_share_steps_and_get_their_solo_tokens(exported: tuple[Path, Path]) -> None:
    """Requests of different prompt lengths, arriving together and while others decode, are batched (fewer
    ONNX Runtime calls than tokens) and each gets exactly its solo reply, greedy or seeded; a request that
    leaves mid-stream frees its row without disturbing the others."""
    import threading

    _, cached = exported
    decoder = load(cached)
    assert isinstance(decoder, Decoder)
    asks = [
        ("the a", Sampling(14, temperature=0)),
        ("the b jumps over the lazy w again the c", Sampling(9, temperature=0)),
        ("the c jumps", Sampling(16, temperature=1.0, top_p=0.9, seed=5)),
        ("the d jumps over", Sampling(12, temperature=0.7, seed=11)),
    ]

    def reply(pieces: Iterator[tuple[str, str | None, int]]) -> tuple[str, str | None, int]:
        # the text, the finish reason and the token count (a slow reader may get pieces joined)
        got = list(pieces)
        return "".join(p[0] for p in got), got[-1][1], got[-1][2]

    alone = [reply(decoder.solo(decoder.encode(p), s)) for p, s in asks]
    rows: list[int] = []  # the batch size of each ONNX Runtime call
    run = decoder.session.run

    def counted(names: object, feed: dict[str, Any]) -> object:
        rows.append(len(feed["input_ids"]))
        return run(names, feed)

    decoder.session = type("Counted", (), {"run": staticmethod(counted)})()
    together: list[tuple[str, str | None, int] | None] = [None for _ in asks]
    start = threading.Barrier(len(asks) + 1)

    def ask(i: int) -> None:
        start.wait()
        together[i] = reply(decoder.generate(decoder.encode(asks[i][0]), asks[i][1]))

    leaver = decoder.generate(decoder.encode("the a jumps"), Sampling(500, temperature=0))
    next(leaver)  # decoding in the batch before the others arrive
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(timeout=60)
    assert together == alone
    assert max(rows) == len(asks) + 1, rows  # everyone decoding in one call
    leaver.close()  # the client went away mid-reply: its row leaves, and the idle batch stops
    wait_until("the idle batch to stop", lambda: not decoder.batch.running, timeout=10)


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_a_request_that_did_not_come_through_the_api_is_refused_by_name(settings: Any) -> None:
    """The inference process trusts the API to name the model and the tenant; a request without either
    (sent to it straight) is a 400 that says so, before any model is touched."""
    from fastapi.testclient import TestClient

    from serve.app import create_app

    stored = {"name": "m", "object_key": "k", "sha256": "0" * 64, "task": "causal-lm"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(settings)) as client:
        for body in (chat, chat | {"ortune_model": stored}, chat | {"ortune_tenant": "t"}):
            refused = client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "model" and "requests come through the API" in error["message"]
        assert client.get("/healthz").json()["models"] == 0
