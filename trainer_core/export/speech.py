"""ONNX export of a speech recognizer (Whisper-shaped): `encoder.onnx` (`input_features` -> the encoder's
hidden states) and `decoder.onnx` (`decoder_input_ids`, `encoder_hidden_states` -> `logits`), the layout
Optimum's ORTModelForSpeechSeq2Seq reads without a cache, with the processor beside them.

Checked at export by greedy transcription (speech.greedy): for held-out clips ONNX Runtime must write
PyTorch's transcripts token for token; the result is in the manifest (`greedy_parity`), and a clip whose
transcripts differ fails the export naming it and both transcripts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer_core.data.mediastore import MediaCollator, MediaStore
from trainer_core.export import ExportError, HeldOut, save_onnx, write_manifest
from trainer_core.tasks import speech

CHECK_CLIPS = 8


class _Encoder(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features).last_hidden_state


class _Decoder(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, decoder_input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.model(
            encoder_outputs=(encoder_hidden_states,), decoder_input_ids=decoder_input_ids, use_cache=False
        )
        return out.logits


def export_onnx(
    model: Any,
    processor: speech.SpeechProcessor,
    directory: Path,
    held_out: HeldOut,
    manifest: dict[str, Any],
) -> dict[str, Any]:
    store: MediaStore = held_out.store
    collator: MediaCollator = held_out.collator
    directory.mkdir(parents=True, exist_ok=True)
    model = model.float().eval().cpu()
    rows = [store[i] for i in range(min(len(store), CHECK_CLIPS))]
    features = collator(rows)["input_features"]
    sample = features[:2] if len(features) > 1 else features.repeat(2, 1, 1)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("decoder_sequence")
    encoder, decoder = _Encoder(model), _Decoder(model)
    with torch.no_grad():
        hidden = encoder(sample)
    ids = torch.full((2, 3), model.config.decoder_start_token_id, dtype=torch.long)
    save_onnx(
        encoder,
        directory / "encoder.onnx",
        args=(sample,),
        input_names=["input_features"],
        output_names=["last_hidden_state"],
        dynamic_shapes=({0: batch},),
    )
    save_onnx(
        decoder,
        directory / "decoder.onnx",
        args=(ids, hidden),
        input_names=["decoder_input_ids", "encoder_hidden_states"],
        output_names=["logits"],
        dynamic_shapes=({0: batch, 1: length}, {0: batch}),
    )
    processor.save_pretrained(directory)
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    parity = _greedy_parity(model, processor, directory, features.numpy())
    manifest = {
        **manifest,
        "format": "onnx",
        "onnx_opset": 18,
        "graphs": {
            "encoder.onnx": ["input_features"],
            "decoder.onnx": ["decoder_input_ids", "encoder_hidden_states"],
        },
        "inputs": ["input_features"],
        "outputs": ["logits"],
        "media": store.media,
        "greedy_parity": parity,
        "parity": {"max_abs_diff": parity["max_abs_diff"], "samples": parity["clips"]},
        "files": sorted(p.name for p in directory.iterdir()),
    }
    write_manifest(directory, manifest)
    return manifest


def _greedy_parity(
    model: Any, processor: speech.SpeechProcessor, directory: Path, features: np.ndarray
) -> dict[str, Any]:
    import onnxruntime as ort

    options = ["CPUExecutionProvider"]
    enc = ort.InferenceSession(str(directory / "encoder.onnx"), providers=options)
    dec = ort.InferenceSession(str(directory / "decoder.onnx"), providers=options)
    start, end = model.config.decoder_start_token_id, model.config.eos_token_id

    def encode(f: np.ndarray) -> np.ndarray:
        return np.asarray(enc.run(None, {"input_features": f.astype(np.float32)})[0])

    def decode(ids: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        logits = dec.run(None, {"decoder_input_ids": ids, "encoder_hidden_states": hidden})[0]
        return np.asarray(logits)[:, -1]

    got = speech.greedy(encode, decode, features, start, end)
    want = speech.torch_greedy(model, features)
    with torch.no_grad():
        first = torch.full((len(features), 1), start, dtype=torch.long)
        ref = model(input_features=torch.from_numpy(features), decoder_input_ids=first).logits[:, -1].numpy()
    diff = float(np.abs(decode(first.numpy(), encode(features)) - ref).max())
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            raise ExportError(
                f"ONNX greedy transcription differs from PyTorch's on held-out clip {i}: "
                f"{processor.text(a)!r} (ids {a}) against {processor.text(b)!r} (ids {b})"
            )
    return {"clips": len(got), "identical": len(got), "max_abs_diff": diff}
