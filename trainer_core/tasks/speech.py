"""Speech recognition (Whisper-shaped encoder-decoder models): the processor pair, the tiny built model
with a tokenizer trained on the job's transcriptions, labels, greedy decoding and word error rate.

Greedy decoding here is the reference both for the job's `eval_wer` and for the ONNX export's check: the
encoder runs once per clip and the decoder is fed the transcript so far, step by step, until its end token.
The same loop runs over PyTorch and over ONNX Runtime, so "the same transcript, token for token" compares
engines, not two decoding strategies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

START, END = "<|startoftranscript|>", "<|endoftext|>"
WER_ROWS = 64  # held-out clips transcribed at each evaluation
MAX_NEW_TOKENS = 48


class SpeechProcessor:
    """The feature extractor (log-mel) and the tokenizer of a speech model, saved and loaded together as a
    Hugging Face processor directory holds them."""

    def __init__(self, feature_extractor: Any, tokenizer: Any) -> None:
        self.feature_extractor, self.tokenizer = feature_extractor, tokenizer

    @property
    def sampling_rate(self) -> int:
        return int(self.feature_extractor.sampling_rate)

    @property
    def max_samples(self) -> int:
        return int(self.feature_extractor.n_samples)

    def save_pretrained(self, directory: str | Path, **kw: Any) -> None:
        self.feature_extractor.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    @classmethod
    def from_pretrained(cls, source: str | Path) -> SpeechProcessor:
        from transformers import AutoFeatureExtractor, AutoTokenizer

        kw: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
        return cls(
            AutoFeatureExtractor.from_pretrained(source, **kw), AutoTokenizer.from_pretrained(source, **kw)
        )

    def labels(self, texts: list[str], start: int, limit: int) -> list[list[int]]:
        """Each transcript's target ids, ending with the end token: what the decoder learns to write after
        its start token (a real Whisper tokenizer's own start token is taken off; its language and task
        tokens stay, so a fine-tuned model writes them as the base did)."""
        end = self.tokenizer.convert_tokens_to_ids(END)
        out = []
        for ids in self.tokenizer(texts)["input_ids"]:
            ids = ids[1:] if ids and ids[0] == start else ids
            ids = ids if ids and ids[-1] == end else [*ids, end]
            out.append(ids[: limit - 1] if len(ids) >= limit else ids)
        return out

    def text(self, ids: Iterable[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True)).strip()


def built_processor(transcripts: Iterable[str]) -> SpeechProcessor:
    """tiny-whisper's: 2-second log-mel windows of 80 bins at 16 kHz, and a byte-level BPE tokenizer learnt
    from the transcriptions with Whisper's start and end tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, WhisperFeatureExtractor

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=[END, START], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(transcripts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=START, eos_token=END, pad_token=END)
    features = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=2)
    return SpeechProcessor(features, tokenizer)


def built_model(processor: SpeechProcessor, *, width: int = 64, layers: int = 2, ffn: int = 128) -> Any:
    """Whisper's shape over the processor's 2-second windows: tiny-whisper is width 64, 2 encoder and 2
    decoder layers of 4 heads (bench/train_backends builds a wider one through the same code)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    tok = processor.tokenizer
    start, end = tok.convert_tokens_to_ids(START), tok.convert_tokens_to_ids(END)
    config = WhisperConfig(
        vocab_size=len(tok),
        num_mel_bins=80,
        d_model=width,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_source_positions=processor.feature_extractor.nb_max_frames // 2,
        max_target_positions=64,
        decoder_start_token_id=start,
        bos_token_id=start,
        eos_token_id=end,
        pad_token_id=end,
        suppress_tokens=[],
        begin_suppress_tokens=None,
    )
    return WhisperForConditionalGeneration(config)


def greedy(
    encode: Callable[[np.ndarray], Any],
    decode: Callable[[np.ndarray, Any], np.ndarray],
    features: np.ndarray,
    start: int,
    end: int,
    max_new: int = MAX_NEW_TOKENS,
) -> list[list[int]]:
    """Each clip's transcript ids: `encode(features)` once, then `decode(ids so far, encoded)` -> the last
    position's logits, the likeliest token taken until every clip has written `end` (not returned)."""
    encoded = encode(features)
    ids = np.full((len(features), 1), start, dtype=np.int64)
    done = np.zeros(len(features), dtype=bool)
    for _ in range(max_new):
        logits = np.asarray(decode(ids, encoded))
        step = np.where(done, end, logits.argmax(-1)).astype(np.int64)
        ids = np.concatenate([ids, step[:, None]], axis=1)
        done |= step == end
        if done.all():
            break
    return [[int(t) for t in row[1:] if t != end] for row in ids]


def torch_greedy(model: Any, features: np.ndarray, max_new: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """Greedy transcripts from the PyTorch model (fp32, no grad)."""
    import torch

    config = model.config
    device = next(model.parameters()).device

    def encode(f: np.ndarray) -> Any:
        return model.get_encoder()(torch.as_tensor(f, device=device)).last_hidden_state

    def decode(ids: np.ndarray, encoded: Any) -> np.ndarray:
        out = model(encoder_outputs=(encoded,), decoder_input_ids=torch.as_tensor(ids, device=device))
        return out.logits[:, -1].float().cpu().numpy()

    with torch.no_grad():
        return greedy(encode, decode, features, config.decoder_start_token_id, config.eos_token_id, max_new)


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    import jiwer

    pairs = [(r, h) for r, h in zip(references, hypotheses, strict=True) if r.strip()]
    if not pairs:
        return 0.0
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


def evaluate_wer(model: Any, processor: SpeechProcessor, store: Any, collator: Any) -> float:
    """Greedy transcripts of the first WER_ROWS held-out clips against their transcriptions."""
    rows = [store[i] for i in range(min(len(store), WER_ROWS))]
    batch = collator(rows)
    was_training = model.training
    model.eval()
    try:
        found = torch_greedy(model, batch["input_features"].cpu().numpy())
    finally:
        model.train(was_training)
    references = [processor.text(r["labels"]) for r in rows]
    return word_error_rate(references, [processor.text(ids) for ids in found])


def trainer_setup(tokenizer: Any, valid: Any, collator: Any) -> tuple[Any, dict[str, Any]]:
    """The speech task's Trainer and its extra arguments (TaskInfo.trainer): evaluations transcribe the
    held-out clips for the word error rate."""
    extra = (
        {"wer": lambda model: evaluate_wer(model, tokenizer, valid, collator)} if valid is not None else {}
    )
    return trainer_class(), extra


def trainer_class() -> Any:
    """ORTTrainer whose evaluations also transcribe held-out clips: `eval_wer` beside `eval_loss`."""
    from trainer_core.engine.ort_trainer import ORTTrainer

    class SpeechTrainer(ORTTrainer):
        def __init__(self, *args: Any, wer: Callable[[Any], float] | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.wer = wer

        def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
            out = super().evaluation_loop(*args, **kwargs)
            if self.wer is not None:  # logged with the loss: the metrics dict is logged after this returns
                prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
                assert out.metrics is not None
                out.metrics[f"{prefix}_wer"] = self.wer(self.plain_model)
            return out

    return SpeechTrainer
