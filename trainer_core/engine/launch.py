"""Run one training job from its spec: `python -m trainer_core.engine.launch spec.json`.

Events go to stdout as JSON lines (see events.py); everything else goes to stderr. The exit codes are
the worker's contract (ortune/contract.py); under torchrun a rank stopped on request exits 0, and rank 0's
`stopped` event tells the worker.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer_core.contract import EXIT_FAILED, EXIT_OK, EXIT_SPEC_ERROR, EXIT_STOPPED, die_with_parent
from trainer_core.engine.callbacks import EVAL_NAMES, Diverged, StopOnRequest
from trainer_core.engine.ranks import rank
from trainer_core.events import EventStream
from trainer_core.spec import TrainingSpec


def with_stores(spec: TrainingSpec) -> TrainingSpec:
    """The spec with its stores named: where the worker staged them, or beside the output when run by hand."""
    if spec.train_store is not None:
        return spec
    stores = Path(spec.output_dir).parent / "stores"
    return spec.model_copy(
        update={
            "train_store": str(stores / "train"),
            "validation_store": str(stores / "valid") if spec.validation_file else None,
        }
    )


class Stopped(Exception):
    """Training stopped on SIGTERM after its checkpoint was saved."""


def run(spec: TrainingSpec, events: EventStream, stop: StopOnRequest | None = None) -> None:
    """The recipe: set up (fail fast, then load), train with an evaluation before and after, save."""
    job = setup(spec, events, stop)
    final = train(job, stop)
    if rank() == 0:  # rank 0 saves, exports and reports for the whole job
        save(job, final)


@dataclass
class Job:
    """What setup hands to training and saving."""

    spec: TrainingSpec
    events: EventStream
    choice: Any  # backends.BackendChoice
    loaded: Any  # modeling.Loaded
    train_set: Any
    valid_set: Any
    hf_trainer: Any = None


def setup(spec: TrainingSpec, events: EventStream, stop: StopOnRequest | None = None) -> Job:
    """Everything that can fail fast fails before the model loads; then the stores, the model, the engine
    (measured when backend is auto) and the method's Trainer."""
    import torch
    import transformers

    from trainer_core.data import prepare
    from trainer_core.engine import backends, precision
    from trainer_core.models import modeling, registry

    transformers.utils.logging.set_verbosity_error()
    cuda = torch.cuda.is_available()
    chosen_precision = precision.choose(spec, cuda=cuda)
    spec = spec.model_copy(update={"precision": chosen_precision.used})
    choice = backends.choose(spec, cuda=cuda)
    transformers.set_seed(spec.seed)
    spec = with_stores(spec)
    train_set, valid_set = prepare.ensure(spec, events)
    path = Path(spec.model_path) if spec.model_path else None
    info = registry.ModelInfo(spec.model, "built" if path is None else "local", path, registry.ALL_TASKS)
    events.emit("phase", name="loading")
    t0 = time.perf_counter()
    # ORT's gradient builder cannot take SDPA attention; `measure` switches it as it times each engine.
    attention = "eager" if choice.used == "ort" else "sdpa"
    tokenizer = prepare.load_tokenizer(spec, train_set)
    loaded = modeling.load(info, spec, tokenizer=tokenizer, attn_implementation=attention)
    load_s = time.perf_counter() - t0
    events.message(
        f"loaded {spec.model} ({sum(p.numel() for p in loaded.model.parameters()):,} parameters) "
        f"in {load_s:.1f}s",
        load_s=round(load_s, 3),
    )
    ort_module = None
    if choice.needs_measurement:
        choice, ort_module = _measure(spec, choice, loaded, train_set, cuda=cuda)
    _report_backend(events, choice, chosen_precision)
    job = Job(spec, events, choice, loaded, train_set, valid_set)
    job.hf_trainer = spec.method_info.load("trainer")(
        spec, choice, loaded, train_set, valid_set, events, cuda=cuda, ort_module=ort_module, stop=stop
    )
    return job


