"""/v1/files against both configurations: uploads, checks, limits, and that bad input changes nothing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ortune.settings import Settings
from tests.support import DEMO, upload, write_jsonl


def _listing(client: TestClient) -> list[dict[str, Any]]:
    return client.get("/v1/files").json()["data"]  # type: ignore[no-any-return]


def test_upload_list_get_content_delete(client: TestClient, tmp_path: Path) -> None:
    path = DEMO / "sentiment_train.jsonl"
    created = upload(client, path).json()
    assert created["object"] == "file" and created["status"] == "processed"
    assert created["row_kind"] == "text_label" and created["row_count"] == 360
    assert created["bytes"] == path.stat().st_size
    assert client.get(f"/v1/files/{created['id']}").json() == created
    assert [f["id"] for f in _listing(client)] == [created["id"]]
    content = client.get(f"/v1/files/{created['id']}/content")
    assert content.status_code == 200 and content.content == path.read_bytes()
    deleted = client.delete(f"/v1/files/{created['id']}").json()
    assert deleted == {"id": created["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{created['id']}").status_code == 404
    assert _listing(client) == []


def test_csv_upload_with_each_kind(client: TestClient, tmp_path: Path) -> None:
    csv = tmp_path / "rows.csv"
    csv.write_text('text,label\n"good, really",pos\nbad,neg\n')
    body = upload(client, csv).json()
    assert (body["status"], body["row_kind"], body["row_count"]) == ("processed", "text_label", 2)
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    assert upload(client, pc).json()["row_kind"] == "prompt_completion"
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}],
    )
    assert upload(client, chat).json()["row_kind"] == "chat"


def test_bad_rows_are_reported_with_their_line(client: TestClient, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"text": "fine", "label": "a"}\n{"text": "no label"}\nnot json\n{"label": "b"}\n'
        '{"text": "", "label": "a"}\n'
    )
    body = upload(client, path).json()
    assert body["status"] == "error"
    details = body["status_details"]
    assert "line 2: a text row in a file of text_label rows" in details
    assert "line 3: invalid JSON" in details
    assert "line 4: missing required field 'text'" in details
    assert "line 5: 'text' must be a non-empty string" in details


def test_chat_rows_are_checked(client: TestClient, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "wizard", "content": "hi"}]}])
    body = upload(client, path).json()
    assert body["status"] == "error" and "line 1: messages[0].role must be one of" in body["status_details"]


def test_task_field_checks_required_columns(client: TestClient, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "only text"}])
    body = upload(client, path, task="sequence-classification").json()
    assert body["status"] == "error"
    assert "needs rows with {label, text}" in body["status_details"]


def test_unsupported_type_is_refused_and_nothing_is_stored(client: TestClient, tmp_path: Path) -> None:
    before = upload(client, DEMO / "sentiment_valid.jsonl").json()
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    response = upload(client, path)
    assert response.status_code == 400
    err = response.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_file_format", "file")
    assert "upload .jsonl or .csv" in err["message"]
    assert _listing(client) == [before]


def test_missing_and_bad_purpose(client: TestClient, tmp_path: Path) -> None:
    path = DEMO / "sentiment_valid.jsonl"
    with path.open("rb") as fh:
        response = client.post("/v1/files", files={"file": (path.name, fh)})
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"
    response = upload(client, path, purpose="batch")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_purpose"
    response = client.post("/v1/files", data={"purpose": "fine-tune"}, files={"other": ("x", b"1")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    assert _listing(client) == []


def test_upload_limit_is_413_and_leaves_no_trace(settings: Settings, tmp_path: Path) -> None:
    from api.main import create_app

    small = settings.model_copy(update={"max_upload_bytes": 4096})
    with TestClient(create_app(small)) as client:
        kept = upload(client, write_jsonl(tmp_path / "ok.jsonl", [{"text": "a", "label": "x"}])).json()
        big = write_jsonl(tmp_path / "big.jsonl", [{"text": "word " * 50, "label": "x"}] * 100)
        response = upload(client, big)
        assert response.status_code == 413
        err = response.json()["error"]
        assert (err["code"], err["param"]) == ("payload_too_large", "file")
        assert "4096 bytes" in err["message"]
        assert _listing(client) == [kept]
        uploads = small.job_work_dir / "uploads"
        assert not uploads.exists() or list(uploads.iterdir()) == []


def test_row_limit(settings: Settings, tmp_path: Path) -> None:
    from api.main import create_app

    with TestClient(create_app(settings.model_copy(update={"max_rows": 3}))) as client:
        body = upload(client, write_jsonl(tmp_path / "r.jsonl", [{"text": "a", "label": "x"}] * 5)).json()
    assert body["status"] == "error" and "line 4: more than 3 rows (limit max_rows)" in body["status_details"]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_row_longer_than_the_limit_is_refused_with_its_line(
    settings: Settings, tmp_path: Path, fmt: str
) -> None:
    from api.main import create_app

    long_text = "word " * 1000  # 5,000 characters, over a 2,048 limit
    if fmt == "jsonl":
        path = write_jsonl(
            tmp_path / "long.jsonl", [{"text": "a", "label": "x"}] * 2 + [{"text": long_text, "label": "y"}]
        )
    else:
        path = tmp_path / "long.csv"
        path.write_text(f"text,label\na,x\nb,x\n{long_text},y\n")
    with TestClient(create_app(settings.model_copy(update={"max_row_chars": 2048}))) as client:
        body = upload(client, path).json()
    assert body["status"] == "error", body
    assert (
        f"line {3 if fmt == 'jsonl' else 4}: longer than 2,048 characters (limit max_row_chars)"
        in body["status_details"]
    )


def test_a_deeply_nested_row_and_an_oversized_csv_field_are_errors_not_500(
    client: TestClient, tmp_path: Path
) -> None:
    nested = tmp_path / "nested.jsonl"
    nested.write_text('{"text": "a", "label": "x"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    body = upload(client, nested).json()
    assert body["status"] == "error" and "line 2: JSON nested too deeply" in body["status_details"]
    field = tmp_path / "field.csv"
    field.write_text("text,label\n" + '"' + "x" * 200_000 + '",y\n')  # past the csv module's field limit
    body = upload(client, field).json()
    assert (
        body["status"] == "error"
        and "line 2: unreadable CSV: field larger than field limit" in body["status_details"]
    )
    chat = tmp_path / "chat.csv"  # a CSV's messages column holds JSON, parsed at upload too
    chat.write_text('messages\n"' + "[" * 50_000 + "]" * 50_000 + '"\n')
    body = upload(client, chat).json()
    assert body["status"] == "error" and "line 2: 'messages' nested too deeply" in body["status_details"]


def test_not_utf8(client: TestClient, tmp_path: Path) -> None:
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"text": "caf\xe9", "label": "a"}\n'.encode("latin-1"))
    body = upload(client, path).json()
    assert body["status"] == "error" and "not UTF-8" in body["status_details"]


def test_unknown_file_is_404(client: TestClient) -> None:
    for method, url in (
        ("GET", "/v1/files/file-nope"),
        ("GET", "/v1/files/file-nope/content"),
        ("DELETE", "/v1/files/file-nope"),
    ):
        response = client.request(method, url)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "file_not_found"


def test_file_in_use_cannot_be_deleted(client: TestClient, train_file: dict[str, Any]) -> None:
    job = client.post("/v1/fine_tuning/jobs", json={"model": "tiny-bert", "training_file": train_file["id"]})
    assert job.status_code == 200, job.text
    response = client.delete(f"/v1/files/{train_file['id']}")
    assert response.status_code == 409 and response.json()["error"]["code"] == "file_in_use"
    assert client.get(f"/v1/files/{train_file['id']}").json()["status"] == "processed"


def test_malformed_multipart_is_400_not_500(client: TestClient) -> None:
    boundary = "7c5156fb04a2177cf9e322ad31ebde44"  # a body schemathesis found: a part with no headers
    response = client.post(
        "/v1/files",
        content=f"--{boundary}\r\nNone--{boundary}--\r\n".encode(),
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert response.status_code == 400
    assert (
        response.json()["error"]["code"] == "invalid_upload"
        and "malformed" in response.json()["error"]["message"]
    )


def test_a_body_of_many_parts_or_a_huge_part_header_is_refused(client: TestClient) -> None:
    boundary = "b0undary"

    def post(parts: list[str]) -> Any:
        content = "".join(f"--{boundary}\r\n{p}\r\n" for p in parts) + f"--{boundary}--\r\n"
        return client.post(
            "/v1/files",
            content=content.encode(),
            headers={"content-type": f"multipart/form-data; boundary={boundary}"},
        )

    field = 'Content-Disposition: form-data; name="f{}"\r\n\r\nx'
    many = post([field.format(i) for i in range(1000)])
    assert many.status_code == 400 and "more than 16 parts" in many.json()["error"]["message"]
    huge = post([f'Content-Disposition: form-data; name="{"n" * 20_000}"\r\n\r\nx'])
    assert huge.status_code == 400 and "Maximum header size exceeded" in huge.json()["error"]["message"]


def test_a_json_body_over_the_limit_is_413_declared_or_chunked(client: TestClient) -> None:
    big = b'{"model": "tiny-bert", "training_file": "' + b"f" * (2 * 1024 * 1024) + b'"}'
    declared = client.post("/v1/fine_tuning/jobs", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413, declared.text
    assert "ORTUNE_MAX_REQUEST_BYTES" in declared.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as it arrives
        for i in range(0, len(big), 64 * 1024):
            yield big[i : i + 64 * 1024]

    chunked = client.post(
        "/v1/fine_tuning/jobs", content=chunks(), headers={"content-type": "application/json"}
    )
    assert chunked.status_code == 413, chunked.text
    assert chunked.json()["error"]["code"] == "payload_too_large"
    assert "chunked request body" in chunked.json()["error"]["message"]


@pytest.mark.parametrize("config", ["embedded"], indirect=True)
def test_an_upload_the_store_refuses_is_a_503_that_leaves_nothing(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    """A store that refuses writes (a file stands where its folder must be, as a full disk or a down S3
    would refuse): was a 500 internal_error naming S3UploadFailedError or OSError."""
    files = Path(settings.storage_url.removeprefix("file://")) / "files"
    shutil.rmtree(files, ignore_errors=True)
    files.write_text("in the way")
    refused = upload(client, DEMO / "sentiment_train.jsonl")
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
    assert refused.json()["error"]["code"] == "storage_unavailable"
    assert client.get("/v1/files").json()["data"] == []
    files.unlink()
    assert upload(client, DEMO / "sentiment_train.jsonl").json()["status"] == "processed"
