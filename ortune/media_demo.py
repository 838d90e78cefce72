"""Small image and audio datasets made here, for the demo, the tests and the benches: drawn shapes in
several colours, sizes and places (image classification) and tones at three pitches with noise, at several
sampling rates and in two codecs (audio classification), packed as the archives users upload.

Made from a seed, so the same call gives the same bytes."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import numpy as np

SHAPES = ("circle", "square", "triangle")
PITCHES = {"low": 220.0, "mid": 440.0, "high": 880.0}
IMAGE_FORMATS = (("png", "PNG"), ("jpg", "JPEG"), ("webp", "WEBP"))
AUDIO_FORMATS = (("wav", "WAV", 16000), ("flac", "FLAC", 22050), ("wav", "WAV", 8000))


def shape_image(shape: str, rng: np.random.Generator, size: int = 48) -> bytes:
    """One shape on a plain background, as PNG bytes (re-encoded by the caller where it asks)."""
    from PIL import Image, ImageDraw

    background = tuple(int(c) for c in rng.integers(0, 90, 3))
    colour = tuple(int(c) for c in rng.integers(140, 256, 3))
    img = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.2, 0.38) * size
    cx, cy = rng.uniform(r, size - r, 2)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return _encode_image(img, "PNG")


def _encode_image(img: object, fmt: str) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt)  # type: ignore[attr-defined]
    return out.getvalue()


def tone(pitch: float, rng: np.random.Generator, rate: int, fmt: str, seconds: float = 0.5) -> bytes:
    """A tone near `pitch` (a few percent off), with a harmonic and noise, in `fmt` at `rate`."""
    import soundfile

    t = np.arange(int(rate * seconds)) / rate
    f = pitch * rng.uniform(0.95, 1.05)
    wave = 0.5 * np.sin(2 * np.pi * f * t) + 0.15 * np.sin(4 * np.pi * f * t + rng.uniform(0, 6))
    wave += rng.normal(0, 0.05, len(t))
    out = io.BytesIO()
    soundfile.write(out, (wave * rng.uniform(0.4, 1.0)).astype(np.float32), rate, format=fmt)
    return out.getvalue()


def image_rows(n: int, seed: int) -> list[tuple[str, str, bytes]]:
    """(file name, label, bytes) of `n` shape images, classes and formats in turn."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        shape = SHAPES[i % len(SHAPES)]
        suffix, fmt = IMAGE_FORMATS[(i // len(SHAPES)) % len(IMAGE_FORMATS)]
        data = shape_image(shape, rng)
        if fmt != "PNG":
            data = _encode_image(Image.open(io.BytesIO(data)), fmt)
        out.append((f"{shape}_{i:04d}.{suffix}", shape, data))
    return out


def audio_rows(n: int, seed: int) -> list[tuple[str, str, bytes]]:
    """(file name, label, bytes) of `n` tones, pitches, rates and codecs in turn."""
    rng = np.random.default_rng(seed)
    names = list(PITCHES)
    out = []
    for i in range(n):
        label = names[i % len(names)]
        suffix, fmt, rate = AUDIO_FORMATS[(i // len(names)) % len(AUDIO_FORMATS)]
        out.append((f"{label}_{i:04d}.{suffix}", label, tone(PITCHES[label], rng, rate, fmt)))
    return out


# a fifth apart: far enough that 80 mel bins tell them apart (a real scale is a tone apart)
NOTES = {"do": 220.0, "re": 330.0, "mi": 495.0, "fa": 742.5, "sol": 1113.8, "la": 1670.6}


def melody_rows(n: int, seed: int) -> list[tuple[str, str, bytes]]:
    """(file name, transcription, bytes) of `n` short melodies of 2 to 4 sung-note names ("do mi sol"):
    speech recognition's shape (a sequence of sounds written as words) in a task a tiny model learns in a
    test's time. 16 kHz WAV, each note 0.18 s with a short gap, a little noise."""
    import soundfile

    rng = np.random.default_rng(seed)
    names = list(NOTES)
    rate = 16000
    out = []
    for i in range(n):
        words = [names[j] for j in rng.integers(0, len(names), int(rng.integers(2, 5)))]
        parts = []
        for w in words:
            t = np.arange(int(rate * 0.18)) / rate
            f = NOTES[w] * rng.uniform(0.98, 1.02)
            parts += [0.6 * np.sin(2 * np.pi * f * t) * np.hanning(len(t)), np.zeros(int(rate * 0.04))]
        wave = np.concatenate(parts) + rng.normal(0, 0.02, sum(len(x) for x in parts))
        buf = io.BytesIO()
        soundfile.write(buf, wave.astype(np.float32), rate, format="WAV")
        out.append((f"melody_{i:04d}.wav", " ".join(words), buf.getvalue()))
    return out


def write_archive(
    path: Path, rows: list[tuple[str, str, bytes]], *, layout: str = "folders", column: str = "label"
) -> Path:
    """The rows as an archive (by `path`'s suffix: .zip, .tar, .tar.gz) in an imagefolder/audiofolder
    layout: `folders` (label/file) or `metadata` (files beside a metadata.jsonl, their `column`: label, or
    transcription for speech)."""
    entries: list[tuple[str, bytes]] = []
    if layout == "folders":
        entries = [(f"{label}/{name}", data) for name, label, data in rows]
    else:
        meta = "".join(
            json.dumps({"file_name": f"data/{name}", column: label}) + "\n" for name, label, _ in rows
        )
        entries = [(f"data/{name}", data) for name, _, data in rows] + [("metadata.jsonl", meta.encode())]
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in entries:
                zf.writestr(name, data)
        return path
    with tarfile.open(path, "w:gz" if path.name.endswith(".gz") else "w") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
