"""Hidden states kept while the target regenerated the replies, for the offline cache.

Regeneration already runs the target over every prompt and every reply token it
writes. Keeping the states at the aux layers and the final norm on the way
spares the offline cache a second forward over the same tokens (12 of the
long CPU recipe's 94 minutes). Each regeneration part `part-NNNNN.jsonl` gets
a sibling `part-NNNNN.safetensors` holding, per conversation, the tokens the
target read and wrote for its last reply (that reply's history covers the
whole conversation) and their states.

The cache finds a sample's capture by the tokens before its last reply, and
then takes the capture's tokens for the reply rather than the sample's: the
sample re-tokenises the reply's text, which can split it otherwise than the
target wrote it (SmolLM2 writes "\n\n" before a list as one token; its
tokenizer encodes it as two), and a draft serves on the target's own tokens.
The last token the target wrote is never read back, so it has no state and
the sample ends before it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagletools.atomic import atomic_file


@dataclass
class Captured:
    ids: list[int]  # the history's tokens, then the reply's
    prompt_length: int  # how many of `ids` are the history
    states: torch.Tensor  # [n <= len(ids), (A+1)*H] bf16: aux layers, then the final norm
    layer_ids: tuple[int, ...]  # the aux layers (HF indexing)


def write_captures(path: Path, captured: Sequence[Captured]) -> None:
    """One regeneration part's captures, atomically (the part's jsonl is written after)."""
    from safetensors.torch import save_file

    layer_ids = {c.layer_ids for c in captured}
    if len(layer_ids) != 1:
        raise ValueError(f"one part, one set of aux layers; got {sorted(layer_ids)}")

    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lengths]).cumsum(0)

    tensors = {
        "ids": torch.tensor([t for c in captured for t in c.ids], dtype=torch.int32),
        "id_offsets": offsets([len(c.ids) for c in captured]),
        "prompt_lengths": torch.tensor([c.prompt_length for c in captured]),
        "states": torch.cat([c.states for c in captured]).to(torch.bfloat16),
        "state_offsets": offsets([c.states.shape[0] for c in captured]),
    }
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={"layer_ids": json.dumps(list(layer_ids.pop()))})


class Captures:
    """Every capture of a regeneration folder made at `layer_ids`, found by prompt tokens.

    Only a 16-byte digest of each prompt and the row offsets stay in memory; the
    tokens and states are read from the memory-mapped files when a sample asks."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self.files = [safe_open(str(f), "pt") for f in files]
        # prompt digest -> (file, row); the same prompt twice: the first (both are the target's)
        self.by_prompt: dict[bytes, tuple[int, int]] = {}
        self.id_offsets: list[list[int]] = []
        self.state_offsets: list[list[int]] = []
        for k, f in enumerate(self.files):
            ids = f.get_tensor("ids")
            bounds = f.get_tensor("id_offsets").tolist()
            self.id_offsets.append(bounds)
            self.state_offsets.append(f.get_tensor("state_offsets").tolist())
            for j, n in enumerate(f.get_tensor("prompt_lengths").tolist()):
                self.by_prompt.setdefault(_digest(ids[bounds[j] : bounds[j] + n]), (k, j))

    @classmethod
    def open(cls, folder: Path, layer_ids: Sequence[int]) -> Captures | None:
        """The folder's captures at these aux layers, or None when it has none."""
        from safetensors import safe_open

        files = []
        for path in sorted(Path(folder).glob("part-*.safetensors")):
            with safe_open(str(path), "pt") as f:
                if json.loads(f.metadata()["layer_ids"]) == list(layer_ids):
                    files.append(path)
        return cls(files) if files else None

    def lookup(
        self, ids: list[int], loss_mask: list[int], max_length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(input_ids, loss_mask, states [n, (A+1)*H]) of a sample: its tokens up to its
        last reply, then the reply as the target wrote it, at most `max_length` in all;
        None when no capture has the sample's prompt."""
        start = _last_reply_start(loss_mask)
        prompt = torch.tensor(ids[:start], dtype=torch.int32)
        found = self.by_prompt.get(_digest(prompt))
        if start == 0 or found is None:
            return None
        k, j = found
        a, b = self.id_offsets[k][j], self.id_offsets[k][j + 1]
        row = self.files[k].get_slice("ids")[a:b]
        if not torch.equal(row[:start], prompt):  # a digest collision: never trust it
            return None
        lo, hi = self.state_offsets[k][j], self.state_offsets[k][j + 1]
        n = min(hi - lo, max_length)
        mask = loss_mask[:start] + [1] * (n - start)
        states = self.files[k].get_slice("states")[lo : lo + n]
        return row[:n].long(), torch.tensor(mask, dtype=torch.int8), states


def _digest(tokens: torch.Tensor) -> bytes:
    """A prompt's key: its int32 token bytes hashed (the length is part of the bytes)."""
    return hashlib.blake2b(tokens.to(torch.int32).numpy().tobytes(), digest_size=16).digest()


def _last_reply_start(loss_mask: list[int]) -> int:
    """Where the last run of reply tokens starts (the loss mask's last 0 -> 1 step)."""
    i = len(loss_mask)
    while i > 0 and not loss_mask[i - 1]:
        i -= 1
    while i > 0 and loss_mask[i - 1]:
        i -= 1
    return i
