"""Image and audio archives: the layouts taken, every refusal naming its member or limit, and ORTModule
training the image and audio classifiers as it trains text ones (fallback disabled, losses as PyTorch's)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ortune import media_demo
from tests.support import ROOT
from trainer_core.data import media
from trainer_core.data.rows import Report

LIMITS = media.Limits(members=1000, total_bytes=50 * 2**20, ratio=50.0)


def check(path: Path, task: str | None = None, limits: media.Limits = LIMITS) -> Report:
    fmt = media.archive_format(path.name)
    assert fmt is not None
    return media.check_archive(
        path, fmt, limits=limits, compressed_size=path.stat().st_size, max_rows=10_000, task=task
    )


def zip_of(path: Path, entries: list[tuple[str, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            zf.writestr(name, data)
    return path


def tar_of(path: Path, entries: list[tuple[str, bytes]], link: tuple[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz" if path.name.endswith(".gz") else "w") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            tar.addfile(info)
    return path


def images(n: int = 6) -> list[tuple[str, bytes]]:
    return [(f"{label}/{name}", data) for name, label, data in media_demo.image_rows(n, 0)]


@pytest.mark.parametrize(
    ("name", "layout", "rows"),
    [("a.zip", "folders", media_demo.image_rows), ("a.tar.gz", "metadata", media_demo.audio_rows)],
)
def test_both_layouts_and_archive_formats_are_read(tmp_path: Path, name: str, layout: str, rows: Any) -> None:
    archive = media_demo.write_archive(tmp_path / name, rows(12, 1), layout=layout)
    report = check(archive)
    assert report.ok, report.details()
    image = rows is media_demo.image_rows
    assert report.kind == ("image_label" if image else "audio_label") and report.rows == 12
    assert report.labels == set(media_demo.SHAPES if image else media_demo.PITCHES)


def test_metadata_csv_and_nested_class_folders(tmp_path: Path) -> None:
    rows = media_demo.image_rows(6, 2)
    csv = "file_name,label\n" + "".join(f"{n},{label}\n" for n, label, _ in rows)
    archive = zip_of(
        tmp_path / "a.zip", [(f"set/{n}", d) for n, _, d in rows] + [("set/metadata.csv", csv.encode())]
    )
    report = check(archive)
    assert report.ok and report.rows == 6, report.details()
    nested = zip_of(tmp_path / "b.zip", [(f"shapes/train/{label}/{n}", d) for n, label, d in rows])
    assert check(nested).labels == set(media_demo.SHAPES)


@pytest.mark.parametrize(
    ("member", "said"),
    [
        ("../evil.png", "'..' in a member name is refused"),
        ("circle/../../evil.png", "'..' in a member name is refused"),
        ("/etc/evil.png", "absolute paths are refused"),
        ("C:/evil.png", "absolute paths are refused"),
    ],
)
def test_a_member_that_could_land_outside_is_refused_by_name(tmp_path: Path, member: str, said: str) -> None:
    data = images(1)[0][1]
    for archive in (
        zip_of(tmp_path / "a.zip", [*images(), (member, data)]),
        tar_of(tmp_path / "a.tar", [*images(), (member, data)]),
    ):
        report = check(archive)
        assert not report.ok and report.details() == f"member {member!r}: {said}"


def test_links_are_refused_in_tar_and_zip(tmp_path: Path) -> None:
    report = check(tar_of(tmp_path / "a.tar", images(), link=("circle/link.png", "/etc/passwd")))
    assert report.details() == "member 'circle/link.png': links and special files are refused"
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        info = zipfile.ZipInfo("circle/link.png")
        info.external_attr = 0o120777 << 16  # a symlink, as Info-ZIP records one
        zf.writestr(info, "/etc/passwd")
    assert check(archive).details() == "member 'circle/link.png': links and special files are refused"


def test_each_limit_is_refused_naming_it(tmp_path: Path) -> None:
    many = check(
        zip_of(tmp_path / "m.zip", images(8)), limits=media.Limits(members=5, total_bytes=2**30, ratio=50)
    )
    assert "more than 5 members (limit max_archive_members)" in (many.details() or "")
    big = check(
        zip_of(tmp_path / "b.zip", images(8)), limits=media.Limits(members=100, total_bytes=4000, ratio=50)
    )
    assert "bytes uncompressed (limit max_archive_bytes)" in (big.details() or "")
    # a zip bomb: 20 MB of zeros compress to a few kB
    bomb = zip_of(tmp_path / "bomb.zip", [*images(3), ("circle/zeros.png", bytes(20 * 2**20))])
    said = check(bomb).details() or ""
    assert said.startswith("member 'circle/zeros.png': expands") and "max_compression_ratio 50" in said
    # and as a compressed tar, whose members say nothing of their compression: the archive's ratio counts
    tar_bomb = tar_of(tmp_path / "bomb.tar.gz", [*images(3), ("circle/zeros.png", bytes(20 * 2**20))])
    assert "expands over 50 times its size (limit max_compression_ratio)" in (check(tar_bomb).details() or "")


def test_undecodable_files_and_missing_labels_are_named(tmp_path: Path) -> None:
    sound = media_demo.audio_rows(1, 0)[0][2]
    cases = [
        (
            [*images(), ("circle/broken.png", b"\x89PNG not really")],
            "member 'circle/broken.png': does not decode as an image",
        ),
        (
            [(f"low/{i}.wav", sound) for i in range(3)] + [("low/cut.wav", sound[:30])],
            "member 'low/cut.wav': does not decode as audio",
        ),
        (
            [*images(), ("loose.png", images(1)[0][1])],
            "member 'loose.png': no label: put it in a class folder",
        ),
        (
            [*images(), ("circle/anim.gif", b"GIF89a" + bytes(40))],
            "member 'circle/anim.gif': .gif files are not taken",
        ),
    ]
    for i, (entries, said) in enumerate(cases):
        report = check(zip_of(tmp_path / f"{i}.zip", entries))
        assert not report.ok and said in (report.details() or ""), (said, report.details())


def test_metadata_that_does_not_match_the_files_is_named(tmp_path: Path) -> None:
    rows = media_demo.image_rows(4, 3)
    lines = [{"file_name": n, "label": label} for n, label, _ in rows[:3]]
    lines += [{"file_name": "ghost.png", "label": "circle"}, {"file_name": rows[0][0]}]
    meta = "".join(json.dumps(x) + "\n" for x in lines).encode()
    report = check(zip_of(tmp_path / "a.zip", [(n, d) for n, _, d in rows] + [("metadata.jsonl", meta)]))
    said = report.details() or ""
    assert "member 'metadata.jsonl' line 5: missing required field 'label' (or 'transcription')" in said
    assert "member 'metadata.jsonl': lists 'ghost.png', which is not in the archive" in said
    assert f"member '{rows[3][0]}': no row in metadata.jsonl: every file needs its label" in said


def test_a_task_the_archive_cannot_train_is_refused(tmp_path: Path) -> None:
    archive = media_demo.write_archive(tmp_path / "a.zip", media_demo.image_rows(6, 0))
    said = check(archive, task="audio-classification").details() or ""
    assert "task audio-classification needs an archive of audio clips with labels" in said


MODELS = {"image": "tiny-vit", "audio": "tiny-audio", "speech": "tiny-whisper"}


def media_archive(kind: str, path: Path, n: int, seed: int) -> Path:
    if kind == "speech":
        rows = media_demo.melody_rows(n, seed)
        return media_demo.write_archive(path, rows, layout="metadata", column="transcription")
    make = media_demo.image_rows if kind == "image" else media_demo.audio_rows
    return media_demo.write_archive(path, make(n, seed))


def media_spec(kind: str, archive: Path, out: Path, **fields: Any) -> Any:
    """A TrainingSpec for an image, audio or speech job on `archive` with the built model of its kind."""
    from trainer_core.spec import Hyperparameters, TrainingSpec

    labels = {"image": sorted(media_demo.SHAPES), "audio": sorted(media_demo.PITCHES), "speech": []}[kind]
    base: dict[str, Any] = {
        "job_id": f"ftjob-{kind}",
        "task": "automatic-speech-recognition" if kind == "speech" else f"{kind}-classification",
        "model": MODELS[kind],
        "train_file": str(archive),
        "train_format": "zip",
        "labels": labels,
        "output_dir": str(out),
        "hyperparameters": Hyperparameters(max_steps=3, batch_size=8).resolved(24),
    }
    return TrainingSpec(**(base | fields))


def media_losses(kind: str, backend: str, tmp: Path) -> tuple[list[float], Any]:
    """Train tiny-vit, tiny-audio or tiny-whisper through the real ORTTrainer, dropout off: what differs
    is the engine."""
    import torch

    from trainer_core.data import prepare
    from trainer_core.engine import backends, trainer
    from trainer_core.engine.launch import with_stores
    from trainer_core.events import EventStream
    from trainer_core.models import modeling, registry
    from trainer_core.spec import Hyperparameters

    model = MODELS[kind]
    spec = media_spec(
        kind,
        media_archive(kind, tmp / f"{kind}.zip", 48, 4),
        tmp / backend / "out",
        seed=3,
        precision="fp32",
        backend=backend,
        hyperparameters=Hyperparameters(max_steps=6, batch_size=8, learning_rate=1e-4).resolved(48),
    )
    choice = backends.choose(spec, cuda=False)
    torch.manual_seed(spec.seed)
    spec = with_stores(spec)
    with (tmp / f"{backend}.prepare").open("w") as out:
        train, _ = prepare.ensure(spec, EventStream(out))
    processor = prepare.load_tokenizer(spec, train)
    loaded = modeling.load(registry.resolve(model), spec, tokenizer=processor, attn_implementation="eager")
    for module in loaded.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if hasattr(loaded.model.config, "layerdrop"):  # wav2vec2 skips whole layers at random while training
        loaded.model.config.layerdrop = 0.0
    with (tmp / f"{backend}.events").open("w") as out:
        hf = trainer.supervised_trainer(spec, choice, loaded, train, None, EventStream(out), cuda=False)
        hf.train()
    return [h["loss"] for h in hf.state.log_history if "loss" in h], hf


def media_parity_probe(tmp: str, kind: str) -> dict[str, Any]:
    import os

    from trainer_core.engine import ort_trainer

    torch_losses, _ = media_losses(kind, "torch", Path(tmp) / "torch")
    ort_losses, hf = media_losses(kind, "ort", Path(tmp) / "ort")
    return {
        "torch": torch_losses,
        "ort": ort_losses,
        "nodes": ort_trainer.training_graph_nodes(hf.ort_module),
        "module": type(hf.ort_module).__name__,
        "policy": os.environ["ORTMODULE_FALLBACK_POLICY"],
    }


@pytest.mark.parametrize("kind", list(MODELS))
def test_ort_trains_the_image_audio_and_speech_models_as_pytorch_does(tmp_path: Path, kind: str) -> None:
    """ORTModule, fallback disabled, trains tiny-vit (patches through a Conv2d), tiny-audio (a Conv1d
    feature encoder, layer norms, a padded batch's mask) and tiny-whisper (an encoder-decoder with cross
    attention and a padded decoder mask) to PyTorch's losses."""
    for side in ("torch", "ort"):
        (tmp_path / side).mkdir()
    code = "import json; from tests.trainer_core.test_media import media_parity_probe; "
    code += f"print(json.dumps(media_parity_probe({str(tmp_path)!r}, {kind!r})))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(probe["torch"]) == len(probe["ort"]) == 6
    # fp32 both sides, same bound and reasoning as for text (test_ort.py): rounding carried by Adam's
    # normalised steps stays orders below 1e-4, a real divergence moves a step's loss by ~1e-3 or more
    assert max(abs(a - b) for a, b in zip(probe["torch"], probe["ort"], strict=True)) < 1e-4, probe
    assert probe["ort"][-1] != probe["ort"][0]
    assert probe["module"] == "ORTModule" and probe["nodes"] > 50 and probe["policy"] == "FALLBACK_DISABLE"


