"""Two hosts as network namespaces: a two-node DDP job whose rendezvous, object store and relay cross the
hosts' links, then a bounded fault soak (a worker killed, a host partitioned, Redis and Postgres
restarted, the inference process killed) while a tenant streams chat replies all along, with the
invariants the service promises checked at the end. bench/soak.py runs it longer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hosts import Network, running, soak, tenant, tenant_key, trainer_attempts
from tests.support import TERMINAL, events, rows, wait_for, wait_until, write_jsonl

SKIP = Network.skip_reason()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


def test_a_ddp_job_across_two_hosts_then_a_fault_soak(tmp_path: Path) -> None:
    with running(tmp_path) as (d, workers, admin):
        assert not d.settings.api_url.startswith("http://127.")
        nodes = {n["id"]: n["address"] for n in admin.get("/v1/nodes")["data"]}
        assert nodes == {h.name: h.address for h in d.network.hosts}

        train = admin.upload(write_jsonl(tmp_path / "ddp.jsonl", rows(16)))
        ddp = admin.create_job(
            model="tiny-bert",
            training_file=train["id"],
            backend="torch",
            distributed={"nodes": 2},
            hyperparameters={"max_steps": 6, "batch_size": 8, "max_seq_length": 32},
        )
        done = wait_for(admin, ddp["id"], TERMINAL, timeout=300)
        assert done["status"] == "succeeded", done["error"]
        placed = next(e["message"] for e in events(admin, ddp["id"]) if "placed on" in e["message"])
        assert all(h.name in placed for h in d.network.hosts), placed

        keys = [tenant_key(admin, name) for name in ("north", "south")]
        report = soak(d, workers, tmp_path, keys, n_jobs=6, streamer=tenant(admin, "streams"))

        def released() -> list[dict[str, object]] | None:
            nodes = admin.get("/v1/nodes")["data"]
            free = all(n["free_devices"] == n["devices"] and not n["running"] for n in nodes)
            return nodes if free else None

        nodes_after = wait_until("every device given back", released, 60)
    print(f"soak: {report.wall_s} s, faults {[(f.name, f.recovered_s) for f in report.faults]}")
    not_done = {j: job["status"] for j, job in report.jobs.items() if job["status"] != "succeeded"}
    assert not not_done, {j: report.jobs[j].get("error") for j in not_done}  # no job lost
    assert report.artifacts_checked >= 2 * len(report.jobs)  # pytorch and onnx, sha256 as recorded
    assert all(f.recovered_s is not None for f in report.faults), report.faults
    assert not report.watch.overlaps, report.watch.overlaps  # never two live attempts of a job
    assert report.watch.seen_trainers > 0 and report.watch.responses > 100
    other = [e for e in report.watch.server_errors if e[0] != 503 or not e[2]]
    assert not other, other  # the database's absence is a 503 with Retry-After, nothing else
    mine = {ddp["id"], *report.jobs}  # other tests of the suite may be training beside this one
    assert not {j: a for j, a in trainer_attempts().items() if j in mine}  # no trainer left behind
    assert len(nodes_after) == 2
    assert report.streams is not None
    print(f"streams: {dict(report.streams.ends)}")
    assert not report.streams.broken, report.streams.broken  # each completed or ended with an error event
    assert report.streams.ends["completed"] > 0
