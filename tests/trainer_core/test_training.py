"""trainer_core on its own: no web/DB/queue imports, strict spec, row checks, a run by hand."""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.support import DEMO, ROOT, launch_trainer, preference_rows, write_jsonl
from trainer_core.data import rows
from trainer_core.spec import Hyperparameters, TrainingSpec

FORBIDDEN = {
    "fastapi",
    "starlette",
    "sqlalchemy",
    "alembic",
    "celery",
    "kombu",
    "redis",
    "psycopg",
    "boto3",
    "botocore",
    "uvicorn",
    "ortune",
    "api",
    "worker",
}


def test_trainer_core_imports_no_web_db_or_queue_library() -> None:
    for path in (ROOT / "trainer_core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
    # and at run time nothing pulls the service's stack in indirectly (transformers may import botocore)
    runtime = sorted(FORBIDDEN - {"boto3", "botocore"})
    probe = (
        "import sys, trainer_core.engine.launch, trainer_core.engine.trainer, trainer_core.export, "
        "trainer_core.models.registry;"
        f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({runtime!r}));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_spec_and_validation_modules_load_no_torch() -> None:
    probe = "import sys, "
    probe += "trainer_core.spec, trainer_core.data.rows, trainer_core.models.registry; "
    probe += "sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT).returncode == 0


def test_spec_rejects_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="lr"):
        Hyperparameters.model_validate({"lr": 0.1})
    with pytest.raises(ValidationError, match="at least two distinct labels"):
        TrainingSpec.model_validate(
            {
                "job_id": "j",
                "task": "sequence-classification",
                "model": "tiny-bert",
                "train_file": "x",
                "output_dir": "o",
                "labels": ["a"],
                "hyperparameters": Hyperparameters().resolved(10).model_dump(),
            }
        )


