"""sgl-jax interop step 2 (the `.venv-sgljax` venv, `make interop-sgljax`): sgl-jax's own
models on the inputs tests/interop/make_sgljax_case.py wrote, against ours, fp32 on CPU.

1. transformers 4 (sgl-jax's pin) reads our exported target as the same model: its
   config (rope_theta) and tokenizer (the same ids, a chat template).
2. Each eagle-layout draft loads through `LlamaForCausalLMEagle3.load_weights`: every
   tensor mapped (t2d aside: sgl-jax derives nothing from it), every mapping found,
   and its hot token ids equal ours (`d2t + arange`).
3. Step 0 on the same tokens, positions and aux states: its hidden output and logits
   against ours. Two sgl-jax choices run an fp32 draft partly in bf16: the lm_head is
   stored bf16 (`llama_eagle3.py` builds `ParallelLMHead` without `param_dtype`, default
   bf16 in `layers/embeddings.py`) and the attention input is concatenated as bf16
   (`llama_eagle3.py:117`). Both are reported as shipped, then lifted to fp32 to compare
   the arithmetic. The `plain` draft must agree to TOLERANCE; the `demo` draft
   (`norm_before_residual`) must not, as sgl-jax always takes the residual before
   `hidden_norm` (if it ever agrees, update eagletools/formats/engines.py).
4. Its Llama and Qwen3 target models capture the aux states our trainer captured.

sgl-jax's native attention returns each head padded to the KV pool's 128-aligned width
(`native_backend.py:327`, the pool pads in `memory_pool.py:70`); the check slices it back
(`SlicedNativeAttention`), the one fix this path needs to run at all.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.srt.layers.attention.native_backend import NativeAttention  # noqa: E402
from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sgl_jax.srt.model_loader.loader import get_model_architecture  # noqa: E402
from sgl_jax.srt.models import llama_eagle3  # noqa: E402
from sgl_jax.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402
from sgl_jax.srt.utils.mesh_utils import create_device_mesh  # noqa: E402

TOLERANCE = 1e-4  # fp32 logits, max abs difference
MESH = create_device_mesh(ici_parallelism=[1, 1], dcn_parallelism=[1, 1])


class SlicedNativeAttention(NativeAttention):
    """sgl-jax's native attention with each head's output cut back to the model's head_dim."""

    def __call__(self, q, k, v, layer, forward_batch, token_to_kv_pool, **kwargs):
        out, kv = super().__call__(q, k, v, layer, forward_batch, token_to_kv_pool, **kwargs)
        n = out.shape[0]
        return out.reshape(n, layer.q_head_num, -1)[..., : layer.v_head_dim].reshape(n, -1), kv


def lift_bf16(lift: bool) -> None:
    """Build sgl-jax's draft with an fp32 lm_head and fp32 attention input, or as shipped."""
    from sgl_jax.srt.layers.embeddings import ParallelLMHead

    llama_eagle3.ParallelLMHead = (
        functools.partial(ParallelLMHead, param_dtype=jnp.float32) if lift else ParallelLMHead
    )
    concat = _concatenate_keeping_dtype if lift else jnp.concatenate
    llama_eagle3.jnp = types.SimpleNamespace(**{**vars(jnp), "concatenate": concat})


def _concatenate_keeping_dtype(arrays, axis=0, dtype=None):
    return jnp.concatenate(arrays, axis=axis)


def load_model(folder: Path, is_draft: bool):
    """The model class sgl-jax picks for `folder`, loaded by its own loader, fp32."""
    config = ModelConfig(str(folder), dtype="float32", is_draft_model=is_draft)
    model_class, _ = get_model_architecture(config)
    with jax.set_mesh(MESH):
        model = nnx.eval_shape(lambda: model_class(config.hf_config, dtype=jnp.float32, mesh=MESH))
        model.load_weights(config)
    return model, config.hf_config


