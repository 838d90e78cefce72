"""Make onnxruntime-training 1.19.2 (the last ORT training build) work on torch 2.9+.

Applied once, before anything imports `onnxruntime.training`:

- torch 2.9 moved the TorchScript exporter under `torch.onnx._internal.torchscript_exporter`; ORTModule still
  imports `torch.onnx._internal.jit_utils`, `torch.onnx._type_utils`, `torch.onnx._globals` and `_beartype`.
  They are aliased back to where ORT looks.
- ORTModule calls `torch.onnx.export` without `dynamo=`, which now means the dynamo exporter; that export
  fails and ORTModule would quietly fall back to PyTorch. Its calls are pinned to the TorchScript exporter.
- ORT's own symbolic for `aten::_convolution` (every Conv: a ViT's patches, a wav2vec2 feature encoder)
  imports `_convolution` from `torch.onnx.symbolic_opset9`, which now re-exports only public names; the
  TorchScript exporter's own is put back there.
- On a CPU build of torch, ORT's NVTX range markers raise; they become no-ops where there is no CUDA.
- `ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE`, so any failure inside ORTModule raises instead of silently
  training with PyTorch.

The C++ side (torch_interop_utils) needs a source patch and a build: see `ort_setup`.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    import torch
    import torch.onnx
    import torch.onnx._internal as internal

    try:
        from torch.onnx._internal.torchscript_exporter import _globals, _type_utils, jit_utils
    except ImportError:  # torch < 2.9 still has the old layout; nothing to alias
        pass
    else:
        sys.modules["torch.onnx._internal.jit_utils"] = jit_utils
        internal.jit_utils = jit_utils  # type: ignore[attr-defined]
        for name, module in (("_type_utils", _type_utils), ("_globals", _globals)):
            sys.modules[f"torch.onnx.{name}"] = module
            setattr(torch.onnx, name, module)
        import torch.onnx.symbolic_opset9 as opset9
        from torch.onnx._internal.torchscript_exporter import symbolic_opset9 as internal_opset9

        if not hasattr(opset9, "_convolution"):
            opset9._convolution = internal_opset9._convolution  # type: ignore[attr-defined]
    if "torch.onnx._internal._beartype" not in sys.modules:
        beartype = types.ModuleType("torch.onnx._internal._beartype")
        beartype.beartype = lambda fn: fn  # type: ignore[attr-defined]
        sys.modules[beartype.__name__] = beartype
        internal._beartype = beartype  # type: ignore[attr-defined]
    if not hasattr(torch.onnx, "SymbolicContext"):
        torch.onnx.SymbolicContext = type("SymbolicContext", (), {})  # type: ignore[attr-defined]

    export = torch.onnx.export

    @functools.wraps(export)
    def torchscript_export(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("dynamo", False)
        return export(*args, **kwargs)

    torch.onnx.export = torchscript_export
    if not torch.cuda.is_available():
        torch.cuda.nvtx.range_push = lambda msg: 0
        torch.cuda.nvtx.range_pop = lambda: 0
    _applied = True


def dynamo_export(*args: Any, **kwargs: Any) -> Any:
    """torch.onnx.export with the dynamo exporter, whatever `apply` did (our own ONNX artifacts use it)."""
    import torch.onnx

    export = getattr(torch.onnx.export, "__wrapped__", torch.onnx.export)
    return export(*args, dynamo=True, **kwargs)
