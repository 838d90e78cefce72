"""Images and audio on disk as the trainer reads them: an archive's members decoded once, brought to what the
model's processor expects, and kept in memory-mapped columns beside the token stores (datastore.py), so
attempts, ranks and later jobs reuse them and the trainer's memory does not grow with the archive.

A media store is a directory:

- `values.u8` (images: each resized and cropped by the model's image processor, channels first, 0-255) or
  `values.f32` (audio: mono, resampled to the model's rate, at most MAX_CLIP_SECONDS), row after row;
- `offsets.i64`, `targets.i64` (the class index) and `meta.json` as in a token store, `media.json` (which
  media, the image shape or the sampling rate), `tokenizer/` holding the processor of a built model.

The processor's last steps (rescaling and normalizing an image, normalizing and padding a clip) run in the
collator, so what is stored stays compact (an image is a quarter of its float size) and the processor of the
artifact is the one that made the batches.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainer_core import tasks
from trainer_core.data import media
from trainer_core.data.datastore import Meta
from trainer_core.data.rows import Report
from trainer_core.spec import TrainingSpec

MAX_CLIP_SECONDS = 30.0
PROGRESS_EVERY = 256


def is_media(task: str) -> bool:
    """Its rows are archive members, kept in a media store (TaskInfo.media)."""
    return tasks.get(task).media is not None


def transcribes(task: str) -> bool:
    """Its targets are token ids of what a clip says, not a class index."""
    info = tasks.get(task)
    return info.media is not None and not info.classifies


def built_processor(model: str, transcripts: list[str]) -> Any:
    """The processor of a built tiny model: 32x32 images normalized to [-1, 1], 16 kHz audio, or for
    tiny-whisper log-mel features and a tokenizer learnt from the transcriptions."""
    if model == "tiny-whisper":
        from trainer_core.tasks import speech

        return speech.built_processor(transcripts)
    if model == "tiny-vit":
        from transformers import ViTImageProcessorPil

        return ViTImageProcessorPil(
            size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
        )
    from transformers import Wav2Vec2FeatureExtractor

    return Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True, return_attention_mask=True
    )


def load_processor(source: Path | str, task: str) -> Any:
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    if transcribes(task):
        from trainer_core.tasks.speech import SpeechProcessor

        return SpeechProcessor.from_pretrained(source)
    if tasks.get(task).media == "image":
        return AutoImageProcessor.from_pretrained(source, local_files_only=True, trust_remote_code=False)
    return AutoFeatureExtractor.from_pretrained(source, local_files_only=True, trust_remote_code=False)


class MediaStore:
    """A media store opened read-only: row i as the collator wants it, from memory-mapped columns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.meta = Meta.read(path)
        self.media = json.loads((path / "media.json").read_text())
        self.offsets = np.fromfile(path / "offsets.i64", dtype=np.int64)
        self.targets = np.fromfile(path / "targets.i64", dtype=np.int64)
        dtype, name = (
            (np.uint8, "values.u8") if self.media["media"] == "image" else (np.float32, "values.f32")
        )
        size = int(self.offsets[-1])
        self.values = (
            np.memmap(path / name, dtype=dtype, mode="r", shape=(size,)) if size else np.zeros(0, dtype)
        )
        self.lengths = np.diff(self.offsets)
        self.label_offsets = np.fromfile(path / "label_offsets.i64", dtype=np.int64) if self.asr else None
        self.label_ids = np.fromfile(path / "labels.u32", dtype=np.uint32) if self.asr else None

    @property
    def asr(self) -> bool:
        return transcribes(self.meta.task)

    def __len__(self) -> int:
        return self.meta.rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        values = np.asarray(self.values[self.offsets[i] : self.offsets[i + 1]])
        if self.media["media"] == "image":
            values = values.reshape(self.media["shape"])
        if self.label_ids is not None and self.label_offsets is not None:  # a transcript's token ids
            ids = self.label_ids[self.label_offsets[i] : self.label_offsets[i + 1]]
            return {"values": values, "labels": ids.astype(np.int64).tolist()}
        return {"values": values, "labels": int(self.targets[i])}

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.path / "tokenizer" if self.meta.has_tokenizer else None