def forward_batch(hf_config, input_ids: np.ndarray, positions: np.ndarray, spec_info=None):
    """One EXTEND (prefill) batch of equal-length sequences from an empty KV pool."""
    b, t = input_ids.shape
    locs = jnp.arange(1, b * t + 1, dtype=jnp.int32)  # native attention treats slot 0 as padding
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    pool = MHATokenToKVPool(
        size=b * t + 1, page_size=1, dtype=jnp.float32, head_num=kv_heads,
        head_dim=-(-getattr(hf_config, "head_dim", hf_config.hidden_size // heads) // 128) * 128,
        layer_num=hf_config.num_hidden_layers, mesh=MESH,
    )  # fmt: skip
    batch = ForwardBatch(
        bid=0, forward_mode=ForwardMode.EXTEND, batch_size=b,
        input_ids=jnp.asarray(input_ids.reshape(-1), jnp.int32),
        req_pool_indices=jnp.arange(b, dtype=jnp.int32), seq_lens=jnp.full((b,), t, jnp.int32),
        out_cache_loc=locs, positions=jnp.asarray(np.tile(positions, b), jnp.int32),
        attn_backend=SlicedNativeAttention(heads, kv_heads, MESH), cache_loc=locs,
        extend_prefix_lens=jnp.zeros((b,), jnp.int32), extend_seq_lens=jnp.full((b,), t, jnp.int32),
        spec_info=spec_info,
    )  # fmt: skip
    return batch, pool


def check_transformers4_reads_our_target(folder: Path, prompts: dict) -> None:
    """Our exported target is the same model and tokenizer under transformers 4."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    theta = config.rope_parameters["rope_theta"]  # kept as an unknown field by transformers 4
    assert config.rope_theta == theta, f"transformers 4 reads rope_theta {config.rope_theta}"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer(p).input_ids[: len(prompts["ids"][0])] for p in prompts["prompts"]]
    assert ids == prompts["ids"], "transformers 4 tokenizes the prompts differently"
    assert tokenizer.chat_template, "transformers 4 finds no chat template"
    print(f"transformers {transformers.__version__} reads {folder}: rope_theta {theta}, "
          f"{type(tokenizer).__name__} with its chat template, the same prompt ids")  # fmt: skip


def check_weights_loaded(folder: Path, model, case) -> None:
    with safe_open(folder / "model.safetensors", "np") as f:
        ours = set(f.keys())  # noqa: SIM118 (safe_open is not iterable)
    mapped = set(model._create_llama_ealge3_weight_mappings())
    assert ours - mapped == {"t2d"}, f"tensors sgl-jax leaves: {sorted(ours - mapped)}"
    assert mapped <= ours, f"mappings without a tensor: {sorted(mapped - ours)}"
    assert np.array_equal(np.asarray(model.hot_token_ids.value), case["hot_ids"]), "hot ids"
    print(f"{folder}: {len(ours & mapped)} tensors mapped, only t2d left; hot ids = d2t + arange")


def draft_step0(folder: Path, embed: np.ndarray, case, lift: bool):
    """sgl-jax's draft on the case: (logits [B*T, Vd], hidden output [B*T, H])."""
    lift_bf16(lift)
    model, hf_config = load_model(folder, is_draft=True)
    if lift:
        check_weights_loaded(folder, model, case)
    ids = case["input_ids"]
    aux = jnp.asarray(case["aux"].reshape(ids.size, -1))
    with jax.set_mesh(MESH):
        model.model.embed_tokens.embedding.value = jnp.asarray(embed)  # set_embed's job
        batch, pool = forward_batch(
            hf_config, ids, case["positions"], EagleDraftInput(hidden_states=aux)
        )
        normed, (hidden,), _, _ = model.model(batch, pool)
        logits = normed @ model.lm_head.embedding.value.T  # what its logits processor applies
    return np.asarray(logits, np.float32), np.asarray(hidden)


def check_draft(folder: Path, embed: np.ndarray, must_match: bool) -> float:
    case = load_file(str(folder.parent / "case.safetensors"))
    ours_logits = case["logits"].reshape(-1, case["logits"].shape[-1])
    ours_hidden = case["hidden"].reshape(-1, case["hidden"].shape[-1])
    shipped, _ = draft_step0(folder, embed, case, lift=False)
    logits, hidden = draft_step0(folder, embed, case, lift=True)
    diff = float(np.abs(logits - ours_logits).max())
    rel_hidden = float(np.abs(hidden - ours_hidden).max() / np.abs(ours_hidden).max())
    print(f"{folder.parent.name}: {ours_logits.shape[0]} positions, logits max abs diff "
          f"{float(np.abs(shipped - ours_logits).max()):.3g} as shipped (bf16 head and attention "
          f"input), {diff:.3g} in fp32; hidden max rel diff {rel_hidden:.3g}")  # fmt: skip
    if must_match:
        assert diff <= TOLERANCE and rel_hidden <= TOLERANCE, f"{folder}: sgl-jax differs"
    else:
        assert diff > 100 * TOLERANCE, f"{folder}: sgl-jax now matches: update formats/engines.py"
    return diff


def check_aux(target: Path) -> None:
    """sgl-jax's target model captures the states our trainer did: at its default ids
    when ours are the default, else at the ids an `eagle_config` would give it."""
    case = load_file(str(target.parent / "aux.safetensors"))
    model, hf_config = load_model(target, is_draft=False)
    n, hf_ids = hf_config.num_hidden_layers, case["layer_ids"].tolist()
    default = hf_ids == [2, n // 2, n - 3]
    model.set_eagle3_layers_to_capture(None if default else [i - 1 for i in hf_ids])
    ids = case["input_ids"]
    with jax.set_mesh(MESH):
        batch, pool = forward_batch(hf_config, ids, np.arange(ids.shape[1]))
        _, aux, _, _ = model.model(batch, pool)
    theirs = np.concatenate([np.asarray(a) for a in aux], axis=-1)
    ours = case["aux"].reshape(theirs.shape)
    rel = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    print(f"{target.parent.name} ({type(model).__name__}): aux states {theirs.shape} at HF ids "
          f"{hf_ids}{' (its default)' if default else ''}, max rel diff {rel:.3g}")  # fmt: skip
    assert rel <= TOLERANCE, f"{target}: aux states differ"


def main(root: Path) -> int:
    smollm2 = root / "smollm2" / "target"
    check_transformers4_reads_our_target(smollm2, json.loads((root / "prompts.json").read_text()))
    embed = load_file(str(smollm2 / "model.safetensors"))["model.embed_tokens.weight"]
    diff = check_draft(root / "drafts" / "plain" / "draft", embed, must_match=True)
    check_draft(root / "drafts" / "demo" / "draft", embed, must_match=False)
    for family in ("smollm2", "llama", "qwen3"):
        check_aux(root / family / "target")
    print(f"max abs difference, ours vs sgl-jax: {diff:.3g} (tolerance {TOLERANCE})")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
