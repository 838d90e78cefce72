"""The LLM methods side by side on one small local Llama-shaped model with a chat template: supervised full
fine-tuning and LoRA (under PyTorch in bf16 and under ORT in fp32), packing, and DPO (full and LoRA) from
the supervised model. Per run: which engine ran and why, the held-out figures before and after (loss for
supervised, the model's own preference accuracy and TRL's reward accuracy for DPO), throughput, and the
ONNX export's greedy-generation parity with PyTorch.

Each run is `python -m trainer_core.engine.launch` on a spec, as the worker would start it.

    python -m bench.llm_methods [--out bench/results]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write
from tests.support import REFUSALS, launch_trainer, write_jsonl
from trainer_core.data import chat, prepare
from trainer_core.models import modeling
from trainer_core.spec import Dpo, Hyperparameters, Lora, Supervised, TrainingSpec

NUMBERS = range(12)


def sums(held_out: bool = False) -> list[dict[str, Any]]:
    ask = "Add {} and {}." if held_out else "What is {} plus {}?"
    pairs = [(a, b) for a in NUMBERS for b in NUMBERS if ((a + b) % 5 == 0) == held_out]
    return [
        {
            "messages": [
                {"role": "user", "content": ask.format(a, b)},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            ]
        }
        for a, b in pairs
    ]


def preferences(held_out: bool = False) -> list[dict[str, Any]]:
    return [
        {
            "input": {"messages": row["messages"][:1]},
            "preferred_output": row["messages"][1:],
            "non_preferred_output": [{"role": "assistant", "content": REFUSALS[i % len(REFUSALS)]}],
        }
        for i, row in enumerate(sums(held_out))
    ]


def base_model(root: Path) -> Path:
    """small-llama: 4 layers of 128, grouped-query attention, a BPE tokenizer with ChatML as its template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [prepare._text(r) for r in sums() + sums(True) + preferences()]
    tokenizer = modeling.train_tokenizer("tiny-gpt2", texts * 4)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = chat.DEFAULT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    path = root / "small-llama"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(root: Path, name: str, model: Path, files: tuple[Path, Path], **kw: Any) -> dict[str, Any]:
    hp = kw.pop("hp")
    spec = TrainingSpec(
        job_id=f"bench-{name}",
        task="causal-lm",
        model=model.name,
        model_path=str(model),
        train_file=str(files[0]),
        validation_file=str(files[1]),
        output_dir=str(root / name / "out"),
        hyperparameters=Hyperparameters(batch_size=16, max_seq_length=64, **hp).resolved(100, "causal-lm"),
        **kw,
    )
    (root / name).mkdir()
    t0 = time.perf_counter()
    code, events, err = launch_trainer(spec, root / name / "spec.json")
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{name}: trainer exited {code}: {err}")
    backend = next(e for e in events if e["type"] == "backend")
    metrics = [e for e in events if e["type"] == "metrics"]
    first = next(m for m in metrics if "eval_loss" in m)
    result = events[-1]
    onnx = next((e["manifest"] for e in events if e["type"] == "artifact" and e["format"] == "onnx"), None)
    rates = [m["samples_per_second"] for m in metrics if "samples_per_second" in m]
    return {
        "backend": backend["used"],
        "reason": backend["reason"] or "asked",
        "precision": backend["precision"],
        "before": first,
        "after": result["metrics"],
        "steps": result["steps"],
        "samples_per_second": rates[-1] if rates else None,
        "wall_s": wall,
        "greedy": onnx["greedy_parity"] if onnx else None,
        "failed": result.get("failed_artifacts"),
        "output": root / name / "out" / "pytorch",
    }


def _figures(r: dict[str, Any]) -> str:
    if "eval_preference_accuracy" in r["after"]:
        b, a = r["before"], r["after"]
        return (
            f"preference acc {b['eval_preference_accuracy']:.2f} -> {a['eval_preference_accuracy']:.2f}, "
            f"reward acc {a['eval_reward_accuracy']:.2f}, margin {a['eval_reward_margin']:.2f}"
        )
    return f"eval loss {r['before']['eval_loss']:.3f} -> {r['after']['eval_loss']:.3f}"


def _greedy(r: dict[str, Any]) -> str:
    g = r["greedy"]
    if g is None:
        return f"failed: {r['failed']}"
    return f"{g['identical']}/{g['prompts']} identical, {g['ties']} ties, {len(g['diverged'])} diverged"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = base_model(root)
        chats = (write_jsonl(root / "chat.jsonl", sums()), write_jsonl(root / "chat-valid.jsonl", sums(True)))
        pairs = (
            write_jsonl(root / "pairs.jsonl", preferences()),
            write_jsonl(root / "pairs-valid.jsonl", preferences(True)),
        )
        sft = {"n_epochs": 6, "learning_rate": 3e-3}
        lora = Lora(r=16, alpha=32, dropout=0.0)
        runs["sft full (auto)"] = run(root, "sft", model, chats, hp=sft)
        runs["sft full (ort, fp32)"] = run(
            root, "sft-ort", model, chats, hp=sft, backend="ort", precision="fp32"
        )
        runs["sft lora (auto)"] = run(root, "lora", model, chats, hp=sft | {"learning_rate": 1e-2}, lora=lora)
        runs["sft lora (ort, fp32)"] = run(
            root,
            "lora-ort",
            model,
            chats,
            hp=sft | {"learning_rate": 1e-2},
            lora=lora,
            backend="ort",
            precision="fp32",
        )
        packed = Supervised(packing=True)
        runs["sft full, packed (auto)"] = run(root, "packed", model, chats, hp=sft, method=packed)
        tuned = runs["sft full (auto)"]["output"]
        dpo = {"n_epochs": 3, "learning_rate": 5e-5}
        runs["dpo full, from sft (auto)"] = run(root, "dpo", tuned, pairs, hp=dpo, method=Dpo(beta=0.1))
        runs["dpo lora, from sft (auto)"] = run(
            root, "dpo-lora", tuned, pairs, hp=dpo | {"learning_rate": 2e-4}, method=Dpo(beta=0.1), lora=lora
        )
    lines = [
        f"### llm_methods (small-llama: 4 x 128, GQA 4/2, ChatML; {len(sums())} chat rows, "
        f"{len(sums(True))} held out; batch 16)",
        "",
        "| method | engine | precision | held-out figures | steps | samples/s | wall | ONNX greedy parity |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in runs.items():
        rate = f"{r['samples_per_second']:.1f}" if r["samples_per_second"] else "-"
        lines.append(
            f"| {name} | {r['backend']} | {r['precision']} | {_figures(r)} | {r['steps']} | {rate} | "
            f"{r['wall_s']:.0f}s | {_greedy(r)} |"
        )
    lines += ["", "Why each engine:"]
    lines += [f"- {name}: {r['reason']}" for name, r in runs.items()]
    for r in runs.values():
        r.pop("output")
    write(args.out, "llm_methods", {"runs": runs}, "\n".join(lines))


if __name__ == "__main__":
    main()
