"""Image and audio datasets as archives (`.zip`, `.tar`, `.tar.gz`) in the layouts Hugging Face's
`imagefolder` and `audiofolder` read: a `metadata.jsonl` or `metadata.csv` beside the files (`file_name` and
`label`, or `transcription`), or class folders (`cat/001.jpg`: the folder is the label).

An archive is read member by member from disk, never unpacked: each member's bytes are decoded in memory
and dropped. Member names with `..`, absolute paths, links and devices are refused, and so is an archive
over its limits (members, uncompressed bytes, compression ratio), each refusal naming the member and the
limit. Only numpy, Pillow, soundfile and the standard library here: the API runs the check at upload.
"""

from __future__ import annotations

import csv
import io
import json
import stat
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from trainer_core.data.rows import MAX_LABELS, Report

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp"})
AUDIO_SUFFIXES = frozenset({".wav", ".flac", ".ogg", ".mp3"})
IMAGE_FORMATS = frozenset({"JPEG", "PNG", "WEBP"})
# images and sound this check cannot take: refused by name, not skipped (a README or a licence is skipped)
UNSUPPORTED = frozenset({".gif", ".bmp", ".tif", ".tiff", ".heic", ".avif", ".m4a", ".aac", ".wma", ".opus"})
METADATA = ("metadata.jsonl", "metadata.csv")
MAX_METADATA_BYTES = 64 * 2**20
MAX_IMAGE_PIXELS = 64 * 2**20  # a decompression bomb in one image is refused by Pillow past this
MAX_AUDIO_SECONDS = 600.0
# the row kind an archive's rows are, by what they hold
KIND_OF = {("image", "label"): "image_label", ("audio", "label"): "audio_label"}
KIND_OF[("audio", "transcription")] = "audio_transcription"


class ArchiveError(ValueError):
    """The archive as a whole cannot be read: the message names the member or the limit."""


@dataclass(frozen=True)
class Limits:
    members: int = 100_000
    total_bytes: int = 8 * 2**30  # uncompressed
    ratio: float = 200.0  # uncompressed / compressed, per zip member and over a compressed tar


def archive_format(filename: str) -> str | None:
    name = filename.lower()
    if name.endswith(".zip"):
        return "zip"
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        return "tar"
    return None


def _safe_name(name: str) -> str:
    """The member's path inside the archive, or ArchiveError when it could land outside it."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or (path.parts and ":" in path.parts[0]):  # /etc/x, C:/x
        raise ArchiveError(f"member {name!r}: absolute paths are refused")
    if ".." in path.parts:
        raise ArchiveError(f"member {name!r}: '..' in a member name is refused")
    return path.as_posix()


def members(
    path: Any, fmt: str, limits: Limits, compressed_size: int, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every regular file in the archive, in archive order, within `limits`; a member
    `wanted` declines comes with b"" (its bytes are not read: a pass that needs only names and metadata does
    not decompress the images). Folders are skipped; links, devices, unsafe names and a limit passed raise
    ArchiveError naming them."""
    account = _Account(limits, compressed_size)
    if fmt == "zip":
        yield from _zip_members(path, limits, account, wanted)
    else:
        yield from _tar_members(path, account, wanted)


@dataclass
class _Account:
    """Members and bytes read so far, against the archive's limits."""

    limits: Limits
    compressed_size: int
    count: int = 0
    total: int = 0

    def __call__(self, name: str, size: int) -> None:
        self.count += 1
        self.total += size
        limits = self.limits
        if self.count > limits.members:
            raise ArchiveError(
                f"member {name!r}: more than {limits.members:,} members (limit max_archive_members)"
            )
        if self.total > limits.total_bytes:
            raise ArchiveError(
                f"member {name!r}: more than {limits.total_bytes:,} bytes uncompressed "
                "(limit max_archive_bytes)"
            )
        ratio = self.total / self.compressed_size if self.compressed_size else 0.0
        if self.total > 1_000_000 and ratio > limits.ratio:
            raise ArchiveError(
                f"member {name!r}: the archive expands over {limits.ratio:g} times its size "
                "(limit max_compression_ratio)"
            )


