"""What the deployment files do, checked without a Docker engine (none runs here): the compose file parses
and wires real services and settings, and the images copy what exists, pin what pyproject pins and run
commands that exist."""

from __future__ import annotations

import re
import shlex
import tomllib
from typing import Any

import yaml

from api import main as api_main
from ortune.cli.app import app as cli
from ortune.settings import Settings
from tests.support import ROOT
from trainer_core.ort_setup import ORT_VERSION

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _pin(name: str) -> str:
    for dep in PYPROJECT["project"]["dependencies"]:
        if m := re.match(rf"^{re.escape(name)}==([\w.]+)", dep):
            return m.group(1)
    raise AssertionError(f"{name} is not pinned in pyproject.toml")


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / dockerfile).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _cli_commands() -> set[str]:
    names = {c.name or (c.callback.__name__ if c.callback else "") for c in cli.registered_commands}
    return names | {g.name or "" for g in cli.registered_groups}


def _runs(args: str) -> list[str]:
    return list(yaml.safe_load(args)) if args.startswith("[") else shlex.split(args)


def test_compose_wires_real_services_and_settings() -> None:
    services: dict[str, Any] = COMPOSE["services"]
    assert {"postgres", "redis", "seaweedfs", "migrate", "api", "worker"} <= set(services)
    for name in ("postgres", "redis", "seaweedfs"):
        assert "healthcheck" in services[name], name
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    fields = {f"ORTUNE_{name.upper()}" for name in Settings.model_fields}
    for name in ("api", "worker", "migrate"):
        env = services[name]["environment"]
        assert set(env) <= fields, f"{name}: {sorted(set(env) - fields)} are not settings"
        assert env["ORTUNE_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["ORTUNE_BROKER_URL"].startswith("redis://") and env["ORTUNE_STORAGE_URL"].startswith(
            "s3://"
        )
        assert (ROOT / services[name]["build"]["dockerfile"]).is_file()
    assert services["migrate"]["command"][0] == "ortune"
    assert services["migrate"]["command"][1] in _cli_commands()


def test_images_copy_what_exists_and_run_real_commands() -> None:
    for dockerfile in ("docker/api.Dockerfile", "docker/worker-gpu.Dockerfile"):
        steps = _instructions(dockerfile)
        for kind, args in steps:
            if kind == "COPY":
                *sources, _ = args.split()
                for source in sources:
                    assert (ROOT / source).exists(), f"{dockerfile} copies {source}, which does not exist"
        cmd = _runs(next(args for kind, args in reversed(steps) if kind == "CMD"))
        if cmd[0] == "ortune":
            assert cmd[1] in _cli_commands(), f"{dockerfile} runs `ortune {cmd[1]}`, no such command"
        else:
            factory = cmd[cmd.index("--factory") + 1]
            module, attr = factory.split(":")
            assert module == "api.main" and callable(getattr(api_main, attr)), factory


def test_images_pin_what_pyproject_pins() -> None:
    torch_pin = _pin("torch")
    assert _pin("onnxruntime-training-cpu") == ORT_VERSION
    for dockerfile in ("docker/api.Dockerfile", "docker/worker-gpu.Dockerfile"):
        runs = " ".join(args for kind, args in _instructions(dockerfile) if kind == "RUN")
        assert set(re.findall(r"torch==([\w.]+)", runs)) == {torch_pin}, dockerfile
