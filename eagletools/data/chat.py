"""Render a conversation with the tokenizer's own chat template and mask its replies.

No separator of any model family is written here. The full conversation is
rendered once, then once more per reply with that reply replaced by a
character absent from the text: where the marker lands is where the reply
starts, whatever the template puts around it (headers, think blocks, a reply
quoted in the question). Character spans become token spans through the fast
tokenizer's offsets. A reply's mask covers its text and the end-of-turn
token: the first special token right after the text, e.g. `<|im_end|>`,
`<|eot_id|>`, `</s>`, with any whitespace the template puts before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagletools.data.conversations import Conversation
from eagletools.errors import UserError


class TemplateMismatch(Exception):
    """The template changes a message's text, so its span cannot be located."""


def read_chat_template(value: str | Path | None) -> str | None:
    """A Jinja chat template given inline or as a file path."""
    if value is None:
        return None
    value = str(value)
    if "{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(f"--chat-template {value}: no such file (give a Jinja file or the text)")
    return path.read_text()


def set_chat_template(tokenizer: Any, value: str | Path | None) -> None:
    """Install `--chat-template` (a Jinja file or text) on a loaded tokenizer, so every
    prompt rendered from it (eval, generate, regenerate) uses it; None keeps its own."""
    template = read_chat_template(value)
    if template is not None:
        tokenizer.chat_template = template


def require_chat_template(tokenizer: Any, chat_template: str | None, source: str) -> None:
    if not (chat_template or tokenizer.chat_template):
        raise UserError(
            f"the tokenizer of {source} has no chat template; pass --chat-template FILE "
            "(a Jinja template such as the one in the model's tokenizer_config.json)"
        )


def check_tokenizer(tokenizer: Any, chat_template: str | None, source: str = "target") -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"the tokenizer of {source} is not a fast tokenizer; loss masks need offsets"
        )
    require_chat_template(tokenizer, chat_template, source)


def chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of a conversation rendered for the assistant's next reply."""
    require_chat_template(tokenizer, None, tokenizer.name_or_path or "the target")
    text = _render(tokenizer, messages, None, True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer: Any, messages: list[dict], template: str | None, gen: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=gen
    )


def assistant_spans(
    tokenizer: Any, conversation: Conversation, chat_template: str | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character span of each assistant reply's text."""
    messages = [{"role": m.role, "content": m.content} for m in conversation]
    text = _render(tokenizer, messages, chat_template, False)
    mark = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text)
    spans = []
    for i, msg in enumerate(conversation):
        if msg.role != "assistant":
            continue
        marked = [*messages[:i], {"role": "assistant", "content": mark}, *messages[i + 1 :]]
        rendered = _render(tokenizer, marked, chat_template, False)
        start = rendered.find(mark)
        if start < 0 or rendered[:start] != text[:start]:
            raise TemplateMismatch(f"message {i}: the template renders the text before it twice")
        for needle in (msg.content, msg.content.strip()):  # some templates trim
            if needle and text.startswith(needle, start):
                spans.append((start, start + len(needle)))
                break
        else:
            raise TemplateMismatch(f"message {i}: the template changes the reply's text")
    return text, spans


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


def tokenize_conversation(
    tokenizer: Any, conversation: Conversation, max_length: int, chat_template: str | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask), truncated to `max_length`; loss_mask is 1 on reply tokens."""
    text, spans = assistant_spans(tokenizer, conversation, chat_template)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = _special_ids(tokenizer)
    mask = [0] * len(ids)
    t = 0
    for start, end in spans:
        while t < len(ids) and offsets[t][1] <= start:
            t += 1
        while t < len(ids) and offsets[t][0] < end:
            mask[t] = 1
            t += 1
        # the end-of-turn token, with the whitespace some templates put before it
        u = t
        while u < len(ids) and ids[u] not in special and not text[end : offsets[u][1]].strip():
            u += 1
        if u < len(ids) and ids[u] in special and not text[end : offsets[u][0]].strip():
            mask[t : u + 1] = [1] * (u + 1 - t)
            t = u + 1
    return ids[:max_length], mask[:max_length]