def test_a_transcription_archive_is_speech_recognition(tmp_path: Path) -> None:
    rows = media_demo.melody_rows(5, 0)
    report = check(
        media_demo.write_archive(tmp_path / "s.zip", rows, layout="metadata", column="transcription")
    )
    assert report.ok and (report.kind, report.rows) == ("audio_transcription", 5), report.details()
    assert report.labels == set()  # transcriptions are not labels


def test_an_onnx_transcript_that_differs_fails_the_export_naming_the_clip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The greedy check compares ONNX Runtime's transcripts with PyTorch's token for token; one divergence
    fails the export with the clip and both transcripts (and an intact export passes it)."""
    from trainer_core.data import mediastore
    from trainer_core.data.datastore import Meta
    from trainer_core.export import ExportError, HeldOut
    from trainer_core.export import speech as export_speech
    from trainer_core.tasks import speech

    archive = media_archive("speech", tmp_path / "s.zip", 6, 1)
    spec = media_spec("speech", archive, tmp_path / "out")
    processor = mediastore.built_processor("tiny-whisper", mediastore.transcripts(archive, "zip"))
    mediastore.build(
        archive, "zip", tmp_path / "store", "k", processor, spec, lambda n: None, has_tokenizer=False
    )
    store = mediastore.MediaStore(tmp_path / "store")
    assert isinstance(store.meta, Meta) and store.meta.tokens > 0
    collator = mediastore.MediaCollator(processor, store.media)
    model = speech.built_model(processor).eval()
    held_out = HeldOut(store, collator)
    manifest = export_speech.export_onnx(model, processor, tmp_path / "onnx", held_out, {"task": spec.task})
    assert manifest["greedy_parity"]["identical"] == manifest["greedy_parity"]["clips"] == 6
    assert {"encoder.onnx", "decoder.onnx", "preprocessor_config.json"} <= set(manifest["files"])

    real = speech.torch_greedy
    monkeypatch.setattr(speech, "torch_greedy", lambda m, f: [[7, 7, 7], *real(m, f)[1:]])
    with pytest.raises(
        ExportError, match=r"differs from PyTorch's on held-out clip 0: .* against .*ids \[7, 7, 7\]"
    ):
        export_speech.export_onnx(model, processor, tmp_path / "onnx2", held_out, {"task": spec.task})


def test_auto_measures_both_engines_on_an_image_job(tmp_path: Path) -> None:
    """`backend: auto` in fp32 (where ORT can run on CPU) times PyTorch and ORTModule on the job's own
    image batches and says which it kept and why, as for text."""
    from tests.support import launch_trainer
    from trainer_core.spec import Hyperparameters

    spec = media_spec(
        "image",
        media_archive("image", tmp_path / "i.zip", 48, 1),
        tmp_path / "out",
        precision="fp32",
        backend="auto",
        auto_budget_fraction=1000.0,  # measure even this short job
        hyperparameters=Hyperparameters(max_steps=4, batch_size=8).resolved(48),
    )
    code, events, stderr = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, stderr
    (backend,) = [e for e in events if e["type"] == "backend"]
    assert backend["used"] in ("torch", "ort") and backend["reason"], backend
    figures = backend["figures"]
    assert "ort_ms" in figures, backend
    assert figures["batch_shape"] == [8, 3, 32, 32] and figures["torch_ms"] > 0 and figures["ort_ms"] > 0, (
        figures
    )


@pytest.mark.parametrize("kind", ["image", "speech"])
def test_a_local_model_directory_trains_through_the_same_code(tmp_path: Path, kind: str) -> None:
    """A real model as a team keeps one (a directory with its config, safetensors and processor, here a
    ViT whose head has 5 ImageNet-style classes, or a Whisper with its own tokenizer) trains through the
    registry's local path: the head gives way to the job's labels, the processor and decoder start come from
    the directory, and both artifacts carry them."""
    from tests.support import launch_trainer
    from trainer_core.data import mediastore
    from trainer_core.models import registry
    from trainer_core.tasks import speech

    home = tmp_path / "models" / "acme" / f"{kind}-base"
    if kind == "image":
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2
        )
        config.intermediate_size, config.num_labels = 64, 5
        ViTForImageClassification(config).save_pretrained(home)
        mediastore.built_processor("tiny-vit", []).save_pretrained(home)
        task = "image-classification"
    else:
        processor = speech.built_processor(t for _, t, _ in media_demo.melody_rows(50, 9))
        speech.built_model(processor).save_pretrained(home)
        processor.save_pretrained(home)
        task = "automatic-speech-recognition"
    info = registry.resolve(f"acme/{kind}-base", tmp_path / "models")
    assert info.source == "local" and task in info.tasks
    spec = media_spec(
        kind,
        media_archive(kind, tmp_path / "t.zip", 24, 1),
        tmp_path / "out",
        model=info.id,
        model_path=str(info.path),
        validation_file=str(media_archive(kind, tmp_path / "v.zip", 8, 2)),
        validation_format="zip",
    )
    code, events, stderr = launch_trainer(spec, tmp_path / "spec.json")
    assert code == 0, stderr
    result = events[-1]
    assert result["type"] == "result" and not result["failed_artifacts"], result
    for fmt in ("pytorch", "onnx"):
        saved = tmp_path / "out" / fmt
        assert (saved / "preprocessor_config.json").is_file()
        if kind == "image":
            config = json.loads((saved / "config.json").read_text())
            assert config["id2label"] == {"0": "circle", "1": "square", "2": "triangle"}
        else:
            assert (saved / "tokenizer.json").is_file()
