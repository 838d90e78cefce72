"""Training throughput of each backend on the same model, data and seed, side by side in one run.

Backends: torch eager with AdamW (foreach), AdamW(fused=True), torch.compile, and ORTModule where it imports
(otherwise the reason is reported). Rounds are interleaved (A B C D, A B C D, ...) so drift on a shared,
noisy machine hits every backend alike; the median round is reported, as a ratio to eager. Model FLOPs
utilisation is 6 * parameters * tokens per second against a matmul peak measured in the same run.

    python -m bench.train_backends [--device cuda] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import BertConfig, BertForSequenceClassification


def make_model(seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=2000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=256,
        num_labels=2,
        attn_implementation="eager",
    )
    return BertForSequenceClassification(config).to(device).train()


def batches(n: int, batch: int, seq: int, device: str, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(5, 2000, (batch, seq), generator=g).to(device),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
            "labels": torch.randint(0, 2, (batch,), generator=g).to(device),
        }
        for _ in range(n)
    ]


def ort_wrap(model: torch.nn.Module) -> torch.nn.Module:
    from trainer_core.ort_trainer import wrap  # applies the torch 2.13 compat layer, fallback disabled

    return wrap(model)  # type: ignore[no-any-return]


BACKENDS: dict[str, Callable[[torch.nn.Module], tuple[torch.nn.Module, dict[str, Any]]]] = {
    "eager_adamw": lambda m: (m, {}),
    "fused_adamw": lambda m: (m, {"fused": True}),
    "torch_compile": lambda m: (torch.compile(m), {}),  # type: ignore[dict-item]
    "ort": lambda m: (ort_wrap(m), {}),
}


def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[dict[str, torch.Tensor]], float]:
    def step(b: dict[str, torch.Tensor]) -> float:
        out = model(**b)
        loss = out["loss"] if isinstance(out, dict) else out[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def matmul_peak(device: str, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(device: str, batch: int, seq: int, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    data = batches(steps + warmup, batch, seq, device, seed=1)
    ready: dict[str, tuple[Callable[[dict[str, torch.Tensor]], float], int]] = {}
    unavailable: dict[str, str] = {}
    losses: dict[str, list[float]] = {}
    reference = make_model(0, device)
    params = sum(p.numel() for p in reference.parameters())
    # FLOPs count matmul work only: embedding lookups cost none, so their parameters are left out.
    matmul_params = sum(p.numel() for n, p in reference.named_parameters() if "embeddings" not in n)
    for name, wrap in BACKENDS.items():
        try:
            model = make_model(0, device)
            wrapped, opt_kw = wrap(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **opt_kw)
            step = step_fn(wrapped, opt)
            losses[name] = [step(b) for b in data[:warmup]]  # warm-up: compile, export, allocator
            ready[name] = (step, 0)
        except Exception as exc:  # a backend that cannot run here is reported, not hidden
            unavailable[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    times: dict[str, list[float]] = {name: [] for name in ready}
    for _ in range(rounds):
        for name, (step, _) in ready.items():
            sync(device)
            t0 = time.perf_counter()
            for b in data[warmup:]:
                losses[name].append(step(b))
            sync(device)
            times[name].append(time.perf_counter() - t0)
    peak = matmul_peak(device)
    results: dict[str, Any] = {}
    for name, ts in times.items():
        sps = batch * steps / statistics.median(ts)
        results[name] = {
            "samples_per_s": sps,
            "tokens_per_s": sps * seq,
            "mfu": 6 * matmul_params * sps * seq / peak,
            "loss_after_warmup": losses[name][warmup - 1],
            "rounds_s": ts,
        }
    eager = results.get("eager_adamw", {}).get("samples_per_s")
    for r in results.values():
        r["ratio_to_eager"] = r["samples_per_s"] / eager if eager else None
    return {
        "device": device,
        "torch": torch.__version__,
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "rounds": rounds,
        "parameters": params,
        "matmul_parameters": matmul_params,
        "matmul_peak_flops": peak,
        "results": results,
        "unavailable": unavailable,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"### train_backends ({report['device']}, torch {report['torch']}, batch {report['batch']}, "
        f"seq {report['seq']}, {report['parameters']:,} parameters)",
        "",
        "| backend | samples/s | tokens/s | ratio to eager | MFU |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r['ratio_to_eager']:.2f}x | {r['mfu'] * 100:.1f}% |"
        )
    for name, why in report["unavailable"].items():
        lines.append(f"| {name} | not run: {why} | | | |")
    lines.append(f"\nmatmul peak measured in this run: {report['matmul_peak_flops'] / 1e9:.1f} GFLOP/s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    report = run(args.device, args.batch, args.seq, args.steps, args.warmup, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_backends.json").write_text(json.dumps(report, indent=2))
    summary = markdown(report)
    (args.out / "train_backends.md").write_text(summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()
