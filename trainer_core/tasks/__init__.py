"""The task registry: what a job can learn, in one torch-free table that the API, the worker, serve and the
trainer all read. Adding a task is a row here and the modules its row names; nothing else lists tasks or
branches on their names (tests/trainer_core/test_registries.py holds the code to that).

A row says which rows train it, whether it classifies, which Auto class loads it, which exporter family
writes its ONNX artifact and how that artifact is served; the modules it names are imported only when used,
so reading the table costs no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

Media = Literal["image", "audio"]
# How an artifact is used after training: `chat` (/v1/chat/completions, /v1/completions), `predict`
# (/v1/predict over texts), or None: not served yet (its ONNX artifact is for download).
Serving = Literal["chat", "predict"]
DEFAULT_MAX_LENGTH = 128


@dataclass(frozen=True)
class TaskInfo:
    name: str
    row_kinds: tuple[str, ...]  # trainer_core/data/rows.py KINDS or MEDIA_KINDS
    auto_class: str  # the transformers Auto class that loads its models
    exporter: str  # "module:function" writing its ONNX artifact (trainer_core/export*.py)
    max_length: int = DEFAULT_MAX_LENGTH  # max_seq_length when a job does not say
    classifies: bool = False  # trains on a label per row, reports accuracy
    media: Media | None = None  # its rows are archive members, kept in media stores
    lora: bool = False  # LoRA may adapt it (PEFT's task type below)
    peft_task_type: str = "SEQ_CLS"
    serving: Serving | None = None
    # the loss is summed over tokens and divided by the global batch's tokens (the Trainer's
    # average_tokens_across_devices); a classifier's loss is a mean already
    token_loss: bool = False
    default_for: tuple[str, ...] = ()  # the row kinds that train this task when a job names none
    trainer: str | None = None  # "module:function" giving the Trainer subclass and its extra arguments
    built_models: tuple[str, ...] = ()  # tiny models built from a config for it (models/modeling.py)
    pretrained_encoders: bool = False  # packaged sentence encoders (all-MiniLM-L6-v2) fine-tune for it

    def load(self, attribute: str) -> Any:
        """The object a `module:function` field names, imported on first use."""
        module, _, name = str(getattr(self, attribute)).partition(":")
        return getattr(importlib.import_module(module), name)


TASKS: dict[str, TaskInfo] = {
    info.name: info
    for info in (
        TaskInfo(
            "sequence-classification",
            row_kinds=("text_label",),
            auto_class="AutoModelForSequenceClassification",
            exporter="trainer_core.export:export_onnx",
            classifies=True,
            lora=True,
            serving="predict",
            default_for=("text_label",),
            built_models=("tiny-bert", "tiny-gpt2"),
            pretrained_encoders=True,
        ),
        TaskInfo(
            "causal-lm",
            row_kinds=("text", "prompt_completion", "chat", "preference"),
            auto_class="AutoModelForCausalLM",
            exporter="trainer_core.export.decoder:export_onnx",
            max_length=2048,  # chat rows are long
            lora=True,
            peft_task_type="CAUSAL_LM",
            serving="chat",
            token_loss=True,
            default_for=("text", "prompt_completion", "chat", "preference"),
            built_models=("tiny-gpt2",),
        ),
        TaskInfo(
            "image-classification",
            row_kinds=("image_label",),
            auto_class="AutoModelForImageClassification",
            exporter="trainer_core.export.media:export_onnx",
            classifies=True,
            media="image",
            default_for=("image_label",),
            built_models=("tiny-vit",),
        ),
        TaskInfo(
            "audio-classification",
            row_kinds=("audio_label",),
            auto_class="AutoModelForAudioClassification",
            exporter="trainer_core.export.media:export_onnx",
            classifies=True,
            media="audio",
            default_for=("audio_label",),
            built_models=("tiny-audio",),
        ),
        TaskInfo(
            "automatic-speech-recognition",
            row_kinds=("audio_transcription",),
            auto_class="AutoModelForSpeechSeq2Seq",
            exporter="trainer_core.export.speech:export_onnx",
            media="audio",
            default_for=("audio_transcription",),
            trainer="trainer_core.tasks.speech:trainer_setup",
            built_models=("tiny-whisper",),
        ),
    )
}
NAMES: tuple[str, ...] = tuple(TASKS)


class UnknownTask(LookupError):
    pass


def get(name: str) -> TaskInfo:
    try:
        return TASKS[name]
    except KeyError:
        raise UnknownTask(f"unknown task {name!r} (one of {', '.join(NAMES)})") from None


def for_rows(kind: str | None) -> TaskInfo:
    """The task a file's rows train when the job does not say: labels classify, text is a causal LM."""
    for info in TASKS.values():
        if kind in info.default_for:
            return info
    return TASKS["causal-lm"]


def where(**wanted: Any) -> tuple[str, ...]:
    """The names of the tasks whose fields have these values, e.g. `where(classifies=True)`."""
    return tuple(n for n, info in TASKS.items() if all(getattr(info, k) == v for k, v in wanted.items()))
