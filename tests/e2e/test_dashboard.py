"""The dashboard in a real browser: Debian's chromium driven by Playwright, against the real service."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.migrate import upgrade
from tests.support import DEMO, embedded_settings, wait_for, write_jsonl

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser_page(tmp_path: Path) -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            args=FLAGS,
            accept_downloads=True,
            viewport={"width": 1200, "height": 1400},
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


def test_dashboard_lists_the_job_draws_its_curve_and_downloads(tmp_path: Path, browser_page: object) -> None:
    from playwright.sync_api import Page, expect

    page = browser_page
    assert isinstance(page, Page)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    settings = embedded_settings(tmp_path)
    upgrade(settings.database_url)
    with embedded.start(settings, log_dir=tmp_path / "logs"):
        client = Client(settings.api_url)
        train = client.upload(DEMO / "sentiment_train.jsonl")
        valid = client.upload(DEMO / "sentiment_valid.jsonl")
        job = client.create_job(
            model="tiny-bert",
            training_file=train["id"],
            validation_file=valid["id"],
            backend="torch",
            hyperparameters={
                "max_steps": 30,
                "batch_size": 8,
                "learning_rate": 1e-3,
                "max_seq_length": 32,
                "eval_every_steps": 10,
            },
        )

        page.goto(f"{settings.api_url}/dashboard")
        row = page.locator(f'tr[data-job="{job["id"]}"]')
        expect(row).to_be_visible()
        expect(row.locator(".status")).to_have_text(re.compile("validating files|queued|running|succeeded"))

        row.locator("a").click()
        expect(page).to_have_url(f"{settings.api_url}/dashboard/jobs/{job['id']}")
        expect(page.locator("#job-title")).to_have_text(job["id"])
        # The curve fills while the job runs: points arrive through polling, not a reload.
        page.wait_for_function("Number(document.querySelector('#chart').dataset.points) > 0", timeout=240_000)
        done = wait_for(client, job["id"], {"succeeded", "failed", "cancelled"})
        assert done["status"] == "succeeded", done["error"]
        onnx = page.locator('a[data-format="onnx"]')
        expect(onnx).to_be_visible(timeout=15_000)
        expect(page.locator("#job-facts")).to_contain_text("torch (asked: torch)")
        expect(page.locator("#events li").first).to_be_visible()
        points = int(page.locator("#chart").get_attribute("data-points") or 0)
        assert points >= 30 + 3 + 3  # every train step, and the three evaluations' loss and accuracy
        # the held-out accuracy on its own 0-1 axis beside the losses
        expect(page.locator("#chart")).to_have_attribute("data-series", "train_loss eval_loss eval_accuracy")
        assert page.locator("#chart canvas").count() == 1
        page.screenshot(path=str(tmp_path / "job.png"), full_page=True)
        assert (tmp_path / "job.png").stat().st_size > 10_000

        with page.expect_download() as download_info:
            onnx.click()
        download = download_info.value
        assert download.suggested_filename == f"{job['id']}-onnx.tar"
        saved = tmp_path / download.suggested_filename
        download.save_as(saved)
        artifact = next(
            a for a in client.get(f"/v1/fine_tuning/jobs/{job['id']}/artifacts") if a["format"] == "onnx"
        )
        assert saved.stat().st_size == artifact["bytes"]

        # the playground scores a text through /v1/predict, as the API answers it
        text = "The headphones broke after two days honestly!"
        page.fill("#playground-input", text)
        page.click("#playground-send")
        expect(page.locator("#playground-output")).to_have_attribute("data-done", "1", timeout=60_000)
        shown = page.locator("#playground-output .score").first.get_attribute("data-label")
        api = client.http.post("/v1/predict", json={"model": done["fine_tuned_model"], "inputs": [text]})
        assert shown == api.json()["data"][0][0]["label"]
    assert errors == []


def test_the_playground_streams_a_chat_reply_that_matches_the_api(
    tmp_path: Path, browser_page: object
) -> None:
    from playwright.sync_api import Page, expect

    page = browser_page
    assert isinstance(page, Page)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    settings = embedded_settings(tmp_path)
    upgrade(settings.database_url)
    chats = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w}"}]}
        for w in ("hello", "thanks", "please", "goodbye") * 8
    ]
    with embedded.start(settings, log_dir=tmp_path / "logs"):
        client = Client(settings.api_url)
        train = client.upload(write_jsonl(tmp_path / "chat.jsonl", chats))
        job = client.create_job(
            model="tiny-gpt2",
            training_file=train["id"],
            hyperparameters={"n_epochs": 4, "batch_size": 8, "learning_rate": 3e-3},
        )
        done = wait_for(client, job["id"], {"succeeded", "failed", "cancelled"})
        assert done["status"] == "succeeded", done["error"]
        page.goto(f"{settings.api_url}/dashboard/jobs/{job['id']}")
        expect(page.locator("#playground")).to_be_visible(timeout=15_000)
        page.fill("#playground-input", "say thanks")
        page.click("#playground-send")
        output = page.locator("#playground-output")
        expect(output).to_have_attribute("data-done", "1", timeout=60_000)
        reply = client.http.post(
            "/v1/chat/completions",
            json={
                "model": done["fine_tuned_model"],
                "messages": [{"role": "user", "content": "say thanks"}],
                "max_tokens": 64,
                "temperature": 0,
            },
        ).json()["choices"][0]["message"]["content"]
        assert reply and output.inner_text() == reply
    assert errors == []


def test_dashboard_shows_a_search_with_its_best_trial(tmp_path: Path, browser_page: object) -> None:
    from playwright.sync_api import Page, expect

    page = browser_page
    assert isinstance(page, Page)
    settings = embedded_settings(tmp_path)
    upgrade(settings.database_url)
    with embedded.start(settings, log_dir=tmp_path / "logs"):
        client = Client(settings.api_url)
        train = client.upload(DEMO / "sentiment_train.jsonl")
        job = client.create_job(
            model="tiny-bert",
            training_file=train["id"],
            backend="torch",
            hyperparameters={"max_steps": 3, "batch_size": 8, "max_seq_length": 32},
            hyperparameter_search={
                "n_trials": 2,
                "metric": "train_loss",
                "space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
            },
        )
        page.goto(f"{settings.api_url}/dashboard/jobs/{job['id']}")
        done = wait_for(client, job["id"], {"succeeded", "failed", "cancelled"})
        assert done["status"] == "succeeded", done["error"]
        best = page.locator("#trials tr.best")
        expect(best).to_have_count(1, timeout=15_000)
        expect(best.locator("a")).to_have_text(done["result"]["best_job_id"])
        expect(page.locator("#trials tbody tr")).to_have_count(2)
        expect(page.locator("#trials-metric")).to_have_text("train_loss (minimize)")
        expect(best).to_contain_text("learning_rate=")
        expect(page.locator('a[data-format="pytorch"]')).to_be_visible()
        expect(page.locator("#training-section")).to_be_hidden()
        page.screenshot(path=str(tmp_path / "search.png"), full_page=True)


def test_dashboard_asks_for_a_key_where_keys_are_required(tmp_path: Path, browser_page: object) -> None:
    from playwright.sync_api import Page, expect
    from pydantic import SecretStr

    from ortune.db.repositories import KeyRepository, TenantRepository
    from ortune.db.session import session_scope

    page = browser_page
    assert isinstance(page, Page)
    settings = embedded_settings(tmp_path, require_api_key=True, admin_api_key=SecretStr("admin-key"))
    upgrade(settings.database_url)
    with session_scope(settings.database_url) as session:
        tenant = TenantRepository(session).create("erin")
        _, secret = KeyRepository(session).issue(tenant.id, "browser")
    with embedded.start(settings, worker=False, log_dir=tmp_path / "logs"):
        client = Client(settings.api_url, api_key=secret)
        train = client.upload(DEMO / "sentiment_train.jsonl")
        job = client.create_job(model="tiny-bert", training_file=train["id"])
        page.goto(f"{settings.api_url}/dashboard")
        expect(page.locator("#poll")).to_contain_text("update failed")
        expect(page.locator("#key-form")).to_be_visible()
        page.fill("#key-input", secret)
        page.click("#key-form button")
        expect(page.locator("#jobs")).to_contain_text(job["id"])
        expect(page.locator("#key-form")).to_be_hidden()


def test_a_job_from_the_form_the_files_page_and_a_comparison(tmp_path: Path, browser_page: object) -> None:
    """The whole loop in the browser: an upload's line-precise refusal, a good upload, a job created from the
    form (base model from /v1/models), the files page (status, problems, delete), and two jobs' loss curves
    on one chart."""
    from playwright.sync_api import Page, expect

    page = browser_page
    assert isinstance(page, Page)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    settings = embedded_settings(tmp_path)
    upgrade(settings.database_url)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine", "label": "a"}\n{"text": "no label"}\n{"text": "b", "label": "b"}\n')
    with embedded.start(settings, log_dir=tmp_path / "logs"):
        client = Client(settings.api_url)
        page.goto(f"{settings.api_url}/dashboard")
        page.click("#new-job summary")
        status = page.locator("#upload-status")
        page.set_input_files("#upload-file", str(bad))
        page.click("#upload-form button")
        expect(status).to_have_attribute("data-status", "error")
        expect(status).to_contain_text("line 2: a text row in a file of text_label rows")
        page.set_input_files("#upload-file", str(DEMO / "sentiment_train.jsonl"))
        page.click("#upload-form button")
        expect(status).to_have_attribute("data-status", "processed")
        good = next(f for f in client.get("/v1/files")["data"] if f["status"] == "processed")
        page.select_option("#job-model", "tiny-bert")
        page.select_option("#job-training-file", good["id"])
        page.fill("#job-epochs", "1")
        page.fill("#job-batch", "16")
        page.click("#job-form button")
        page.wait_for_url(re.compile(r".*/dashboard/jobs/ftjob-[0-9a-f]+$"))
        from_form = page.url.rsplit("/", 1)[1]
        made = client.job(from_form)
        assert made["model"] == "tiny-bert" and made["hyperparameters"]["n_epochs"] == 1
        other = client.create_job(
            model="tiny-bert", training_file=good["id"], hyperparameters={"max_steps": 5, "batch_size": 16}
        )
        for job_id in (from_form, other["id"]):
            done = wait_for(client, job_id, {"succeeded", "failed", "cancelled"})
            assert done["status"] == "succeeded", done["error"]

        page.goto(f"{settings.api_url}/dashboard")
        for job_id in (from_form, other["id"]):
            page.check(f'input[data-compare="{job_id}"]')
        page.click("#compare")
        page.wait_for_url(re.compile(r".*/dashboard/compare\?jobs=.*"))
        expect(page.locator("#compare-chart")).to_have_attribute("data-series", "2")
        assert page.locator("#compare-chart canvas").count() == 1

        page.goto(f"{settings.api_url}/dashboard/files")
        refused = next(f for f in client.get("/v1/files")["data"] if f["status"] == "error")
        row = page.locator(f'tr[data-file="{refused["id"]}"]')
        expect(row).to_contain_text("line 2: a text row in a file of text_label rows")
        row.locator("button[data-delete]").click()
        expect(row).to_have_count(0)
        assert refused["id"] not in [f["id"] for f in client.get("/v1/files")["data"]]
    assert errors == []
