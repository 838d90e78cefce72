"""Streaming multipart parsing for uploads: the file part goes to a temporary file on disk in chunks,
counted as it arrives, so a too-large upload is refused with 413 without reading it whole into memory."""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from api.errors import APIError, PayloadTooLarge

MAX_FIELD_BYTES = 64 * 1024
# An upload needs three parts (file, purpose, task): a body of many small parts is refused before it can
# grow the fields kept (python-multipart itself caps a part's header size).
MAX_PARTS = 16


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    path: Path | None = None
    size: int = 0
    sha256: str = ""


class _Parts:
    def __init__(self, workdir: Path, limit: int) -> None:
        self.workdir, self.limit = workdir, limit
        self.upload = Upload()
        self._headers: dict[str, str] = {}
        self._hname = b""
        self._hvalue = b""
        self._name: str | None = None
        self._is_file = False
        self._buf = bytearray()
        self._fh: Any = None
        self._digest = hashlib.sha256()
        self._parts = 0

    def on_part_begin(self) -> None:
        self._headers, self._buf = {}, bytearray()
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise APIError(
                f"the upload has more than {MAX_PARTS} parts; send a 'file' part and a 'purpose' field",
                param="file",
                code="invalid_upload",
            )

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def on_header_end(self) -> None:
        # latin-1 keeps the bytes as they came (parse_options_header wants them so); names and filenames
        # in them are UTF-8, decoded where they are read
        self._headers[self._hname.decode("latin-1").lower()] = self._hvalue.decode("latin-1")
        self._hname, self._hvalue = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get("content-disposition", ""))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        self._is_file = filename is not None and self._name == "file"
        if self._is_file:
            if self.upload.path is not None:
                raise APIError("send exactly one file part named 'file'", param="file", code="invalid_upload")
            self.upload.filename = (filename or b"").decode("utf-8", "replace")
            # closed in on_part_end, or by close() when parsing fails
            self._fh = tempfile.NamedTemporaryFile(dir=self.workdir, delete=False, prefix="upload-")  # noqa: SIM115
            self.upload.path = Path(self._fh.name)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._is_file:
            self.upload.size += len(chunk)
            if self.upload.size > self.limit:
                raise PayloadTooLarge(
                    f"file is larger than the upload limit of {self.limit} bytes (ORTUNE_MAX_UPLOAD_BYTES)",
                    param="file",
                )
            self._digest.update(chunk)
            self._fh.write(chunk)
        else:
            self._buf += chunk
            if len(self._buf) > MAX_FIELD_BYTES:
                raise APIError(
                    f"form field '{self._name}' is too long", param=self._name, code="invalid_upload"
                )

    def on_part_end(self) -> None:
        if self._is_file:
            self._fh.close()
            self._fh = None
            self.upload.sha256 = self._digest.hexdigest()
        elif self._name:
            self.upload.fields[self._name] = self._buf.decode("utf-8", "replace")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


async def receive(request: Request, workdir: Path, limit: int) -> Upload:
    """Parse a multipart/form-data body; on any error the temporary file is removed."""
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in options:
        raise APIError(
            "upload as multipart/form-data with a 'file' part and a 'purpose' field",
            param="file",
            code="invalid_upload",
        )
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + MAX_FIELD_BYTES:
        raise PayloadTooLarge(
            f"request of {declared} bytes is larger than the upload limit of {limit} bytes "
            "(ORTUNE_MAX_UPLOAD_BYTES)",
            param="file",
        )
    workdir.mkdir(parents=True, exist_ok=True)
    parts = _Parts(workdir, limit)
    callbacks: Any = {
        name: getattr(parts, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
            "on_part_data",
            "on_part_end",
        )
    }
    parser = MultipartParser(options[b"boundary"], callbacks)
    try:
        try:
            async for chunk in request.stream():
                parser.write(chunk)
            parser.finalize()
        except MultipartParseError as exc:
            raise APIError(
                f"the multipart body is malformed: {exc}", param="file", code="invalid_upload"
            ) from exc
    except BaseException:
        parts.close()
        if parts.upload.path is not None:
            parts.upload.path.unlink(missing_ok=True)
        raise
    return parts.upload
