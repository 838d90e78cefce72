"""OpenAI's `method` of a job: its request shape (one field per method of the registry, trainer_core.methods)
and the stored spec's method shown back in that shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from trainer_core import methods
from trainer_core.spec import Auto, Dpo, Hyperparameters, Lora, Supervised
from trainer_core.spec import Method as TrainedMethod


class SupervisedMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: Hyperparameters | None = None
    lora: Lora | None = Field(
        default=None, description="Train a LoRA adapter (PEFT) instead of every weight."
    )
    packing: bool = Field(
        default=False,
        description="Pack short causal-LM rows into full sequences; no row attends to another.",
    )


class DpoHyperparameters(Hyperparameters):
    """OpenAI's DPO hyperparameters: the supervised ones and `beta`."""

    beta: Annotated[float, Field(gt=0, le=10)] | Auto = "auto"


class DpoMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: DpoHyperparameters | None = None
    lora: Lora | None = Field(
        default=None, description="Train a LoRA adapter; the base with it switched off is the reference."
    )


class Method(BaseModel):
    """OpenAI's `method`: its `type` and, under a field of the same name, that method's options. One field
    per method of trainer_core/methods/__init__.py (a test holds the two together)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised", "dpo"] = "supervised"
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None

    @model_validator(mode="after")
    def _one_method(self) -> Method:
        for other in methods.NAMES:
            if other != self.type and getattr(self, other) is not None:
                raise ValueError(f"method.{other} given with method.type {self.type}")
        return self

    @property
    def options(self) -> SupervisedMethod | DpoMethod | None:
        return getattr(self, self.type)

    def trained(self) -> TrainedMethod:
        """The method as the trainer takes it, its options resolved ("auto" beta: the default)."""
        options = self.options
        if isinstance(options, DpoMethod):
            hp = options.hyperparameters
            return Dpo() if hp is None or hp.beta == "auto" else Dpo(beta=hp.beta)
        if isinstance(options, SupervisedMethod):
            return Supervised(packing=options.packing)
        return TypeAdapter(TrainedMethod).validate_python({"type": self.type})  # its defaults


def stored_method(spec: Any, hp: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's `method` of a stored spec, with our options (lora) inside it."""
    lora = getattr(spec, "lora", None)
    options: dict[str, Any] = {"hyperparameters": hp}
    if lora is not None:
        options["lora"] = lora.model_dump(mode="json")
    method = getattr(spec, "method", Supervised())
    if isinstance(method, Supervised) and method.packing:
        options["packing"] = True
    if isinstance(method, Dpo):
        options["hyperparameters"] = hp | {"beta": method.beta}
    return {"type": method.type, method.type: options}