def test_auto_hyperparameters_resolve() -> None:
    hp = Hyperparameters(learning_rate=1e-4, learning_rate_multiplier=2.0).resolved(n_rows=400)
    assert (hp.n_epochs, hp.batch_size, hp.learning_rate) == (3, 16, 2e-4)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"text": "a", "label": true}\n', "line 1: 'label' must be a non-empty string or an integer"),
        ("[1, 2]\n", "line 1: a row must be a JSON object"),
        ('{"prompt": "p"}\n', "line 1: missing required field 'completion'"),
        ('{"text": "a", "extra": 1}\n{"text": "b"}\n', "unexpected field(s) extra"),
        ('{"messages": []}\n', "'messages' must be a non-empty list"),
        (
            '{"messages": [{"role": "user", "content": "a", "weight": 0}]}\n',
            "line 1: messages[0].weight is only for assistant messages",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, '
            '{"role": "assistant", "content": "b", "weight": 2}]}\n',
            "line 1: messages[1].weight must be 0 or 1",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, '
            '{"role": "assistant", "content": "b", "weight": 0}]}\n',
            "line 1: a chat row needs an assistant message to learn from (one without weight 0)",
        ),
        (
            '{"input": {"messages": [{"role": "user", "content": "q"}]}, "preferred_output": '
            '[{"role": "assistant", "content": "a"}]}\n',
            "line 1: no supported fields",
        ),
        (
            '{"input": [], "preferred_output": [{"role": "assistant", "content": "a"}], '
            '"non_preferred_output": [{"role": "assistant", "content": "b"}]}\n',
            "line 1: 'input' must be an object with 'messages'",
        ),
        (
            '{"input": {"messages": [{"role": "user", "content": "q"}], "tools": []}, "preferred_output": '
            '[{"role": "assistant", "content": "a"}], "non_preferred_output": [{"role": "assistant", '
            '"content": "b"}]}\n',
            "line 1: unsupported field(s) tools in 'input'",
        ),
        (
            '{"input": {"messages": [{"role": "user", "content": "q"}]}, "preferred_output": '
            '[{"role": "user", "content": "a"}], "non_preferred_output": [{"role": "assistant", '
            '"content": "b"}]}\n',
            "line 1: preferred_output[0].role must be assistant",
        ),
        (
            '{"input": {"messages": [{"role": "user", "content": "q"}]}, "preferred_output": '
            '[{"role": "assistant", "content": "a"}], "non_preferred_output": [{"role": "assistant", '
            '"content": "a"}]}\n',
            "line 1: preferred_output and non_preferred_output are the same: nothing to prefer",
        ),
        (
            '{"input": {"messages": [{"role": "user", "content": "q"}]}, "preferred_output": '
            '[{"role": "assistant", "content": "a", "weight": 0}], "non_preferred_output": '
            '[{"role": "assistant", "content": "b"}]}\n',
            "line 1: preferred_output[0].weight is only for a chat row's assistant messages",
        ),
    ],
)
def test_row_errors(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text(text)
    report = rows.check_file(path, "jsonl", max_rows=10)
    assert not report.ok and fragment in (report.details() or "")


def test_csv_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "f.csv"
    path.write_text("text,label\nok,a\n,b\nx,y,z\n")
    details = rows.check_file(path, "csv", max_rows=10).details() or ""
    assert "line 3: missing required field 'text'" in details
    assert "line 4: more values than header columns" in details


def test_error_report_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text("nope\n" * 50)
    report = rows.check_file(path, "jsonl", max_rows=100)
    assert report.error_count == 50 and "and 40 more" in (report.details() or "")


def demo_file(tmp: Path, n: int) -> Path:
    """The demo's first `n` training rows as a JSONL file of the test's own."""
    lines = (DEMO / "sentiment_train.jsonl").read_text().splitlines()[:n]
    return write_jsonl(tmp / "t.jsonl", [json.loads(x) for x in lines])


def tiny_causal_lm(directory: Path, tokenizer: Any, shape: str = "llama") -> None:
    """A tiny Llama- or Qwen2-shaped model built from a config (seeded), saved with `tokenizer` as a local
    model directory: what a team's own base model looks like to the registry."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config, cls = (LlamaConfig, LlamaForCausalLM) if shape == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    size = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    cls(config(**size, **heads)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def test_launch_by_hand_emits_json_lines(tmp_path: Path) -> None:
    train = demo_file(tmp_path, 32)
    spec = TrainingSpec(
        job_id="ftjob-hand",
        task="sequence-classification",
        model="tiny-bert",
        train_file=str(train),
        labels=["negative", "positive"],
        output_dir=str(tmp_path / "out"),
        hyperparameters=Hyperparameters(max_steps=2, batch_size=8).resolved(32),
        backend="torch",
    )
    code, events, stderr = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, stderr
    kinds = [e["type"] for e in events]
    assert "backend" in kinds and kinds[-1] == "result"
    assert {"metrics", "artifact", "progress"} <= set(kinds)
    assert (tmp_path / "out" / "pytorch" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "onnx" / "model.onnx").is_file()


def test_a_failed_onnx_export_costs_that_artifact_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export fails (as a model torch.onnx cannot trace, or a parity check, would): training succeeded,
    so the PyTorch model is reported and the result says which format failed and why, instead of an error
    that failed a finished job."""
    from trainer_core import export
    from trainer_core.engine import launch
    from trainer_core.events import EventStream

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise export.ExportError("ONNX logits differ from PyTorch by 0.5 (tolerance 0.001)")

    monkeypatch.setattr(export, "export_onnx", refuse)
    train = demo_file(tmp_path, 32)
    spec = launch.with_stores(
        TrainingSpec(
            job_id="ftjob-export",
            task="sequence-classification",
            model="tiny-bert",
            train_file=str(train),
            labels=["negative", "positive"],
            output_dir=str(tmp_path / "out"),
            hyperparameters=Hyperparameters(max_steps=2, batch_size=8, max_seq_length=32).resolved(32),
            backend="torch",
        )
    )
    out = io.StringIO()
    launch.run(spec, EventStream(out))
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["format"] for e in events if e["type"] == "artifact"] == ["pytorch"]
    result = events[-1]
    assert result["type"] == "result" and result["onnx_max_abs_diff"] is None
    assert result["failed_artifacts"] == {"onnx": "ONNX logits differ from PyTorch by 0.5 (tolerance 0.001)"}
    assert any(e["type"] == "message" and "keeps its PyTorch model" in e["message"] for e in events)


