"""`ortune demo` as a user runs it: the embedded default, a real pretrained model, accuracy up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import free_port

pytestmark = pytest.mark.e2e


def test_demo_fine_tunes_minilm_and_beats_the_baseline(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTUNE_")}
    env |= {"ORTUNE_DATA_DIR": str(tmp_path / "state"), "ORTUNE_API_PORT": str(free_port()), "COLUMNS": "120"}
    env |= {"ORTUNE_SERVE_PORT": str(free_port())}
    ortune = Path(sys.executable).with_name("ortune")
    result = subprocess.run(
        [str(ortune), "demo"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    before = float(re.search(r"before training.*?(\d\.\d{3})", out).group(1))  # type: ignore[union-attr]
    after_pt = float(re.search(r"PyTorch artifact loaded back.*?(\d\.\d{3})", out).group(1))  # type: ignore[union-attr]
    after_onnx = float(re.search(r"ONNX artifact in onnxruntime.*?(\d\.\d{3})", out).group(1))  # type: ignore[union-attr]
    assert after_pt > before and after_onnx > before
    assert abs(after_pt - after_onnx) < 0.02
    assert "sha256" in out and "verified" in out
    assert len(re.findall(r"served by /v1/predict: (negative|positive) \(", out)) == 2, out[-2000:]