def train(job: Job, stop: StopOnRequest | None) -> dict[str, float]:
    """Train, with an evaluation before and after so the job shows what training bought; the final
    metrics."""
    from trainer_core.engine import ranks

    spec, hf_trainer, valid_set = job.spec, job.hf_trainer, job.valid_set
    if valid_set is not None and spec.resume_from is None:
        hf_trainer.evaluate()  # the callback reports it as step 0
    result = hf_trainer.train(resume_from_checkpoint=spec.resume_from)
    if stop is not None and stop.requested:
        step = hf_trainer.state.global_step
        job.events.emit(
            "stopped", step=step
        )  # the worker tells a stop from a crash by this, not the exit code
        raise Stopped(step)
    final: dict[str, float] = {"train_loss": float(result.training_loss)}
    if spec.hyperparameters.gradient_checkpointing:  # what the model really did, not what was asked
        final["gradient_checkpointing"] = float(
            bool(getattr(hf_trainer.plain_model, "is_gradient_checkpointing", 0))
        )
    if valid_set is not None:
        # The Trainer may have evaluated the last step already (eval_every_steps divides max_steps).
        step = hf_trainer.state.global_step
        done = [h for h in hf_trainer.state.log_history if "eval_loss" in h and h.get("step") == step]
        after = done[-1] if done else hf_trainer.evaluate()
        final |= {EVAL_NAMES[k]: float(v) for k, v in after.items() if k in EVAL_NAMES}
    if spec.distributed.world_size > 1:  # every rank, before rank 0 goes on alone: it is a collective
        final["replicas_max_rel_diff"] = ranks.check_in_sync(hf_trainer.plain_model)
    return final


def save(job: Job, final: dict[str, float]) -> None:
    """The PyTorch directory (and a LoRA job's adapter), the ONNX export checked against it, the result."""
    from trainer_core import export
    from trainer_core.engine import ort_trainer

    spec, events, hf_trainer = job.spec, job.events, job.hf_trainer
    if job.choice.used == "ort":
        nodes = ort_trainer.training_graph_nodes(hf_trainer.ort_module)
        final["ort_training_graph_nodes"] = nodes
        events.message(f"ONNX Runtime trained this job: its training graph has {nodes} nodes")
    out = Path(spec.output_dir)
    # without the autocast wrapper Accelerate put on forward for mixed precision: the export traces fp32
    model = hf_trainer.accelerator.unwrap_model(hf_trainer.model, keep_fp32_wrapper=False)
    manifest = {
        "job_id": spec.job_id,
        "base_model": spec.model,
        "task": spec.task,
        "method": spec.method.type,
        "serving": spec.task_info.serving,  # how serve loads the ONNX artifact (serve/models.py)
        "labels": spec.labels,
        "backend_used": job.choice.used,
        "steps": hf_trainer.state.global_step,
        "metrics": final,
    }
    tokenizer = job.loaded.tokenizer
    if spec.lora is not None:  # the adapter as trained, then the model with it merged in for the rest
        manifest["lora"] = spec.lora.model_dump()
        adapter = export.save_adapter(model, tokenizer, out / "adapter", manifest)
        events.emit("artifact", format="adapter", path=str(out / "adapter"), manifest=adapter)
        model = model.merge_and_unload()
    pt = export.save_pytorch(model, tokenizer, out / "pytorch", manifest)
    events.emit("artifact", format="pytorch", path=str(out / "pytorch"), manifest=pt)
    del model
    failed, parity = _save_onnx(job, out, manifest)
    tokens = job.train_set.meta.tokens * spec.hyperparameters.n_epochs or None  # None: media has no tokens
    events.emit(
        "result",
        metrics=final,
        steps=hf_trainer.state.global_step,
        trained_tokens=tokens,
        onnx_max_abs_diff=parity,
        failed_artifacts=failed,
    )


def _save_onnx(job: Job, out: Path, manifest: dict[str, Any]) -> tuple[dict[str, str], float | None]:
    """The task's exporter over the PyTorch model as stored, checked on the held-out rows as the collator
    batches them; a failed export costs that artifact only. The stored model, not the trainer's copy: its
    forward may still carry a mixed-precision wrapper, and bf16 greedy decoding then disagrees with ONNX."""
    from trainer_core import export
    from trainer_core.engine import trainer
    from trainer_core.models import modeling

    spec, tokenizer = job.spec, job.loaded.tokenizer
    model = modeling.from_directory(out / "pytorch", spec.task)
    rows = job.valid_set or job.train_set
    held_out = export.HeldOut(
        rows, trainer.collator_for(spec, tokenizer, rows), max_len=spec.hyperparameters.max_seq_length
    )
    try:
        onnx = spec.task_info.load("exporter")(model, tokenizer, out / "onnx", held_out, manifest)
    except export.ExportError as exc:
        job.events.message(f"{exc}; the job keeps its PyTorch model", level="warn", format="onnx")
        return {"onnx": str(exc)}, None
    job.events.emit("artifact", format="onnx", path=str(out / "onnx"), manifest=onnx)
    return {}, onnx["parity"]["max_abs_diff"]


