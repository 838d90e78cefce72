"""The models the inference process holds: a job's ONNX artifact fetched from object storage, checked against
its sha256, unpacked and loaded into ONNX Runtime, in a cache bounded in bytes (least recently used out)."""

from __future__ import annotations

import json
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ortune.storage import ObjectStore, fetch_archive
from trainer_core import chat

MANIFEST = "ortune_manifest.json"


class TooLarge(ValueError):
    """A model bigger than the whole cache."""


@dataclass(frozen=True)
class Ref:
    """What the API sends: which stored archive a model name stands for."""

    name: str
    object_key: str
    sha256: str


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


class Decoder:
    """A causal LM's ONNX artifact. With its KV cache (our exports since the cache was added) each step feeds
    one token and the cache; an artifact without one is fed the whole sequence each step, more slowly."""

    def __init__(self, directory: Path, session: Any, manifest: dict[str, Any]) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.session = session
        self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self.context = int(positions or 2048)
        self.kv_cache = bool(manifest.get("kv_cache"))
        self.inputs = {i.name: i for i in session.get_inputs()}
        self.past = [n for n in self.inputs if n.startswith("past_key_values.")]

    def chat_prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[str]]:
        """The conversation as the model was trained on it (its own template, or ortune's default), and the
        end-of-turn text the reply stops at."""
        template = getattr(self.tokenizer, "chat_template", None) or chat.DEFAULT_TEMPLATE
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        stops = ["<|im_end|>"] if "<|im_end|>" in template else []
        return self.encode(str(text)), stops

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, prompt: list[int], sampling: Sampling) -> Iterator[tuple[str, str | None, int]]:
        """(new text, finish reason or None, tokens generated so far) per step, the reason on the last: "stop"
        at the end token or a stop text (which is not returned), "length" at max_tokens."""
        rng = np.random.default_rng(sampling.seed)
        eos = self.tokenizer.eos_token_id
        ids: list[int] = []
        said = ""
        past = {
            n: np.zeros((1, self.inputs[n].shape[1], 0, self.inputs[n].shape[3]), np.float32)
            for n in self.past
        }
        step, seen = list(prompt), 0
        for _ in range(sampling.max_tokens):
            logits, past = self._step(step, seen, past, prompt + ids)
            token = _pick(logits, sampling, rng)
            if token == eos:
                yield "", "stop", len(ids) + 1
                return
            ids.append(token)
            text = str(self.tokenizer.decode(ids, skip_special_tokens=False))
            cut = min((i for s in sampling.stop if (i := text.find(s)) >= 0), default=-1)
            if cut >= 0:
                yield text[len(said) : cut], "stop", len(ids)
                return
            # hold back what may be the start of a stop text, or half a character
            safe = len(text) - max((len(s) - 1 for s in sampling.stop), default=0)
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
            if safe > len(said):
                yield text[len(said) : safe], None, len(ids)
                said = text[:safe]
            seen += len(step)
            step = [token]
        yield str(self.tokenizer.decode(ids))[len(said) :], "length", len(ids)

    def _step(
        self, step: list[int], seen: int, past: dict[str, np.ndarray], everything: list[int]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if not self.kv_cache:
            feed = {
                "input_ids": np.array([everything], np.int64),
                "attention_mask": np.ones((1, len(everything)), np.int64),
            }
            return self.session.run(["logits"], feed)[0][0, -1], past
        total = seen + len(step)
        feed = {
            "input_ids": np.array([step], np.int64),
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(seen, total, dtype=np.int64)[None],
        } | past
        logits, *present = self.session.run(None, feed)
        return logits[0, -1], dict(zip(self.past, present, strict=True))


def _pick(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    if sampling.temperature == 0:
        return int(logits.argmax())
    scaled = logits.astype(np.float64) / sampling.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if sampling.top_p < 1:
        order = np.argsort(-probs)
        keep = order[: int(np.searchsorted(np.cumsum(probs[order]), sampling.top_p)) + 1]
        trimmed = np.zeros_like(probs)
        trimmed[keep] = probs[keep]
        probs = trimmed / trimmed.sum()
    return int(rng.choice(len(probs), p=probs))


class Classifier:
    """A sequence classifier's ONNX artifact: label scores (softmax) per text."""

    def __init__(self, directory: Path, session: Any, manifest: dict[str, Any]) -> None:
        from transformers import AutoTokenizer

        self.session = session
        self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.names = list(manifest["inputs"])
        self.labels = [str(label) for label in manifest.get("labels") or []]
        self.max_len = int(manifest.get("max_seq_length") or 512)

    def predict(self, texts: list[str]) -> list[list[dict[str, Any]]]:
        enc = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_len, return_tensors="np"
        )
        logits = self.session.run(["logits"], {n: enc[n].astype(np.int64) for n in self.names})[0]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        labels = self.labels or [str(i) for i in range(probs.shape[-1])]
        return [
            sorted(
                ({"label": labels[j], "score": float(p[j])} for j in range(len(p))), key=lambda x: -x["score"]
            )
            for p in probs
        ]


@dataclass
class Entry:
    model: Decoder | Classifier
    bytes: int


class ModelCache:
    """Models by their archive's sha256, loaded on first use, held within `max_bytes` (the unpacked files'
    size: what ONNX Runtime maps), least recently used out first."""

    def __init__(self, store: ObjectStore, directory: Path, max_bytes: int) -> None:
        self.store, self.directory, self.max_bytes = store, directory, max_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.lock = threading.Lock()

    @property
    def used(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    def get(self, ref: Ref) -> Decoder | Classifier:
        with self.lock:  # one load at a time: two requests for a new model load it once
            if (entry := self.entries.get(ref.sha256)) is not None:
                self.entries.move_to_end(ref.sha256)
                return entry.model
            home = self.directory / ref.sha256
            if not (home / "onnx" / MANIFEST).is_file():
                fetch_archive(self.store, ref.object_key, ref.sha256, home, f"{ref.name} ONNX archive")
            size = sum(p.stat().st_size for p in home.rglob("*") if p.is_file())
            if size > self.max_bytes:
                shutil.rmtree(home, ignore_errors=True)
                raise TooLarge(
                    f"{ref.name} is {size:,} bytes, more than this server's whole model cache "
                    f"({self.max_bytes:,} bytes, ORTUNE_SERVE_CACHE_BYTES)"
                )
            while self.entries and self.used + size > self.max_bytes:
                sha, _ = self.entries.popitem(last=False)
                shutil.rmtree(self.directory / sha, ignore_errors=True)
            model = _load(home / "onnx")
            self.entries[ref.sha256] = Entry(model, size)
            return model


def _load(directory: Path) -> Decoder | Classifier:
    import onnxruntime as ort

    manifest = json.loads((directory / MANIFEST).read_text())
    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    if manifest.get("task") == "causal-lm":
        return Decoder(directory, session, manifest)
    return Classifier(directory, session, manifest)
