"""The task and method registries are the only lists of tasks and methods: the types that mirror them stay
equal to them, and no product module names a task or a method anywhere else."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, get_args

import pytest

from api import method_schemas
from ortune.jobspec import JobSpec
from serve import cache as served
from tests.support import ROOT
from trainer_core import methods, spec, tasks
from trainer_core.data import rows
from trainer_core.models import registry

PRODUCT = ("api", "ortune", "serve", "trainer_core", "worker")
REGISTRIES = {"trainer_core/tasks/__init__.py", "trainer_core/methods/__init__.py"}
# Where a name may still be written: the Literal types that mirror the tables (held to them below) and the
# loader of version-1 specs, which had `dpo` and `packing` fields before methods were a union.
MIRRORS = {
    "trainer_core/spec.py": {"method_from_v1"},
    "api/schemas.py": set(),
    "api/method_schemas.py": set(),
}


def test_the_types_mirror_the_tables() -> None:
    assert get_args(spec.Task) == tasks.NAMES
    union = get_args(get_args(spec.Method)[0])
    assert tuple(get_args(m.model_fields["type"].annotation)[0] for m in union) == methods.NAMES
    assert get_args(method_schemas.Method.model_fields["type"].annotation) == methods.NAMES
    assert set(method_schemas.Method.model_fields) == {"type", *methods.NAMES}
    assert {k for info in tasks.TASKS.values() for k in info.row_kinds} <= {*rows.KINDS, *rows.MEDIA_KINDS}
    for info in methods.METHODS.values():
        assert set(info.tasks) <= set(tasks.NAMES), info


def test_every_row_names_modules_that_exist() -> None:
    for info in tasks.TASKS.values():
        assert callable(info.load("exporter")), info.name
        if info.trainer is not None:
            assert callable(info.load("trainer")), info.name
    for method in methods.METHODS.values():
        assert callable(method.load("trainer")), method.name
    assert set(registry.BUILT) == {m for info in tasks.TASKS.values() for m in info.built_models}


def _named_outside_the_registries(path: Path, names: set[str]) -> list[str]:
    relative = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text())
    allowed: set[int] = set()
    for node in ast.walk(tree):
        literal = isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal"
        # `type: Literal["dpo"] = "dpo"`: a union member's tag and its default
        literal |= isinstance(node, ast.AnnAssign) and "Literal[" in ast.unparse(node.annotation)
        loader = isinstance(node, ast.FunctionDef) and node.name in MIRRORS.get(relative, set())
        if relative in MIRRORS and (literal or loader):
            allowed |= {id(n) for n in ast.walk(node)}
    return [
        f"{relative}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in allowed
    ]


def test_no_module_lists_a_task_or_a_method_but_its_registry() -> None:
    names = set(tasks.NAMES) | set(methods.NAMES)
    found = [
        hit
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in REGISTRIES
        for hit in _named_outside_the_registries(path, names)
    ]
    assert not found, "tasks and methods are named in their registries only:\n" + "\n".join(found)


def test_the_guard_sees_a_task_named_in_a_branch(tmp_path: Path) -> None:
    module = ROOT / "worker" / "_registry_probe.py"
    module.write_text('def f(task: str) -> bool:\n    return task == "causal-lm"\n')
    try:
        assert _named_outside_the_registries(module, set(tasks.NAMES)) == [
            "worker/_registry_probe.py:2: 'causal-lm'"
        ]
    finally:
        module.unlink()


def _v1(**method_fields: Any) -> dict[str, Any]:
    hp = spec.Hyperparameters()
    return {
        "task": "causal-lm",
        "hyperparameters": hp.model_dump(mode="json"),
        "resolved_hyperparameters": hp.resolved(8, "causal-lm").model_dump(mode="json"),
        **method_fields,
    }


def test_version_1_job_specs_load_with_their_method() -> None:
    dpo = JobSpec.model_validate(_v1(dpo={"beta": 0.3}))
    assert dpo.version == 2 and dpo.method == spec.Dpo(beta=0.3)
    packed = JobSpec.model_validate(_v1(packing=True))
    assert packed.method == spec.Supervised(packing=True)
    assert JobSpec.model_validate(_v1()).method == spec.Supervised()
    stored = json.loads(json.dumps(dpo.stored()))
    assert stored["version"] == 2 and stored["method"] == {"type": "dpo", "beta": 0.3}
    assert JobSpec.model_validate(stored) == dpo
    with pytest.raises(ValueError, match="dpo"):
        JobSpec.model_validate(_v1(dpo={"beta": 0.3}) | {"version": 2})  # v2 has no `dpo` field


def test_version_1_training_specs_load_and_a_method_is_held_to_its_tasks() -> None:
    fields = {
        "job_id": "j",
        "task": "causal-lm",
        "model": "tiny-gpt2",
        "train_file": "t.jsonl",
        "output_dir": "out",
        "hyperparameters": spec.Hyperparameters().resolved(8, "causal-lm").model_dump(),
    }
    assert spec.TrainingSpec.model_validate(fields | {"dpo": {"beta": 0.2}}).method == spec.Dpo(beta=0.2)
    assert spec.TrainingSpec.model_validate(fields | {"packing": True}).packing
    classifier = fields | {"task": "sequence-classification", "labels": ["a", "b"]}
    with pytest.raises(ValueError, match="method dpo trains causal-lm"):
        spec.TrainingSpec.model_validate(classifier | {"method": {"type": "dpo"}})
    with pytest.raises(ValueError, match="nothing to pack"):
        spec.TrainingSpec.model_validate(classifier | {"method": {"type": "supervised", "packing": True}})


def test_serve_loads_an_artifact_as_its_manifest_says(tmp_path: Path) -> None:
    """An image, audio or speech artifact is refused by name, not loaded as a text classifier; artifacts
    from before manifests said how they are served go by their task."""
    (tmp_path / served.MANIFEST).write_text(json.dumps({"task": "image-classification"}))
    with pytest.raises(served.NotServed, match="image-classification"):
        served.load(tmp_path)
    assert served.serving({"task": "causal-lm"}) == "chat"
    assert served.serving({"task": "sequence-classification"}) == "predict"
    assert served.serving({"task": "automatic-speech-recognition"}) is None
    assert served.serving({"task": "causal-lm", "serving": "predict"}) == "predict"
