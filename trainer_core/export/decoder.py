"""A causal LM's ONNX export with its KV cache, in the layout ONNX Runtime's generation tooling reads
(Optimum's ORTModelForCausalLM, onnxruntime-genai): inputs `input_ids`, `attention_mask` (past and new
positions), `position_ids`, `past_key_values.{layer}.key|value` ([batch, kv heads, past, head size]; past 0
for the first call); outputs `logits` and `present.{layer}.key|value`; `genai_config.json` beside it.

Checked at export like the classifiers' (logits over a padded batch, export.PARITY_TOLERANCE) and by greedy
generation: for sample prompts, ONNX Runtime decoding with its cache must produce PyTorch's `generate`
tokens (a divergence where PyTorch's two candidates are within the tolerance is a tie, counted, not a
failure); the result is in the manifest (`greedy_parity`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer_core.export import (
    PARITY_TOLERANCE,
    ExportError,
    HeldOut,
    _inputs,
    save_onnx,
    write_manifest,
)


class _WithCache(torch.nn.Module):
    """The causal LM as one decoding step: new tokens and the past key/values in, logits and the present
    key/values (past and new) out, flat, as ONNX needs them."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


@dataclass(frozen=True)
class _Shape:
    layers: int
    kv_heads: int
    head_size: int

    @classmethod
    def of(cls, config: Any) -> _Shape:
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, kv_heads, head_size)

    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]

    def present_names(self) -> list[str]:
        return [f"present.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]

    def empty(self, batch: int) -> list[np.ndarray]:
        return [
            np.zeros((batch, self.kv_heads, 0, self.head_size), np.float32) for _ in range(2 * self.layers)
        ]


GREEDY_PROMPTS = 4
GREEDY_NEW_TOKENS = 16


def export_onnx(
    model: Any, tokenizer: Any, directory: Path, held_out: HeldOut, manifest: dict[str, Any]
) -> dict[str, Any]:
    """A decoder with its KV cache, checked by greedy generation on the held-out rows' texts."""
    return export_texts(model, tokenizer, directory, held_out.texts, manifest, max_len=held_out.max_len)


def export_texts(
    model: Any,
    tokenizer: Any,
    directory: Path,
    sample_texts: Sequence[str],
    manifest: dict[str, Any],
    *,
    max_len: int = 2048,
) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    model = model.float().eval().cpu()
    shape = _Shape.of(model.config)
    texts = [t for t in sample_texts if t.strip()] or ["hello world", "a second sample"]
    names, outputs = _export_graph(model, tokenizer, shape, texts, directory / "model.onnx", max_len)
    tokenizer.save_pretrained(directory)
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    _genai_config(model, tokenizer, shape, directory, max_len)
    check_texts = (texts * 4)[: min(len(texts) * 4, 7)] if len(texts) > 2 else [*texts, texts[0] * 2]
    onnx = directory / "model.onnx"
    diff, greedy = _check_parity(model, tokenizer, shape, onnx, texts, check_texts, max_len)
    manifest = {
        **manifest,
        "format": "onnx",
        "onnx_opset": 18,
        "inputs": names,
        "outputs": outputs,
        "kv_cache": True,
        "parity": {"max_abs_diff": diff, "tolerance": PARITY_TOLERANCE, "samples": len(check_texts)},
        "greedy_parity": greedy,
        "files": sorted(p.name for p in directory.iterdir()),
    }
    write_manifest(directory, manifest)
    return manifest


def _export_graph(
    model: Any, tokenizer: Any, shape: _Shape, texts: list[str], path: Path, max_len: int
) -> tuple[list[str], list[str]]:
    """The graph with its cache as inputs and outputs; its input and output names."""
    ids = _inputs(tokenizer, (texts * 2)[:2], ["input_ids"], max_len)["input_ids"]
    if ids.shape[1] < 3:
        ids = _inputs(tokenizer, [t + " x y" for t in (texts * 2)[:2]], ["input_ids"], max_len)["input_ids"]
    # a sample with a past of 2 and 3 new tokens, none of the sizes 0 or 1 (the export would fix them)
    ids, past_len = ids[:, :3], 2
    past = tuple(torch.randn(2, shape.kv_heads, past_len, shape.head_size) for _ in range(2 * shape.layers))
    mask = torch.ones(2, past_len + 3, dtype=torch.long)
    positions = torch.arange(past_len, past_len + 3).expand(2, 3)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    total, past_seq = torch.export.Dim("total_sequence"), torch.export.Dim("past_sequence")
    names = ["input_ids", "attention_mask", "position_ids", *shape.past_names()]
    outputs = ["logits", *shape.present_names()]
    save_onnx(
        _WithCache(model),
        path,
        args=(ids, mask, positions, past),
        input_names=names,
        output_names=outputs,
        dynamic_shapes=(
            {0: batch, 1: seq},
            {0: batch, 1: total},
            {0: batch, 1: seq},
            tuple({0: batch, 2: past_seq} for _ in past),
        ),
    )
    return names, outputs


def _check_parity(
    model: Any,
    tokenizer: Any,
    shape: _Shape,
    path: Path,
    texts: list[str],
    check_texts: list[str],
    max_len: int,
) -> tuple[float, dict[str, Any]]:
    """Prefill logits within tolerance and the same greedy tokens, or an ExportError saying where not."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    diff = _prefill_parity(model, tokenizer, session, shape, check_texts, max_len)
    if not np.isfinite(diff) or diff > PARITY_TOLERANCE:
        raise ExportError(f"ONNX logits differ from PyTorch by {diff:.3g} (tolerance {PARITY_TOLERANCE})")
    greedy = _greedy_parity(model, tokenizer, session, shape, texts[:GREEDY_PROMPTS], max_len)
    if greedy["diverged"]:
        first, count = greedy["diverged"][0], len(greedy["diverged"])
        raise ExportError(
            f"ONNX Runtime's greedy generation differs from PyTorch's on {count} of {greedy['prompts']} "
            f"sample prompts (first: prompt {first['prompt']}, new token {first['step']}: token "
            f"{first['onnx']} for {first['pytorch']})"
        )
    return diff, greedy


def _positions(mask: np.ndarray) -> np.ndarray:
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)


def _prefill_parity(
    model: Any, tokenizer: Any, session: Any, shape: _Shape, texts: Sequence[str], max_len: int
) -> float:
    """The largest logits difference over a padded batch with no past (padding positions not compared)."""
    enc = _inputs(tokenizer, texts, ["input_ids", "attention_mask"], max_len)
    mask = enc["attention_mask"].numpy()
    feed = {"input_ids": enc["input_ids"].numpy(), "attention_mask": mask, "position_ids": _positions(mask)}
    feed |= dict(zip(shape.past_names(), shape.empty(len(texts)), strict=True))
    got = session.run(["logits"], feed)[0]
    with torch.no_grad():
        want = model(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            position_ids=torch.from_numpy(feed["position_ids"]),
            use_cache=False,
        ).logits.numpy()
    if got.shape != want.shape:
        raise ExportError(f"ONNX logits shape {got.shape} != PyTorch {want.shape}")
    return float(np.abs(got - want)[mask.astype(bool)].max())


def _greedy_parity(
    model: Any, tokenizer: Any, session: Any, shape: _Shape, texts: Sequence[str], max_len: int
) -> dict[str, Any]:
    """Greedy decoding of each sample's first half, by ONNX Runtime with its KV cache and by PyTorch's
    `generate`, token for token."""
    result: dict[str, Any] = {"prompts": 0, "new_tokens": GREEDY_NEW_TOKENS, "identical": 0, "ties": 0}
    result["diverged"] = []
    for n, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max(1, min(max_len, 64) // 2)]
        prompt = ids[: max(1, len(ids) // 2)]
        with torch.no_grad():
            want = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=GREEDY_NEW_TOKENS,  # or up to its end token: ONNX decodes as many
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
        got = _onnx_greedy(session, shape, prompt, len(want))
        result["prompts"] += 1
        step = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if step is None:
            result["identical"] += 1
        elif _is_tie(model, prompt + want[:step], want[step], got[step]):
            result["ties"] += 1
        else:
            result["diverged"].append({"prompt": n, "step": step, "onnx": got[step], "pytorch": want[step]})
    return result


def _onnx_greedy(session: Any, shape: _Shape, prompt: list[int], new_tokens: int) -> list[int]:
    past = shape.empty(1)
    step_ids, seen, out = np.array([prompt], np.int64), 0, []
    for _ in range(new_tokens):
        total = seen + step_ids.shape[1]
        feed = {
            "input_ids": step_ids,
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(seen, total, dtype=np.int64)[None],
        }
        logits, *past = session.run(None, feed | dict(zip(shape.past_names(), past, strict=True)))
        out.append(int(logits[0, -1].argmax()))
        seen, step_ids = total, np.array([[out[-1]]], np.int64)
    return out


def _is_tie(model: Any, prefix: list[int], want: int, got: int) -> bool:
    """Whether PyTorch's own logits for the two tokens are closer than the parity tolerance."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prefix]), use_cache=False).logits[0, -1]
    return bool(abs(float(logits[want] - logits[got])) <= PARITY_TOLERANCE)


def _genai_config(model: Any, tokenizer: Any, shape: _Shape, directory: Path, max_len: int) -> None:
    """genai_config.json: how onnxruntime-genai finds this decoder's inputs, outputs and sizes."""
    config = model.config.get_text_config()
    decoder = {
        "filename": "model.onnx",
        "head_size": shape.head_size,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "position_ids": "position_ids",
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": "present.%d.key",
            "present_value_names": "present.%d.value",
        },
    }
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", max_len)
    genai = {
        "model": {
            "type": config.model_type,
            "context_length": context,
            "vocab_size": config.vocab_size,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "decoder": decoder,
        },
        "search": {"max_length": context, "do_sample": False, "num_beams": 1},
    }
    (directory / "genai_config.json").write_text(json.dumps(genai, indent=2))