def _die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a worker killing torchrun's process group
    would leave the ranks training on: each rank asks the kernel to kill it when torchrun goes."""
    if die_with_parent() and os.getppid() == 1:  # torchrun was already gone
        os._exit(EXIT_FAILED)


def _measure(spec: TrainingSpec, choice: Any, loaded: Any, train_set: Any, *, cuda: bool) -> tuple[Any, Any]:
    """backend=auto: time both engines as this job will train (see backends.measure); the choice and, when
    ORT won, its ORTModule."""
    import torch

    from trainer_core.data.batches import BucketSampler
    from trainer_core.engine import backends, trainer

    hp = spec.hyperparameters
    per_epoch = -(-len(train_set) // hp.batch_size)
    order = iter(BucketSampler(train_set.lengths, hp.batch_size, spec.seed))
    collate = trainer.collator_for(spec, loaded.tokenizer, train_set)
    batches = []
    for _ in range(min(3, per_epoch)):  # the job's first batches, as its sampler orders them
        rows = [train_set[i] for _, i in zip(range(hp.batch_size), order, strict=False)]
        batches.append(collate(rows))
    micro_steps = hp.max_steps * hp.gradient_accumulation_steps if hp.max_steps else per_epoch * hp.n_epochs
    if cuda:
        loaded.model.to("cuda")
        batches = [{k: v.to("cuda") for k, v in b.items()} for b in batches]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision)
    try:
        figures = backends.measure(
            loaded.model,
            batches,
            micro_steps=micro_steps,
            autocast_dtype=dtype,
            budget_fraction=spec.auto_budget_fraction,
        )
    except Exception as exc:  # ORT could not run this model: auto trains with PyTorch and says why
        loaded.model.zero_grad(set_to_none=True)
        loaded.model.set_attn_implementation("sdpa")
        reason = f"fell back to PyTorch: ORT failed on this model: {backends.describe(exc)}"
        return backends.BackendChoice("auto", "torch", reason, choice.optim, None, choice.optim_note), None
    return backends.decided(choice, figures, cuda), figures.get("ort_module")


def _report_backend(events: EventStream, choice: Any, chosen_precision: Any) -> None:
    events.emit(
        "backend",
        requested=choice.requested,
        used=choice.used,
        reason=choice.reason,
        optim=choice.ort_optim or choice.optim,
        optim_note=choice.optim_note,
        figures={k: v for k, v in choice.figures.items() if k != "ort_module"},
        precision_requested=chosen_precision.requested,
        precision=chosen_precision.used,
        precision_reason=chosen_precision.reason,
    )
    events.message(f"training in {chosen_precision.reason}")
    if choice.reason:
        events.message(choice.reason, level="warn" if "fell back" in choice.reason else "info")
    if choice.optim_note:
        events.message(choice.optim_note, level="warn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer_core.engine.launch", description=__doc__)
    parser.add_argument("spec", type=Path, help="the job's spec.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_launcher()
    events = EventStream.take_stdout()
    if rank() != 0:
        events = EventStream.silent()
    stop = StopOnRequest().install()
    from trainer_core.engine.backends import BackendUnavailable
    from trainer_core.engine.trainer import SpecError
    from trainer_core.export import ExportError
    from trainer_core.models.modeling import ModelLoadError

    try:
        spec = TrainingSpec.load(args.spec)
        run(spec, events, stop)
    except Stopped:
        # Under torchrun a rank's non-zero exit is a failure to its torchrun; rank 0's event says it stopped.
        return EXIT_OK if "TORCHELASTIC_RUN_ID" in os.environ else EXIT_STOPPED
    except (SpecError, BackendUnavailable, ModelLoadError, ValueError) as exc:
        events.emit("error", code=type(exc).__name__, message=str(exc))
        traceback.print_exc()
        return EXIT_SPEC_ERROR
    except Diverged as exc:
        events.emit("error", code="training_diverged", message=str(exc))
        traceback.print_exc()
        return EXIT_FAILED
    except ExportError as exc:
        events.emit("error", code="ExportError", message=str(exc))
        traceback.print_exc()
        return EXIT_FAILED
    except Exception as exc:
        events.emit("error", code=type(exc).__name__, message=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return EXIT_FAILED
    return EXIT_OK


def _leave_together(code: int) -> None:
    """A rank under torchrun that finished its work waits for the others, leaves the process group, and exits
    without the interpreter's teardown.

    The teardown runs ONNX Runtime's C++ destructors with threads still joinable, where a finished rank can
    abort ("terminate called without an active exception", SIGABRT) and fail a job whose training and
    artifacts are complete. The barrier comes first so that no rank closes its sockets while another still
    waits on a collective. Every file a rank writes is closed by the time `main` returns; stdio is flushed
    here."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_code = main()
    if exit_code == 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        _leave_together(exit_code)  # a failed rank exits as usual: the others may be gone
    sys.exit(exit_code)
