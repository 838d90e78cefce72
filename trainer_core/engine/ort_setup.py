"""`ortune setup-ort`: make ONNX Runtime training usable here, idempotently, saying what failed.

1. onnxruntime-training 1.19.2 is importable (the CPU build where there is no CUDA);
2. its torch_interop_utils C++ sources are patched for torch 2.9+ (autograd `Node` is held by
   `c10::intrusive_ptr`, `PyNode::obj` became `pyobj()`, `THPFunction::cdata` is no longer a weak pointer,
   and libtorch_python no longer exports `tensor_fromDLPack` or PyNode's type info);
3. the extensions are built (what `python -m torch_ort.configure` did; torch-ort itself is not needed);
4. a two-step ORTModule smoke run with fallback disabled proves ORT really trains, on the GPU when there is
   one.

On a CUDA build (the GPU image sets ONNXRUNTIME_FORCE_CUDA=1, since an image build sees no GPU) the CUDA
extensions (fused_ops: ORT's FusedAdam; torch_gpu_allocator) are built and checked too, with nvcc, which must
be the CUDA of the torch wheel (docker/worker-gpu.Dockerfile; tests/kernel/test_images.py holds the pins).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer_core import contract

ORT_VERSION = "1.19.2"
MARK = "// ortune: patched for torch >= 2.9"
_FROM_DLPACK = """
// ortune: torch::utils::tensor_fromDLPack is no longer exported by libtorch_python.
static at::Tensor ortune_tensor_from_dlpack(PyObject* capsule) {
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  TORCH_CHECK(managed != nullptr, "from_dlpack received an invalid capsule");
  at::Tensor tensor = at::fromDLPack(managed);
  PyCapsule_SetName(capsule, "used_dltensor");
  return tensor;
}
"""
_NOT_EXPORTED = "  // PyNode's type info is not exported by libtorch_python; ORT only passes PyNodes here"
PATCHES: dict[str, list[tuple[str, str]]] = {
    "ctx_pool.h": [
        (
            "std::unordered_map<size_t, std::shared_ptr<torch::autograd::Node>> grad_fns_;",
            "std::unordered_map<size_t, c10::intrusive_ptr<torch::autograd::Node>> grad_fns_;",
        ),
    ],
    "custom_function_fw.cc": [
        (
            "const std::shared_ptr<torch::autograd::Node>& cdata = tensor_owning_ctx.value().grad_fn();",
            "const auto& cdata = tensor_owning_ctx.value().grad_fn();",
        ),
        (
            "auto py_node_fn = dynamic_cast<torch::autograd::PyNode*>(grad_fn.get());",
            "auto py_node_fn = static_cast<torch::autograd::PyNode*>(grad_fn.get());" + _NOT_EXPORTED,
        ),
        (
            "auto py_node_fn = dynamic_cast<torch::autograd::PyNode*>(cdata.get());",
            "auto py_node_fn = static_cast<torch::autograd::PyNode*>(cdata.get());" + _NOT_EXPORTED,
        ),
        ("(THPFunction*)py_node_fn->obj;", "(THPFunction*)py_node_fn->pyobj();"),
        ("auto saved_for = py_fn->cdata.lock();", "auto saved_for = py_fn->cdata;"),
        ("torch::utils::tensor_fromDLPack(", "ortune_tensor_from_dlpack("),
    ],
    "custom_function_bw.cc": [("torch::utils::tensor_fromDLPack(", "ortune_tensor_from_dlpack(")],
}
NEEDS_HELPER = ("custom_function_fw.cc", "custom_function_bw.cc")

SMOKE = """
from trainer_core.engine import ort_compat; ort_compat.apply()
import torch
from onnxruntime.training.ortmodule import ORTModule
from transformers import BertConfig, BertForSequenceClassification
torch.manual_seed(0)
config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64, num_labels=2, attn_implementation="eager")
device = "cuda" if torch.cuda.is_available() else "cpu"
model = BertForSequenceClassification(config).train().to(device)
ort_model = ORTModule(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(5, 100, (4, 8), device=device)
for _ in range(2):
    labels = torch.tensor([0, 1, 0, 1], device=device)
    loss = ort_model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
    loss.backward(); opt.step(); opt.zero_grad()
print("ok", float(loss.detach()), "on", device)
"""


class SetupError(RuntimeError):
    pass


def _say(message: str) -> None:
    print(f"setup-ort: {message}", flush=True)


def extensions_dir() -> Path:
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or spec.origin is None:
        raise SetupError("onnxruntime is not installed")
    path = Path(spec.origin).parent / "training" / "ortmodule" / "torch_cpp_extensions"
    if not path.is_dir():
        import torch

        wanted = "onnxruntime-training" if torch.cuda.is_available() else "onnxruntime-training-cpu"
        raise SetupError(
            f"{Path(spec.origin).parent} is an inference-only onnxruntime; install {wanted}=={ORT_VERSION} "
            f"(ortune setup-ort --install; it has wheels for Python 3.11 only"
            f"{', and links CUDA 11.8' if wanted == 'onnxruntime-training' else ''})"
        )
    return path


def patch_sources(ext_dir: Path) -> list[str]:
    """Patch torch_interop_utils in place; returns the files changed (none when already patched)."""
    src = ext_dir / "cpu" / "torch_interop_utils"
    changed = []
    for name, subs in PATCHES.items():
        path = src / name
        text = path.read_text()
        if MARK in text:
            continue
        for old, new in subs:
            if old not in text:
                raise SetupError(f"{path}: expected source not found (is this ORT {ORT_VERSION}?): {old!r}")
            text = text.replace(old, new)
        if name in NEEDS_HELPER:
            anchor = "#include <torch/extension.h>"
            if anchor not in text:
                raise SetupError(f"{path}: expected source not found: {anchor!r}")
            text = text.replace(anchor, f"{anchor}\n#include <ATen/DLConvertor.h>\n{_FROM_DLPACK}", 1)
        path.write_text(f"{MARK}\n{text}")
        changed.append(name)
    return changed


def wants_cuda() -> bool:
    """Whether the CUDA extensions must be built: a CUDA torch with a GPU, or an image build that says so."""
    import torch

    return bool(os.environ.get("ONNXRUNTIME_FORCE_CUDA")) or (
        torch.version.cuda is not None and torch.cuda.is_available()
    )


def built(ext_dir: Path) -> bool:
    names = ["aten_op_executor", "torch_interop_utils"]
    if wants_cuda():
        names += ["fused_ops", "torch_gpu_allocator"]
    return all(any(ext_dir.glob(f"{name}*.so")) for name in names)


def build(ext_dir: Path) -> None:
    code = (
        "from trainer_core.engine import ort_compat; ort_compat.apply();"
        "from onnxruntime.training.ortmodule.torch_cpp_extensions import install;"
        "install.build_torch_cpp_extensions()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0 or not built(ext_dir):
        errors = [
            line
            for line in (result.stdout + result.stderr).splitlines()
            if " error" in line or "Error" in line
        ]
        raise SetupError(
            "building ORT's torch extensions failed:\n"
            + "\n".join(errors[-15:] or result.stderr.splitlines()[-15:])
        )


_SOURCE_SUFFIXES = frozenset({".cc", ".cpp", ".cu", ".h", ".py"})


def cache_key(ext_dir: Path) -> str:
    """What the built extensions depend on: torch, ORT, Python, the machine, CUDA or not, and every source
    file as patched (a change to PATCHES gives a new key)."""
    import torch

    digest = hashlib.sha256()
    for part in (torch.__version__, ORT_VERSION, platform.python_version(), platform.machine(), wants_cuda()):
        digest.update(f"{part}\0".encode())
    for path in sorted(ext_dir.rglob("*")):
        rel = path.relative_to(ext_dir)
        if path.suffix in _SOURCE_SUFFIXES and "build" not in rel.parts:
            digest.update(f"{rel}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path | None:
    """Built extensions kept across virtual environments (a fresh clone's `make install` takes them instead
    of four minutes of compiling); ORTUNE_BUILD_CACHE moves it, an empty value turns it off."""
    configured = os.environ.get("ORTUNE_BUILD_CACHE")
    if configured is not None:
        return Path(configured) if configured else None
    return contract.user_cache("ort-extensions")


def restore(ext_dir: Path, cache: Path | None) -> bool:
    if cache is None or not cache.is_dir():
        return False
    for so in cache.glob("*.so"):
        shutil.copy2(so, ext_dir / so.name)
    return built(ext_dir)


def save(ext_dir: Path, cache: Path | None) -> None:
    """Copied aside and renamed into place, so a concurrent install never sees half an entry."""
    if cache is None or cache.is_dir():
        return
    staging = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".tmp-"))
        for so in ext_dir.glob("*.so"):
            shutil.copy2(so, staging / so.name)
        staging.rename(cache)
    except OSError as exc:  # a cache is an optimisation: a read-only home must not fail the install
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        _say(f"could not keep the built extensions in {cache} ({exc})")


def smoke() -> str:
    result = subprocess.run([sys.executable, "-c", SMOKE], capture_output=True, text=True, timeout=600)
    last = (result.stdout.strip().splitlines() or [""])[-1]
    if result.returncode != 0 or not last.startswith("ok"):
        tail = [line for line in result.stderr.splitlines() if line.strip()][-6:]
        raise SetupError("ORTModule smoke run failed:\n" + "\n".join(tail))
    return last


def install_package(cuda: bool) -> None:
    name = "onnxruntime-training" if cuda else "onnxruntime-training-cpu"
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    # Both distributions write the same `onnxruntime/` folder: the inference-only one must go first.
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "onnxruntime"], check=False)
    if subprocess.run([*pip, f"{name}=={ORT_VERSION}"]).returncode != 0:
        raise SetupError(f"pip could not install {name}=={ORT_VERSION} (it exists for Python 3.11 on x86-64)")


def run(*, install: bool = False) -> str:
    """Every step, each skipped when already done. Returns the smoke run's result line."""
    try:
        ext_dir = extensions_dir()
    except SetupError:
        if not install:
            raise
        import torch

        install_package(torch.cuda.is_available())
        importlib.invalidate_caches()
        ext_dir = extensions_dir()
    changed = patch_sources(ext_dir)
    _say(f"patched {', '.join(changed)}" if changed else "sources already patched")
    root = cache_root()
    cache = root / cache_key(ext_dir) if root else None
    restored = False
    if changed or not built(ext_dir):
        if restored := restore(ext_dir, cache):
            _say(f"extensions restored from {cache} (built before for this torch, ORT and these sources)")
        else:
            _build(ext_dir)
    else:
        _say("extensions already built")
    try:
        line = smoke()
    except SetupError as exc:
        if not restored:
            raise
        _say(f"the restored extensions do not run ({exc}); building them again")
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
        for so in ext_dir.glob("*.so"):
            so.unlink()
        _build(ext_dir)
        line = smoke()
    save(ext_dir, cache)  # only extensions that passed the smoke run are kept
    _say(f"ORTModule trains with fallback disabled ({line})")
    return line


def _build(ext_dir: Path) -> None:
    _say("building ORT's torch extensions (about 4 minutes on 2 cores)")
    build(ext_dir)


def reason_if_broken() -> str | None:
    """Why ORT cannot train here, or None; cheap enough to call before every job."""
    try:
        ext_dir = extensions_dir()
    except SetupError as exc:
        return str(exc)
    if not built(ext_dir):
        return "ORT's torch extensions are not built: run `ortune setup-ort`"
    return None


__all__ = [
    "ORT_VERSION",
    "SetupError",
    "built",
    "cache_key",
    "cache_root",
    "extensions_dir",
    "patch_sources",
    "reason_if_broken",
    "restore",
    "run",
    "save",
]
