"""Object storage: one small interface, a local-folder and an S3 (boto3) implementation.

Keys are built by the service (`files/<id>`, `jobs/<id>/artifacts/onnx.tar`), never taken from user
input; `_check_key` refuses anything that could escape the bucket or folder all the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import parse_qs, urlparse

CHUNK = 1024 * 1024
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")


class StorageError(Exception):
    pass


class ObjectNotFound(StorageError):
    pass


class StorageUnavailable(StorageError):
    """A write the store could not take (its server down or refusing, its disk full): worth trying again
    later, unlike a bad key."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


def _check_key(key: str) -> str:
    if not _KEY.match(key) or ".." in key.split("/"):
        raise StorageError(f"unsafe object key {key!r}")
    return key


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pack_dir(directory: Path, archive: Path) -> tuple[int, str]:
    """Tar `directory` (uncompressed: model weights and token ids barely compress) into `archive`; its size
    and sha256."""
    with tarfile.open(archive, "w") as tar:
        tar.add(directory, arcname=directory.name)
    return archive.stat().st_size, sha256_file(archive)


class ObjectStore(Protocol):
    def put_fileobj(self, key: str, fileobj: IO[bytes]) -> None: ...
    def put_path(self, key: str, path: Path) -> None: ...
    def get_to_path(self, key: str, path: Path) -> None: ...
    def stat(self, key: str) -> ObjectInfo: ...
    def iter_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]: ...
    def delete(self, key: str) -> None: ...
    def ping(self) -> None: ...


class LocalStore:
    """A folder. Writes go to a temporary name and are renamed, so a reader never sees half an object."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / _check_key(key)).resolve()
        if not path.is_relative_to(self.root):
            raise StorageError(f"unsafe object key {key!r}")
        return path

    def put_fileobj(self, key: str, fileobj: IO[bytes]) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as out:
                shutil.copyfileobj(fileobj, out, CHUNK)
            tmp.replace(path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StorageUnavailable(f"could not store {key}: {exc}") from exc

    def put_path(self, key: str, path: Path) -> None:
        with path.open("rb") as fh:
            self.put_fileobj(key, fh)

    def get_to_path(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.exists():
            raise ObjectNotFound(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        return ObjectInfo(key, path.stat().st_size)

    def iter_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        with path.open("rb") as fh:
            fh.seek(start)
            remaining = None if end is None else end - start + 1
            while remaining is None or remaining > 0:
                chunk = fh.read(CHUNK if remaining is None else min(CHUNK, remaining))
                if not chunk:
                    return
                if remaining is not None:
                    remaining -= len(chunk)
                yield chunk

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def ping(self) -> None:
        if not os.access(self.root, os.W_OK):
            raise StorageError(f"{self.root} is not writable")


class S3Store:
    """Any S3 API (SeaweedFS, MinIO, AWS). Uploads are multipart and streamed by boto3's transfer manager."""

    def __init__(self, bucket: str, client: Any) -> None:
        self.bucket = bucket
        self.client = client

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self.client.create_bucket(Bucket=self.bucket)

    def put_fileobj(self, key: str, fileobj: IO[bytes]) -> None:
        with _unavailable(key):
            self.client.upload_fileobj(fileobj, self.bucket, _check_key(key))

    def put_path(self, key: str, path: Path) -> None:
        with _unavailable(key):  # a missing source stays a FileNotFoundError: the caller's, not the store's
            self.client.upload_file(str(path), self.bucket, _check_key(key))

    def get_to_path(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.stat(key)
        self.client.download_file(self.bucket, _check_key(key), str(path))

    def stat(self, key: str) -> ObjectInfo:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=_check_key(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise ObjectNotFound(key) from exc
            raise StorageError(str(exc)) from exc
        return ObjectInfo(key, int(head["ContentLength"]))

    def iter_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": _check_key(key)}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end}"
        body = self.client.get_object(**kwargs)["Body"]
        try:
            yield from body.iter_chunks(CHUNK)
        finally:
            body.close()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=_check_key(key))

    def ping(self) -> None:
        self.client.head_bucket(Bucket=self.bucket)


@contextmanager
def _unavailable(key: str) -> Iterator[None]:
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (Boto3Error, BotoCoreError, ClientError) as exc:
        raise StorageUnavailable(f"could not store {key}: {exc}") from exc


def open_store(
    url: str, *, access_key: str = "", secret_key: str = "", region: str = "us-east-1"
) -> ObjectStore:
    """`file:///path` or `s3://bucket?endpoint_url=http://host:port` (credentials from settings)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalStore(Path(parsed.netloc + parsed.path))
    if parsed.scheme == "s3":
        import boto3
        from botocore.config import Config

        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        client = boto3.client(
            "s3",
            endpoint_url=query.get("endpoint_url"),
            region_name=query.get("region", region),
            aws_access_key_id=access_key or None,
            aws_secret_access_key=secret_key or None,
            config=Config(
                retries={"max_attempts": 5, "mode": "standard"},
                s3={"addressing_style": "path"},
                signature_version="s3v4",
            ),
        )
        store = S3Store(parsed.netloc, client)
        store.ensure_bucket()
        return store
    raise StorageError(f"unsupported storage url {url!r}: use file:///path or s3://bucket?endpoint_url=...")


class ArchiveUnusable(StorageError):
    """A stored archive that is gone, or whose bytes are not the ones recorded."""


def fetch_archive(store: ObjectStore, key: str, sha256: str, home: Path, what: str = "archive") -> None:
    """Fetch the tar archive at `key` and unpack it as `home`, after checking its sha256: whole or absent,
    so a concurrent reader never sees half of it (the worker's base models, the inference cache)."""
    import tempfile

    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent) as tmp:
        archive = Path(tmp) / "model.tar"
        try:
            store.get_to_path(key, archive)
        except ObjectNotFound as exc:
            raise ArchiveUnusable(f"the {what} {key} is gone (was it deleted?)") from exc
        if (got := sha256_file(archive)) != sha256:
            raise ArchiveUnusable(
                f"the {what} {key} failed its sha256 check (recorded {sha256[:12]}…, read {got[:12]}…); it "
                "was not unpacked"
            )
        with tarfile.open(archive) as tar:
            tar.extractall(Path(tmp) / "model", filter="data")
        shutil.rmtree(home, ignore_errors=True)
        (Path(tmp) / "model").rename(home)