def test_launch_reports_a_spec_that_cannot_run(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}])
    spec = TrainingSpec(
        job_id="ftjob-fp16",
        task="sequence-classification",
        model="tiny-bert",
        train_file=str(train),
        labels=["x", "y"],
        output_dir=str(tmp_path / "out"),
        hyperparameters=Hyperparameters(max_steps=1).resolved(2),
        backend="torch",
        precision="fp16",
    )
    code, events, _ = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 2
    error = events[-1]
    assert error["type"] == "error" and "fp16 needs a CUDA GPU" in error["message"]


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    from trainer_core.models import modeling, registry

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"pickle")
    info = registry.resolve("m", tmp_path)
    spec = TrainingSpec(
        job_id="j",
        task="causal-lm",
        model="m",
        model_path=str(info.path),
        train_file="x",
        output_dir="o",
        hyperparameters=Hyperparameters().resolved(1),
    )
    with pytest.raises(modeling.ModelLoadError, match="pickled weights are refused"):
        modeling.load(info, spec, ["text"])


def test_registry_loads_a_local_directory(tmp_path: Path) -> None:
    """A hub-layout directory under ORTUNE_MODELS_DIR loads through the real from_pretrained path."""
    import shutil

    from trainer_core.models import modeling, registry

    src = registry.resolve("sentence-transformers/all-MiniLM-L6-v2").path
    assert src is not None
    shutil.copytree(src, tmp_path / "acme" / "minilm")
    info = registry.resolve("acme/minilm", tmp_path)
    assert info.source == "local"
    spec = TrainingSpec(
        job_id="j",
        task="sequence-classification",
        model="acme/minilm",
        model_path=str(info.path),
        train_file="x",
        output_dir="o",
        labels=["a", "b", "c"],
        hyperparameters=Hyperparameters().resolved(1),
    )
    loaded = modeling.load(info, spec, [])
    assert loaded.model.config.num_labels == 3 and loaded.model.training


@pytest.mark.parametrize("shape", ["llama", "qwen2"])
def test_a_hugging_face_cache_is_a_registry_and_its_chat_template_is_used(tmp_path: Path, shape: str) -> None:
    """A tiny Llama- or Qwen2-shaped model built from a config, with a tokenizer carrying a chat template,
    saved in the hub cache layout (models--org--name/snapshots/<rev>, refs/main): found under the hub's id,
    loaded through from_pretrained, and its own template (not the default) renders the chat rows."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    from trainer_core.data import chat, prepare
    from trainer_core.models import modeling, registry

    texts = [f"<|im_start|>user\nsay {w}<|im_end|>\n<|im_start|>assistant\n{w}<|im_end|>\n" for w in "abcdef"]
    tokenizer = modeling.train_tokenizer("tiny-gpt2", texts * 20)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = (  # ChatML with upper-case roles: unlike the default, so its use shows
        chat.DEFAULT_TEMPLATE.replace("{{ m['role'] }}", "{{ m['role'] | upper }}").replace(
            "<|im_start|>assistant", "<|im_start|>ASSISTANT"
        )
    )
    cls = LlamaForCausalLM if shape == "llama" else Qwen2ForCausalLM
    cache = tmp_path / "hub" / f"models--acme--tiny-{shape}"
    snapshot = cache / "snapshots" / "0123abcd"
    tiny_causal_lm(snapshot, tokenizer, shape)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("0123abcd")

    info = registry.resolve(f"acme/tiny-{shape}", tmp_path)
    assert (info.source, info.path) == ("local", snapshot)
    assert f"acme/tiny-{shape}" in [m.id for m in registry.list_models(tmp_path)]
    spec = TrainingSpec(
        job_id="j",
        task="causal-lm",
        model=f"acme/tiny-{shape}",
        model_path=str(info.path),
        train_file="x",
        output_dir="o",
        hyperparameters=Hyperparameters().resolved(1, "causal-lm"),
    )
    loaded = modeling.load(info, spec, [])
    assert type(loaded.model) is cls and loaded.model.training
    own = prepare._tokenizer(spec, tmp_path / "unused")
    ids, loss = chat.encode(
        own, [{"role": "user", "content": "say a"}, {"role": "assistant", "content": "a"}], 64
    )
    text = own.decode(ids)
    assert text.startswith("<|im_start|>USER\n") and "<|im_start|>ASSISTANT\n" in text  # its own template
    assert own.decode([t for t, c in zip(ids, loss, strict=True) if c]) == "a<|im_end|>\n"


@pytest.mark.parametrize("model", ["tiny-bert", "tiny-gpt2"])
def test_built_models_are_the_same_for_the_same_seed(model: str) -> None:
    """Same data and seed, same tokenizer and weights: tokenizers' WordPieceTrainer broke this once."""
    import torch

    from trainer_core.models import modeling, registry

    texts = [json.loads(x)["text"] for x in (DEMO / "sentiment_train.jsonl").read_text().splitlines()[:48]]
    spec = TrainingSpec(
        job_id="j",
        task="sequence-classification",
        model=model,
        train_file="x",
        output_dir="o",
        labels=["negative", "positive"],
        hyperparameters=Hyperparameters().resolved(48),
    )
    builds = []
    for _ in range(3):
        torch.manual_seed(0)
        builds.append(modeling.load(registry.resolve(model), spec, texts))
    first = builds[0]
    assert len(first.tokenizer) > 100
    if model == "tiny-bert":  # whole words the data holds stay whole
        assert first.tokenizer.tokenize("The new phone") == ["the", "new", "phone"]
    for other in builds[1:]:
        assert other.tokenizer.get_vocab() == first.tokenizer.get_vocab()
        for (name, a), (_, b) in zip(
            first.model.state_dict().items(), other.model.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), name


