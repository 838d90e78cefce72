"""Chat rows as the model reads them: rendered with the tokenizer's own chat template, and a mask of the
tokens that carry the loss (every assistant turn, not only the last; none of a turn with `weight: 0`, as in
OpenAI's format).

A tokenizer without a template gets DEFAULT_TEMPLATE (ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n`). A
turn's tokens are found by rendering the conversation up to it: the template renders the beginning of a
conversation the same whatever follows (every template we know does; one that does not is refused with
`ChatTemplateError`), so an assistant turn is the text between the render of the turns before it with the
generation prompt and the render through it. Its end-of-turn marker is in the loss: the model learns to stop.
"""

from __future__ import annotations

from typing import Any

DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The tokenizer's template cannot be used to find the assistant turns."""


def plain(messages: list[dict[str, Any]]) -> str:
    """The DEFAULT_TEMPLATE rendering, without a tokenizer: the text a built model's tokenizer learns from."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _render(tokenizer: Any, messages: list[dict[str, str]], *, prompt: bool = False) -> str:
    template = getattr(tokenizer, "chat_template", None) or DEFAULT_TEMPLATE
    text = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=prompt
    )
    return str(text)


def loss_spans(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant turns that carry the loss."""
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = _render(tokenizer, turns)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("weight", 1) == 0:
            continue
        before, through = _render(tokenizer, turns[:i], prompt=True), _render(tokenizer, turns[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ChatTemplateError(
                "the chat template renders a conversation's beginning differently depending on what follows, "
                "so the assistant turns cannot be found in it"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode(tokenizer: Any, messages: list[dict[str, Any]], max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of a conversation (cut at `max_len`) and, per token, 1 where it carries the loss."""
    text, spans = loss_spans(tokenizer, messages)
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError("chat rows need a fast tokenizer (one with offset mappings)")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(start <= a < end for start, end in spans)) for a, _ in enc["offset_mapping"]]
    return list(enc["input_ids"])[:max_len], mask[:max_len]


def answered(prompt: list[dict[str, Any]], answer: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A preference pair's side as one conversation whose loss is on `answer` alone: the prompt's own
    assistant turns (earlier turns of the conversation) carry none."""
    earlier = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in prompt]
    return earlier + answer
