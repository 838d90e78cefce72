"""Build the Trainer for a spec: an ORTTrainer, with ORTModule on or off as backends.choose decided."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainer_core.data import mediastore
from trainer_core.data.batches import BucketSampler, Collator, Packed, PackedCollator
from trainer_core.data.datastore import Store, TokenStore
from trainer_core.engine.backends import BackendChoice
from trainer_core.engine.callbacks import CheckpointPacing, DivergenceGuard, EventCallback, StopOnRequest
from trainer_core.engine.ort_trainer import ORTTrainer, ORTTrainingArguments
from trainer_core.events import EventStream
from trainer_core.spec import TrainingSpec


class SpecError(ValueError):
    """The spec asks for something this machine cannot do; the message says what and why."""


def accuracy(pred: Any) -> dict[str, float]:
    logits, labels = pred.predictions, pred.label_ids
    if isinstance(logits, tuple):
        logits = logits[0]
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def training_arguments(
    spec: TrainingSpec, choice: BackendChoice, *, cuda: bool, has_eval: bool
) -> ORTTrainingArguments:
    return ORTTrainingArguments(
        use_ort=choice.used == "ort",
        ort_optim=choice.ort_optim,
        **common_arguments(spec, choice, cuda=cuda, has_eval=has_eval),
    )


def common_arguments(
    spec: TrainingSpec, choice: BackendChoice, *, cuda: bool, has_eval: bool
) -> dict[str, Any]:
    """The TrainingArguments every method's trainer takes (ORTTrainer's, TRL's DPOConfig)."""
    hp = spec.hyperparameters
    every = spec.checkpoint_every_steps
    world = spec.distributed.world_size
    if hp.batch_size % world:
        raise SpecError(f"batch_size {hp.batch_size} does not split over {world} processes; use a multiple")
    return dict(
        output_dir=str(Path(spec.output_dir) / "checkpoints"),
        per_device_train_batch_size=hp.batch_size // world,  # batch_size is the global batch
        per_device_eval_batch_size=max(hp.batch_size, 16),
        gradient_accumulation_steps=hp.gradient_accumulation_steps,
        gradient_checkpointing=hp.gradient_checkpointing,
        # non-reentrant: no input that requires grad needed (a LoRA model's embeddings are frozen)
        gradient_checkpointing_kwargs={"use_reentrant": False} if hp.gradient_checkpointing else None,
        num_train_epochs=hp.n_epochs,
        max_steps=hp.max_steps or -1,
        learning_rate=hp.learning_rate,
        weight_decay=hp.weight_decay,
        warmup_steps=hp.warmup_ratio,
        optim=choice.optim,
        # mixed precision: autocast compute, fp32 master weights and optimizer state (spec.precision is
        # already decided by trainer_core/engine/precision.py)
        bf16=spec.precision == "bf16",
        fp16=spec.precision == "fp16",
        use_cpu=not cuda,
        seed=spec.seed,
        data_seed=spec.seed,
        logging_steps=1,
        logging_first_step=True,
        save_strategy="steps" if every else "no",
        save_steps=every or 500,
        # None: the worker deletes each checkpoint once it is stored; the Trainer's own rotation deleted
        # ones the worker had not stored yet whenever uploads ran behind training
        save_total_limit=None,
        eval_strategy="steps" if has_eval and hp.eval_every_steps else "no",
        eval_steps=hp.eval_every_steps,
        report_to="none",
        logging_nan_inf_filter=False,  # a NaN loss is shown (DivergenceGuard fails the job), not averaged out
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        ddp_backend=None if world == 1 else ("nccl" if cuda else "gloo"),
        # The Trainer scales each rank's loss by the world size, assuming the model divides a summed loss
        # by the tokens of the whole global batch. The causal-LM losses do; a classifier's loss is already a
        # mean, and scaling it would double the loss and the gradients on 2 processes. So is a method's own
        # loss (DPO's: a mean over the pairs).
        average_tokens_across_devices=spec.task_info.token_loss and not spec.method_info.own_loss,
        ddp_timeout=spec.distributed_timeout_seconds,
        deepspeed=zero1_config(spec) if spec.distributed.strategy == "zero1" and world > 1 else None,
    )


def zero1_config(spec: TrainingSpec) -> dict[str, Any]:
    """DeepSpeed ZeRO stage 1: optimizer states sharded over the ranks. `torch_adam` keeps DeepSpeed from
    compiling its CPU Adam; "auto" takes batch, accumulation, learning rate and clipping from the Trainer."""
    return {
        "zero_optimization": {"stage": 1},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "bf16": {"enabled": spec.precision == "bf16"},
        "fp16": {"enabled": spec.precision == "fp16"},
    }


