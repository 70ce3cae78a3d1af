"""Interop step 2 (speculators venv): load each converted checkpoint with the real client,
`speculators.models.eagle3.Eagle3DraftModel.from_pretrained`, run step 0 (and two
training-time-test steps) on the inputs of make_case.py, and compare draft-vocab logits
with ours (fp32, must agree to 1e-5). A P-EAGLE case (one with `mask_hidden`) loads through
`SpeculatorModel.from_pretrained`, which must pick `PEagleDraftModel`; its training forward
runs on the same inputs and lm_head's output at each sampled (anchor, depth) is compared with
our unroll's step `depth` at `anchor`.
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


def their_block_logits(folder: Path, case: dict, cod: bool = False, attn: str | None = None):
    """speculators' P-EAGLE training forward over the case's inputs (its `input_ids[i]` is the
    token after the one whose aux states are `hidden_states[i]`, as in the eagle3 cases): the
    logits it computes for each sampled slot -> (logits [N,Vd], anchor [N], depth [N]).

    The slots are every depth-0 one plus the case's anchors' whole blocks, or with `cod` what
    its COD sampler draws (seeded; every anchor is a seed, and a chain at anchor -1, its
    index-0 quirk, has no counterpart here and is left out). `attn` replaces the package's
    flex attention with another transformers implementation, fed its dense float mask."""
    from speculators.losses import resolve_loss_config
    from speculators.model import SpeculatorModel
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig, core

    kwargs = {}
    if attn is not None:
        config = PEagleSpeculatorConfig.from_pretrained(str(folder))
        config.transformer_layer_config._attn_implementation = attn
        kwargs["config"] = config
    model = SpeculatorModel.from_pretrained(str(folder), dtype=torch.float32, **kwargs).eval()
    assert type(model) is PEagleDraftModel, type(model)
    check_peagle_loaded(model, folder, case)
    ids, depths = case["input_ids"], len(case["ttt_logits"])
    anchors = case["anchors"]
    sampler, sampled, captured = core.generate_cod_sample_indices, [], []

    def chosen(seq_length: int, **_) -> tuple[torch.Tensor, torch.Tensor]:
        anchor = torch.cat([torch.arange(seq_length), anchors.repeat_interleave(depths - 1)])
        depth = torch.cat([torch.zeros(seq_length, dtype=torch.long),
                           torch.arange(1, depths).repeat(len(anchors))])  # fmt: skip
        return anchor, depth

    def record(**kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        sampled.append((sampler if cod else chosen)(**kwargs))
        return sampled[-1]

    model.lm_head.register_forward_hook(lambda mod, args, out: captured.append(out))
    core.generate_cod_sample_indices = record
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            model(
                hidden_states=case["aux"],
                input_ids=ids,
                document_ids=torch.zeros_like(ids),
                loss_mask=torch.ones(ids.shape),
                verifier_last_hidden_states=torch.zeros(*ids.shape, model.hidden_size),
                loss_config=resolve_loss_config("kl_div", "eager"),  # fused needs Triton
                num_depths=depths,
                down_sample_ratio=1.0,
                down_sample_ratio_min=1.0,
            )
    finally:
        core.generate_cod_sample_indices = sampler
    (anchor, depth), logits = sampled[0], captured[0][0]
    keep = anchor >= 0
    assert depth.max() == depths - 1, "no full block sampled"
    return logits[keep], anchor[keep], depth[keep]


def check_peagle_loaded(model, folder: Path, case: dict) -> None:
    """The config and tensors speculators loaded are the ones written: the type and
    mask token, norm_before_residual as in config.json, and every tensor of the file (its
    loader lets `mask_hidden`, `input_norm.weight` and `embed_tokens` go missing
    silently, re-initialised)."""
    written = json.loads((folder / "config.json").read_text())
    config = model.config
    assert config.speculators_model_type == "peagle", config.speculators_model_type
    assert config.mask_token_id == model.mask_token_id == int(case["mask_token_id"])
    assert config.norm_before_residual is written["norm_before_residual"] is True
    assert model.layers[0].norm_before_residual is True
    assert config.norm_before_fc is written["norm_before_fc"] and model.input_norm is not None
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(str(file))
    state = model.state_dict()
    assert torch.equal(model.mask_hidden.detach(), case["mask_hidden"]), "mask_hidden"
    assert torch.equal(tensors["mask_hidden"], case["mask_hidden"])
    own = {k for k in state if not k.startswith("verifier_")}
    assert own == set(tensors), sorted(own ^ set(tensors))
    for key, value in tensors.items():
        assert torch.equal(state[key], value), key


def check_peagle(case_dir: Path, case: dict) -> float:
    """Ours vs speculators' PEagleDraftModel on the case's blocks (flex attention, then eager)
    and on a COD draw; per depth, the max abs difference of the draft-vocab logits."""
    worst = 0.0
    for label, cod, attn in (("blocks", False, None), ("blocks, eager", False, "eager"),
                             ("COD draw", True, None)):  # fmt: skip
        theirs, anchor, depth = their_block_logits(case_dir / "draft", case, cod, attn)
        ours = case["ttt_logits"][depth, 0, anchor]
        diff = (theirs - ours).abs().amax(-1)
        per_depth = [diff[depth == d].max().item() for d in range(len(case["ttt_logits"]))]
        counts = torch.bincount(depth).tolist()
        worst = max(worst, *per_depth)
        print(f"{case_dir.name} ({label}): slots per depth {counts}, max abs diff per depth "
              f"{[f'{d:.3g}' for d in per_depth]}")  # fmt: skip
    return worst


def check_dflash(case_dir: Path, case: dict) -> float:
    """Ours vs speculators' DFlashDraftModel on the case's anchors (flex attention, then
    eager): every slot of each block, the max abs difference of the draft-vocab logits."""
    from speculators.losses import resolve_loss_config
    from speculators.model import SpeculatorModel
    from speculators.models.dflash import DFlashSpeculatorConfig, core

    folder, anchors, ids = case_dir / "draft", case["anchors"], case["input_ids"]
    worst = 0.0
    for attn in (None, "eager"):
        kwargs = {}
        if attn is not None:
            config = DFlashSpeculatorConfig.from_pretrained(str(folder))
            config.transformer_layer_config._attn_implementation = attn
            kwargs["config"] = config
        model = SpeculatorModel.from_pretrained(str(folder), dtype=torch.float32, **kwargs)
        model = model.eval()
        assert type(model) is core.DFlashDraftModel, type(model)
        assert model.mask_token_id == int(case["mask_token_id"])
        assert model.config.sliding_window_non_causal and not model.uses_sliding_window_attn
        captured: list[torch.Tensor] = []
        select = core.select_anchors
        model.lm_head.register_forward_hook(lambda mod, args, out, seen=captured: seen.append(out))
        core.select_anchors = lambda *_: (anchors, torch.ones(len(anchors), dtype=torch.bool))
        try:
            with torch.no_grad():
                model(hidden_states=case["aux"], input_ids=ids, loss_mask=torch.ones(ids.shape),
                      verifier_last_hidden_states=torch.zeros(*ids.shape, model.config.transformer_layer_config.hidden_size),
                      document_ids=torch.zeros_like(ids), max_anchors=len(anchors),
                      loss_config=resolve_loss_config("kl_div", "eager"))  # fmt: skip
        finally:
            core.select_anchors = select
        theirs = captured[0][0].view(len(anchors), -1, captured[0].shape[-1])
        ours = case["block_logits"][anchors - 1]
        diff = (theirs - ours).abs().amax(-1)
        worst = max(worst, diff.max().item())
        print(f"{case_dir.name} ({attn or 'flex'}): {len(anchors)} blocks of "
              f"{theirs.shape[1]}, max abs diff per slot {diff.amax(0).tolist()}")  # fmt: skip
    return worst


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
        if "block_logits" in case:  # DFlash
            worst = max(worst, check_dflash(case_dir, case))
            continue
        if "mask_hidden" in case:  # P-EAGLE
            worst = max(worst, check_peagle(case_dir, case))
            continue
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
