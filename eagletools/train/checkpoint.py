"""Training checkpoints: everything a resumed run needs to follow the same trajectory.

Layout of `OUT/checkpoints/step-NNNNNNNN/` (written atomically, last k kept):

    model.safetensors     draft weights, `eagle` keys, fp32, with d2t/t2d, no embed_tokens
    draft_config.json     `DraftConfig.to_dict()`
    optimizer.pt          optimizer state, unsharded, keyed by parameter name
    state.pt              RNG states (torch, python)
    trainer_state.json    step, data position (epoch, batch), counters, recipe

The `.pt` files hold tensors, numbers and strings only and are read with
`torch.load(weights_only=True)`, and only when the user asks to resume.
Weights and optimizer state go through `torch.distributed.checkpoint`'s
full state dicts, so a run sharded by FSDP writes the same files as one
process and resumes on any number of processes.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from eagletools.atomic import atomic_dir, atomic_file
from eagletools.errors import UserError

PREFIX = "step-"


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temp folders start with '.')."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.is_dir()]
    return sorted(p for p in done if (p / "trainer_state.json").is_file())


EMBEDDINGS = "embed_tokens.weight"  # the target's, frozen: never saved


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(
    draft: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The draft's `eagle`-keyed tensors (fp32, no embeddings) and the optimizer state,
    unsharded on CPU.

    Under FSDP this gathers the shards, so every rank must call it; ranks other
    than 0 then get empty dicts.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(draft, optimizer, options=_options(cpu_offload=True))
    tensors = {k: v.float() if v.is_floating_point() else v
               for k, v in model.items() if k != EMBEDDINGS}  # fmt: skip
    return tensors, optim


def save_checkpoint(
    root: Path,
    step: int,
    state: tuple[dict[str, torch.Tensor], dict[str, Any]],
    draft_config: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write step-N from a `full_state` atomically, then drop all but the last `keep_last`."""
    from safetensors.torch import save_file

    path = checkpoint_dir(root, step)
    previous = list_checkpoints(root)
    try:
        with atomic_dir(path, overwrite=True) as tmp:
            tensors, optim = state
            save_file(
                {k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors")
            )
            (tmp / "draft_config.json").write_text(json.dumps(draft_config, indent=2))
            torch.save(optim, tmp / "optimizer.pt")
            rng = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
            torch.save({"rng": rng}, tmp / "state.pt")
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    except OSError as err:
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "none existed"
        raise UserError(
            f"could not write checkpoint {path}: {err}; {kept}. Free disk space or fix the "
            "permissions of the output folder, then resume with --resume"
        ) from err
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(
    path: Path, draft: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore weights, optimizer and RNG from `path`; return the trainer state (with the
    step and elapsed seconds the learning-rate schedule follows). Every rank calls it:
    under FSDP each takes its shard of the full tensors."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_state_dict

    needed = ["model.safetensors", "optimizer.pt", "state.pt", "trainer_state.json"]
    missing = [n for n in needed if not (path / n).is_file()]
    if missing:
        raise UserError(f"{path}: not a training checkpoint (missing {missing})")
    tensors = load_file(str(path / "model.safetensors"))
    expected = set(draft.state_dict()) - {EMBEDDINGS}
    missing_keys, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if unexpected or missing_keys:
        raise UserError(
            f"{path}/model.safetensors does not fit this draft (missing {missing_keys}, "
            f"unexpected {unexpected}); resume with the recipe that wrote it"
        )
    optim = torch.load(path / "optimizer.pt", weights_only=True)
    set_state_dict(draft, optimizer, model_state_dict=tensors, optim_state_dict=optim,
                   options=_options(strict=False))  # fmt: skip
    state = torch.load(path / "state.pt", weights_only=True)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate((3, tuple(state["rng"]["python"]), None))
    return json.loads((path / "trainer_state.json").read_text())


def write_history(out: Path, history: list[dict[str, float]]) -> None:
    """`OUT/train_log.jsonl`: a line (step, loss, lr) per step, rewritten with each
    checkpoint so that it never runs past the one a resume starts from."""
    with atomic_file(out / "train_log.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(h) + "\n" for h in history))


def read_history(out: Path, up_to: int) -> list[dict[str, float]]:
    """The logged steps up to `up_to`, the step a run resumes from."""
    path = out / "train_log.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [h for h in map(json.loads, filter(None, lines)) if h["step"] <= up_to]
