"""Follow a job until it ends: the polling loop `ortune follow` and the demo share, and its rich view."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ortune.cli.client import Client

TERMINAL = {"succeeded", "failed", "cancelled"}


def event_number(event: dict[str, Any]) -> int:
    """The sequence number in an event id (`ftevent-42` -> 42): events are paged and ordered by it."""
    return int(event["id"].split("-")[1])


def poll(
    client: Client,
    job_id: str,
    *,
    interval: float = 1.0,
    on_event: Callable[[dict[str, Any]], None] = lambda event: None,
    on_job: Callable[[dict[str, Any]], None] = lambda job: None,
) -> dict[str, Any]:
    """Poll the job and its new events until it reaches a terminal status; returns the final job."""
    last_event = 0
    while True:
        job = client.job(job_id)
        for event in client.events_since(job_id, last_event):
            last_event = event_number(event)
            on_event(event)
        on_job(job)
        if job["status"] in TERMINAL:
            return job
        time.sleep(interval)


def follow_with_progress(
    client: Client, job_id: str, console: Console, interval: float = 1.0
) -> dict[str, Any]:
    """`poll` drawn as a progress bar with step, loss and ETA, the job's messages printed above it."""
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("", total=None, loss="-")

        def on_event(event: dict[str, Any]) -> None:
            if event["type"] == "metrics":
                loss = (event.get("data") or {}).get("train_loss")
                if loss is not None:
                    bar.update(task, loss=f"{loss:.4f}")
            else:
                style = {"error": "red", "warn": "yellow"}.get(event["level"], "dim")
                bar.console.print(f"[{style}]{event['message']}[/]")

        def on_job(job: dict[str, Any]) -> None:
            p = job["progress"]
            bar.update(task, description=job["status"], completed=p["step"], total=p["total_steps"])

        return poll(client, job_id, interval=interval, on_event=on_event, on_job=on_job)