def _replica(rank: int, init: str, skew: float, out: Any) -> None:
    """One of two gloo ranks holding the same small model, rank 1's weights moved by `skew`."""
    import torch
    import torch.distributed as dist

    from trainer_core.engine import ranks

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += skew
    vote = ranks.any_rank(rank == 1)  # only rank 1 says yes; both hear it
    try:
        out.put((rank, vote, ranks.check_in_sync(model)))
    except ranks.ReplicasDiverged as exc:
        out.put((rank, vote, str(exc)))
    dist.destroy_process_group()


@pytest.mark.parametrize(("skew", "in_sync"), [(0.0, True), (1e-3, False)])
def test_ranks_vote_together_and_replicas_that_trained_apart_are_caught(
    tmp_path: Path, skew: float, in_sync: bool
) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_replica, args=(r, init, skew, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [vote for _, vote, _ in results] == [True, True]
    for _, _, found in results:
        if in_sync:
            assert found == 0.0
        else:
            assert isinstance(found, str) and "rank(s) [1] hold parameters that differ from rank 0's" in found


def test_a_lora_job_trains_an_adapter_that_on_its_base_gives_the_merged_models_logits(tmp_path: Path) -> None:
    """LoRA on a local Llama-shaped base, trained by ORTModule over the PEFT model: only the adapter trains,
    the loss falls, and three artifacts come out: the adapter, the merged model (`pytorch`) and its ONNX. The
    adapter loaded on the base with PEFT gives the merged model's logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer_core.models import modeling
    from trainer_core.spec import Lora

    texts = [
        f"<|im_start|>user\nsay {w}<|im_end|>\n<|im_start|>assistant\n{w} {w}<|im_end|>\n" for w in "abcdefgh"
    ]
    tokenizer = modeling.train_tokenizer("tiny-gpt2", texts * 20)
    base = tmp_path / "acme" / "tiny-llama"
    tiny_causal_lm(base, tokenizer)
    chat_rows = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w}"}]}
        for w in "abcdefgh" * 4
    ]
    spec = TrainingSpec(
        job_id="ftjob-lora",
        task="causal-lm",
        model="acme/tiny-llama",
        model_path=str(base),
        train_file=str(write_jsonl(tmp_path / "chat.jsonl", chat_rows)),
        output_dir=str(tmp_path / "out"),
        hyperparameters=Hyperparameters(
            max_steps=12, batch_size=8, learning_rate=5e-3, max_seq_length=64
        ).resolved(32, "causal-lm"),
        lora=Lora(r=4, alpha=8, dropout=0.0),
        backend="ort",  # ORTModule over the PEFT model
        precision="fp32",  # ORT training on CPU is fp32
    )
    code, events, stderr = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, stderr
    backend = next(e for e in events if e["type"] == "backend")
    assert backend["used"] == "ort" and events[-1]["metrics"]["ort_training_graph_nodes"] > 50
    formats = {e["format"]: e["manifest"] for e in events if e["type"] == "artifact"}
    assert list(formats) == ["adapter", "pytorch", "onnx"]
    assert 0 < formats["adapter"]["trainable_parameters"] < formats["adapter"]["total_parameters"] / 5
    losses = [e["train_loss"] for e in events if e["type"] == "metrics" and "train_loss" in e]
    assert losses[-1] < losses[0]

    ids = torch.tensor([tokenizer("<|im_start|>user\nsay c<|im_end|>\n")["input_ids"]])
    on_base = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), tmp_path / "out" / "adapter"
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "pytorch")
    with torch.no_grad():
        a, b = on_base.eval()(ids).logits, merged.eval()(ids).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_gradient_checkpointing_trains_the_same_steps(tmp_path: Path) -> None:
    """Recomputing activations in the backward pass (dropout masks replayed) gives the losses of a run that
    kept them; the job's backend says why it is PyTorch."""
    train = demo_file(tmp_path, 48)

    def losses(checkpointing: bool) -> tuple[list[float], dict[str, Any]]:
        spec = TrainingSpec(
            job_id="ftjob-gc",
            task="causal-lm",
            model="tiny-gpt2",
            train_file=str(train),
            output_dir=str(tmp_path / f"out-{checkpointing}"),
            hyperparameters=Hyperparameters(
                max_steps=6, batch_size=8, learning_rate=1e-3, gradient_checkpointing=checkpointing
            ).resolved(48, "causal-lm"),
            precision="fp32",
        )
        code, events, stderr = launch_trainer(spec, tmp_path / f"spec-{checkpointing}.json")
        assert code == 0, stderr
        backend = next(e for e in events if e["type"] == "backend")
        result = events[-1]
        assert result["metrics"].get("gradient_checkpointing") == (1.0 if checkpointing else None)
        return [e["train_loss"] for e in events if e["type"] == "metrics" and "train_loss" in e], backend

    kept, _ = losses(False)
    recomputed, backend = losses(True)
    assert len(kept) == 6 and kept == pytest.approx(recomputed, rel=1e-4)
    assert backend["used"] == "torch" and "gradient checkpointing runs under PyTorch" in backend["reason"]


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
def test_dpo_raises_the_preference_accuracy_on_held_out_pairs(tmp_path: Path, adapter: bool) -> None:
    """DPO through TRL on a local tiny Llama, full or LoRA (the base with the adapter off is the reference):
    on held-out pairs asked in other words, the share the model itself ranks the preferred answer first rises;
    the events carry TRL's reward margins and accuracies; the backend says why PyTorch; the model comes out as
    for supervised jobs."""
    from trainer_core.models import modeling
    from trainer_core.spec import Dpo, Lora

    train_rows, valid_rows = preference_rows(48), preference_rows(12, held_out=True)
    tokenizer = modeling.train_tokenizer("tiny-gpt2", [prepare_text(r) for r in train_rows + valid_rows] * 10)
    base = tmp_path / "acme" / "tiny-llama"
    tiny_causal_lm(base, tokenizer)
    spec = TrainingSpec(
        job_id="ftjob-dpo",
        task="causal-lm",
        model="acme/tiny-llama",
        model_path=str(base),
        train_file=str(write_jsonl(tmp_path / "pairs.jsonl", train_rows)),
        validation_file=str(write_jsonl(tmp_path / "held-out.jsonl", valid_rows)),
        output_dir=str(tmp_path / "out"),
        hyperparameters=Hyperparameters(
            n_epochs=3, batch_size=8, learning_rate=5e-2 if adapter else 1e-2, max_seq_length=64
        ).resolved(48, "causal-lm"),
        method=Dpo(beta=0.1),
        lora=Lora(r=8, alpha=16, dropout=0.0) if adapter else None,
    )
    code, events, stderr = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, stderr
    backend = next(e for e in events if e["type"] == "backend")
    assert backend["used"] == "torch" and "DPO trains under PyTorch" in backend["reason"]
    metrics = [e for e in events if e["type"] == "metrics"]
    before = next(m for m in metrics if "eval_preference_accuracy" in m)
    result = events[-1]["metrics"]
    assert before["step"] == 0 and abs(before["eval_reward_margin"]) < 1e-3  # the policy is its reference
    # against the reference, on held-out pairs (TRL's measure): every pair moved the right way
    assert result["eval_reward_accuracy"] >= 0.9 and result["eval_reward_margin"] > 0, result
    train = [m for m in metrics if "reward_margin" in m]
    assert train[-1]["reward_margin"] > 0 and train[-1]["reward_accuracy"] >= 0.75
    if not adapter:  # the model's own ranking too: a random base prefers the short refusals at first
        assert result["eval_preference_accuracy"] >= before["eval_preference_accuracy"] + 0.3
        assert result["eval_preference_accuracy"] >= 0.9, result
    formats = [e["format"] for e in events if e["type"] == "artifact"]
    assert formats == (["adapter", "pytorch", "onnx"] if adapter else ["pytorch", "onnx"])


def prepare_text(row: dict[str, Any]) -> str:
    from trainer_core.data import prepare

    return prepare._text(row)


@pytest.mark.parametrize("shape", ["llama", "qwen2", "gpt2"])
def test_a_causal_lm_exports_with_its_kv_cache_and_generates_pytorchs_tokens(
    tmp_path: Path, shape: str
) -> None:
    """The ONNX decoder takes and returns the KV cache in the layout ONNX Runtime's generation tooling reads
    (genai_config.json names it); decoding with it token by token gives PyTorch's greedy tokens, recorded in
    the manifest; a divergence fails the export with the prompt and the tokens."""
    import onnxruntime as ort
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer_core import export
    from trainer_core.export import decoder as export_decoder
    from trainer_core.models import modeling

    texts = [f"the {w} jumps over the lazy {v} again and again" for w in "abcd" for v in "wxyz"]
    tokenizer = modeling.train_tokenizer("tiny-gpt2", texts * 5)
    if shape == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2))
    else:
        tiny_causal_lm(tmp_path / "base", tokenizer, shape)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    manifest = export_decoder.export_texts(model, tokenizer, tmp_path / "onnx", texts, {}, max_len=64)
    assert manifest["kv_cache"] is True and manifest["outputs"][:2] == ["logits", "present.0.key"]
    greedy = manifest["greedy_parity"]
    assert greedy["prompts"] == 4 and greedy["identical"] + greedy["ties"] == 4 and greedy["diverged"] == []
    genai = json.loads((tmp_path / "onnx" / "genai_config.json").read_text())["model"]["decoder"]
    assert genai["inputs"]["past_key_names"] == "past_key_values.%d.key" and genai["num_hidden_layers"] == 2
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"))
    past = {i.name: i.shape for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    assert len(past) == 4 and all(s[2] == "past_sequence" for s in past.values())

    def off_by_one(session: Any, shape: Any, prompt: list[int], n: int) -> list[int]:
        return [(t + 1) % len(tokenizer) for t in real(session, shape, prompt, n)]

    real = export_decoder._onnx_greedy
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_decoder, "_onnx_greedy", off_by_one)
        with pytest.raises(export.ExportError, match="greedy generation differs from PyTorch's on 4 of 4"):
            export_decoder.export_texts(model, tokenizer, tmp_path / "onnx2", texts, {}, max_len=64)


