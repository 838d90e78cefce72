"""The models the inference process runs: a causal LM's decoding (with the export's KV cache, concurrent
requests batched step by step) and a classifier's label scores. serve/cache.py loads and holds them."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer_core.data import chat


class PromptTooLong(ValueError):
    """A prompt too long for the model's context, found before it is tokenized."""


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


class Decoder:
    """A causal LM's ONNX artifact. With its KV cache (our exports since the cache was added) each step feeds
    one token and the cache, and concurrent requests share each step (`_Batch`); an artifact without one is
    fed the whole sequence each step, one request at a time, more slowly."""

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
        self.batch = _Batch(self)
        # no token covers more bytes of text than the longest in the vocabulary, so a prompt of more bytes
        # than context x that is over the context before it is tokenized (which a huge prompt makes costly)
        vocab = list(self.tokenizer.get_vocab())
        self.token_bytes = max(len(self.tokenizer.convert_tokens_to_string([t]).encode()) for t in vocab)
        self.max_prompt_bytes = self.context * max(1, self.token_bytes)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> tuple[str, list[str]]:
        """The conversation as the model was trained on it (its own template, or ortune's default), and the
        end-of-turn text the reply stops at."""
        template = getattr(self.tokenizer, "chat_template", None) or chat.DEFAULT_TEMPLATE
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        stops = ["<|im_end|>"] if "<|im_end|>" in template else []
        return str(text), stops

    def encode(self, text: str) -> list[int]:
        size = len(text.encode())
        if size > self.max_prompt_bytes:
            raise PromptTooLong(
                f"the prompt is {size:,} bytes: more than this model's context of {self.context} tokens can "
                f"hold (no token of its vocabulary covers more than {self.token_bytes} bytes)"
            )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, prompt: list[int], sampling: Sampling) -> Iterator[Piece]:
        """(new text, finish reason or None, tokens generated so far) per step, the reason on the last: "stop"
        at the end token or a stop text (which is not returned), "length" at max_tokens. Decoded in the
        model's shared batch when it has a KV cache; alone otherwise."""
        if not self.kv_cache:
            yield from self.solo(prompt, sampling)
            return
        stream = _Stream(self, prompt, sampling)
        self.batch.submit(stream)
        try:
            while True:
                piece = stream.out.get()
                if isinstance(piece, BaseException):
                    raise piece
                text, reason, count = piece
                # a reader slower than the batch (a busy client or proxy) gets what has piled up as one
                # piece: fewer, larger events instead of a growing backlog of one-token ones
                while reason is None and not stream.out.empty():
                    more = stream.out.get()
                    if isinstance(more, BaseException):
                        raise more
                    text, reason, count = text + more[0], more[1], more[2]
                yield text, reason, count
                if reason is not None:
                    return
        finally:
            stream.cancelled = True  # a client gone mid-stream leaves the batch at the next step

    def solo(self, prompt: list[int], sampling: Sampling) -> Iterator[Piece]:
        """The same decoding, one request in its own ONNX Runtime calls (no batch)."""
        stream = _Stream(self, prompt, sampling)
        past = self.empty_past()
        step, seen = list(prompt), 0
        while True:
            logits, past = self.step(step, seen, past, prompt + stream.ids)
            pieces, done = stream.take(logits)
            yield from pieces
            if done:
                return
            seen += len(step)
            step = [stream.next]

    def empty_past(self) -> list[np.ndarray]:
        return [
            np.zeros((1, self.inputs[n].shape[1], 0, self.inputs[n].shape[3]), np.float32) for n in self.past
        ]

    def step(
        self, step: list[int], seen: int, past: list[np.ndarray], everything: list[int]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
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
        } | dict(zip(self.past, past, strict=True))
        logits, *present = self.session.run(None, feed)
        return logits[0, -1], present


Piece = tuple[str, str | None, int]


class _Stream:
    """One request's decoding: its sampler, the tokens it has written, and what it has sent back."""

    def __init__(self, decoder: Decoder, prompt: list[int], sampling: Sampling) -> None:
        self.tokenizer, self.eos = decoder.tokenizer, decoder.tokenizer.eos_token_id
        self.prompt, self.sampling = prompt, sampling
        self.rng = np.random.default_rng(sampling.seed)
        self.ids: list[int] = []
        self.said = ""
        self.next = -1
        self.out: queue.SimpleQueue[Piece | BaseException] = queue.SimpleQueue()
        self.cancelled = False

    def take(self, logits: np.ndarray) -> tuple[list[Piece], bool]:
        """Pick the next token from the last position's logits: the text that can be sent now, and whether
        the reply is finished."""
        token = _pick(logits, self.sampling, self.rng)
        if token == self.eos:
            return [("", "stop", len(self.ids) + 1)], True
        self.ids.append(token)
        text = str(self.tokenizer.decode(self.ids, skip_special_tokens=False))
        stops = self.sampling.stop
        cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            return [(text[len(self.said) : cut], "stop", len(self.ids))], True
        pieces: list[Piece] = []
        # hold back what may be the start of a stop text, or half a character
        safe = len(text) - max((len(s) - 1 for s in stops), default=0)
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if safe > len(self.said):
            pieces.append((text[len(self.said) : safe], None, len(self.ids)))
            self.said = text[:safe]
        if len(self.ids) >= self.sampling.max_tokens:
            pieces.append((text[len(self.said) :], "length", len(self.ids)))
            return pieces, True
        self.next = token
        return pieces, False


