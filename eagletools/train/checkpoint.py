"""Training checkpoints: everything a resumed run needs to follow the same trajectory.

Layout of `OUT/checkpoints/step-NNNNNNNN/` (written atomically, last k kept):

    model.safetensors     draft weights, `eagle` keys, fp32, with d2t/t2d, no embed_tokens
    draft_config.json     `DraftConfig.to_dict()`
    optimizer.pt          optimizer state_dict (tensors and numbers only)
    state.pt              RNG states (torch, python)
    trainer_state.json    step, data position (epoch, batch), counters, recipe

The `.pt` files hold tensors, numbers and strings only and are read with
`torch.load(weights_only=True)`, and only when the user asks to resume.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from eagletools.atomic import atomic_dir
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


def draft_tensors(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's `eagle`-keyed tensors without the frozen target embeddings."""
    state = draft.state_dict()
    return {k: v.detach().float() if v.is_floating_point() else v.detach()
            for k, v in state.items() if k != "embed_tokens.weight"}  # fmt: skip


def save_checkpoint(
    root: Path,
    step: int,
    draft: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write step-N atomically, then drop all but the last `keep_last`."""
    from safetensors.torch import save_file

    path = checkpoint_dir(root, step)
    previous = list_checkpoints(root)
    try:
        with atomic_dir(path, overwrite=True) as tmp:
            tensors = {k: v.contiguous().cpu() for k, v in draft_tensors(draft).items()}
            save_file(tensors, str(tmp / "model.safetensors"))
            (tmp / "draft_config.json").write_text(json.dumps(draft.config.to_dict(), indent=2))
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
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
    step and elapsed seconds the learning-rate schedule follows)."""
    from safetensors.torch import load_file

    needed = ["model.safetensors", "optimizer.pt", "state.pt", "trainer_state.json"]
    missing = [n for n in needed if not (path / n).is_file()]
    if missing:
        raise UserError(f"{path}: not a training checkpoint (missing {missing})")
    tensors = load_file(str(path / "model.safetensors"))
    result = draft.load_state_dict(tensors, strict=False)
    unexpected = list(result.unexpected_keys)
    missing_keys = [k for k in result.missing_keys if k != "embed_tokens.weight"]
    if unexpected or missing_keys:
        raise UserError(
            f"{path}/model.safetensors does not fit this draft (missing {missing_keys}, "
            f"unexpected {unexpected}); resume with the recipe that wrote it"
        )
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    state = torch.load(path / "state.pt", weights_only=True)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate((3, tuple(state["rng"]["python"]), None))
    return json.loads((path / "trainer_state.json").read_text())