@pytest.mark.parametrize("shape", ["llama", "qwen2", "gpt2"])
def test_packed_rows_do_not_see_each_other(tmp_path: Path, shape: str) -> None:
    """Three rows packed into one sequence (and a padded second sequence) give every row exactly the logits
    it has alone, and the loss of the rows alone: no row attends to another, and no row's first token is
    predicted from the row before it."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from trainer_core.data import batches
    from trainer_core.models import modeling

    texts = ["one two three four five", "six seven", "eight nine ten eleven", "twelve"]
    tokenizer = modeling.train_tokenizer("tiny-gpt2", texts * 20)
    if shape == "gpt2":
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2)).eval()
    else:
        tiny_causal_lm(tmp_path / "base", tokenizer, shape)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    rows = [tokenizer(t)["input_ids"] for t in texts]

    class Store:
        lengths = np.array([len(r) for r in rows])
        meta = None

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": rows[i], "labels": rows[i]}

    packed = batches.Packed(Store(), capacity=int(Store.lengths[:3].sum()))
    assert sorted(r for g in packed.groups for r in g.tolist()) == [0, 1, 2, 3]
    assert max(len(g) for g in packed.groups) >= 3 and len(packed) == 2
    batch = batches.PackedCollator(0)([packed[i] for i in range(len(packed))])
    assert "attention_mask" not in batch
    with torch.no_grad():
        out = model(**batch, use_cache=False)  # as in training (modeling.load): a cache hides the packing
        together = out.logits
        alone = [model(input_ids=torch.tensor([r])).logits[0] for r in rows]
        losses = [model(input_ids=torch.tensor([r]), labels=torch.tensor([r])) for r in rows]
    for b, group in enumerate(packed.groups):
        start = 0
        for row in group.tolist():
            n = len(rows[row])
            torch.testing.assert_close(together[b, start : start + n], alone[row], atol=1e-5, rtol=1e-4)
            start += n
    # the mean over every row's predicted tokens, as the packed batch's own loss counts them
    tokens = sum(len(r) - 1 for r in rows)
    want = sum(float(x.loss) * (len(r) - 1) for x, r in zip(losses, rows, strict=True) if len(r) > 1) / tokens
    assert float(out.loss) == pytest.approx(want, rel=1e-4)


def test_a_packed_job_trains_on_fewer_fuller_sequences(tmp_path: Path) -> None:
    """packing on short prompt/completion rows: the job says how many sequences its rows became, trains
    that many (fewer steps than unpacked), the loss falls, and the backend says why PyTorch."""
    items = [{"prompt": f"{a} plus {b} is", "completion": f" {a + b}"} for a in range(8) for b in range(8)]
    spec = TrainingSpec(
        job_id="ftjob-packed",
        task="causal-lm",
        model="tiny-gpt2",
        train_file=str(write_jsonl(tmp_path / "sums.jsonl", items)),
        validation_file=str(write_jsonl(tmp_path / "held-out.jsonl", items[::8])),  # evaluated unpacked
        output_dir=str(tmp_path / "out"),
        hyperparameters=Hyperparameters(
            n_epochs=4, batch_size=4, learning_rate=3e-3, max_seq_length=64
        ).resolved(64, "causal-lm"),
        packing=True,
    )
    code, events, stderr = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, stderr
    packed = next(e for e in events if e["type"] == "message" and e["message"].startswith("packed 64 rows"))
    sequences = packed["data"]["sequences"]
    assert sequences <= 64 // 8 and packed["data"]["fill"] > 0.8, packed
    assert events[-1]["steps"] == 4 * -(-sequences // 4)  # epochs x batches of packed sequences
    backend = next(e for e in events if e["type"] == "backend")
    assert backend["used"] == "torch" and "packed sequences train under PyTorch" in backend["reason"]
    losses = [e["train_loss"] for e in events if e["type"] == "metrics" and "train_loss" in e]
    assert losses[-1] < losses[0]
    evals = [e["eval_loss"] for e in events if e["type"] == "metrics" and "eval_loss" in e]
    assert evals[-1] < evals[0]


NAN_AT_THIRD_LOSS = """
import torch.nn.functional as F
_cross_entropy, _calls = F.cross_entropy, [0]
def cross_entropy(*args, **kwargs):
    _calls[0] += 1
    out = _cross_entropy(*args, **kwargs)
    return out * float("nan") if _calls[0] == 3 else out
