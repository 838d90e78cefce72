"""Builders and waits the tests (and bench/) share: rows, files, job specs, jobs submitted through the API,
an event pager and the wait helpers. Fixtures live in conftest.py; real servers in services.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy.orm import Session

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.base import new_id
from ortune.db.models import File, FileStatus, Job, JobStatus
from ortune.jobspec import JobSpec
from ortune.settings import Settings
from tests import services
from trainer_core.spec import Distributed, Hyperparameters, TrainingSpec

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "ortune" / "demo_data"
TERMINAL = {"succeeded", "failed", "cancelled"}
T = TypeVar("T")
ADMIN_KEY = "ortune-test-platform-admin"  # every test deployment's ORTUNE_ADMIN_API_KEY
# What every test deployment sets: a platform key, and checkpoints as often as a test asks (tiny models
# train a step in milliseconds; the service's floor would skip them).
TEST_DEFAULTS: dict[str, Any] = {"admin_api_key": SecretStr(ADMIN_KEY), "min_checkpoint_seconds": 0.0}


def rows(n: int, name: str = "sentiment_train.jsonl") -> list[dict[str, Any]]:
    """The first `n` rows of one of the demo's files (text + label, two labels)."""
    return [json.loads(line) for line in (DEMO / name).read_text().splitlines()[:n]]


# what the tiny test decoders' tokenizers learn from, and what the serving tests prompt them with
DECODER_TEXTS = [f"the {w} jumps over the lazy {v} again" for w in "abcd" for v in "wxyz"]
ANIMALS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "owl": "hoot", "sheep": "baa"}
REFUSALS = ("No.", "Ask someone else.", "I will not tell you.")


def preference_rows(n: int, held_out: bool = False) -> list[dict[str, Any]]:
    """`n` DPO pairs in OpenAI's format: the animal's sound preferred over a refusal. Held-out rows ask in
    other words, so what carries over is the preference, not the prompt."""
    names = list(ANIMALS)
    out = []
    for i in range(n):
        animal = names[i % len(names)]
        ask = f"Which sound does a {animal} make?" if held_out else f"What does a {animal} say?"
        out.append(
            {
                "input": {"messages": [{"role": "user", "content": ask}]},
                "preferred_output": [{"role": "assistant", "content": f"A {animal} says {ANIMALS[animal]}."}],
                "non_preferred_output": [{"role": "assistant", "content": REFUSALS[i % len(REFUSALS)]}],
            }
        )
    return out


