"""What can be checked here of the images and the compose file (no Docker engine runs on this machine)."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.support import ROOT
from trainer_core.ort_setup import ORT_VERSION

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pin(name: str) -> str:
    for dep in PYPROJECT["project"]["dependencies"]:
        if m := re.match(rf"^{re.escape(name)}==([\w.]+)", dep):
            return m.group(1)
    raise AssertionError(f"{name} is not pinned in pyproject.toml")


def test_compose_file_parses_and_wires_the_services() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "seaweedfs", "migrate", "api", "worker"} <= set(services)
    for name in ("postgres", "redis", "seaweedfs"):
        assert "healthcheck" in services[name], name
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    env = services["api"]["environment"]
    assert env["ORTUNE_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["ORTUNE_BROKER_URL"].startswith("redis://") and env["ORTUNE_STORAGE_URL"].startswith("s3://")
    for service in ("api", "worker", "migrate"):
        assert (ROOT / services[service]["build"]["dockerfile"]).is_file()


def test_images_pin_what_pyproject_pins() -> None:
    torch_pin = _pin("torch")
    ort_pin = _pin("onnxruntime-training-cpu")
    assert ort_pin == ORT_VERSION
    for dockerfile in (ROOT / "docker").glob("*.Dockerfile"):
        text = dockerfile.read_text()
        assert text.startswith("#") and "\nFROM " in text, dockerfile.name
        assert f"torch=={torch_pin}" in text, dockerfile.name
        for other in re.findall(r"torch==([\w.]+)", text):
            assert other == torch_pin, dockerfile.name


def test_gpu_image_fits_ort_training_cuda_build() -> None:
    text = (ROOT / "docker" / "worker-gpu.Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M)
    assert base and "cuda:11.8" in base.group(1) and "cudnn8" in base.group(1)
    assert f"onnxruntime-training=={ORT_VERSION}" in text and "ortune setup-ort" in text
    assert "python3.11" in text  # the only Python onnxruntime-training 1.19.2 ships for
    assert "libcublas.so.11" in text  # the comment says why the base is CUDA 11.8