F.cross_entropy = cross_entropy
"""


def test_a_loss_that_is_not_a_number_fails_the_job_at_its_step(tmp_path: Path) -> None:
    """A NaN loss (bf16 overflow, a learning rate too high, a bad kernel) fails the job naming the step and
    the precision; before, the Trainer averaged it out of the logs and the job "succeeded" with NaN weights
    whose ONNX export then failed parity."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(NAN_AT_THIRD_LOSS)
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [json.loads(x) for x in (DEMO / "sentiment_train.jsonl").read_text().splitlines()[:48]],
    )
    spec = TrainingSpec(
        job_id="ftjob-nan",
        task="sequence-classification",
        model="tiny-bert",
        train_file=str(train),
        labels=["negative", "positive"],
        output_dir=str(tmp_path / "out"),
        precision="fp32",
        backend="torch",
        hyperparameters=Hyperparameters(max_steps=6, batch_size=8).resolved(48),
    )
    code, events, stderr = launch_trainer(
        spec, tmp_path / "spec.json", env={"PYTHONPATH": f"{tmp_path / 'hook'}:{ROOT}"}
    )
    assert code != 0, stderr
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "training_diverged", error
    assert error["message"].startswith("training diverged at step 3: its loss is nan (precision fp32")
    assert not any(e["type"] == "artifact" for e in events)  # nothing exported from NaN weights
