"""Several hosts on one machine: Linux network namespaces on a bridge, with the servers a deployment needs
listening on the bridge's address (never 127.0.0.1), so that the rendezvous, the object store and the relay
really cross hosts, and a host's link can be taken down (a partition). Needs root and `ip` (iproute2); where
the kernel refuses, `Network.skip_reason` says why.

Used by tests/e2e/test_hosts.py (bounded, in CI) and bench/soak.py (longer)."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from ortune.cli import embedded
from ortune.cli.client import Client
from ortune.db.migrate import upgrade
from ortune.settings import Settings
from tests import services
from tests.streams import Streams, chat_model
from tests.support import (
    ADMIN_KEY,
    TERMINAL,
    TEST_DEFAULTS,
    rows,
    wait_until,
    worker_process,
    write_jsonl,
)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@dataclass
class Host:
    name: str  # the network namespace
    address: str
    link: str  # the veth end in the root namespace: down is a partition

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


@dataclass
class Network:
    """A bridge at <net>.1 in the root namespace (where the servers listen) and hosts at <net>.2, .3, ..."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    net: str = field(default_factory=lambda: f"10.{random.randint(64, 250)}.{random.randint(1, 250)}")
    hosts: list[Host] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"ob{self.tag}"

    @property
    def address(self) -> str:
        return f"{self.net}.1"

    @staticmethod
    def skip_reason() -> str | None:
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "iproute2's `ip` is not installed"
        probe = f"oprobe{uuid.uuid4().hex[:6]}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"the kernel refuses network namespaces: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def up(self, n_hosts: int) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(n_hosts):
            host = Host(f"oh{self.tag}{i}", f"{self.net}.{i + 2}", f"ov{self.tag}{i}")
            inner = f"oi{self.tag}{i}"
            _ip("netns", "add", host.name)
            self.hosts.append(host)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", host.name)
            _ip("link", "set", host.link, "master", self.bridge)
            _ip("link", "set", host.link, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", inner)
            _ip("-n", host.name, "link", "set", inner, "up")
            _ip("-n", host.name, "link", "set", "lo", "up")

    def partition(self, host: Host) -> None:
        _ip("link", "set", host.link, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def down(self) -> None:
        for host in self.hosts:
            _ip("netns", "del", host.name, check=False)  # takes its veth pair with it
            _ip("link", "del", host.link, check=False)
        _ip("link", "del", self.bridge, check=False)


@dataclass
class Deployment:
    network: Network
    settings: Settings  # the API's, on the bridge address
    postgres: services.PostgresCluster
    redis: services.RedisServer
    processes: embedded.Services | None = None  # the API and inference processes, once started

    def node(self, host: Host, tmp: Path) -> Settings:
        """A worker's settings on `host`: its own disk, its own address."""
        data = tmp / host.name
        return self.settings.model_copy(
            update={
                "node_name": host.name,
                "node_address": host.address,
                "node_devices": 1,
                "data_dir": data,
                "work_dir": data / "work",
            }
        )


@contextmanager
def deployment(tmp: Path, n_hosts: int, **overrides: object) -> Iterator[Deployment]:
    """The network, then Postgres, Redis and SeaweedFS of their own on the bridge address, and the settings
    (migrated database) that reach them there."""
    network = Network()
    with ExitStack() as stack:
        stack.callback(network.down)
        network.up(n_hosts)
        at = network.address
        pg = services.PostgresCluster(tmp / "pg", host=at, allow=f"{network.net}.0/24")
        pg.start()
        stack.callback(pg.remove)
        redis = services.RedisServer(tmp, host=at)
        redis.start()
        stack.callback(redis.stop)
        s3 = stack.enter_context(services.seaweedfs(tmp / "weed", host=at))
        url = services.create_database(pg.url, "ortune")
        upgrade(url)
        settings = Settings(
            data_dir=tmp / "api",
            database_url=url,
            broker_url=redis.url,
            storage_url=s3.url("ortune"),
            s3_access_key=s3.access_key,
            s3_secret_key=s3.secret_key,
            api_host=at,
            api_port=services.free_port(),
            serve_port=services.free_port(),
            queue=f"ortune.hosts.{network.tag}",
            **(TEST_DEFAULTS | overrides),
        )
        yield Deployment(network, settings, pg, redis)


FAST = {  # seconds, so that a lost worker or a partition is noticed within a test's time
    "heartbeat_seconds": 0.5,
    "heartbeat_timeout_seconds": 4.0,
    "sweep_seconds": 0.5,
    "requeue_after_seconds": 3.0,
    "max_attempts": 6,
    "distributed_timeout_seconds": 30,
}


class Workers:
    """One Celery worker per host, killed and started again at will."""

    def __init__(self, d: Deployment, tmp: Path) -> None:
        self.d, self.tmp = d, tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stack = ExitStack()

    def start(self, host: Host) -> None:
        node = self.d.node(host, self.tmp)
        log = self.tmp / f"{host.name}.log"
        self.procs[host.name] = self.stack.enter_context(worker_process(node, host.name, log, host.prefix))

    def kill(self, host: Host) -> None:
        proc = self.procs[host.name]
        proc.kill()
        proc.wait(30)

    def close(self) -> None:
        self.stack.close()


@contextmanager
def running(tmp: Path, n_hosts: int = 2) -> Iterator[tuple[Deployment, Workers, Client]]:
    """A deployment on `n_hosts` hosts with the API on the bridge and a worker on each host, registered: the
    deployment, its workers (to kill and restart) and a client with the platform key."""
    with deployment(tmp, n_hosts, admin_api_key=ADMIN_KEY, **FAST) as d:
        workers = Workers(d, tmp)
        with embedded.start(d.settings, worker=False, log_dir=tmp / "logs") as d.processes:
            try:
                for host in d.network.hosts:
                    workers.start(host)
                admin = Client(d.settings.api_url, api_key=ADMIN_KEY)
                wait_until("every host's worker", lambda: len(admin.get("/v1/nodes")["data"]) == n_hosts, 120)
                yield d, workers, admin
            finally:
                workers.close()


def tenant(admin: Client, name: str) -> tuple[str, str]:
    """A new tenant, made with the platform key: its id and an API key of its own."""
    made = admin.post("/v1/admin/tenants", json={"name": name})
    return made["id"], str(
        admin.post(f"/v1/admin/tenants/{made['id']}/api_keys", json={"name": "soak"})["key"]
    )


def tenant_key(admin: Client, name: str) -> str:
    return tenant(admin, name)[1]


def restart_inference(d: Deployment) -> None:
    """SIGKILL the inference process, as a crash would, and start a new one in its place."""
    assert d.processes is not None
    at = next(i for i, (name, _) in enumerate(d.processes.logs) if name.startswith("inference"))
    d.processes.procs[at].kill()
    d.processes.procs[at].wait(30)
    with d.processes.logs[at][1].open("ab") as log:
        d.processes.procs[at] = subprocess.Popen(
            embedded.serve_command(d.settings),
            env=embedded.child_env(d.settings),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@dataclass
class Watch:
    """What callers and the machine saw during the soak: every 5xx and whether it carried Retry-After,
    and any moment one job had trainer processes of two attempts alive."""

    responses: int = 0
    server_errors: list[tuple[int, str, str | None]] = field(default_factory=list)
    overlaps: list[tuple[str, set[int]]] = field(default_factory=list)
    seen_trainers: int = 0


def trainer_attempts() -> dict[str, set[int]]:
    """Live trainer processes on this machine (every namespace shares its process table), by job: the
    attempts they belong to, read from their work directory (<work>/<job>/attempt-<n>/...)."""
    found: dict[str, set[int]] = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "trainer_core.engine.launch" not in cmdline:
            continue
        if m := re.search(r"/(ftjob-[\w-]+)/attempt-(\d+)/", cmdline):
            found.setdefault(m.group(1), set()).add(int(m.group(2)))
    return found


@dataclass
class Fault:
    name: str
    at: float  # seconds into the soak
    recovered_s: float | None = None  # until a job took a training step again


@dataclass
class Report:
    jobs: dict[str, dict[str, object]]  # final job objects
    faults: list[Fault]
    watch: Watch
    streams: Streams | None = None
    artifacts_checked: int = 0
    wall_s: float = 0.0


def soak(
    d: Deployment,
    workers: Workers,
    tmp: Path,
    keys: list[str],
    n_jobs: int,
    rounds: int = 1,
    streamer: tuple[str, str] | None = None,
) -> Report:
    """Submit `n_jobs` small jobs round-robin from the tenants of `keys`, inject `rounds` rounds of faults
    (SIGKILL a worker, partition a host, restart Redis, restart Postgres, and with a `streamer` (a tenant's
    id and key) SIGKILL the inference process) while they run and the streamer streams chat replies all
    along, and wait for every job to end. What was seen is returned; the caller asserts on it."""
    api = d.settings.api_url
    clients = [Client(api, api_key=k) for k in keys]
    watch, stop = Watch(), threading.Event()
    streams = None
    if streamer is not None:
        streams = Streams(api, streamer[1], chat_model(d.settings, streamer[0], tmp)).start()

    def poll() -> None:  # a tenant's dashboard, and the machine's process table, all along
        with httpx.Client(base_url=api, timeout=10, headers={"Authorization": f"Bearer {keys[0]}"}) as http:
            while not stop.is_set():
                for path in ("/healthz", "/v1/fine_tuning/jobs"):
                    try:
                        r = http.get(path)
                    except httpx.TransportError:
                        continue
                    watch.responses += 1
                    if r.status_code >= 500:
                        said = f"{path}: {r.text[:200]}"
                        watch.server_errors.append((r.status_code, said, r.headers.get("retry-after")))
                ours = {j for _, j in submitted}  # other tests of the suite may train beside the soak
                for job, attempts in trainer_attempts().items():
                    if job not in ours:
                        continue
                    watch.seen_trainers += 1
                    if len(attempts) > 1:
                        watch.overlaps.append((job, attempts))
                stop.wait(0.2)

    def steps() -> int:
        total = 0
        for c, job in submitted:
            try:
                series = c.get(f"/v1/fine_tuning/jobs/{job}/metrics", name="train_loss")["data"]
                total += len(series.get("train_loss", {}).get("steps", []))
            except Exception:
                return -1
        return total

    def progressed_since(before: int, deadline: float) -> bool:
        while time.monotonic() < deadline:
            now = steps()
            if now > before:
                return True
            time.sleep(0.3)
        return False

    started = time.monotonic()
    threading.Thread(target=poll, daemon=True).start()
    submitted: list[tuple[Client, str]] = []
    for n in range(n_jobs):
        c = clients[n % len(clients)]
        train = c.upload(write_jsonl(tmp / f"train-{n}.jsonl", rows(48)))
        job = c.create_job(
            model="tiny-bert",
            training_file=train["id"],
            backend="torch",
            seed=n,
            checkpoint_every_steps=10,
            hyperparameters={"max_steps": 60, "batch_size": 8, "learning_rate": 1e-3, "max_seq_length": 32},
        )
        submitted.append((c, job["id"]))

    a, b = d.network.hosts[0], d.network.hosts[1]
    faults: list[Fault] = []

    def inject(name: str, act: object) -> None:
        before = max(steps(), 0)
        fault = Fault(name, round(time.monotonic() - started, 1))
        t0 = time.monotonic()
        act()  # type: ignore[operator]
        if progressed_since(before, time.monotonic() + 120):
            fault.recovered_s = round(time.monotonic() - t0, 1)
        faults.append(fault)

    def inject_serving(name: str, act: object) -> None:  # recovered: a stream completed again
        assert streams is not None
        fault, t0 = Fault(name, round(time.monotonic() - started, 1)), time.monotonic()
        act()  # type: ignore[operator]
        while time.monotonic() < t0 + 120 and not streams.completed_since(t0):
            time.sleep(0.2)
        fault.recovered_s = round(time.monotonic() - t0, 1) if streams.completed_since(t0) else None
        faults.append(fault)

    def partition() -> None:
        d.network.partition(b)
        time.sleep(FAST["heartbeat_timeout_seconds"] * 2)  # long enough to be declared lost
        d.network.heal(b)

    def restart_postgres() -> None:
        d.postgres.stop()
        time.sleep(3)
        d.postgres.start()

    def kill_worker() -> None:
        workers.kill(a)
        workers.start(a)

    for _ in range(rounds):
        progressed_since(max(steps(), 0), time.monotonic() + 120)  # training, so that faults hit it
        inject("SIGKILL the worker on host a", kill_worker)
        inject("partition host b for 8 s", partition)
        inject("restart Redis", d.redis.restart)
        inject("restart Postgres (down 3 s)", restart_postgres)
        if streams is not None:
            inject_serving("SIGKILL the inference process (restarted)", lambda: restart_inference(d))

    final: dict[str, dict[str, object]] = {}
    deadline = time.monotonic() + 600
    for c, job in submitted:
        while True:
            try:
                got = c.job(job)
            except Exception:
                got = {"status": "unknown"}
            if got["status"] in TERMINAL or time.monotonic() > deadline:
                final[job] = got
                break
            time.sleep(0.5)
    time.sleep(2)  # the last trainers' exit
    stop.set()
    if streams is not None:
        streams.stop.set()
    report = Report(final, faults, watch, streams, wall_s=round(time.monotonic() - started, 1))
    for c, job in submitted:
        if final[job]["status"] != "succeeded":
            continue
        for artifact in c.get(f"/v1/fine_tuning/jobs/{job}/artifacts"):
            dest = tmp / f"{job}-{artifact['format']}.tar"
            got = c.download(job, artifact["format"], dest)  # verifies the bytes against the header
            digest = hashlib.sha256(dest.read_bytes()).hexdigest()
            assert got == artifact["sha256"] == digest, (job, artifact["format"])
            report.artifacts_checked += 1
    return report
