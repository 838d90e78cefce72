"""Tokenize a job's files into stores (data/datastore.py): `python -m trainer_core.data.prepare spec.json`.

The worker runs this before the trainer when the stores its spec names are not cached yet, relays its
progress events and keeps the stores. Rows are read streaming and tokenized in batches by the fast
tokenizer's own threads, so memory stays flat in the file's size. `ensure` is also what the trainer calls
when it is run by hand without stores.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainer_core.contract import EXIT_FAILED, EXIT_OK
from trainer_core.data import chat, datastore, mediastore, rows
from trainer_core.data.datastore import StoreWriter, TokenStore
from trainer_core.events import EventStream
from trainer_core.spec import TrainingSpec

BATCH = 2048
TOKENIZER_ROWS = 100_000  # a built model's tokenizer learns its vocabulary from the first rows only
PROGRESS_EVERY_S = 1.0
DROPPED_LINES = 10  # the lines of left-out rows a store remembers, to name them


def _text(row: dict[str, Any]) -> str:
    """A row as one text: what a built model's tokenizer learns from, and the export's parity samples."""
    if "messages" in row:
        return chat.plain(row["messages"])
    if "preferred_output" in row:  # both answers: a built model's tokenizer must know the words of each
        return chat.plain(row["input"]["messages"] + row["preferred_output"] + row["non_preferred_output"])
    if "prompt" in row:
        return str(row["prompt"]) + str(row["completion"])
    return str(row["text"])


def _texts(path: Path, fmt: str, limit: int) -> Iterator[str]:
    with path.open(encoding="utf-8", newline="") as fh:
        for n, (_, row) in enumerate(rows.iter_rows(fh, fmt)):
            if n >= limit:
                return
            assert not isinstance(row, rows.RowError), row
            yield _text(row)


def _tokenizer(spec: TrainingSpec, store: Path) -> Any:
    """The job's tokenizer: the model's own, or for a built model one trained on the training file's first
    rows and kept in the store (every later reader of the store must use the very same one)."""
    from transformers import AutoTokenizer

    if mediastore.is_media(spec.task):  # images and audio: the model's processor stands for a tokenizer
        if spec.model_path is not None:
            return mediastore.load_processor(spec.model_path, spec.task)
        said = (
            mediastore.transcripts(Path(spec.train_file), spec.train_format)
            if mediastore.transcribes(spec.task)
            else []
        )
        processor = mediastore.built_processor(spec.model, said)
        processor.save_pretrained(store / "tokenizer")
        return processor
    if spec.model_path is not None:
        return AutoTokenizer.from_pretrained(spec.model_path, local_files_only=True, trust_remote_code=False)
    from trainer_core.models.modeling import train_tokenizer

    tokenizer = train_tokenizer(spec.model, _texts(Path(spec.train_file), spec.train_format, TOKENIZER_ROWS))
    tokenizer.save_pretrained(store / "tokenizer")
    return tokenizer


def seq_limit(spec: TrainingSpec, tokenizer: Any) -> int:
    """max_seq_length, bounded by what the model reads (its tokenizer's model_max_length; transformers puts a
    huge number there when a tokenizer does not say)."""
    model_max = getattr(tokenizer, "model_max_length", None) or 0
    bound = model_max if 0 < model_max < 1_000_000 else spec.hyperparameters.max_seq_length
    return min(spec.hyperparameters.max_seq_length, bound)


def _encode(
    batch: list[dict[str, Any]], tokenizer: Any, spec: TrainingSpec
) -> tuple[list[list[int]], list[int], list[list[int]] | None]:
    """Token ids, targets and loss masks of a batch of rows: for classification the class index (no mask);
    for a causal LM each row's per-token loss mask and its count of loss tokens (0: all cut by truncation)."""
    max_len = seq_limit(spec, tokenizer)
    if spec.task_info.classifies:
        index = {str(label): i for i, label in enumerate(spec.labels)}
        ids = tokenizer([r["text"] for r in batch], truncation=True, max_length=max_len)["input_ids"]
        return ids, [index[str(r["label"])] for r in batch], None
    if "messages" in batch[0]:  # a file holds one kind of row; chat: the model's own template, every turn
        encoded = [chat.encode(tokenizer, row["messages"], max_len) for row in batch]
    elif "preferred_output" in batch[0]:  # a pair as two rows, preferred then not: see methods/dpo.py
        encoded = [
            chat.encode(tokenizer, chat.answered(row["input"]["messages"], row[side]), max_len)
            for row in batch
            for side in ("preferred_output", "non_preferred_output")
        ]
    else:  # prompt/completion or text: one tokenizer call per batch for each side, as the fast path wants
        pairs = [("", r["text"]) if "text" in r else (r["prompt"], r["completion"]) for r in batch]
        prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
        targets = tokenizer([t for _, t in pairs], add_special_tokens=False)["input_ids"]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        encoded = [
            ((p + t + eos)[:max_len], ([0] * len(p) + [1] * (len(t) + len(eos)))[:max_len])
            for p, t in zip(prompts, targets, strict=True)
        ]
    return [i for i, _ in encoded], [sum(m) for _, m in encoded], [m for _, m in encoded]


