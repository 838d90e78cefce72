"""Row formats a training file may hold, and the streaming check run on every upload.

Supported rows (JSONL objects, or CSV with a header): `{"text", "label"}`, `{"text"}`,
`{"prompt", "completion"}`, chat `{"messages": [{"role", "content"}, ...]}` and preference pairs in OpenAI's
DPO format `{"input": {"messages"}, "preferred_output": [...], "non_preferred_output": [...]}`. A file holds
one kind.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from trainer_core import tasks

KINDS: dict[str, frozenset[str]] = {
    "text_label": frozenset({"text", "label"}),
    "prompt_completion": frozenset({"prompt", "completion"}),
    "chat": frozenset({"messages"}),
    "preference": frozenset({"input", "preferred_output", "non_preferred_output"}),
    "text": frozenset({"text"}),
}
# archives of media files (trainer_core/data/media.py), described as a refusal names them
MEDIA_KINDS: dict[str, str] = {
    "image_label": "an archive of images with labels",
    "audio_label": "an archive of audio clips with labels",
    "audio_transcription": "an archive of audio clips with transcriptions",
}
FORMATS = ("jsonl", "csv")
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_REPORTED_ERRORS = 10
MAX_LABELS = 1000


class RowError(ValueError):
    pass


def file_format(filename: str) -> str | None:
    suffix = filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
    return {"jsonl": "jsonl", "json": "jsonl", "ndjson": "jsonl", "csv": "csv"}.get(suffix)


def required_columns(kinds: Iterable[str]) -> str:
    """Row kinds as a refusal names them: their fields, or what an archive of them holds."""
    return " or ".join(
        MEDIA_KINDS[k] if k in MEDIA_KINDS else "{" + ", ".join(sorted(KINDS[k])) + "}" for k in kinds
    )


def row_kind(row: dict[str, Any]) -> str:
    """The kind of one row, or RowError saying what is wrong with it."""
    keys = frozenset(k for k, v in row.items() if v is not None)
    for kind, needed in KINDS.items():
        if needed <= keys:
            extra = keys - needed
            if extra and kind != "text_label":
                raise RowError(f"unexpected field(s) {', '.join(sorted(extra))} in a {kind} row")
            _check_values(kind, row)
            return kind
    if "label" in keys:
        raise RowError("missing required field 'text'")
    if "prompt" in keys or "completion" in keys:
        missing = "completion" if "prompt" in keys else "prompt"
        raise RowError(f"missing required field '{missing}'")
    raise RowError(
        "no supported fields: expected one of "
        + ", ".join("{" + ", ".join(sorted(v)) + "}" for v in KINDS.values())
    )


def _check_messages(messages: Any, where: str, roles: frozenset[str] = CHAT_ROLES) -> None:
    if not isinstance(messages, list) or not messages:
        raise RowError(f"'{where}' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in roles:
            allowed = f"one of {', '.join(sorted(roles))}" if len(roles) > 1 else next(iter(roles))
            raise RowError(f"{where}[{i}].role must be {allowed}")
        if not isinstance(msg.get("content"), str):
            raise RowError(f"{where}[{i}].content must be a string")
        if "weight" in msg:  # OpenAI's: 0 leaves an assistant turn out of the loss
            if where != "messages":
                raise RowError(f"{where}[{i}].weight is only for a chat row's assistant messages")
            if msg["role"] != "assistant":
                raise RowError(f"{where}[{i}].weight is only for assistant messages")
            if isinstance(msg["weight"], bool) or msg["weight"] not in (0, 1):
                raise RowError(f"{where}[{i}].weight must be 0 or 1")


def _check_values(kind: str, row: dict[str, Any]) -> None:
    if kind == "chat":
        _check_messages(row["messages"], "messages")
        if not any(m["role"] == "assistant" and m.get("weight", 1) for m in row["messages"]):
            raise RowError("a chat row needs an assistant message to learn from (one without weight 0)")
        return
    if kind == "preference":
        prompt = row["input"]
        if not isinstance(prompt, dict) or "messages" not in prompt:
            raise RowError("'input' must be an object with 'messages'")
        if extra := set(prompt) - {"messages"}:
            raise RowError(f"unsupported field(s) {', '.join(sorted(extra))} in 'input'")
        _check_messages(prompt["messages"], "input.messages")
        for side in ("preferred_output", "non_preferred_output"):
            _check_messages(row[side], side, frozenset({"assistant"}))
        if row["preferred_output"] == row["non_preferred_output"]:
            raise RowError("preferred_output and non_preferred_output are the same: nothing to prefer")
        return
    for name in KINDS[kind]:
        value = row[name]
        if name == "label":
            if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
                raise RowError("'label' must be a non-empty string or an integer")
        elif not isinstance(value, str) or not value.strip():
            raise RowError(f"'{name}' must be a non-empty string")


class LineTooLong(RowError):
    pass


def _lines(fh: IO[str], max_chars: int | None) -> Iterator[str]:
    """The file's lines; a line over `max_chars` raises LineTooLong after at most `max_chars` are read, so a
    file of one huge line never sits in memory whole."""
    if max_chars is None:
        yield from fh
        return
    while line := fh.readline(max_chars + 1):
        if len(line) > max_chars and not line.endswith("\n"):
            raise LineTooLong(f"longer than {max_chars:,} characters (limit max_row_chars)")
        yield line


def iter_rows(
    fh: IO[str], fmt: str, *, max_chars: int | None = None
) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """Yield (line number, row or the error for that line) without holding the file in memory. A line
    longer than `max_chars` ends the file's rows with its error: nothing after it can be read reliably."""
    lines = _lines(fh, max_chars)
    lineno, counter = 0, _Counting()
    try:
        if fmt == "jsonl":
            for lineno, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                yield lineno, _json_row(line)
            return
        reader = csv.DictReader(counter(lines))
        if not reader.fieldnames:
            yield 1, RowError("empty CSV: the first line must be a header")
            return
        for row in reader:
            yield reader.line_num, _csv_row(row)
    except LineTooLong as exc:
        yield (lineno if fmt == "jsonl" else counter.last) + 1, exc
    except csv.Error as exc:  # a field over the csv module's limit, a NUL byte, ...
        yield counter.last, RowError(f"unreadable CSV: {exc}")