def _zip_members(
    path: Any, limits: Limits, account: _Account, wanted: Callable[[str], bool] | None
) -> Iterator[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            name = _safe_name(info.filename)
            if info.is_dir():
                continue
            kind = stat.S_IFMT(info.external_attr >> 16)  # 0: no Unix type recorded (a plain file)
            if kind not in (0, stat.S_IFREG):
                raise ArchiveError(f"member {name!r}: links and special files are refused")
            if info.file_size > 1_000_000 and info.file_size / max(1, info.compress_size) > limits.ratio:
                raise ArchiveError(
                    f"member {name!r}: expands {info.file_size / max(1, info.compress_size):,.0f} times "
                    f"(limit max_compression_ratio {limits.ratio:g})"
                )
            account(name, info.file_size)
            if wanted is not None and not wanted(name):
                yield name, b""
                continue
            with zf.open(info) as fh:  # never more than the header says: a lying header is cut off
                data = fh.read(info.file_size + 1)
            if len(data) != info.file_size:
                raise ArchiveError(f"member {name!r}: its size does not match the archive's directory")
            yield name, data


def _tar_members(
    path: Any, account: _Account, wanted: Callable[[str], bool] | None
) -> Iterator[tuple[str, bytes]]:
    try:
        with tarfile.open(path, mode="r|*") as tar:  # a stream: members one after the other, never seeked
            for member in tar:
                name = _safe_name(member.name)
                if member.isdir():
                    continue
                if not member.isfile():
                    raise ArchiveError(f"member {name!r}: links and special files are refused")
                account(name, member.size)
                if wanted is not None and not wanted(name):
                    yield name, b""  # the stream moves past its bytes without handing them over
                    continue
                reader = tar.extractfile(member)
                assert reader is not None
                yield name, reader.read()
    except tarfile.TarError as exc:
        raise ArchiveError(f"not a readable tar archive: {exc}") from exc


@dataclass
class Sound:
    samples: np.ndarray  # mono float32
    rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate


def decode_image(data: bytes) -> Any:
    """The image as RGB (a PIL image), or ValueError saying why it cannot be."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in IMAGE_FORMATS:
                raise ValueError(f"{img.format} images are not taken (JPEG, PNG, WebP)")
            return img.convert("RGB")
    except (OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"does not decode as an image ({type(exc).__name__}: {exc})") from exc


def decode_audio(data: bytes) -> Sound:
    """The audio as mono float32 with its sampling rate, or ValueError saying why it cannot be."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        raise ValueError(f"does not decode as audio (WAV, FLAC, OGG, MP3): {exc}") from exc
    if len(samples) == 0:
        raise ValueError("holds no audio samples")
    sound = Sound(samples.mean(axis=1).astype(np.float32), int(rate))
    if sound.seconds > MAX_AUDIO_SECONDS:
        raise ValueError(f"lasts {sound.seconds:,.0f} s, over the {MAX_AUDIO_SECONDS:,.0f} s a clip may")
    return sound


def media_kind(name: str) -> str | None:
    suffix = PurePosixPath(name).suffix.lower()
    return "image" if suffix in IMAGE_SUFFIXES else "audio" if suffix in AUDIO_SUFFIXES else None


@dataclass
class Layout:
    """What an archive holds: its media members with their targets (a label or a transcription)."""

    targets: dict[str, Any] = field(default_factory=dict)  # member name -> label or transcription
    column: str = "label"
    media: str | None = None  # "image" or "audio"

    @property
    def kind(self) -> str | None:
        return KIND_OF.get((self.media, self.column)) if self.media else None


def _metadata_rows(name: str, data: bytes) -> list[dict[str, Any]]:
    text = data.decode("utf-8")
    if name.endswith(".csv"):
        return list(csv.DictReader(io.StringIO(text)))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_layout(
    path: Any, fmt: str, limits: Limits, compressed_size: int, report: Report, *, decode: bool = True
) -> Layout:
    """Check every member (names, limits, each image or clip decodes unless `decode` is False) and match the
    media to their targets; problems go into `report`, each naming its member."""
    layout = Layout()
    seen: list[str] = []
    metadata: tuple[str, bytes] | None = None
    wanted = None if decode else (lambda name: PurePosixPath(name).name in METADATA)
    for name, data in members(path, fmt, limits, compressed_size, wanted):
        base = PurePosixPath(name).name
        if base in METADATA:
            if metadata is not None:
                report.fail(f"member {name!r}: a second metadata file (the first: {metadata[0]!r})")
            elif len(data) > MAX_METADATA_BYTES:
                report.fail(f"member {name!r}: metadata over {MAX_METADATA_BYTES:,} bytes")
            else:
                metadata = (name, data)
            continue
        kind = media_kind(name)
        if PurePosixPath(name).suffix.lower() in UNSUPPORTED and not base.startswith("."):
            report.fail(
                f"member {name!r}: {PurePosixPath(name).suffix} files are not taken "
                "(images: JPEG, PNG, WebP; audio: WAV, FLAC, OGG, MP3)"
            )
            continue
        if kind is None or base.startswith("."):
            continue  # a README, a licence, macOS's ._ files: not rows
        if layout.media is None:
            layout.media = kind
        elif kind != layout.media:
            report.fail(f"member {name!r}: {kind} in an archive of {layout.media} files")
            continue
        try:
            if decode:
                decode_image(data) if kind == "image" else decode_audio(data)
        except ValueError as exc:
            report.fail(f"member {name!r}: {exc}")
            continue
        seen.append(name)
    if metadata is not None:
        _match_metadata(metadata, seen, layout, report)
    else:
        for name in seen:
            parent = PurePosixPath(name).parent.name
            if not parent:
                report.fail(
                    f"member {name!r}: no label: put it in a class folder (cat/001.jpg) or list it in "
                    "metadata.jsonl with file_name and label"
                )
                continue
            layout.targets[name] = parent
    return layout


def _match_metadata(metadata: tuple[str, bytes], seen: list[str], layout: Layout, report: Report) -> None:
    name, data = metadata
    root = PurePosixPath(name).parent
    try:
        rows = _metadata_rows(name, data)
    except (UnicodeDecodeError, json.JSONDecodeError, csv.Error) as exc:
        report.fail(f"member {name!r}: unreadable ({type(exc).__name__}: {exc})")
        return
    listed: dict[str, Any] = {}
    for line, row in enumerate(rows, start=2 if name.endswith(".csv") else 1):
        where = f"member {name!r} line {line}"
        if not isinstance(row, dict) or not row.get("file_name"):
            report.fail(f"{where}: missing required field 'file_name'")
            continue
        column = "transcription" if row.get("transcription") not in (None, "") else "label"
        if row.get(column) in (None, ""):
            report.fail(f"{where}: missing required field 'label' (or 'transcription')")
            continue
        if listed and column != layout.column:
            report.fail(f"{where}: a {column} row among {layout.column} rows")
            continue
        layout.column = column
        member = (root / _safe_name(str(row["file_name"]))).as_posix()
        listed[member] = row[column]
    present = set(seen)
    for member in listed:
        if member not in present:
            report.fail(f"member {name!r}: lists {member!r}, which is not in the archive (or did not decode)")
    for member in seen:
        if member not in listed:
            report.fail(f"member {member!r}: no row in {name}: every file needs its {layout.column}")
        else:
            layout.targets[member] = listed[member]


def check_archive(
    path: Any, fmt: str, *, limits: Limits, compressed_size: int, max_rows: int, task: str | None = None
) -> Report:
    """The upload check for an archive: the report the API files under the upload, as for JSONL rows."""
    from trainer_core import tasks
    from trainer_core.data.rows import required_columns

    report = Report()
    try:
        layout = read_layout(path, fmt, limits, compressed_size, report)
    except (ArchiveError, zipfile.BadZipFile, OSError) as exc:
        report.fail(str(exc) if isinstance(exc, ArchiveError) else f"not a readable {fmt} archive: {exc}")
        return report
    report.kind = layout.kind
    report.rows = len(layout.targets)
    if report.rows == 0 and report.error_count == 0:
        report.fail("the archive holds no images or audio (JPEG, PNG, WebP; WAV, FLAC, OGG, MP3)")
    if report.rows > max_rows:
        report.fail(f"more than {max_rows} files (limit max_rows)")
    wanted = tasks.get(task).row_kinds if task else ()
    if task and report.kind and report.kind not in wanted:
        report.fail(
            f"task {task} needs {required_columns(wanted)}, and this archive holds {report.kind} rows"
        )
    if layout.column == "label":
        report.labels = {str(v) for v in layout.targets.values()}
        if len(report.labels) > MAX_LABELS:
            report.fail(f"more than {MAX_LABELS} distinct labels")
    return report
