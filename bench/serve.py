"""Inference through the service against the same ONNX model run directly with onnxruntime, side by side:
tokens/s and time to first token for 1 and for 8 concurrent streams (target: the service at 8 streams gets
>= 0.8x of direct throughput), and the inference process's memory with its cache setting.

The model: small-llama (bench/llm_methods) fine-tuned briefly through the embedded service, so the artifact
is the service's own KV-cache export. Direct runs use serve.models.Decoder.solo in this process: the same
decoding code, no HTTP, no API, each stream its own ONNX Runtime calls on its own thread (what a program of
one's own would do); service runs stream through the official openai client, and the inference process
batches the concurrent streams' steps.

    python -m bench.serve [--out bench/results] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

from bench.common import configuration, verdict, write
from bench.llm_methods import base_model, sums
from ortune.cli import embedded
from ortune.cli.client import Client
from tests.support import TERMINAL, wait_for, write_jsonl

# a text completion: the chat-trained model never learned an end token outside the template, so every
# stream decodes all its tokens and the figures measure decoding, not the length of an answer
PROMPT = "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n3 plus 4 is 7."


def direct(onnx_dir: Path, streams: int, tokens: int) -> dict[str, Any]:
    import onnxruntime as ort

    from serve.cache import MANIFEST
    from serve.models import Decoder, Sampling

    manifest = __import__("json").loads((onnx_dir / MANIFEST).read_text())
    session = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    decoder = Decoder(onnx_dir, session, manifest)
    prompt = decoder.encode(PROMPT)

    def one() -> tuple[float, int]:
        t0 = time.perf_counter()
        first, generated = None, 0
        for text, _, so_far in decoder.solo(prompt, Sampling(tokens, temperature=1.0, seed=1)):
            if text:
                first = first or time.perf_counter() - t0
            generated = so_far
        return first or 0.0, generated

    return _concurrently(one, streams)


def service(client: openai.OpenAI, name: str, streams: int, tokens: int) -> dict[str, Any]:
    def one() -> tuple[float, int]:
        t0 = time.perf_counter()
        first, count = None, 0
        stream = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=tokens, temperature=1.0, seed=1, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter() - t0
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
        return first or 0.0, count

    return _concurrently(one, streams)


def _concurrently(one: Any, streams: int) -> dict[str, Any]:
    one()  # warm: the model loaded, the first-call costs paid
    results: list[tuple[float, int]] = []
    lock = threading.Lock()

    def run() -> None:
        got = one()
        with lock:
            results.append(got)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    firsts = sorted(r[0] for r in results)
    return {
        "tokens_per_s": sum(r[1] for r in results) / wall,
        "ttft_median_ms": statistics.median(firsts) * 1000,
        "ttft_max_ms": firsts[-1] * 1000,  # of 8 streams, the p99 is the slowest
        "tokens": sum(r[1] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, configuration("embedded", Path(tmp) / "svc") as settings:
        root = Path(tmp)
        base_model(root / "hub")
        settings = settings.model_copy(update={"models_dir": root / "hub", "serve_cache_bytes": 256 * 2**20})
        with embedded.start(settings, log_dir=root / "logs") as services:
            api = Client(settings.api_url)
            train = api.upload(write_jsonl(root / "chat.jsonl", sums()))
            job = api.create_job(
                model="small-llama",
                training_file=train["id"],
                hyperparameters={"n_epochs": 2, "batch_size": 16, "learning_rate": 3e-3},
            )
            done = wait_for(api, job["id"], TERMINAL, timeout=900)
            assert done["status"] == "succeeded", done["error"]
            api.download(job["id"], "onnx", root / "onnx.tar")
            with tarfile.open(root / "onnx.tar") as tar:
                tar.extractall(root, filter="data")
            client = openai.OpenAI(base_url=f"{settings.api_url}/v1", api_key="unused", max_retries=0)
            rows = {}
            for streams in (1, 8):
                rows[f"direct, {streams} stream(s)"] = direct(root / "onnx", streams, args.tokens)
                rows[f"service, {streams} stream(s)"] = service(
                    client, done["fine_tuned_model"], streams, args.tokens
                )
            serve_pid = httpx.get(f"{settings.serve_url}/healthz").json()["pid"]
            rss = psutil.Process(serve_pid).memory_info().rss
            cache = httpx.get(f"{settings.serve_url}/healthz").json()["cache_bytes"]
            assert services.procs
    ratio8 = rows["service, 8 stream(s)"]["tokens_per_s"] / rows["direct, 8 stream(s)"]["tokens_per_s"]
    ratio1 = rows["service, 1 stream(s)"]["tokens_per_s"] / rows["direct, 1 stream(s)"]["tokens_per_s"]
    lines = [
        f"### serve (small-llama ONNX with KV cache, text completions of up to {args.tokens} tokens a "
        "stream, sampled; embedded)",
        "",
        "| run | tokens/s | TTFT median | TTFT slowest | tokens |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        ttft = f"{r['ttft_median_ms']:.0f} ms | {r['ttft_max_ms']:.0f} ms"
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {ttft} | {r['tokens']} |")
    lines += [
        "",
        f"service/direct throughput: 1 stream {ratio1:.2f}x, 8 streams {ratio8:.2f}x (target >= 0.8x at 8: "
        f"{verdict(ratio8 >= 0.8)}); inference process RSS {rss / 2**20:.0f} MiB with "
        f"{cache / 2**20:.1f} MiB of models cached (cache bound 256 MiB)",
    ]
    write(
        args.out,
        "serve",
        {"rows": rows, "ratio_8": ratio8, "rss": rss, "cache_bytes": cache},
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