def _build(
    path: Path,
    fmt: str,
    store: Path,
    key: str,
    tokenizer: Any,
    spec: TrainingSpec,
    events: EventStream,
    *,
    what: str,
    total: int | None,
    has_tokenizer: bool,
) -> None:
    if mediastore.is_media(spec.task):
        _build_media(
            path,
            fmt,
            store,
            key,
            tokenizer,
            spec,
            events,
            what=what,
            total=total,
            has_tokenizer=has_tokenizer,
        )
        return
    writer = StoreWriter(store, key, spec.task)
    unit = spec.method_info.rows_per_example  # store rows per file row
    t0 = last = time.monotonic()
    cpu0 = time.process_time()
    with path.open(encoding="utf-8", newline="") as fh:
        stream = (item for item in rows.iter_rows(fh, fmt) if not isinstance(item[1], rows.RowError))
        for numbered in datastore.batched(stream, BATCH):
            batch = [row for _, row in numbered]
            ids, targets, loss = _encode(batch, tokenizer, spec)
            texts = [_text(r) for r in batch[:8]]
            if loss is not None:  # a row whose every loss token was cut would train on nothing (a 0/0 loss)
                ids, targets, loss = _without_emptied(
                    writer, [n for n, _ in numbered], ids, targets, loss, unit
                )
            writer.add(ids, targets, texts, loss)
            if (now := time.monotonic()) - last >= PROGRESS_EVERY_S:
                last = now
                _progress(events, what, writer.rows // unit, total, writer.rows / unit / (now - t0))
    meta = writer.close(has_tokenizer=has_tokenizer)
    took, cpu_took = time.monotonic() - t0, time.process_time() - cpu0
    _report_tokenized(meta, spec, tokenizer, events, what, key, took, cpu_took)


def _report_tokenized(
    meta: datastore.Meta,
    spec: TrainingSpec,
    tokenizer: Any,
    events: EventStream,
    what: str,
    key: str,
    took: float,
    cpu_took: float,
) -> None:
    unit, rows_word = spec.method_info.rows_per_example, spec.method_info.example
    events.message(
        f"Tokenized {meta.rows // unit:,} {what} {rows_word} ({meta.tokens:,} tokens) in {took:.1f}s "
        f"({meta.rows / unit / max(took, 1e-9):,.0f} {rows_word}/s)",
        phase="tokenizing",
        rows=meta.rows,
        tokens=meta.tokens,
        seconds=round(took, 3),
        cpu_seconds=round(cpu_took, 3),  # over `seconds`: how many cores it kept busy
        store=key,
    )
    if meta.dropped and meta.rows and spec.hyperparameters.truncated_rows == "drop":
        events.message(
            f"{_truncated(meta, spec, tokenizer, what, rows_word)}; raise max_seq_length to train on them",
            level="warn",
            dropped=meta.dropped,
            lines=meta.dropped_lines,
        )


def _without_emptied(
    writer: StoreWriter,
    lines: list[int],
    ids: list[list[int]],
    targets: list[int],
    loss: list[list[int]],
    unit: int,
) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """A batch without the rows that truncation left no loss token; `unit` store rows make one example
    (a preference pair's two), kept or left out together. The writer counts them and keeps their lines."""
    keep = [n + k for n in range(0, len(targets), unit) if all(targets[n : n + unit]) for k in range(unit)]
    writer.dropped += (len(targets) - len(keep)) // unit
    cut = [lines[n // unit] for n in range(0, len(targets), unit) if not all(targets[n : n + unit])]
    writer.dropped_lines += cut[: DROPPED_LINES - len(writer.dropped_lines)]
    return [ids[n] for n in keep], [targets[n] for n in keep], [loss[n] for n in keep]


def _build_media(
    path: Path,
    fmt: str,
    store: Path,
    key: str,
    processor: Any,
    spec: TrainingSpec,
    events: EventStream,
    *,
    what: str,
    total: int | None,
    has_tokenizer: bool,
) -> None:
    t0 = time.monotonic()

    def report(done: int) -> None:
        _progress(events, what, done, total, done / max(time.monotonic() - t0, 1e-9), verb="Decoding")

    meta = mediastore.build(path, fmt, store, key, processor, spec, report, has_tokenizer=has_tokenizer)
    rows_done, took = meta.rows, time.monotonic() - t0
    events.message(
        f"Decoded {rows_done:,} {what} files in {took:.1f}s ({rows_done / max(took, 1e-9):,.0f} files/s)",
        phase="tokenizing",
        rows=rows_done,
        seconds=round(took, 3),
        store=key,
    )


def open_store(path: Path, task: str) -> datastore.Store:
    """A whole store opened read-only: token ids, or decoded media."""
    return mediastore.MediaStore(path) if mediastore.is_media(task) else TokenStore(path)


def _truncated(meta: datastore.Meta, spec: TrainingSpec, tokenizer: Any, what: str, rows_word: str) -> str:
    lines = ", ".join(map(str, meta.dropped_lines)) + (
        ", ..." if meta.dropped > len(meta.dropped_lines) else ""
    )
    return (
        f"{meta.dropped:,} {what} {rows_word} (line {lines}) were left out: max_seq_length "
        f"{seq_limit(spec, tokenizer)} cut every token that carried their loss (their assistant turns, or "
        "completion)"
    )


def check_truncation(
    store: datastore.Store, spec: TrainingSpec, tokenizer: Callable[[], Any], what: str
) -> None:
    """A store's left-out rows against the job's policy: a file that truncation emptied is always refused,
    any left-out row when `truncated_rows` is "refuse". Checked on every open, cached stores too."""
    meta = store.meta
    if not meta.dropped:
        return
    rows_word = spec.method_info.example
    cut = _truncated(meta, spec, tokenizer(), what, rows_word)
    if not meta.rows:
        raise ValueError(f"{cut}, which was all of them; raise max_seq_length")
    if spec.hyperparameters.truncated_rows == "refuse":
        raise ValueError(f"{cut}; truncated_rows is refuse: raise max_seq_length or shorten them")


def _progress(
    events: EventStream, what: str, done: int, total: int | None, rate: float, verb: str = "Tokenizing"
) -> None:
    eta = (total - done) / rate if total and rate > 0 else None
    of = f"/{total:,}" if total else ""
    tail = f", ETA {eta:.0f}s" if eta is not None else ""
    events.message(
        f"{verb} {what} data: {done:,}{of} rows, {rate:,.0f} rows/s{tail}",
        phase="tokenizing",
        rows_done=done,
        rows_total=total,
        rows_per_second=round(rate, 1),
        eta_seconds=round(eta, 1) if eta is not None else None,
    )


def ensure(spec: TrainingSpec, events: EventStream) -> tuple[Any, Any]:
    """The job's stores, built where the spec names them unless they are whole already. Processes on one
    machine that ask at once build each store once (a file lock), the others wait and open it."""
    assert spec.train_store is not None, "a spec to train from names its stores (see launch.with_stores)"
    train_dir = Path(spec.train_store)
    train_dir.parent.mkdir(parents=True, exist_ok=True)
    events.emit("phase", name="tokenizing")
    with _locked(train_dir):
        if not datastore.is_whole(train_dir):
            shutil.rmtree(train_dir, ignore_errors=True)
            tokenizer = _tokenizer(spec, train_dir)
            _build(
                Path(spec.train_file),
                spec.train_format,
                train_dir,
                train_dir.name,
                tokenizer,
                spec,
                events,
                what="training",
                total=spec.train_rows,
                has_tokenizer=spec.model_path is None,
            )
        else:
            tokenizer = None
    train = open_store(train_dir, spec.task)
    check_truncation(train, spec, lambda: tokenizer or load_tokenizer(spec, train), "training")
    valid = None
    if spec.validation_store is not None and spec.validation_file is not None:
        valid_dir = Path(spec.validation_store)
        with _locked(valid_dir):
            if not datastore.is_whole(valid_dir):
                shutil.rmtree(valid_dir, ignore_errors=True)
                tokenizer = tokenizer or load_tokenizer(spec, train)
                _build(
                    Path(spec.validation_file),
                    spec.validation_format,
                    valid_dir,
                    valid_dir.name,
                    tokenizer,
                    spec,
                    events,
                    what="validation",
                    total=None,
                    has_tokenizer=False,
                )
        valid = open_store(valid_dir, spec.task)
        check_truncation(valid, spec, lambda: tokenizer or load_tokenizer(spec, train), "validation")
    return train, valid


def load_tokenizer(spec: TrainingSpec, train: datastore.Store) -> Any:
    from transformers import AutoTokenizer

    source = train.tokenizer_dir or spec.model_path
    if mediastore.is_media(spec.task):
        assert source is not None, "a media store of a built model keeps its processor"
        return mediastore.load_processor(source, spec.task)
    return AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False)


class _locked:
    """An exclusive lock on `<store>.lock` for the block."""

    def __init__(self, store: Path) -> None:
        self.path = store.with_name(store.name + ".lock")

    def __enter__(self) -> None:
        self.fh = self.path.open("w")
        fcntl.flock(self.fh, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer_core.data.prepare", description=__doc__)
    parser.add_argument("spec", type=Path, help="the job's spec.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # batches are encoded on every core
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    events = EventStream.take_stdout()
    try:
        ensure(TrainingSpec.load(args.spec), events)
    except Exception as exc:
        events.emit(
            "error", code=type(exc).__name__, message=f"tokenizing failed: {type(exc).__name__}: {exc}"
        )
        logging.exception("prepare failed")
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
