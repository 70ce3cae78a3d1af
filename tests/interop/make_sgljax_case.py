"""sgl-jax interop step 1 (project venv), written under OUT:

- `smollm2/target`: the built-in target exported as `eagletools assets export` does, and
  our capture of its default aux states on 8 tokens of 3 real prompts;
- `llama/target`, `qwen3/target`: tiny random targets of each shape, same capture;
- `drafts/<name>/draft`: random SmolLM2-shaped drafts converted `--to eagle` (the layout
  sgl-jax reads), with our step-0 logits and hidden output on those prompts and aux
  states: `plain` (what sgl-jax computes) and `demo` (the demo recipe's
  `norm_before_residual: true`, which it does not).

Step 2 (tests/interop/check_sgljax.py, in the sgl-jax venv) runs sgl-jax's own models
on the same inputs and compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from make_case import make_target, our_step0, save_random_draft
from safetensors.torch import save_file

from eagletools.cli import main as cli
from eagletools.formats import load_draft
from eagletools.targets import capture_aux, default_aux_layer_ids, load_target, load_tokenizer
from eagletools.targets.folder import save_target_folder
from eagletools.targets.load import export_target
from eagletools.vocab import DraftVocab

PROMPTS = [
    "Write a short poem about the sea at night.",
    "Explain why the sky is blue to a ten-year-old child.",
    "What are three good habits for writing clean Python code?",
]
TOKENS = 8
DRAFTS = {"plain": {}, "demo": {"norm_before_residual": True}}
TINY = {"llama": dict(rope_theta=500000.0), "qwen3": dict(head_dim=16, rope_theta=1000000.0)}


def prompt_ids(tokenizer) -> torch.Tensor:
    """The first TOKENS ids of each prompt, [3, TOKENS]."""
    return torch.tensor([tokenizer(p).input_ids[:TOKENS] for p in PROMPTS])


def capture_case(folder: Path, input_ids: torch.Tensor, layer_ids: list[int] | None = None):
    """Our trainer's capture of the target in `folder`, at `layer_ids` (HF indexing) or
    the default ones."""
    target = load_target(folder, dtype=torch.float32)
    ids = layer_ids or default_aux_layer_ids(target.model.config.num_hidden_layers)
    aux = capture_aux(target.model, input_ids, layer_ids=ids).aux
    save_file({"input_ids": input_ids, "aux": aux, "layer_ids": torch.tensor(ids)},
              str(folder.parent / "aux.safetensors"))  # fmt: skip
    return aux


def make_drafts(out: Path, target_folder: Path, input_ids: torch.Tensor, aux) -> None:
    target = load_target(target_folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    vocab_size = target.model.config.vocab_size
    vocab = DraftVocab.from_selected(torch.randperm(vocab_size, generator=g)[:2048], vocab_size)
    positions = torch.arange(TOKENS)
    for name, options in DRAFTS.items():
        case = out / name
        save_random_draft(case / "train", target, vocab, g, **options)
        rc = cli(["convert", str(case / "train"), str(case / "draft"), "--to", "eagle",
                  "--target", str(target_folder)])  # fmt: skip
        assert rc == 0, rc
        draft = load_draft(case / "draft", target=target)
        logits, hidden = our_step0(draft, aux, input_ids, positions)
        hot_ids = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size))
        save_file({"input_ids": input_ids, "positions": positions, "aux": aux, "logits": logits,
                   "hidden": hidden, "hot_ids": hot_ids}, str(case / "case.safetensors"))  # fmt: skip
        print(f"{name}: wrote {case}")


def main(out: Path) -> None:
    tokenizer = load_tokenizer("smollm2-135m")
    input_ids = prompt_ids(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "ids": input_ids.tolist()}))
    smollm2 = export_target("smollm2-135m", out / "smollm2" / "target", torch.float32)
    aux = capture_case(smollm2, input_ids)
    for family, overrides in TINY.items():
        make_target(out / family / "tmp", family, **overrides)
        model = load_target(out / family / "tmp", dtype=torch.float32).model
        folder = save_target_folder(model, tokenizer, out / family / "target", torch.float32)
        # 6 layers: the default ids [2, 3, 3] repeat one, which sgl-jax captures once
        capture_case(folder, input_ids % model.config.vocab_size, layer_ids=[1, 3, 5])
    make_drafts(out / "drafts", smollm2, input_ids, aux)


if __name__ == "__main__":
    with torch.no_grad():
        main(Path(sys.argv[1]))
