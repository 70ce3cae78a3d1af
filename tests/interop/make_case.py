"""Interop step 1 (project venv): a tiny target, a random draft, `convert --to speculators`,
and our module's draft-vocab logits on random inputs, all written under OUT.

Step 2 (tests/interop/check_speculators.py, in the speculators venv) loads the
converted checkpoint with `Eagle3DraftModel.from_pretrained` and compares. A `peagle`
case is a P-EAGLE draft, loaded there by `PEagleDraftModel`; its expectation is our
`ParallelModel` unroll, every depth at every anchor. A `dflash` case is a DFlash draft,
loaded there by `DFlashDraftModel`; its expectation is our `BlockModel`'s blocks.

`make_case.py OUT [NAME ...]` makes the cases named (default: all).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_formats import save_target_folder  # noqa: E402

from eagletools.cli import main as cli
from eagletools.draft import DFlashDraft, DraftKVCache, Eagle3Draft, PEagleDraft
from eagletools.formats import Checkpoint, load_draft, save_checkpoint
from eagletools.targets import load_target
from eagletools.vocab import DraftVocab

CASES = {
    # llama3-scaled RoPE and norm_before_residual exercise the config translation
    "llama": dict(
        target=dict(
            model_type="llama",
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            max_position_embeddings=8192,
        ),
        draft=dict(norm_before_residual=True),
    ),
    # Qwen3-style q/k norms travel as transformer_layer_config.model_type "qwen3"
    "qwen3": dict(target=dict(model_type="qwen3", head_dim=16), draft=dict(qk_norm=True)),
    # EAGLE-3.1: per-aux-state norms before fc (step 0 sees them; norm_output acts from step 1)
    "eagle3.1": dict(target=dict(model_type="llama"), draft=dict(fc_norm=True, norm_output=True)),
    # one norm over the concatenated aux states (speculators' training default, `input_norm`)
    "norm-before-fc": dict(
        target=dict(model_type="llama"), draft=dict(norm_before_fc=True, norm_before_residual=True)
    ),
    # a plain Llama layer after the EAGLE-3 one (speculators' --num-layers 2): its keys are
    # layers.1.*, and across TTT steps it attends over its own K/V of each step
    "two-layers": dict(
        target=dict(model_type="llama"), draft=dict(norm_before_residual=True, num_hidden_layers=2)
    ),
    # P-EAGLE as speculators' CLI trains it (qwen3 layer, norm_before_residual), with
    # norm_before_fc so that mask_hidden goes through a non-unit input_norm before fc
    "peagle": dict(
        target=dict(model_type="qwen3", head_dim=16), kind=PEagleDraft, depths=4,
        draft=dict(qk_norm=True, norm_before_residual=True, norm_before_fc=True),
    ),
    # DFlash on a Llama target (SmolLM2's family): Qwen3 layers with q/k norms, two of them,
    # a block of 4 that every slot sees whole
    "dflash": dict(
        target=dict(model_type="llama"), kind=DFlashDraft,
        draft=dict(block_size=4, num_hidden_layers=2),
    ),
}  # fmt: skip


def make_target(folder: Path, model_type: str, **overrides) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        tie_word_embeddings=False, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    save_target_folder(folder, AutoModelForCausalLM.from_config(config))


def our_step0(draft: Eagle3Draft, aux, input_ids, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0 of EAGLE-3 over whole sequences [B,T]: fc(aux), one causal layer; returns
    (draft-vocab logits, the hidden the next step takes)."""
    b, t = input_ids.shape
    cache = DraftKVCache.allocate(draft.config, b, t, torch.float32, "cpu")
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return draft.decode(draft.fuse_aux(aux), input_ids, positions, cache, torch.arange(t), causal)


def our_ttt_logits(draft: Eagle3Draft, aux, input_ids, steps: int = 2) -> torch.Tensor:
    """The first `steps` training-time-test steps (teacher-forced ids, each step's hidden
    carried to the next: where `norm_output` acts), their draft-vocab logits [steps,B,T,Vd].
    For a `PEagleDraft`, P-EAGLE's unroll: step j at t is depth j of the block anchored at t
    (the mask token and `mask_hidden` from step 1)."""
    from eagletools.train.parallel import ParallelModel
    from eagletools.train.ttt import TTTModel

    captured = []
    hook = draft.lm_head.register_forward_hook(lambda mod, args, out: captured.append(out))
    # TTT feeds step 0 the ids shifted by one against the aux states: prepend a dummy id
    # and append a dummy aux row, which causal attention keeps from the real positions
    b, t = input_ids.shape
    ids = torch.cat([input_ids.new_zeros(b, 1), input_ids], dim=1)
    aux = torch.cat([aux, aux.new_zeros(b, 1, aux.shape[-1])], dim=1)
    vd = draft.config.draft_vocab_size
    uniform = torch.full((b, t + 1, vd), 1 / vd)
    unroll = ParallelModel if isinstance(draft, PEagleDraft) else TTTModel
    unroll(draft, steps=steps)(ids, aux, torch.ones_like(ids), uniform, torch.zeros_like(ids))
    hook.remove()
    return torch.stack([logits[:, :t] for logits in captured])