def _json_row(line: str) -> dict[str, Any] | RowError:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return RowError(f"invalid JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:
        return RowError("JSON nested too deeply")
    return obj if isinstance(obj, dict) else RowError("a row must be a JSON object")


def _csv_row(row: dict[str | Any, Any]) -> dict[str, Any] | RowError:
    if None in row:
        return RowError("more values than header columns")
    clean: dict[str, Any] = {k: (v if v != "" else None) for k, v in row.items()}
    if "messages" in clean and isinstance(clean["messages"], str):
        try:
            clean["messages"] = json.loads(clean["messages"])
        except json.JSONDecodeError:
            return RowError("'messages' must hold a JSON list")
        except RecursionError:
            return RowError("'messages' nested too deeply")
    return clean


class _Counting:
    """Counts the lines handed to the csv reader, to name the line a reading error is on."""

    def __init__(self) -> None:
        self.last = 0

    def __call__(self, lines: Iterator[str]) -> Iterator[str]:
        for line in lines:
            self.last += 1
            yield line


@dataclass
class Report:
    kind: str | None = None
    rows: int = 0
    labels: set[Any] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    error_count: int = 0

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.rows > 0

    def details(self) -> str | None:
        if self.ok:
            return None
        if not self.errors:
            return "the file holds no rows"
        more = self.error_count - len(self.errors)
        return "; ".join(self.errors) + (f"; and {more} more" if more > 0 else "")

    def fail(self, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(message)


def check_rows(
    rows: Iterable[tuple[int, dict[str, Any] | RowError]], *, max_rows: int, task: str | None = None
) -> Report:
    """Check every row: one kind per file, the task's required columns, the row limit."""
    report = Report()
    allowed = tasks.get(task).row_kinds if task else None
    for lineno, row in rows:
        if isinstance(row, RowError):
            report.fail(f"line {lineno}: {row}")
            continue
        try:
            kind = row_kind(row)
        except RowError as exc:
            report.fail(f"line {lineno}: {exc}")
            continue
        if report.kind is None:
            report.kind = kind
            if allowed and kind not in allowed:
                report.fail(
                    f"line {lineno}: task {task} needs rows with {required_columns(allowed)}, "
                    f"got a {kind} row"
                )
        elif kind != report.kind:
            report.fail(f"line {lineno}: a {kind} row in a file of {report.kind} rows")
            continue
        report.rows += 1
        if report.rows > max_rows:
            report.fail(f"line {lineno}: more than {max_rows} rows (limit max_rows)")
            break
        if kind == "text_label" and len(report.labels) <= MAX_LABELS:
            report.labels.add(row["label"])
    if len(report.labels) > MAX_LABELS:
        report.fail(f"more than {MAX_LABELS} distinct labels")
    return report


def check_file(
    path: Path, fmt: str, *, max_rows: int, task: str | None = None, max_chars: int | None = None
) -> Report:
    try:
        with path.open(encoding="utf-8", newline="") as fh:
            return check_rows(iter_rows(fh, fmt, max_chars=max_chars), max_rows=max_rows, task=task)
    except UnicodeDecodeError as exc:
        report = Report()
        report.fail(f"not UTF-8 text (byte {exc.start}): upload JSONL or CSV")
        return report


__all__ = [
    "FORMATS",
    "KINDS",
    "LineTooLong",
    "Report",
    "RowError",
    "check_file",
    "check_rows",
    "file_format",
    "iter_rows",
    "required_columns",
    "row_kind",
]
