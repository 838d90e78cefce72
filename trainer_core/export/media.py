"""ONNX export of an image or audio classifier, checked as the text classifiers are (export.py): the graph
takes what the processor makes (`pixel_values`, or `input_values` with its `attention_mask`), with dynamic
batch (and clip length) dimensions, and its logits on held-out rows batched differently from the export
sample must match PyTorch's within `PARITY_TOLERANCE`. The processor is saved beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer_core.data.mediastore import MediaCollator, MediaStore
from trainer_core.export import PARITY_TOLERANCE, HeldOut, logits_parity, save_onnx, write_manifest


class _Logits(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, values: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if values.dim() == 4:
            return self.model(pixel_values=values).logits
        return self.model(input_values=values, attention_mask=attention_mask).logits


def _batch(store: MediaStore, collator: MediaCollator, rows: list[int]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in collator([store[i] for i in rows]).items() if k != "labels"}


def export_onnx(
    model: Any, processor: Any, directory: Path, held_out: HeldOut, manifest: dict[str, Any]
) -> dict[str, Any]:
    store: MediaStore = held_out.store
    collator: MediaCollator = held_out.collator
    directory.mkdir(parents=True, exist_ok=True)
    model = model.float().eval().cpu()
    n = len(store)
    # two rows for the export (a batch of 1 or a fixed clip length would be baked into the graph), and
    # up to 7 others, batched otherwise, for the check
    order = sorted(range(min(n, 64)), key=lambda i: int(store.lengths[i]))
    sample = _batch(store, collator, [order[0], order[-1]] if n > 1 else [0, 0])
    check_rows = order[1 : 1 + 7] or [0]
    check = _batch(store, collator, check_rows)
    image = "pixel_values" in sample
    names = ["pixel_values"] if image else [k for k in ("input_values", "attention_mask") if k in sample]
    batch = torch.export.Dim("batch")
    shapes: dict[str, Any] = {"values": {0: batch}}
    if not image:
        length = torch.export.Dim("samples", min=400)  # a wav2vec2-style encoder needs a few frames
        shapes = {"values": {0: batch, 1: length}}
        if "attention_mask" in sample:
            shapes["attention_mask"] = {0: batch, 1: length}
        if sample["input_values"].shape[1] == check["input_values"].shape[1]:
            check = _batch(store, collator, check_rows[:1])  # another length than the sample's
    args = {"values": sample[names[0]]} | (
        {"attention_mask": sample["attention_mask"]} if len(names) > 1 else {}
    )
    wrapper = _Logits(model)
    save_onnx(
        wrapper,
        directory / "model.onnx",
        kwargs=args,
        input_names=names,
        output_names=["logits"],
        dynamic_shapes=shapes,
    )
    processor.save_pretrained(directory)
    model.config.save_pretrained(directory)

    import onnxruntime as ort

    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {n: check[n].numpy() for n in names})[0]
    with torch.no_grad():
        want = wrapper(check[names[0]], check.get("attention_mask")).numpy()
    diff = logits_parity(got, want)
    manifest = {
        **manifest,
        "format": "onnx",
        "onnx_opset": 18,
        "inputs": names,
        "outputs": ["logits"],
        "media": store.media,
        "parity": {"max_abs_diff": diff, "tolerance": PARITY_TOLERANCE, "samples": int(got.shape[0])},
        "files": sorted(p.name for p in directory.iterdir()),
    }
    write_manifest(directory, manifest)
    return manifest
