"""Load a base model and its tokenizer from the registry, or build a tiny one for the job's own data."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trainer_core.models.registry import ModelInfo
from trainer_core.spec import TrainingSpec


class ModelLoadError(RuntimeError):
    pass


@dataclass
class Loaded:
    model: Any
    tokenizer: Any


def train_tokenizer(kind: str, texts: Iterable[str]) -> Any:
    """A tokenizer for a built model, learnt from `texts` (deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "tiny-bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        # tokenizers 0.23 learns a different vocabulary on every run (ids and even size) whenever a
        # continuing-subword prefix is set, WordPieceTrainer included; that broke "same seed, same model".
        # Plain BpeTrainer is deterministic, so learn its pieces and give WordPiece each piece in both forms,
        # word-initial and "##"-continuation, in BPE's id order.
        normalizer = normalizers.BertNormalizer(lowercase=True)
        pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
        bpe.normalizer, bpe.pre_tokenizer = normalizer, pre_tokenizer
        bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=specials))
        pieces = [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1]) if t not in specials]
        vocab = {t: i for i, t in enumerate(specials + pieces + [f"##{p}" for p in pieces])}
        tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
        tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
        tok.decoder = decoders.WordPiece()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
            model_input_names=["input_ids", "attention_mask"],
        )
    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=2000, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=eos,
        eos_token=eos,
        pad_token=eos,
        model_input_names=["input_ids", "attention_mask"],
    )


def _build(info: ModelInfo, spec: TrainingSpec, tokenizer: Any, label_kw: dict[str, Any]) -> Loaded:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
        GPT2LMHeadModel,
    )

    positions = max(256, spec.hyperparameters.max_seq_length)
    if info.id == "tiny-bert":
        bert = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=positions,
            pad_token_id=tokenizer.pad_token_id,
            **label_kw,
        )
        return Loaded(BertForSequenceClassification(bert), tokenizer)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=positions,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **label_kw,
    )
    if spec.task_info.classifies:
        return Loaded(GPT2ForSequenceClassification(config), tokenizer)
    return Loaded(GPT2LMHeadModel(config), tokenizer)


def load(
    info: ModelInfo,
    spec: TrainingSpec,
    texts: Iterable[str] = (),
    *,
    tokenizer: Any = None,
    attn_implementation: str = "sdpa",
) -> Loaded:
    """The model in train mode and its tokenizer. Never trust_remote_code; weights from safetensors only.

    A built model takes `tokenizer` (the one its data was tokenized with) or learns one from `texts`."""
    label_kw: dict[str, Any] = {}
    if spec.task_info.classifies:
        names = [str(label) for label in spec.labels]
        label_kw = {
            "num_labels": len(names),
            "id2label": dict(enumerate(names)),
            "label2id": {n: i for i, n in enumerate(names)},
        }
    if info.source == "built":
        loaded = _built(info, spec, tokenizer, texts, label_kw)
        loaded.model.config._attn_implementation = attn_implementation
    else:
        loaded = _local(info, spec, tokenizer, label_kw, attn_implementation)
    # No KV cache while training: it is useless there, and ORTModule cannot flatten a DynamicCache output.
    if hasattr(loaded.model.config, "use_cache"):
        loaded.model.config.use_cache = False
    if spec.lora is not None:
        loaded = Loaded(with_lora(loaded.model, spec), loaded.tokenizer)
    # from_pretrained returns eval mode; training (and ORTModule's training graph) needs train mode.
    loaded.model.train()
    return loaded


def _built(
    info: ModelInfo, spec: TrainingSpec, tokenizer: Any, texts: Iterable[str], label_kw: Any
) -> Loaded:
    """A tiny model built from a config: text models learn a tokenizer from `texts` unless given one; media
    models take their processor as `tokenizer`."""
    if info.id == "tiny-whisper":
        from trainer_core.tasks import speech

        return Loaded(speech.built_model(tokenizer), tokenizer)
    if info.id in ("tiny-vit", "tiny-audio"):
        return Loaded(_build_media(info.id, label_kw), tokenizer)
    return _build(info, spec, tokenizer or train_tokenizer(info.id, texts), label_kw)


def _local(info: ModelInfo, spec: TrainingSpec, tokenizer: Any, label_kw: Any, attention: str) -> Loaded:
    """A local directory through transformers' own loading, safetensors only, in fp32."""
    import torch
    from transformers import AutoTokenizer

    assert info.path is not None
    if not (info.path / "model.safetensors").is_file() and not any(info.path.glob("*.safetensors")):
        raise ModelLoadError(
            f"{info.id}: no safetensors weights in {info.path} (pickled weights are refused)"
        )
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(
        info.path, local_files_only=True, trust_remote_code=False
    )
    model = _auto(spec.task).from_pretrained(
        info.path,
        local_files_only=True,
        trust_remote_code=False,
        use_safetensors=True,
        attn_implementation=attention,
        # fp32 master weights whatever the checkpoint's dtype: transformers 5 would keep a bf16
        # checkpoint in bf16 and train it, Adam states included, in pure bf16; precision decides compute
        dtype=torch.float32,
        # a pretrained classifier's head (ImageNet's 1000 classes) gives way to one for these labels
        ignore_mismatched_sizes=bool(label_kw) and spec.task_info.media is not None,
        **label_kw,
    )
    if getattr(tokenizer, "pad_token", "") is None:  # a text model's tokenizer (not a processor)
        tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
    return Loaded(model, tokenizer)


def from_directory(directory: Any, task: str) -> Any:
    """A saved model (ours: safetensors, no remote code) in fp32 eval mode."""
    import torch

    model = _auto(task).from_pretrained(
        directory, local_files_only=True, trust_remote_code=False, use_safetensors=True, dtype=torch.float32
    )
    return model.eval()


def _auto(task: str) -> Any:
    import transformers

    from trainer_core import tasks

    return getattr(transformers, tasks.get(task).auto_class)


def _build_media(model_id: str, label_kw: dict[str, Any]) -> Any:
    """tiny-vit (32x32 images in 8x8 patches) or tiny-audio (a wav2vec2-shaped encoder over 16 kHz audio),
    both 2 layers of width 32: the shapes of real ones, small enough for the tests."""
    from transformers import (
        ViTConfig,
        ViTForImageClassification,
        Wav2Vec2Config,
        Wav2Vec2ForSequenceClassification,
    )

    width: dict[str, Any] = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    width["intermediate_size"] = 64
    if model_id == "tiny-vit":
        return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, **width, **label_kw))
    config = Wav2Vec2Config(
        **width,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 4, 4),
        conv_kernel=(10, 8, 8),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        feat_extract_norm="layer",  # with an attention mask: padded clips in a batch
        do_stable_layer_norm=True,
        classifier_proj_size=32,
        mask_time_prob=0.0,
        layerdrop=0.0,  # a regulariser for deep encoders; with 2 layers it only makes ranks differ
        **label_kw,
    )
    return Wav2Vec2ForSequenceClassification(config)


def with_lora(model: Any, spec: TrainingSpec) -> Any:
    """The model with a LoRA adapter (PEFT): the base frozen, the adapter (and a classifier's new head,
    which PEFT keeps trainable for SEQ_CLS) trained."""
    from peft import LoraConfig, TaskType, get_peft_model

    assert spec.lora is not None
    config = LoraConfig(
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        target_modules=spec.lora.target_modules,
        task_type=TaskType[spec.task_info.peft_task_type],
    )
    return get_peft_model(model, config)
