"""Interop step 2 (speculators venv): load each converted checkpoint with the real client,
`speculators.models.eagle3.Eagle3DraftModel.from_pretrained`, run step 0 (and two
training-time-test steps) on the inputs of make_case.py, and compare draft-vocab logits
with ours (fp32, must agree to 1e-5).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: E402

TOLERANCE = 1e-5


def their_logits(folder: Path, case: dict, ttt_steps: int = 1) -> torch.Tensor:
    kwargs = {}
    if ttt_steps > 1:  # its flex-attention masks need 128-token blocks: dense masks instead
        from speculators.models.eagle3 import Eagle3SpeculatorConfig

        config = Eagle3SpeculatorConfig.from_pretrained(str(folder))
        config.transformer_layer_config._attn_implementation = "eager"
        kwargs["config"] = config
    model = Eagle3DraftModel.from_pretrained(str(folder), dtype=torch.float32, **kwargs).eval()
    captured = []
    model.lm_head.register_forward_hook(lambda mod, args, out: captured.append(out))
    assert torch.equal(model.d2t, case["d2t"]) and torch.equal(model.t2d, case["t2d"]), "d2t/t2d"
    ids = case["input_ids"]
    with torch.no_grad():
        model(
            hidden_states=case["aux"],
            input_ids=ids,
            document_ids=torch.zeros_like(ids),
            position_ids=case["positions"].unsqueeze(0),
            ttt_steps=ttt_steps,
        )
    return torch.stack(captured) if ttt_steps > 1 else captured[0]


def check_pinned_facts() -> None:
    """What eagletools.formats.speculators relies on, asserted against the installed package."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from transformers import LlamaConfig

    fields = Eagle3SpeculatorConfig.model_fields
    # vLLM reads a missing norm_before_residual as True, this package as False: always write it
    assert fields["norm_before_residual"].default is False
    layer = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        num_hidden_layers=1,
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=100,
        target_hidden_size=32,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
    )
    # fc is sized from hidden_size alone: target_hidden_size != hidden_size does not load here
    assert Eagle3DraftModel(config).fc.in_features == 3 * 64
    # norm_before_fc: off by default, one `input_norm` [A*H], refused with fc_norm
    assert fields["norm_before_fc"].default is False
    kwargs = dict(transformer_layer_config=layer, draft_vocab_size=100,
                  eagle_aux_hidden_state_layer_ids=[1, 2, 3])  # fmt: skip
    model = Eagle3DraftModel(Eagle3SpeculatorConfig(**kwargs, norm_before_fc=True))
    assert model.input_norm.weight.shape == (3 * 64,) and "input_norm.weight" in model.state_dict()
    try:
        Eagle3SpeculatorConfig(**kwargs, norm_before_fc=True, fc_norm=True)
    except ValueError:
        pass
    else:
        raise AssertionError("norm_before_fc with fc_norm accepted: update DraftConfig.validate")
    print(
        "pinned facts hold: norm_before_residual defaults to False; fc ignores target_hidden_size; "
        "norm_before_fc is one input_norm, refused with fc_norm"
    )


def main(root: Path) -> int:
    check_pinned_facts()
    worst = 0.0
    for case_dir in sorted(p for p in root.iterdir() if (p / "case.safetensors").is_file()):
        case = load_file(str(case_dir / "case.safetensors"))
        theirs = their_logits(case_dir / "draft", case)
        diff = (theirs - case["logits"]).abs().max().item()
        worst = max(worst, diff)
        print(f"{case_dir.name}: logits {tuple(theirs.shape)}, max abs diff {diff:.3g}")
        # two training-time-test steps: step 1 takes step 0's hidden (normed with norm_output)
        steps = case["ttt_logits"]
        ttt_diff = (their_logits(case_dir / "draft", case, len(steps)) - steps).abs().max().item()
        worst = max(worst, ttt_diff)
        print(f"{case_dir.name}: {len(steps)} TTT steps, max abs diff {ttt_diff:.3g}")
        # without a verifier folder the package cannot load it at all, even with the
        # embeddings shipped: load_verifier_weights asks the hub for a config of None
        unbound = root / f"{case_dir.name}-no-verifier"
        shutil.copytree(case_dir / "draft", unbound, dirs_exist_ok=True)
        config = json.loads((unbound / "config.json").read_text())
        config["speculators_config"]["verifier"]["name_or_path"] = None
        (unbound / "config.json").write_text(json.dumps(config))
        try:
            their_logits(unbound, case)
        except OSError:
            print(f"{case_dir.name}: as pinned, verifier None fails to load offline")
        else:
            raise AssertionError("verifier None loaded: update the speculators writer's warning")
    print(f"max abs difference, ours vs speculators: {worst:.3g} (tolerance {TOLERANCE})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
