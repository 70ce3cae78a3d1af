"""Replace a dataset's assistant replies with the target's own (self-distillation).

Turn by turn: the reply to user turn k is generated from the history with the
regenerated replies to turns < k, as the target would see it when serving.
Conversations go in chunks; each finished chunk is written atomically to
`OUT.parts/`, so an interrupted run resumes at the first missing chunk, and
the parts are joined into `OUT` (JSONL, `messages: [{role, content}]`) at the end.

Two backends: a local target (HF `generate`, batched, left-padded) and any
OpenAI-compatible server (`/v1/chat/completions`, as vLLM and SGLang serve)
for targets too big for this machine. A local target in the decoding runtime
can also keep the hidden states it computes on the way (`data.captures`):
each part then has a `.safetensors` sibling the offline cache reads.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagletools.atomic import atomic_file, write_text
from eagletools.data.captures import Captured, write_captures
from eagletools.data.chat import chat_ids, require_chat_template
from eagletools.data.conversations import Conversation
from eagletools.decode.sampling import Sampling
from eagletools.errors import UserError

log = logging.getLogger(__name__)

Chat = list[dict[str, str]]  # OpenAI-style messages


@dataclass
class Reply:
    text: str
    captured: Captured | None = None  # the tokens and states behind it, when kept


# a batch of histories -> one reply each; None: the history is too long, the conversation ends
Generate = Callable[[list[Chat]], list[Reply | None]]


@dataclass
class Regenerated:
    chat: Chat
    last: Reply  # the reply to the last user turn: its capture spans the whole conversation


def segments(conversation: Conversation) -> list[Chat]:
    """The non-assistant messages before each reply: [[system, user1], [user2], ...]."""
    out: list[Chat] = []
    pending: Chat = []
    for m in conversation:
        if m.role == "assistant":
            continue
        pending.append({"role": m.role, "content": m.content})
        if m.role == "user":
            out.append(pending)
            pending = []
    return out


def regenerate_chunk(
    conversations: list[Conversation], generate: Generate, max_turns: int | None = None
) -> list[Regenerated]:
    """Every conversation of the chunk, replies regenerated turn by turn (batched per turn).

    With `max_turns`, a conversation ends after that many user turns; it also
    ends before a turn whose history the generator declines as too long, and
    one left without a reply is dropped.
    """
    parts = [segments(c)[:max_turns] for c in conversations]
    histories: list[Chat] = [[] for _ in conversations]
    last: list[Reply | None] = [None] * len(conversations)
    for turn in range(max((len(p) for p in parts), default=0)):
        active = [i for i, p in enumerate(parts) if turn < len(p)]
        for i in active:
            histories[i] += parts[i][turn]
        replies = generate([histories[i] for i in active])
        for i, reply in zip(active, replies, strict=True):
            if reply is None:
                del histories[i][len(histories[i]) - len(parts[i][turn]) :]
                parts[i] = parts[i][:turn]
            else:
                histories[i].append({"role": "assistant", "content": reply.text})
                last[i] = reply
    return [Regenerated(h, r) for h, r in zip(histories, last, strict=True) if r is not None]


def local_generator(
    target: Any,
    sampling: Sampling,
    batch_size: int = 8,
    max_prompt_tokens: int | None = None,
    capture_layer_ids: Sequence[int] = (),
) -> Generate:
    """Replies from a local target, `batch_size` histories at a time; histories
    longer than `max_prompt_tokens` are declined (None).

    Llama-family targets run in the decoding runtime (static KV cache, faster
    than HF `generate` on CPU: docs/lab.md, Part 3), which also keeps the states at `capture_layer_ids` and the
    final norm's when given; other architectures fall back to HF `generate`.
    """
    import torch

    from eagletools.decode.model import SUPPORTED

    tokenizer, model = target.tokenizer, target.model
    require_chat_template(tokenizer, None, f"target {target.info.name_or_path}")
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )

    if model.config.model_type in SUPPORTED:
        return _runtime_generator(
            target, sampling, batch_size, pad_id, max_prompt_tokens, capture_layer_ids
        )
    if capture_layer_ids:
        log.info("%s: HF generate keeps no hidden states; the offline cache will run the "
                 "target over the replies", model.config.model_type)  # fmt: skip

    def generate(chats: list[Chat]) -> list[Reply | None]:
        ids_all = [chat_ids(tokenizer, c) for c in chats]
        keep = [i for i, ids in enumerate(ids_all) if _fits(ids, max_prompt_tokens)]
        replies: list[Reply | None] = [None] * len(chats)
        for start in range(0, len(keep), batch_size):
            rows = keep[start : start + batch_size]
            ids = [ids_all[i] for i in rows]
            width = max(len(x) for x in ids)
            input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            torch.manual_seed(sampling.seed + start)
            sample = sampling.temperature > 0
            out = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=sampling.max_new_tokens,
                do_sample=sample,
                temperature=sampling.temperature if sample else None,
                top_p=sampling.top_p if sample else None,
                top_k=None,
                pad_token_id=pad_id,
            )
            for i, row in zip(rows, out[:, width:], strict=True):
                replies[i] = Reply(tokenizer.decode(row, skip_special_tokens=True).strip())
        return replies

    return generate


def _fits(ids: list[int], max_prompt_tokens: int | None) -> bool:
    return max_prompt_tokens is None or len(ids) <= max_prompt_tokens


def _runtime_generator(
    target: Any,
    sampling: Sampling,
    batch_size: int,
    pad_id: int,
    max_prompt_tokens: int | None,
    capture_layer_ids: Sequence[int],
) -> Generate:
    """Batches of similar prompt length through `decode.batched.generate_batch`."""
    import torch

    from eagletools.decode.batched import generate_batch
    from eagletools.decode.model import Transformer
    from eagletools.decode.stopping import eos_token_ids

    tokenizer = target.tokenizer
    runtime = Transformer.from_hf(target.model)
    runtime.set_exact(False)  # replies need not match one-by-one decoding bit for bit: speed
    eos = eos_token_ids(tokenizer)
    layers = tuple(capture_layer_ids)
    state_layers = (*layers, runtime.args.n_layers) if layers else ()  # the final norm's last

    def generate(chats: list[Chat]) -> list[Reply | None]:
        ids = [chat_ids(tokenizer, c) for c in chats]
        fitting = [i for i in range(len(ids)) if _fits(ids[i], max_prompt_tokens)]
        order = sorted(fitting, key=lambda i: len(ids[i]))  # little padding per batch
        replies: list[Reply | None] = [None] * len(ids)
        n_batches = -(-len(order) // batch_size)  # even batches: no short one stepping alone
        for b in range(n_batches):
            start = b * len(order) // n_batches
            rows = order[start : (b + 1) * len(order) // n_batches]
            generator = torch.Generator(runtime.device).manual_seed(sampling.seed + start)
            out = generate_batch(runtime, [ids[i] for i in rows], sampling.max_new_tokens, eos,
                                 sampling, pad_id, generator, state_layers)  # fmt: skip
            for k, (i, tokens) in enumerate(zip(rows, out.tokens, strict=True)):
                captured = None
                if out.states is not None:
                    captured = Captured(ids[i] + tokens, len(ids[i]), out.states[k], layers)
                text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                replies[i] = Reply(text, captured)
        return replies

    return generate


def _endpoint(url: str, path: str) -> str:
    base = url.rstrip("/")
    return f"{base}/{path}" if base.endswith("/v1") else f"{base}/v1/{path}"


def _request(url: str, body: dict | None, timeout: float) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300]
        raise UserError(f"{url}: the server answered HTTP {err.code}: {detail}") from err
    except (urllib.error.URLError, TimeoutError, OSError) as err:
        raise UserError(f"{url}: could not reach the server ({err}); is it running?") from err
    except json.JSONDecodeError as err:
        raise UserError(f"{url}: the server's answer is not JSON ({err})") from err


def server_generator(
    url: str,
    sampling: Sampling,
    model: str | None = None,
    concurrency: int = 8,
    timeout: float = 600.0,
) -> Generate:
    """Replies from an OpenAI-compatible server, `concurrency` requests at a time."""
    if model is None:
        listing = _request(_endpoint(url, "models"), None, timeout)
        try:
            model = listing["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{url}: /v1/models lists no model; pass --model") from None

    def one(chat: Chat) -> Reply:
        body = {
            "model": model,
            "messages": chat,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
        }
        answer = _request(_endpoint(url, "chat/completions"), body, timeout)
        try:
            return Reply(answer["choices"][0]["message"]["content"].strip())
        except (KeyError, IndexError, TypeError, AttributeError):
            raise UserError(f"{url}: unexpected answer {str(answer)[:200]}") from None

    def generate(chats: list[Chat]) -> list[Reply | None]:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(one, chats))

    return generate


def parts_dir(output: str | Path) -> Path:
    """Where `regenerate` keeps the finished chunks of `output` (and their captures)."""
    output = Path(output)
    return output.with_name(output.name + ".parts")


def is_regenerated(output: str | Path, identity: dict[str, Any]) -> bool:
    """Whether `output` is complete and was made with `identity` (with other settings it is
    not: `regenerate` then refuses the parts rather than reusing them)."""
    output = Path(output)
    stamp = parts_dir(output) / "identity.json"
    return output.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == identity


def regenerate(
    conversations: list[Conversation],
    generate: Generate,
    output: str | Path,
    *,
    identity: dict[str, Any],
    chunk_size: int = 64,
    max_turns: int | None = None,
) -> Path:
    """Regenerate every conversation into `output` (JSONL), resuming from `output.parts/`.

    `identity` (data, backend, sampling) is kept with the parts; a rerun with
    another identity is refused rather than mixing replies of two settings.
    Replies that carry captures get them written beside their part first.
    """
    from tqdm.auto import tqdm

    output = Path(output)
    parts = parts_dir(output)
    parts.mkdir(parents=True, exist_ok=True)
    stamp = parts / "identity.json"
    if stamp.is_file() and json.loads(stamp.read_text()) != identity:
        raise UserError(
            f"{parts}: holds replies made with other settings ({stamp.read_text()}); delete it "
            "or rerun with the same data, target/server and sampling to resume"
        )
    write_text(stamp, json.dumps(identity, indent=2))
    chunks = range(0, len(conversations), chunk_size)
    bar = tqdm(total=len(conversations), desc="regenerate", unit="conv")
    for start in chunks:
        part = parts / f"part-{start // chunk_size:05d}.jsonl"
        batch = conversations[start : start + chunk_size]
        if not part.is_file():
            done = regenerate_chunk(batch, generate, max_turns)
            captured = [r.last.captured for r in done if r.last.captured is not None]
            if captured:
                write_captures(part.with_suffix(".safetensors"), captured)
            lines = [json.dumps({"messages": r.chat}) for r in done]
            with atomic_file(part) as tmp:
                tmp.write_text("".join(line + "\n" for line in lines))
        bar.update(len(batch))
    bar.close()
    with atomic_file(output) as tmp, open(tmp, "w") as out:
        for start in chunks:
            out.write((parts / f"part-{start // chunk_size:05d}.jsonl").read_text())
    return output
