"""What the deployment files do, checked without a Docker engine (none runs here): the compose file parses
and wires real services and settings, and the images copy what exists, pin what pyproject pins and run
commands that exist."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from api import main as api_main
from ortune.cli.app import app as cli
from ortune.settings import PLACEHOLDERS, Settings
from tests.support import ROOT
from trainer_core.engine.ort_setup import ORT_VERSION

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


def _shipped_credentials() -> dict[str, str]:
    """Every example credential the deployment files and the settings' defaults carry, by where it is."""
    found: dict[str, str] = {}
    for ident in json.loads((ROOT / "docker" / "s3.json").read_text())["identities"]:
        for n, cred in enumerate(ident["credentials"]):
            found |= {f"s3.json {ident['name']}[{n}].{k}": v for k, v in cred.items()}
    for name, service in COMPOSE["services"].items():
        for key, value in (service.get("environment") or {}).items():
            literal = not str(value).startswith("${")
            if literal and any(word in key for word in ("PASSWORD", "SECRET", "ACCESS_KEY")):
                found[f"compose {name}.{key}"] = str(value)
    defaults = Settings.model_fields
    found["default s3_access_key"] = str(defaults["s3_access_key"].default)
    found["default s3_secret_key"] = defaults["s3_secret_key"].default.get_secret_value()
    return found


def _real(tmp: Path) -> dict[str, Any]:
    return {
        "environment": "production",
        "data_dir": tmp,
        "database_url": "postgresql+psycopg://ortune:pg-4f9a1c@db:5432/ortune",
        "broker_url": "redis://redis:6379/0",
        "storage_url": "s3://ortune?endpoint_url=http://s3:8333",
        "s3_access_key": "AK-7d2e91",
        "s3_secret_key": "sk-0b83f2aa",
        "admin_api_key": "admin-5e6c77",
    }


def test_production_refuses_every_placeholder_credential_the_project_ships(tmp_path: Path) -> None:
    Settings(**_real(tmp_path))  # real secrets start
    shipped = _shipped_credentials()
    assert set(shipped.values()) <= PLACEHOLDERS, shipped
    slots = {
        "s3_access_key": ("ORTUNE_S3_ACCESS_KEY", "{}"),
        "s3_secret_key": ("ORTUNE_S3_SECRET_KEY", "{}"),
        "admin_api_key": ("ORTUNE_ADMIN_API_KEY", "{}"),
        "database_url": ("ORTUNE_DATABASE_URL password", "postgresql+psycopg://ortune:{}@db:5432/ortune"),
        "broker_url": ("ORTUNE_BROKER_URL password", "redis://:{}@redis:6379/0"),
    }
    for value in sorted(set(shipped.values())):
        for field, (named, shape) in slots.items():
            with pytest.raises(ValidationError, match=re.escape(named)):
                Settings(**_real(tmp_path) | {field: shape.format(value)})
    Settings(data_dir=tmp_path)  # development keeps its defaults
    postgres = COMPOSE["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"]
    url = COMPOSE["services"]["api"]["environment"]["ORTUNE_DATABASE_URL"]
    assert postgres.startswith("${ORTUNE_POSTGRES_PASSWORD:?") and "${ORTUNE_POSTGRES_PASSWORD:?" in url


def test_settings_never_print_a_secret(tmp_path: Path) -> None:
    real = _real(tmp_path)
    shown = repr(Settings(**real)) + str(Settings(**real))
    for secret in ("pg-4f9a1c", "sk-0b83f2aa", "admin-5e6c77"):
        assert secret not in shown


def test_images_run_as_production() -> None:
    for dockerfile in ("docker/api.Dockerfile", "docker/worker-gpu.Dockerfile"):
        env = " ".join(args for kind, args in _instructions(dockerfile) if kind == "ENV")
        assert "ORTUNE_ENVIRONMENT=production" in env.split(), dockerfile