class MediaCollator:
    """The processor's last steps over a batch: an image rescaled and normalized, clips normalized and
    padded to the longest (the padding share is reported as for text)."""

    def __init__(self, processor: Any, info: dict[str, Any]) -> None:
        self.processor, self.info = processor, info
        self.real = self.padded = 0

    def padding_fraction(self) -> float | None:
        total, real = self.padded, self.real
        self.real = self.padded = 0
        return None if total == 0 else 1.0 - real / total

    def features(self, values: list[np.ndarray]) -> dict[str, Any]:
        if self.info["media"] == "image":
            out = self.processor(
                images=values,
                do_resize=False,
                do_center_crop=False,
                return_tensors="pt",
                input_data_format="channels_first",
            )
            return {"pixel_values": out["pixel_values"]}
        if "max_samples" in self.info:  # speech: log-mel windows of the model's fixed length
            out = self.processor.feature_extractor(
                values, sampling_rate=self.info["rate"], return_tensors="pt"
            )
            return {"input_features": out["input_features"]}
        self.real += sum(len(v) for v in values)
        self.padded += max(len(v) for v in values) * len(values)
        out = self.processor(values, sampling_rate=self.info["rate"], padding=True, return_tensors="pt")
        return {k: out[k] for k in ("input_values", "attention_mask") if k in out}

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        out = self.features([b["values"] for b in batch])
        if isinstance(batch[0]["labels"], list):  # transcripts, padded with the ignored index
            width = max(len(b["labels"]) for b in batch)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, b in enumerate(batch):
                labels[i, : len(b["labels"])] = torch.tensor(b["labels"], dtype=torch.long)
                mask[i, : len(b["labels"])] = 1  # the start token and the transcript but its last token
            out["labels"] = labels
            # the decoder's own mask: without one transformers derives packed sequences from positions
            # with torch.diff, which ORTModule's exporter cannot take
            out["decoder_attention_mask"] = mask
        else:
            out["labels"] = torch.tensor([b["labels"] for b in batch], dtype=torch.long)
        return out


def image_values(data: bytes, processor: Any) -> np.ndarray:
    """An image as its store keeps it: resized and cropped by the processor, channels first, 0-255 bytes."""
    img = media.decode_image(data)
    out = processor(images=img, return_tensors="np", do_rescale=False, do_normalize=False)
    return np.clip(np.asarray(out["pixel_values"][0]).round(), 0, 255).astype(np.uint8)


