"""Image and audio archives through POST /v1/files on both configurations: taken with their rows and
labels, refused with the member named and nothing unpacked anywhere, and jobs that pick the task from them."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from fastapi.testclient import TestClient

from ortune import media_demo
from ortune.settings import Settings
from tests.support import upload


def test_an_archive_is_taken_with_its_rows_and_labels(client: TestClient, tmp_path: Path) -> None:
    archive = media_demo.write_archive(
        tmp_path / "shapes.tar.gz", media_demo.image_rows(9, 0), layout="metadata"
    )
    body = upload(client, archive).json()
    assert (body["status"], body["status_details"]) == ("processed", None), body
    got = client.get(f"/v1/files/{body['id']}/content")
    assert got.status_code == 200 and got.content == archive.read_bytes()
    job = client.post(
        "/v1/fine_tuning/jobs", json={"model": "tiny-vit", "training_file": body["id"], "seed": 1}
    ).json()
    assert job["task"] == "image-classification", job  # the archive's rows decided the task
    refused = client.post("/v1/fine_tuning/jobs", json={"model": "tiny-bert", "training_file": body["id"]})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "model tiny-bert cannot be fine-tuned for image-classification (it supports sequence-classification)"
    )
    sounds = upload(
        client, media_demo.write_archive(tmp_path / "tones.zip", media_demo.audio_rows(6, 0))
    ).json()
    wrong = client.post(
        "/v1/fine_tuning/jobs",
        json={"model": "tiny-vit", "training_file": body["id"], "validation_file": sounds["id"]},
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "validation_file"


def test_a_traversal_member_is_named_and_nothing_is_unpacked(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    target = settings.data_dir.parent / "evil.png"
    rows = media_demo.image_rows(3, 0)
    archive = tmp_path / "bad.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name, label, data in rows:
            zf.writestr(f"{label}/{name}", data)
        zf.writestr("../../evil.png", rows[0][2])
    body = upload(client, archive).json()
    assert body["status"] == "error"
    assert body["status_details"] == "member '../../evil.png': '..' in a member name is refused"
    assert not target.exists()
    assert not any(p.name == "evil.png" for p in settings.data_dir.rglob("*"))  # nothing unpacked anywhere
    job = client.post("/v1/fine_tuning/jobs", json={"model": "tiny-vit", "training_file": body["id"]})
    assert (
        job.status_code == 400
        and "failed its checks: member '../../evil.png'" in job.json()["error"]["message"]
    )


def test_archive_limits_come_from_settings(settings: Settings, tmp_path: Path) -> None:
    from api.main import create_app

    strict = settings.model_copy(update={"max_archive_members": 4, "max_compression_ratio": 10.0})
    with TestClient(create_app(strict)) as client:
        many = media_demo.write_archive(tmp_path / "many.zip", media_demo.image_rows(6, 0))
        body = upload(client, many).json()
        assert (
            body["status"] == "error"
            and "more than 4 members (limit max_archive_members)" in body["status_details"]
        )
        bomb = io.BytesIO()
        with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("circle/zeros.png", bytes(4 * 2**20))
        (tmp_path / "bomb.zip").write_bytes(bomb.getvalue())
        body = upload(client, tmp_path / "bomb.zip").json()
        assert body["status"] == "error" and "(limit max_compression_ratio 10)" in body["status_details"]


def test_an_unsupported_upload_type_names_what_is_taken(client: TestClient, tmp_path: Path) -> None:
    (tmp_path / "x.rar").write_bytes(b"Rar!")
    err = upload(client, tmp_path / "x.rar").json()["error"]
    assert (
        err["code"] == "invalid_file_format" and "images or audio as .zip, .tar or .tar.gz" in err["message"]
    )
