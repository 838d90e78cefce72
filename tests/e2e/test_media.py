"""Image and audio classification jobs through the whole service on both configurations: an archive
uploaded, a job that learns (held-out accuracy after beats before), and both artifacts loaded back as a
user would (transformers and onnxruntime, each with the processor saved beside it) predicting the same
labels."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ortune import media_demo
from ortune.cli.client import APIError, Client
from tests.support import TERMINAL, series, wait_for

pytestmark = pytest.mark.e2e

CASES = {
    # model, rows, epochs, lr multiplier (of 5e-5), what held-out accuracy must reach over before
    "image": ("tiny-vit", media_demo.image_rows, 8, 40, 0.15),
    "audio": ("tiny-audio", media_demo.audio_rows, 4, 40, 0.4),
}


def extract(archive: Path, into: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def features(kind: str, processor: Any, files: list[bytes]) -> dict[str, Any]:
    """What a user feeds the model: images through the image processor, clips resampled to its rate."""
    if kind == "image":
        from PIL import Image

        return dict(
            processor(images=[Image.open(io.BytesIO(f)).convert("RGB") for f in files], return_tensors="np")
        )
    import soundfile
    from scipy.signal import resample_poly

    clips = []
    for f in files:
        samples, rate = soundfile.read(io.BytesIO(f), dtype="float32")
        g = math.gcd(rate, processor.sampling_rate)
        clips.append(resample_poly(samples, processor.sampling_rate // g, rate // g).astype(np.float32))
    if kind == "speech":  # Whisper's extractor pads every clip to its fixed window
        return dict(processor(clips, sampling_rate=processor.sampling_rate, return_tensors="np"))
    return dict(processor(clips, sampling_rate=processor.sampling_rate, padding=True, return_tensors="np"))


@pytest.mark.parametrize(
    ("kind", "config"), [("image", "production"), ("audio", "embedded")], indirect=["config"]
)
def test_a_media_classifier_learns_and_both_artifacts_agree(
    service: Client, tmp_path: Path, kind: str
) -> None:
    import onnxruntime as ort
    import torch
    from transformers import (
        AutoFeatureExtractor,
        AutoImageProcessor,
        AutoModelForAudioClassification,
        AutoModelForImageClassification,
    )

    model, make, epochs, lr, gain = CASES[kind]
    held_out = make(60, 2)
    train = service.upload(media_demo.write_archive(tmp_path / "train.zip", make(240, 1)))
    valid = service.upload(media_demo.write_archive(tmp_path / "valid.tar.gz", held_out, layout="metadata"))
    assert (train["status"], valid["status"]) == ("processed", "processed"), (train, valid)
    job = service.create_job(
        model=model,
        training_file=train["id"],
        validation_file=valid["id"],
        seed=7,
        hyperparameters={"n_epochs": epochs, "batch_size": 16, "learning_rate_multiplier": lr},
    )
    done = wait_for(service, job["id"], TERMINAL, timeout=600)
    assert done["status"] == "succeeded", done["error"]
    assert done["task"] == f"{kind}-classification"
    with pytest.raises(APIError, match="does not serve yet: download its ONNX artifact") as unserved:
        service.post("/v1/predict", {"model": done["fine_tuned_model"], "inputs": "a circle"})
    assert (unserved.value.status, unserved.value.code) == (400, "model_not_served")
    accuracy = series(service, job["id"], "eval_accuracy")["values"]
    assert accuracy[-1] >= accuracy[0] + gain, accuracy

    labels = [label for _, label, _ in held_out]
    files = [data for _, _, data in held_out]
    predicted = {}
    for fmt in ("pytorch", "onnx"):
        service.download(job["id"], fmt, tmp_path / f"{fmt}.tar")
        directory = extract(tmp_path / f"{fmt}.tar", tmp_path / f"{fmt}-x") / fmt
        load = AutoImageProcessor if kind == "image" else AutoFeatureExtractor
        batch = features(kind, load.from_pretrained(directory), files)
        if fmt == "pytorch":
            auto = AutoModelForImageClassification if kind == "image" else AutoModelForAudioClassification
            net = auto.from_pretrained(directory).eval()
            with torch.no_grad():
                logits = net(**{k: torch.from_numpy(v) for k, v in batch.items()}).logits.numpy()
            names = [net.config.id2label[i] for i in range(logits.shape[1])]
        else:
            session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
            wanted = [i.name for i in session.get_inputs()]
            logits = session.run(["logits"], {n: batch[n] for n in wanted})[0]
        predicted[fmt] = [names[i] for i in logits.argmax(-1)]
    assert predicted["onnx"] == predicted["pytorch"]
    right = sum(p == t for p, t in zip(predicted["pytorch"], labels, strict=True)) / len(labels)
    assert right == pytest.approx(accuracy[-1], abs=0.1)  # a user's own pipeline scores what the job said


@pytest.mark.parametrize("config", ["production"], indirect=True)
def test_a_speech_recognizer_learns_and_both_artifacts_write_the_same_transcripts(
    service: Client, tmp_path: Path
) -> None:
    """tiny-whisper with a tokenizer trained on the job's transcriptions: held-out WER falls; the PyTorch
    artifact's `generate` and ONNX Runtime over encoder.onnx and decoder.onnx write the same transcripts."""
    import onnxruntime as ort
    import torch
    from transformers import AutoFeatureExtractor, AutoModelForSpeechSeq2Seq, AutoTokenizer

    from trainer_core.tasks import speech

    def archive(name: str, n: int, seed: int) -> Path:
        rows = media_demo.melody_rows(n, seed)
        return media_demo.write_archive(tmp_path / name, rows, layout="metadata", column="transcription")

    held_out = media_demo.melody_rows(32, 2)
    train = service.upload(archive("train.zip", 480, 1))
    valid = service.upload(archive("valid.tar.gz", 32, 2))
    job = service.create_job(
        model="tiny-whisper",
        training_file=train["id"],
        validation_file=valid["id"],
        seed=7,
        hyperparameters={"n_epochs": 15, "batch_size": 16, "learning_rate_multiplier": 20},
    )
    done = wait_for(service, job["id"], TERMINAL, timeout=900)
    assert done["status"] == "succeeded", done["error"]
    assert done["task"] == "automatic-speech-recognition" and done["trained_tokens"] > 0
    wer = series(service, job["id"], "eval_wer")["values"]
    assert wer[0] == 1.0 and wer[-1] <= 0.3, wer

    clips = [data for _, _, data in held_out]
    said: dict[str, list[str]] = {}
    for fmt in ("pytorch", "onnx"):
        service.download(job["id"], fmt, tmp_path / f"{fmt}.tar")
        directory = extract(tmp_path / f"{fmt}.tar", tmp_path / f"{fmt}-x") / fmt
        tokenizer = AutoTokenizer.from_pretrained(directory)
        feats = features("speech", AutoFeatureExtractor.from_pretrained(directory), clips)["input_features"]
        if fmt == "pytorch":
            model = AutoModelForSpeechSeq2Seq.from_pretrained(directory).eval()
            with torch.no_grad():
                ids = model.generate(torch.from_numpy(feats), max_new_tokens=speech.MAX_NEW_TOKENS).tolist()
        else:
            enc = ort.InferenceSession(str(directory / "encoder.onnx"), providers=["CPUExecutionProvider"])
            dec = ort.InferenceSession(str(directory / "decoder.onnx"), providers=["CPUExecutionProvider"])
            config = json.loads((directory / "config.json").read_text())
            ids = speech.greedy(
                lambda f, enc=enc: enc.run(None, {"input_features": f})[0],
                lambda i, h, dec=dec: dec.run(None, {"decoder_input_ids": i, "encoder_hidden_states": h})[0][
                    :, -1
                ],
                feats,
                config["decoder_start_token_id"],
                config["eos_token_id"],
            )
        said[fmt] = [tokenizer.decode(i, skip_special_tokens=True).strip() for i in ids]
    assert said["onnx"] == said["pytorch"]
    right = speech.word_error_rate([t for _, t, _ in held_out], said["pytorch"])
    assert right == pytest.approx(wer[-1], abs=0.1)
