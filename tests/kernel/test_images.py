"""The GPU worker image's pins fit together: what cannot be built here (no Docker, no GPU) is checked by
reading the Dockerfile against pyproject.toml, the Makefile and trainer_core's own pins."""

from __future__ import annotations

import re

from tests.support import ROOT
from trainer_core.engine.ort_setup import ORT_VERSION

GPU = (ROOT / "docker" / "worker-gpu.Dockerfile").read_text()
# onnxruntime-training 1.19.2's CUDA provider (build_and_package_info.cuda_version = '11.8') links these;
# each must come from a cu11 wheel whose lib folder is on LD_LIBRARY_PATH.
ORT_CUDA_LIBS = {
    "nvidia-cuda-runtime-cu11": "cuda_runtime",  # libcudart.so.11.0
    "nvidia-cublas-cu11": "cublas",  # libcublas.so.11, libcublasLt.so.11
    "nvidia-cufft-cu11": "cufft",  # libcufft.so.10
    "nvidia-curand-cu11": "curand",  # libcurand.so.10
    "nvidia-cudnn-cu11": "cudnn",  # libcudnn.so.8
}


def pin(text: str, name: str) -> str:
    found = re.findall(rf"{re.escape(name)}==([\w.]+)", text)
    assert len(set(found)) == 1, f"{name}: expected one pin, found {found}"
    return found[0]


def test_the_toolkit_is_the_cuda_of_the_torch_wheel() -> None:
    toolkit = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel", GPU, re.M)
    index = re.search(r"download\.pytorch\.org/whl/cu(\d+)", GPU)
    assert toolkit and index, "the GPU image names its CUDA toolkit and torch's wheel index"
    assert "".join(toolkit.groups()) == index.group(1)  # nvcc 12.6 for a cu126 torch


def test_torch_deepspeed_and_ort_are_the_projects_pins() -> None:
    assert pin(GPU, "torch") == pin((ROOT / "pyproject.toml").read_text(), "torch")
    assert pin(GPU, "deepspeed") == pin((ROOT / "Makefile").read_text(), "deepspeed")
    assert pin(GPU, "onnxruntime-training") == ORT_VERSION
    assert "python3.11" in GPU  # the only Python onnxruntime-training 1.19.2 has wheels for


def test_orts_cuda_11_runtime_is_installed_and_on_the_library_path() -> None:
    library_path = re.search(r"^ENV LD_LIBRARY_PATH=(\S+)", GPU, re.M)
    assert library_path is not None
    folders = library_path.group(1).split(":")
    for wheel, folder in ORT_CUDA_LIBS.items():
        assert re.search(rf"{wheel}==11\.|{wheel}==1\d\.|{wheel}==8\.", GPU), f"{wheel} is not installed"
        assert any(f.endswith(f"/nvidia/{folder}/lib") for f in folders), f"{folder} is not on the path"


def test_setup_ort_builds_the_cuda_extensions_in_the_image() -> None:
    assert "ONNXRUNTIME_FORCE_CUDA=1" in GPU  # an image build sees no GPU; the CUDA extensions are forced
    assert GPU.rstrip().splitlines()[-2].strip().endswith("ortune setup-ort")