def save_random_draft(
    folder: Path, target, vocab: DraftVocab, g: torch.Generator, kind=Eagle3Draft, **options
):
    """A draft for `target` with random weights, norms included (so no weight is trivially
    shared; P-EAGLE's `mask_hidden` too), saved as a training checkpoint for `convert`."""
    draft = kind.from_target(target.model, vocab, **options)
    with torch.no_grad():
        for k, p in draft.named_parameters():
            if k != "embed_tokens.weight":
                p.copy_(
                    torch.randn(p.shape, generator=g) * (0.05 if p.dim() == 2 else 0.3)
                    + (p.dim() == 1)
                )
    tensors = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    save_checkpoint(Checkpoint("memory", draft.config, tensors, "memory"), folder, "training")


def make_case(out: Path, name: str) -> None:
    spec = CASES[name]
    make_target(out / "target", **spec["target"])
    target = load_target(out / "target", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    vocab = DraftVocab.from_selected(torch.randperm(256, generator=g)[:96], 256)
    kind = spec.get("kind", Eagle3Draft)
    save_random_draft(out / "train", target, vocab, g, kind, aux_layer_ids=[1, 3, 5],
                      **spec["draft"])  # fmt: skip
    rc = cli(["convert", str(out / "train"), str(out / "draft"), "--to", "speculators",
              "--target", str(out / "target"), "--with-embeddings"])  # fmt: skip
    assert rc == 0, rc
    ours = load_draft(out / "draft", target=target)
    aux = torch.randn(1, 12, 3 * 64, generator=g)
    input_ids = torch.randint(0, 256, (1, 12), generator=g)
    if isinstance(ours, DFlashDraft):
        return save_dflash_case(out, ours, aux, input_ids)
    positions = torch.arange(12) + 100
    with torch.no_grad():
        logits, _ = our_step0(ours, aux, input_ids, positions)
        ttt_logits = our_ttt_logits(ours, aux, input_ids, spec.get("depths", 2))
    torch.testing.assert_close(ttt_logits[0], logits, atol=1e-5, rtol=1e-5)  # RoPE is relative
    case = {"aux": aux, "input_ids": input_ids, "positions": positions, "logits": logits,
            "ttt_logits": ttt_logits}  # fmt: skip
    if isinstance(ours, PEagleDraft):
        assert type(ours) is kind and ours.config.norm_before_residual
        # ttt_logits [K,1,T,Vd]: depth d of the block anchored at t (its slot at t+d);
        # the check compares these anchors' whole blocks, and wherever COD samples
        case |= {"anchors": torch.tensor([0, 3, 6, 12 - len(ttt_logits)]),
                 "mask_hidden": ours.mask_hidden.detach().clone(),
                 "mask_token_id": torch.tensor(ours.config.mask_token_id)}  # fmt: skip
    save_file({**case, "d2t": ours.d2t, "t2d": ours.t2d},
              str(out / "case.safetensors"))  # fmt: skip
    print(f"{name}: wrote {out}")


def save_dflash_case(out: Path, ours: DFlashDraft, aux, input_ids) -> None:
    """Our blocks after every position [T,S,Vd] (the block after t holds the token t+1
    then the mask) and the anchors the check asks speculators for (its anchor a is the
    position of the block's first token, so our block a-1)."""
    from eagletools.train.block import BlockModel

    assert ours.config.block_size == 4 and len(ours.layers) == 2
    with torch.no_grad():
        states = BlockModel(ours).block_states(input_ids, aux, None)
        logits = ours.lm_head(states)[0]
    case = {"aux": aux, "input_ids": input_ids, "block_logits": logits,
            "anchors": torch.tensor([1, 4, 6, 12 - ours.config.block_size]),
            "mask_token_id": torch.tensor(ours.config.mask_token_id)}  # fmt: skip
    save_file(case, str(out / "case.safetensors"))
    print(f"dflash: wrote {out}")


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name in sys.argv[2:] or CASES:
        make_case(root / name, name)