def clip_values(data: bytes, rate: int, seconds: float = MAX_CLIP_SECONDS) -> np.ndarray:
    """A clip as its store keeps it: mono float32 at `rate`, at most `seconds` long."""
    from scipy.signal import resample_poly

    sound = media.decode_audio(data)
    samples = sound.samples
    if sound.rate != rate:
        g = math.gcd(sound.rate, rate)
        samples = resample_poly(samples, rate // g, sound.rate // g).astype(np.float32)
    return samples[: int(seconds * rate)]


def build(
    path: Path,
    fmt: str,
    store: Path,
    key: str,
    processor: Any,
    spec: TrainingSpec,
    progress: Any,
    *,
    has_tokenizer: bool,
) -> Meta:
    """Decode every member the archive lists into the store (a fresh directory); meta.json is written last,
    so a store is whole or absent; the store's Meta. `progress(done)` is called as rows go in."""
    # the upload check passed: here only the names and their targets are read, nothing decoded twice
    checked = Report()
    layout = media.read_layout(path, fmt, media.Limits(), 0, checked, decode=False)
    if checked.error_count:
        raise ValueError(f"the archive no longer passes its upload check: {checked.details()}")
    index = {str(label): i for i, label in enumerate(spec.labels)}
    store.mkdir(parents=True, exist_ok=True)
    image = layout.media == "image"
    info, seconds = _media_info(layout.media, processor, spec)
    start = model_start(spec, processor) if transcribes(spec.task) else 0
    offsets, targets, samples = [0], [], list[str]()
    label_offsets, labels = [0], list[int]()
    with (store / ("values.u8" if image else "values.f32")).open("wb") as out:
        for name, data in media.members(path, fmt, media.Limits(), 0, lambda name: name in layout.targets):
            if name not in layout.targets:
                continue
            values = image_values(data, processor) if image else clip_values(data, info["rate"], seconds)
            if image:
                info.setdefault("shape", list(values.shape))
            out.write(values.tobytes())
            offsets.append(offsets[-1] + values.size)
            target = str(layout.targets[name])
            if transcribes(spec.task):
                (ids,) = processor.labels([target], start, spec.hyperparameters.max_seq_length)
                labels += ids
                label_offsets.append(len(labels))
                targets.append(len(ids))
                samples += [target][: 8 - len(samples)]
            else:
                targets.append(index[target])
                samples += [name][: 8 - len(samples)]
            if len(targets) % PROGRESS_EVERY == 0:
                progress(len(targets))
    return _finish(store, key, spec, info, (offsets, targets, label_offsets, labels), samples, has_tokenizer)


def _media_info(media_kind: str | None, processor: Any, spec: TrainingSpec) -> tuple[dict[str, Any], float]:
    """media.json's fields, and the longest clip kept in seconds."""
    info: dict[str, Any] = {"media": media_kind}
    if media_kind != "image":
        info["rate"] = int(processor.sampling_rate)
    seconds = MAX_CLIP_SECONDS
    if transcribes(spec.task):  # a speech model reads a window of fixed length; the clip is cut to it
        info["max_samples"] = processor.max_samples
        seconds = processor.max_samples / info["rate"]
    return info, seconds


def _finish(
    store: Path,
    key: str,
    spec: TrainingSpec,
    info: dict[str, Any],
    columns: tuple[list[int], list[int], list[int], list[int]],
    samples: list[str],
    has_tokenizer: bool,
) -> Meta:
    """The columns and media.json written, then meta.json last."""
    offsets, targets, label_offsets, labels = columns
    np.asarray(offsets, np.int64).tofile(store / "offsets.i64")
    np.asarray(targets, np.int64).tofile(store / "targets.i64")
    if transcribes(spec.task):
        np.asarray(labels, np.uint32).tofile(store / "labels.u32")
        np.asarray(label_offsets, np.int64).tofile(store / "label_offsets.i64")
    (store / "media.json").write_text(json.dumps(info))
    longest = int(np.diff(offsets).max(initial=0))
    meta = Meta(key, spec.task, len(targets), len(labels), longest, samples, has_tokenizer)
    (store / "meta.json").write_text(json.dumps(meta.__dict__))
    return meta


def model_start(spec: TrainingSpec, processor: Any) -> int:
    """The decoder's start token: the base model's config says it; a built model's is its tokenizer's."""
    if spec.model_path is not None:
        config = json.loads((Path(spec.model_path) / "config.json").read_text())
        return int(config["decoder_start_token_id"])
    from trainer_core.tasks.speech import START

    return int(processor.tokenizer.convert_tokens_to_ids(START))


def transcripts(path: Path, fmt: str) -> list[str]:
    """An archive's transcriptions (a built speech model's tokenizer learns from them)."""
    layout = media.read_layout(path, fmt, media.Limits(), 0, Report(), decode=False)
    return [str(t) for t in layout.targets.values()] if layout.column == "transcription" else []


def batches(store: MediaStore, collator: MediaCollator, size: int, count: int) -> Iterator[dict[str, Any]]:
    """The store's first rows as `count` batches of up to `size` (export checks and samples)."""
    for start in range(0, min(len(store), size * count), size):
        rows = [store[i] for i in range(start, min(len(store), start + size))]
        yield collator(rows)