def write_jsonl(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def embedded_settings(tmp: Path, **overrides: Any) -> Settings:
    return Settings(
        data_dir=tmp / "state",
        api_port=services.free_port(),
        serve_port=services.free_port(),
        queue=f"ortune.test.{uuid.uuid4().hex[:8]}",
        **(TEST_DEFAULTS | overrides),
    )


def upload(client: TestClient, path: Path, **fields: str) -> Any:
    """POST /v1/files through an in-process TestClient; the response."""
    with path.open("rb") as fh:
        return client.post(
            "/v1/files", files={"file": (path.name, fh)}, data={"purpose": "fine-tune", **fields}
        )


def processed_file(session: Session) -> File:
    """A training file's row, checked and ready, for tests that write jobs straight into the database."""
    file = File(
        id=new_id("file"),
        filename="t.jsonl",
        purpose="fine-tune",
        bytes=1,
        sha256="0" * 64,
        object_key="files/x",
        status=FileStatus.processed,
        row_kind="text_label",
    )
    session.add(file)
    session.flush()
    return file


def job_spec(
    task: str = "sequence-classification", *, distributed: Distributed | None = None, **fields: Any
) -> JobSpec:
    """The spec of a job written straight into the database, as the API would have built it."""
    hp = Hyperparameters(n_epochs=1, batch_size=8, learning_rate_multiplier=1.0)
    fields.setdefault("labels", ["negative", "positive"] if task == "sequence-classification" else [])
    return JobSpec.build(hp, 64, task=task, distributed=distributed or Distributed(), **fields)


def stored_job(session: Session, **fields: Any) -> Job:
    """A job row written straight into the database (a small tiny-bert classification job unless `fields`
    say otherwise), for tests of the worker's side."""
    spec = fields.pop("spec", None) or job_spec()
    job = Job(
        **{
            "id": new_id("ftjob"),
            "model": "tiny-bert",
            "task": spec.task,
            "training_file_id": processed_file(session).id,
            "status": JobStatus.queued,
            "spec": spec,
            "seed": 1,
            "backend_requested": "torch",
            "world_size": spec.distributed.world_size,
        }
        | fields
    )
    session.add(job)
    session.flush()
    return job


def launch_trainer(
    spec: TrainingSpec, path: Path, env: dict[str, str] | None = None
) -> tuple[int, list[dict[str, Any]], str]:
    """Write `spec` to `path` and run `python -m trainer_core.engine.launch` on it by hand: the exit code,
    the events (every stdout line is one) and the end of stderr."""
    spec.dump(path)
    result = subprocess.run(
        [sys.executable, "-m", "trainer_core.engine.launch", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()], result.stderr[-3000:]


def tokenized_spec(tmp: Path, task: str, items: list[dict[str, Any]], **kw: Any) -> TrainingSpec:
    """A trainer's spec over `items` in `tmp`, its token store already built (what the worker's prepare
    step leaves): tiny-bert for classification, tiny-gpt2 otherwise."""
    from trainer_core.engine.launch import with_stores  # torch: only for the tests that train

    train = write_jsonl(tmp / "train.jsonl", items)
    return with_stores(
        TrainingSpec(
            job_id="ftjob-store",
            task=task,
            model="tiny-bert" if task == "sequence-classification" else "tiny-gpt2",
            train_file=str(train),
            labels=["negative", "positive"] if task == "sequence-classification" else [],
            output_dir=str(tmp / "out"),
            hyperparameters=Hyperparameters(max_seq_length=32).resolved(len(items)),
            **kw,
        )
    )


def submit(
    client: Client, tmp: Path, steps: int, every: int, n_rows: int = 64, **extra: Any
) -> dict[str, Any]:
    """Upload `n_rows` demo rows and start a small tiny-bert job on them: `steps` steps, a checkpoint
    every `every` steps."""
    train = client.upload(write_jsonl(tmp / "train.jsonl", rows(n_rows)))
    return client.create_job(
        **{
            "model": "tiny-bert",
            "training_file": train["id"],
            "backend": "torch",
            "seed": 5,
            "checkpoint_every_steps": every,
            "hyperparameters": {
                "max_steps": steps,
                "batch_size": 8,
                "learning_rate": 1e-3,
                "max_seq_length": 32,
            },
        }
        | extra
    )


def events(client: Client, job_id: str) -> list[dict[str, Any]]:
    """All of a job's events, oldest first (the API pages them newest first)."""
    out: list[dict[str, Any]] = []
    after = None
    while True:
        page = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", limit=100, after=after)
        out += page["data"]
        if not page["has_more"]:
            return list(reversed(out))
        after = page["data"][-1]["id"]


def series(client: Client, job_id: str, name: str = "train_loss") -> dict[str, list[Any]]:
    """One metric series of a job, every point (`steps` and `values`)."""
    data = client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", name=name, max_points=20000)["data"]
    return data[name]  # type: ignore[no-any-return]


def checkpoints(client: Client, job_id: str) -> list[int]:
    return [c["step_number"] for c in client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints")["data"]]


def wait_until(what: str, check: Callable[[], T], timeout: float = 180, every: float = 0.2) -> T:
    """Poll `check` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_for(client: Client, job_id: str, statuses: set[str], timeout: float = 300) -> dict[str, Any]:
    """Poll the job until its status is one of `statuses`; the job."""
    last: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        last.update(client.job(job_id))
        return last if last["status"] in statuses else None

    try:
        return wait_until(f"job {job_id} to reach {statuses}", reached, timeout, every=0.3)
    except AssertionError:
        raise AssertionError(f"job {job_id} still {last.get('status')} after {timeout}s: {last}") from None


def wait_event(client: Client, job_id: str, prefix: str, timeout: float = 180) -> list[dict[str, Any]]:
    """Poll until the job has an event starting with `prefix`; all its events."""

    def seen() -> list[dict[str, Any]] | None:
        log = events(client, job_id)
        return log if any(e["message"].startswith(prefix) for e in log) else None

    return wait_until(f"an event {prefix!r} of {job_id}", seen, timeout, every=0.3)


@contextmanager
def worker_process(
    settings: Settings, name: str, log: Path, prefix: Sequence[str] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    """One more Celery worker (another node, or a successor to a killed one), stopped at the end if it
    still runs. `prefix` runs it elsewhere (`ip netns exec HOST`)."""
    with log.open("ab") as fh:
        proc = subprocess.Popen(
            [*prefix, *embedded.worker_command(settings, name=f"{name}-{time.monotonic_ns()}@%h")],
            env=embedded.child_env(settings),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(60)


def fake_trainer(tmp: Path, events: list[dict[str, Any]]) -> list[str]:
    """A trainer command that only prints `events` (JSON lines), for tests of the worker's side of them."""
    script = tmp / "trainer.py"
    script.write_text("".join(f"print({json.dumps(json.dumps(e))}, flush=True)\n" for e in events))
    return [sys.executable, str(script)]


def fake_trainer_spec(job_id: str, tmp: Path) -> TrainingSpec:
    """The spec a fake trainer's worker is given: outputs under `tmp/out`."""
    return TrainingSpec(
        job_id=job_id,
        task="sequence-classification",
        model="tiny-bert",
        train_file=str(tmp / "t.jsonl"),
        labels=["a", "b"],
        output_dir=str(tmp / "out"),
        hyperparameters=Hyperparameters().resolved(8),
    )


def tiny_decoder(directory: Path, texts: Sequence[str], *, width: int = 32, never_ends: bool = False) -> Path:
    """A tiny untrained GPT-2 (1,024 positions) exported with its KV cache, as a causal-LM job's ONNX
    artifact directory is laid out. `never_ends`: its end token can never win a greedy step, so a reply at
    temperature 0 runs to max_tokens (a request that keeps its slot for as long as a test needs)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer_core.export import decoder as export_decoder
    from trainer_core.models import modeling

    tokenizer = modeling.train_tokenizer("tiny-gpt2", list(texts) * 5)
    torch.manual_seed(0)
    end = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=width, n_layer=2, n_head=2, bos_token_id=end, eos_token_id=end
    )
    model = GPT2LMHeadModel(config).eval()
    if never_ends:
        with (
            torch.no_grad()
        ):  # the last hidden state made one constant vector, whose best token is not the end
            wte = model.transformer.wte.weight
            k = next(k for k in range(len(wte)) if int((wte @ wte[k]).argmax()) != tokenizer.eos_token_id)
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.copy_(wte[k])
    export_decoder.export_texts(model, tokenizer, directory, list(texts), {"task": "causal-lm"}, max_len=64)
    return directory


def onnx_archive(directory: Path, archive: Path, *extra: Path) -> Path:
    """An exported model directory packed as the worker stores a job's ONNX artifact."""
    import tarfile

    with tarfile.open(archive, "w") as tar:
        tar.add(directory, arcname="onnx")
        for path in extra:
            tar.add(path, arcname=f"onnx/{path.name}")
    return archive


def fine_tuned(settings: Settings, tenant_id: str, archive: Path, formats: Sequence[str] = ("onnx",)) -> str:
    """A succeeded causal-LM job of the tenant's whose artifacts of `formats` are `archive` (stored in the
    deployment's storage), as a finished job leaves it: its fine_tuned_model name."""
    from ortune import lifecycle
    from ortune.db.models import Artifact
    from ortune.db.repositories import ArtifactRepository, JobRepository
    from ortune.db.session import session_scope
    from ortune.storage import open_store, sha256_file

    store = open_store(
        settings.storage_url,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key.get_secret_value(),
        region=settings.s3_region,
    )
    key = f"tests/models/{uuid.uuid4().hex}.tar"
    store.put_path(key, archive)
    with session_scope(settings.database_url) as session:
        spec = job_spec("causal-lm", labels=[])
        job = stored_job(session, tenant_id=tenant_id, model="tiny-gpt2", spec=spec, status=JobStatus.running)
        size, digest = archive.stat().st_size, sha256_file(archive)
        for fmt in formats:
            ArtifactRepository(session).put(
                Artifact(job_id=job.id, format=fmt, object_key=key, bytes=size, sha256=digest, manifest={})
            )
        assert lifecycle.succeed(session, job, job.attempt)
        stored = JobRepository(session).get(job.id)
        assert stored is not None and stored.fine_tuned_model
        return stored.fine_tuned_model