def supervised_trainer(
    spec: TrainingSpec,
    choice: BackendChoice,
    loaded: Any,
    train: Store,
    valid: Store | None,
    events: EventStream,
    *,
    cuda: bool,
    ort_module: Any = None,
    stop: StopOnRequest | None = None,
) -> Any:
    """The supervised method's Trainer (MethodInfo.trainer): an ORTTrainer, or the task's own subclass."""
    model, tokenizer = loaded.model, loaded.tokenizer
    args = training_arguments(spec, choice, cuda=cuda, has_eval=valid is not None)
    hp = spec.hyperparameters
    collator = collator_for(spec, tokenizer, train)
    train_set: Any = train
    if spec.packing:
        assert isinstance(train, TokenStore)  # the spec allows packing only where the loss is on tokens
        train_set, collator = _packed(spec, train, tokenizer, events)
    # bucketed by the global batch: accelerate cuts each into the ranks' parts
    sampler = BucketSampler(train_set.lengths, hp.batch_size, spec.seed)
    extra: dict[str, Any] = {}
    cls: Any = ORTTrainer
    if spec.task_info.trainer is not None:
        cls, extra = spec.task_info.load("trainer")(tokenizer, valid, collator)
    return cls(
        ort_module=ort_module,
        train_sampler=sampler,
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=valid,
        data_collator=collator,
        # saved into every checkpoint: a checkpoint is then a model a later job can start from
        processing_class=tokenizer,
        compute_metrics=accuracy if spec.task_info.classifies else None,
        callbacks=_callbacks(spec, events, collator, stop),
        **extra,
    )


def collator_for(spec: TrainingSpec, tokenizer: Any, store: Any) -> Any:
    """What makes the model's batches: padding token ids, or the processor's last steps over media."""
    if spec.task_info.media is not None:
        return mediastore.MediaCollator(tokenizer, store.media)
    return Collator(tokenizer.pad_token_id, classifies=spec.task_info.classifies)


def _callbacks(
    spec: TrainingSpec, events: EventStream, collator: Any, stop: StopOnRequest | None
) -> list[Any]:
    """What every method's trainer reports through: its events, the checkpoint floor, and a stop."""
    hp = spec.hyperparameters
    return [
        EventCallback(events, hp.batch_size * hp.gradient_accumulation_steps, collator.padding_fraction),
        CheckpointPacing(spec.min_checkpoint_seconds, events),
        DivergenceGuard(spec.precision),
        *([stop] if stop else []),  # after the pacing: a pause's checkpoint is always taken
    ]


def _packed(
    spec: TrainingSpec, train: TokenStore, tokenizer: Any, events: EventStream
) -> tuple[Packed, Collator]:
    """The training rows packed into sequences up to the job's length (evaluation stays unpacked, so its
    loss reads as any other job's)."""
    from trainer_core.data.prepare import seq_limit

    capacity = seq_limit(spec, tokenizer)
    packed = Packed(train, capacity)
    fill = float(packed.lengths.sum()) / max(1, len(packed) * capacity)
    events.message(
        f"packed {len(train):,} rows into {len(packed):,} sequences of up to {capacity} tokens "
        f"({fill:.0%} full)",
        rows=len(train),
        sequences=len(packed),
        fill=round(fill, 4),
    )
    return packed, PackedCollator(tokenizer.pad_token_id)


def dpo_trainer(
    spec: TrainingSpec,
    choice: BackendChoice,
    loaded: Any,
    train: TokenStore,
    valid: TokenStore | None,
    events: EventStream,
    *,
    cuda: bool,
    ort_module: Any = None,
    stop: StopOnRequest | None = None,
) -> Any:
    """The dpo method's Trainer (MethodInfo.trainer): TRL's DPOTrainer over the preference stores
    (methods/dpo.py). ORTModule never runs it (MethodInfo.ort_problem), so `ort_module` is unused."""
    from trl import DPOConfig

    from trainer_core.methods import dpo
    from trainer_core.spec import Dpo

    assert isinstance(spec.method, Dpo)
    model, tokenizer = loaded.model, loaded.tokenizer
    hp = spec.hyperparameters
    args = DPOConfig(
        beta=spec.method.beta,
        max_length=None,  # the store is cut at max_seq_length already, pairs whose answers were cut left out
        precompute_ref_log_probs=False,
        **common_arguments(spec, choice, cuda=cuda, has_eval=valid is not None),
    )
    stores = {"train": train} | ({"valid": valid} if valid is not None else {})
    collator = dpo.PairCollator(tokenizer.pad_token_id, stores)
    return dpo.trainer_class()(
        model=model,
        ref_model=dpo.reference(model),
        args=args,
        data_collator=collator,
        train_dataset=dpo.index("train", train),
        eval_dataset=dpo.index("valid", valid) if valid is not None else None,
        processing_class=tokenizer,
        train_sampler=BucketSampler(dpo.pair_lengths(train), hp.batch_size, spec.seed),
        callbacks=_callbacks(spec, events, collator, stop),
    )
