"""The inference requests, in OpenAI's shapes: validated by the API, which adds the stored model they name
(`ortune_model`), and read by the inference process (serve/). Fields OpenAI clients send that do not change
the answer here (user, presence_penalty 0, ...) are accepted and ignored; ones that would are refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StoredModel(BaseModel):
    name: str
    object_key: str
    sha256: str
    task: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class Generation(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=512)]
    max_tokens: Annotated[int, Field(ge=1, le=8192)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=8192)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Literal[1] = 1
    stop: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]
        | None
    ) = None
    seed: int | None = None
    stream: bool = False
    ortune_model: StoredModel | None = None  # set by the API, never by a caller
    ortune_tenant: str | None = None  # likewise: whose limits the request counts against

    @model_validator(mode="after")
    def _one_length(self) -> Generation:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def asked(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(Generation):
    messages: Annotated[list[Message], Field(min_length=1)]


class CompletionRequest(Generation):
    prompt: Annotated[str, Field(min_length=1)]


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=512)]
    inputs: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=256)]
    )
    ortune_model: StoredModel | None = None
    ortune_tenant: str | None = None


def error(message: str, *, param: str | None = None, code: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
