"""ORTTrainer: a `transformers.Trainer` whose training forward and backward run in ONNX Runtime.

What Optimum's ORTTrainer did, through the Trainer's hooks only (never a copy of `train()`):

- `_wrap_model` wraps the model with ORTModule for training and makes it, for the length of `train()`, the
  Trainer's `model`. The Trainer hands Accelerate the model only when `_wrap_model` returns `self.model`
  unchanged (otherwise it prepares the optimizer alone and each rank would train on its own shard), so
  Accelerate wraps the ORTModule itself: DDP(ORTModule), DeepSpeedEngine(ORTModule) for ZeRO-1, or nothing in
  one process.
- Evaluation and saving use the plain PyTorch module, which shares its parameters with the ORTModule, so
  checkpoints are ordinary Hugging Face directories whatever the backend.
- `create_optimizer` adds `adamw_ort_fused` (ORT's CUDA FusedAdam).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainingArguments


@dataclass
class ORTTrainingArguments(TrainingArguments):
    """TrainingArguments plus the ORT engine's options."""

    use_ort: bool = field(default=False, metadata={"help": "Run training forward/backward in ORTModule."})
    ort_optim: str | None = field(
        default=None,
        metadata={
            "help": "`adamw_ort_fused` for ORT's FusedAdam (CUDA only); TrainingArguments.optim otherwise."
        },
    )
    ort_log_level: str = field(default="WARNING", metadata={"help": "ORTModule's log level."})


def wrap(model: torch.nn.Module, log_level: str = "WARNING") -> torch.nn.Module:
    """ORTModule(model) with fallback disabled (ort_compat.apply makes that the policy)."""
    from trainer_core.engine import ort_compat

    ort_compat.apply()
    from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule

    options = DebugOptions(log_level=getattr(LogLevel, log_level))
    return ORTModule(model, debug_options=options)


def training_graph_nodes(ort_module: torch.nn.Module) -> int:
    """Nodes in the ONNX training graph ORT built and ran: the proof that ORT, not PyTorch, trained."""
    manager = ort_module._torch_module._execution_manager(True)  # type: ignore[operator,union-attr]
    model = manager._onnx_models.optimized_model
    if model is None or manager._execution_agent is None:
        raise RuntimeError("ORTModule holds no training graph: ORT did not run")
    return len(model.graph.node)


class ORTTrainer(Trainer):
    def __init__(
        self,
        *args: Any,
        ort_module: torch.nn.Module | None = None,
        train_sampler: torch.utils.data.Sampler[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.ort_module = ort_module
        self.job_sampler = train_sampler
        self.plain_model: torch.nn.Module = self.model  # type: ignore[assignment]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self.model = self.plain_model  # whatever ran, the caller gets the PreTrainedModel back

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler[int] | None:
        # the job's own sampler (length-bucketed, resumable by seed and epoch) where one was given
        return self.job_sampler or super()._get_train_sampler(train_dataset)

    def _wrap_model(
        self, model: torch.nn.Module, training: bool = True, dataloader: Any = None
    ) -> torch.nn.Module:
        args: ORTTrainingArguments = self.args  # type: ignore[assignment]
        if not training:  # evaluation runs in PyTorch
            plain = self.plain_model if model is self.ort_module else model
            return super()._wrap_model(plain, False, dataloader)
        if not args.use_ort:
            return super()._wrap_model(model, training, dataloader)
        if model is not self.plain_model:
            return model  # already wrapped: the ORTModule, or DDP or DeepSpeed around it
        if self.ort_module is None:
            self.ort_module = wrap(model, args.ort_log_level)
        self.model = self.ort_module  # returned as `self.model`, so Accelerate wraps it (see above)
        return self.ort_module

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        model, self.model = self.model, self.plain_model  # save_pretrained of the model, not ORTModule's
        try:
            super()._save(output_dir, state_dict)
        finally:
            self.model = model

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        args: ORTTrainingArguments = self.args  # type: ignore[assignment]
        if args.ort_optim != "adamw_ort_fused" or self.optimizer is not None:
            return super().create_optimizer(model)
        from onnxruntime.training.optim import FusedAdam

        target: torch.nn.Module = model if model is not None else self.model  # type: ignore[assignment]
        decay = set(self.get_decay_parameter_names(target))
        groups = [
            {
                "params": [p for n, p in target.named_parameters() if n in decay and p.requires_grad],
                "weight_decay": args.weight_decay,
            },
            {
                "params": [p for n, p in target.named_parameters() if n not in decay and p.requires_grad],
                "weight_decay": 0.0,
            },
        ]
        self.optimizer = FusedAdam(
            groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon
        )
        return self.optimizer