class _Batch:
    """Continuous batching for one model: a thread (alive while there is work) runs one ONNX Runtime call per
    step for every request decoding, and takes newcomers in between steps. Rows are left-padded to the
    longest past; the attention mask hides the padding and each row keeps its own position ids, so a row's
    tokens are the ones it would get alone. A newcomer's prompt is run alone first (a padded prompt would
    give its padding queries nothing to attend to), then its cache joins the batch."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.lock = threading.Lock()
        self.waiting: list[_Stream] = []
        self.running = False

    def submit(self, stream: _Stream) -> None:
        with self.lock:
            self.waiting.append(stream)
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="ortune-decode", daemon=True).start()

    def _run(self) -> None:
        rows: list[_Stream] = []
        past: list[np.ndarray] = []
        mask = np.zeros((0, 0), np.int64)
        try:
            while True:
                with self.lock:
                    if not rows and not self.waiting:
                        self.running = False
                        return
                    new, self.waiting = self.waiting, []
                for stream in new:
                    row_past = self._prefill(stream)
                    if row_past is not None:
                        rows, past, mask = [*rows, stream], *_join(past, mask, row_past)
                if rows:
                    rows, past, mask = self._step(rows, past, mask)
        except BaseException as exc:  # every waiting client gets the error, none hangs
            with self.lock:
                failed, self.waiting, self.running = rows + self.waiting, [], False
            for stream in failed:
                stream.out.put(exc)

    def _prefill(self, stream: _Stream) -> list[np.ndarray] | None:
        if stream.cancelled:
            return None
        logits, past = self.decoder.step(stream.prompt, 0, self.decoder.empty_past(), stream.prompt)
        return None if self._send(stream, logits) else past

    def _step(
        self, rows: list[_Stream], past: list[np.ndarray], mask: np.ndarray
    ) -> tuple[list[_Stream], list[np.ndarray], np.ndarray]:
        mask = np.concatenate([mask, np.ones((len(rows), 1), np.int64)], axis=1)
        positions = np.array([[len(s.prompt) + len(s.ids) - 1] for s in rows], np.int64)
        feed = {
            "input_ids": np.array([[s.next] for s in rows], np.int64),
            "attention_mask": mask,
            "position_ids": positions,
        } | dict(zip(self.decoder.past, past, strict=True))
        logits, *present = self.decoder.session.run(None, feed)
        keep = [i for i, s in enumerate(rows) if not self._send(s, logits[i, -1])]
        if len(keep) == len(rows):
            return rows, present, mask
        mask = mask[keep]
        start = int(mask.any(axis=0).argmax()) if keep else mask.shape[1]  # padding no row needs any more
        return [rows[i] for i in keep], [p[keep][:, :, start:] for p in present], mask[:, start:]

    @staticmethod
    def _send(stream: _Stream, logits: np.ndarray) -> bool:
        """Take the row's next token and send its text; True when the row leaves the batch."""
        if stream.cancelled:
            return True
        pieces, done = stream.take(logits)
        for piece in pieces:
            stream.out.put(piece)
        return done


def _join(
    past: list[np.ndarray], mask: np.ndarray, row: list[np.ndarray]
) -> tuple[list[np.ndarray], np.ndarray]:
    """The batch's cache with one more row, all left-padded to the longest."""
    if not past:
        return row, np.ones((1, row[0].shape[2]), np.int64)
    length = max(mask.shape[1], row[0].shape[2])

    def pad(t: np.ndarray) -> np.ndarray:
        return np.pad(t, [(0, 0), (0, 0), (length - t.shape[2], 0), (0, 0)])

    joined = [np.concatenate([pad(a), pad(b)]) for a, b in zip(past, row, strict=True)]
    row_mask = np.ones((1, row[0].shape[2]), np.int64)
    masks = [np.pad(m, [(0, 0), (length - m.shape[1], 0)]) for m in (mask, row_mask)]
    return joined, np.concatenate(masks)


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
