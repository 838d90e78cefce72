"""Training throughput of each way to train, side by side in one run, on real variable-length text.

Rows, per model:
- eager fp32: PyTorch eager, SDPA attention, AdamW (foreach): the baseline every ratio is against;
- eager bf16: the same under bf16 autocast (fp32 master weights and optimizer state);
- fused bf16: and AdamW(fused=True);
- compile bf16: and torch.compile (its compile time is reported apart: `setup_s`);
- ORT fp32 and ORT bf16: ORTModule (eager attention, which its gradient builder needs), or why it cannot run;
- auto: what a default job picks here (precision auto, backend auto, optim auto) through the trainer's own
  code (engine.precision, engine.backends.measure), timed like the others; `auto+measure` spreads
  the measuring cost over a job of --job-steps steps.

Data: the demo's sentences joined into texts of 1 to 12 sentences, tokenized by the model's own tokenizer,
ordered by the job's BucketSampler and padded per batch by the job's Collator: the lengths a job sees. The
image, audio and speech models (`vit`, `wav2vec2`, `whisper`) get ortune.media_demo's shapes, tones and
melodies through the job's own store transforms and MediaCollator; their "tokens" are the encoder's
positions (patches, feature frames; for Whisper its frames plus the transcript's tokens, each side's MFU
counted with its own parameters).
Rounds are interleaved (every row once per round) so drift on a shared, noisy machine hits each alike; the
median round is reported. MFU is 6 x matmul parameters x padded positions/s against the matmul peak of the
precision the row computes in, measured in the same run.

    python -m bench.train_backends [--device cuda --models bert-base,gpt2-small] [--out bench/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer_core import tasks
from trainer_core.data.batches import BucketSampler, Collator
from trainer_core.engine import backends, precision
from trainer_core.models import modeling, registry
from trainer_core.spec import Hyperparameters, TrainingSpec

DEMO = Path(__file__).resolve().parents[1] / "ortune" / "demo_data" / "sentiment_train.jsonl"
ROWS = ["eager_fp32", "eager_bf16", "fused_bf16", "compile_bf16", "ort_fp32", "ort_bf16", "auto", "auto_fp32"]


def texts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    sentences = [json.loads(line) for line in DEMO.read_text().splitlines()]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        picked = rng.sample(sentences, rng.randint(1, 12))
        out.append((" ".join(s["text"] for s in picked), int(picked[0]["label"] == "positive")))
    return out


MEDIA = {
    "vit": "image-classification",
    "wav2vec2": "audio-classification",
    "whisper": "automatic-speech-recognition",
}


def build_media(name: str, device: str) -> tuple[torch.nn.Module, Any, str]:
    """A small ViT (64x64 images, 8x8 patches), wav2vec2 or Whisper (2 s windows) of width 256, 4 layers
    (Whisper: 4 + 4), with the processor its jobs use."""
    from transformers import (
        ViTConfig,
        ViTForImageClassification,
        ViTImageProcessorPil,
        Wav2Vec2Config,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2ForSequenceClassification,
    )

    from ortune import media_demo
    from trainer_core.tasks import speech

    torch.manual_seed(0)
    width = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024}
    model: Any
    if name == "vit":
        processor: Any = ViTImageProcessorPil(size={"height": 64, "width": 64})
        model = ViTForImageClassification(ViTConfig(image_size=64, patch_size=8, num_labels=3, **width))
    elif name == "wav2vec2":
        processor = Wav2Vec2FeatureExtractor(sampling_rate=16000, return_attention_mask=True)
        config = Wav2Vec2Config(
            num_labels=3,
            feat_extract_norm="layer",
            do_stable_layer_norm=True,
            layerdrop=0.0,
            mask_time_prob=0.0,
            **width,
        )
        model = Wav2Vec2ForSequenceClassification(config)
    else:
        processor = speech.built_processor(t for _, t, _ in media_demo.melody_rows(200, 0))
        model = speech.built_model(processor, width=256, layers=4, ffn=1024)
        model.config.use_cache = False  # as the trainer loads it: ORTModule cannot flatten a KV cache output
    model.config._attn_implementation = "sdpa"
    return model.to(device).train(), processor, MEDIA[name]


def media_batches(
    name: str, processor: Any, n: int, batch: int, device: str
) -> list[dict[str, torch.Tensor]]:
    from ortune import media_demo
    from trainer_core.data import mediastore
    from trainer_core.tasks import speech

    task = MEDIA[name]
    make = {
        "vit": media_demo.image_rows,
        "wav2vec2": media_demo.audio_rows,
        "whisper": media_demo.melody_rows,
    }
    rows = make[name](n * batch, 1)
    labels = sorted({label for _, label, _ in rows})
    info: dict[str, Any] = {"media": "image" if name == "vit" else "audio"}
    items = []
    for _, target, raw in rows:
        if name == "vit":
            values = mediastore.image_values(raw, processor)
        else:
            info["rate"] = processor.sampling_rate
            values = mediastore.clip_values(raw, processor.sampling_rate)
        if mediastore.transcribes(task):
            info["max_samples"] = processor.max_samples
            (ids,) = processor.labels([target], processor.tokenizer.convert_tokens_to_ids(speech.START), 64)
            items.append({"values": values, "labels": ids})
        else:
            items.append({"values": values, "labels": labels.index(target)})
    collate = mediastore.MediaCollator(processor, info)
    order = list(BucketSampler([len(i["values"]) for i in items], batch, seed=1))
    out = [collate([items[i] for i in order[k : k + batch]]) for k in range(0, n * batch, batch)]
    return [{k: v.to(device) for k, v in b.items()} for b in out]


def positions(model: Any, batch: dict[str, torch.Tensor]) -> tuple[int, int, list[tuple[str, int]]]:
    """(real, padded) positions a batch feeds, and (parameter-name prefix, positions) per part for MFU."""
    if "input_ids" in batch:
        real, padded = int(batch["attention_mask"].sum()), batch["attention_mask"].numel()
        return real, padded, [("", padded)]
    if "pixel_values" in batch:
        n = len(batch["pixel_values"]) * ((model.config.image_size // model.config.patch_size) ** 2 + 1)
        return n, n, [("", n)]
    if "input_values" in batch:
        lengths = model._get_feat_extract_output_lengths(batch["attention_mask"].sum(-1))
        width = model._get_feat_extract_output_lengths(torch.tensor(batch["input_values"].shape[1]))
        return int(lengths.sum()), int(width) * len(lengths), [("", int(width) * len(lengths))]
    frames = len(batch["input_features"]) * model.config.max_source_positions
    tokens = batch["decoder_attention_mask"]
    return (
        frames + int(tokens.sum()),
        frames + tokens.numel(),
        [("model.encoder.", frames), ("model.decoder.", tokens.numel())],
    )


def build(name: str, device: str) -> tuple[torch.nn.Module, Any, str]:
    """(model, tokenizer, task) with SDPA attention, in fp32, in train mode."""
    if name in MEDIA:
        return build_media(name, device)
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
    )

    torch.manual_seed(0)
    minilm = next((m.path for m in registry.list_models() if m.id.endswith("all-MiniLM-L6-v2")), None)
    if name == "minilm":
        model = AutoModelForSequenceClassification.from_pretrained(
            minilm, num_labels=2, dtype=torch.float32, attn_implementation="sdpa"
        )
        return model.to(device).train(), AutoTokenizer.from_pretrained(minilm), "sequence-classification"
    if name in ("small-bert", "bert-base"):
        # MiniLM's real WordPiece vocabulary where it is installed (not on a bare GPU machine), else one
        # learnt from the texts; the embedding table has BERT's size either way
        tok = (
            AutoTokenizer.from_pretrained(minilm)
            if minilm
            else modeling.train_tokenizer("tiny-bert", (t for t, _ in texts(2000)))
        )
        size = {
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "intermediate_size": 1024,
        }
        config = BertConfig(
            vocab_size=max(len(tok), 30522),
            num_labels=2,
            attn_implementation="sdpa",
            **(size if name == "small-bert" else {}),
        )
        return BertForSequenceClassification(config).to(device).train(), tok, "sequence-classification"
    tok = modeling.train_tokenizer("tiny-gpt2", (t for t, _ in texts(2000)))
    size = {"n_embd": 256, "n_layer": 4, "n_head": 4} if name == "gpt2" else {}  # gpt2-small: GPT-2's own
    config = GPT2Config(
        vocab_size=max(len(tok), 50257 if name == "gpt2-small" else 0),
        pad_token_id=tok.pad_token_id,
        use_cache=False,  # as the trainer loads it: ORTModule cannot flatten a KV cache output
        attn_implementation="sdpa",
        **size,
    )
    return GPT2LMHeadModel(config).to(device).train(), tok, "causal-lm"


def batches(
    tok: Any, task: str, n: int, batch: int, max_len: int, device: str
) -> list[dict[str, torch.Tensor]]:
    items = []
    for text, label in texts(n * batch, seed=1):
        ids = tok(text, truncation=True, max_length=max_len)["input_ids"]
        items.append({"input_ids": ids, "labels": label if task == "sequence-classification" else ids})
    order = list(BucketSampler([len(i["input_ids"]) for i in items], batch, seed=1))
    collate = Collator(tok.pad_token_id, classifies=tasks.get(task).classifies)
    out = [collate([items[i] for i in order[k : k + batch]]) for k in range(0, n * batch, batch)]
    return [{k: v.to(device) for k, v in b.items()} for b in out]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: str, dtype: torch.dtype) -> float:
    n, reps = (8192, 20) if device == "cuda" else (2048, 10)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


class Row:
    """One way to train a fresh copy of the model: its step, its setup cost and what it computes in."""

    def __init__(self, name: str, model_name: str, device: str, job_steps: int, warm: list[Any]) -> None:
        self.name, self.device = name, device
        model, tok, self.task = build(model_name, device)
        self.pad_id = getattr(tok, "pad_token_id", None)
        self.info: dict[str, Any] = {}
        t0 = time.perf_counter()
        bf16 = name.endswith("bf16")
        fused = name in ("fused_bf16", "compile_bf16")
        module: Any = model
        if name.startswith("auto"):  # auto_fp32: backend auto with precision fp32, where ORT is measured
            bf16, fused, module = self._auto(
                model, job_steps, warm, "fp32" if name == "auto_fp32" else "auto"
            )
        elif name.startswith("ort"):
            if bf16 and device != "cuda":
                raise RuntimeError(
                    "ORT training on CPU runs fp32 only (its CPU kernels have no bf16 training)"
                )
            problem = backends.ort_problem(_spec("ort", "fp32"), cuda=device == "cuda")
            if problem:
                raise RuntimeError(problem)
            from trainer_core.engine.ort_trainer import wrap

            model.set_attn_implementation("eager")
            module = wrap(model)
        elif name == "compile_bf16":
            module = torch.compile(model)
        self.dtype = torch.bfloat16 if bf16 else None
        self.module, self.model = module, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if fused else {}))
        for batch in warm:  # warm-up: allocator, kernel choice, and compile or export
            self.step(batch)
        sync(device)
        self.info["setup_s"] = time.perf_counter() - t0 - self.info.get("measure_s", 0.0)
        self.info["precision"] = "bf16" if bf16 else "fp32"

    def _auto(self, model: Any, job_steps: int, warm: list[Any], prec: str) -> tuple[bool, bool, Any]:
        cuda = self.device == "cuda"
        spec = _spec("auto", prec)
        chosen = precision.choose(spec, cuda=cuda)
        spec = spec.model_copy(update={"precision": chosen.used})
        choice = backends.choose(spec, cuda=cuda)
        module = model
        if choice.needs_measurement:
            t0 = time.perf_counter()
            figures = backends.measure(
                model,
                warm[:3],
                micro_steps=job_steps,
                autocast_dtype=torch.bfloat16 if chosen.used == "bf16" else None,
            )
            self.info["measure_s"] = time.perf_counter() - t0
            choice = backends.decided(choice, figures, cuda)
            module = figures.get("ort_module") or model
        self.info |= {"picked": f"{choice.used} {chosen.used} {choice.optim}", "reason": choice.reason}
        return chosen.used == "bf16", choice.optim == "adamw_torch_fused", module

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        with torch.autocast(self.device, dtype=self.dtype, enabled=self.dtype is not None):
            out = self.module(**batch)
        loss = out["loss"] if isinstance(out, dict) else out[0]
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def _spec(backend: str, prec: str) -> TrainingSpec:
    return TrainingSpec(
        job_id="bench",
        task="sequence-classification",
        model="bench",
        train_file="-",
        labels=[0, 1],
        output_dir="-",
        backend=backend,  # type: ignore[arg-type]
        precision=prec,  # type: ignore[arg-type]
        hyperparameters=Hyperparameters().resolved(1000),
    )


def run_model(
    model_name: str,
    device: str,
    batch: int,
    max_len: int,
    steps: int,
    warmup: int,
    rounds: int,
    job_steps: int,
) -> dict[str, Any]:
    model, tok, task = build(model_name, "cpu")
    if model_name in MEDIA:
        all_batches = media_batches(model_name, tok, warmup + steps, batch, device)
    else:
        all_batches = batches(tok, task, warmup + steps, batch, max_len, device)
    warm, timed = all_batches[:warmup], all_batches[warmup:]
    ready: dict[str, Row] = {}
    unavailable: dict[str, str] = {}
    for name in ROWS:
        try:
            ready[name] = Row(name, model_name, device, job_steps, warm)
        except Exception as exc:  # a row that cannot run here is reported, not hidden
            unavailable[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    times: dict[str, list[float]] = {name: [] for name in ready}
    for _ in range(rounds):
        for name, row in ready.items():
            sync(device)
            t0 = time.perf_counter()
            for b in timed:
                row.step(b)
            sync(device)
            times[name].append(time.perf_counter() - t0)
    first = next(iter(ready.values()))

    # matmul work only: lookups cost none (GPT-2's tied wte is also its LM head, a matmul, so it counts)
    def matmul(prefix: str) -> int:
        return sum(
            p.numel()
            for n, p in first.model.named_parameters()
            if n.startswith(prefix)
            and "embeddings" not in n
            and "wpe" not in n
            and "embed_positions" not in n
        )

    params = matmul("")
    peaks = {"fp32": matmul_peak(device, torch.float32), "bf16": matmul_peak(device, torch.bfloat16)}
    samples = batch * steps
    counted = [positions(model, b) for b in timed]
    real, padded = sum(c[0] for c in counted), sum(c[1] for c in counted)
    flops = sum(6 * matmul(prefix) * n for c in counted for prefix, n in c[2])
    results: dict[str, Any] = {}
    for name, ts in times.items():
        row = ready[name]
        median = statistics.median(ts)
        results[name] = row.info | {
            "samples_per_s": samples / median,
            "tokens_per_s": real / median,
            "mfu": flops / median / peaks[row.info["precision"]],
            "spread": (max(ts) - min(ts)) / median,
            "rounds_s": ts,
        }
        if name.startswith("auto"):
            per_step = median / steps + row.info.get("measure_s", 0.0) / job_steps
            results[name]["samples_per_s_with_measure"] = batch / per_step
            results[name]["measure_share"] = row.info.get("measure_s", 0.0) / (median / steps * job_steps)
    del ready
    gc.collect()
    base = results.get("eager_fp32", {}).get("samples_per_s")
    for r in results.values():
        r["ratio"] = r["samples_per_s"] / base if base else None
    return {
        "model": model_name,
        "matmul_parameters": params,
        "padding_fraction": 1 - real / padded,
        "mean_length": real / samples,
        "peaks_flops": peaks,
        "results": results,
        "unavailable": unavailable,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"### train_backends ({report['device']}, torch {report['torch']}, batch {report['batch']}, "
        f"texts up to {report['max_len']} tokens, {report['steps']} steps x {report['rounds']} rounds; for "
        "vit, wav2vec2 and whisper the tokens are encoder positions)",
    ]
    for m in report["models"]:
        peaks = m["peaks_flops"]
        lines += [
            "",
            f"**{m['model']}** ({m['matmul_parameters']:,} matmul parameters, mean length "
            f"{m['mean_length']:.0f} tokens, padding {m['padding_fraction']:.1%}; measured peaks fp32 "
            f"{peaks['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:,.0f} GFLOP/s)",
            "",
            "| row | samples/s | tokens/s | ratio to eager fp32 | MFU (its peak) | spread | setup |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in m["results"].items():
            lines.append(
                f"| {name} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['ratio']:.2f}x | "
                f"{r['mfu'] * 100:.1f}% {r['precision']} | {r['spread']:.0%} | {r['setup_s']:.1f}s |"
            )
        for name, why in m["unavailable"].items():
            lines.append(f"| {name} | not run: {why} | | | | | |")
        for name in ("auto", "auto_fp32"):
            auto = m["results"].get(name)
            if not auto:
                continue
            fastest = max(m["results"].values(), key=lambda r: r["samples_per_s"])
            slowest = min(m["results"].values(), key=lambda r: r["samples_per_s"])
            lines.append(
                f"\n{name} picked {auto['picked']}: {auto['reason'] or 'as requested'}; "
                f"{auto.get('samples_per_s_with_measure', auto['samples_per_s']):.1f} samples/s counting its "
                f"measuring ({auto.get('measure_s', 0.0):.1f}s, {auto['measure_share']:.1%} of a "
                f"{report['job_steps']}-step job); "
                f"{auto['samples_per_s'] / fastest['samples_per_s']:.2f}x the fastest row"
                f"{', the slowest row' if auto is slowest else ''}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="small-bert,minilm,gpt2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job-steps", type=int, default=2000, help="the job auto's measuring is spread over")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "max_len": args.max_len,
        "steps": args.steps,
        "rounds": args.rounds,
        "job_steps": args.job_steps,
        "models": [],
    }
    run: Callable[[str], dict[str, Any]] = lambda name: run_model(  # noqa: E731
        name, args.device, args.batch, args.max_len, args.steps, args.warmup, args.rounds, args.job_steps
    )
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        report["models"].append(run(name))
        # written after each model, so a run stopped at its time limit keeps what it measured
        (args.out / "train_backends.json").write_text(json.dumps(report, indent=2))
        summary = markdown(report)
        (args.out / "train_backends.md").write_text(summary + "\n")
        print(summary, flush=True)


if __name__ == "__main__":
    main()
