"""The EAGLE-3 draft head (docs/design.md 3.3), in one file.

One Llama-style decoder layer whose attention input is the concatenation of
the normed token embedding and the normed hidden state (2H wide), optionally
followed by plain Llama decoder layers `layer1`, ... (`num_hidden_layers` > 1, as
speculators' `--num-layers` builds them). A layer's
attention is left to the caller: training-time test attends over a causal
block plus a diagonal per unrolled step, the tree decoder over a KV cache with
a tree mask. Training uses `qkv` before and `finish` after its attention;
decoding (`Eagle3Draft.decode`) runs the same layer through fused products
and a RoPE table (`DecodeWeights`), made from the same weights.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eagletools.attention import causal_attention, heads_for_mask
from eagletools.cpu_ops import linear, rms_norm
from eagletools.draft.config import DraftConfig
from eagletools.rope import RotaryEmbedding, apply_rope
from eagletools.targets import anatomy

_INITIALISERS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")


@contextmanager
def meta_device() -> Iterator[None]:
    """Build modules on the meta device without running their initialisers.

    Initialising a meta tensor computes nothing, yet its first use imports
    torch._dynamo (~170 MB of memory and seconds on 2 cores): shape checks
    and weight copies only need the structure.
    """
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One op that normalises in fp32: per-op overhead matters at batch 1 on CPU. The
        # weight follows x's dtype (fp32 master weights under bf16 autocast).
        return rms_norm(x, self.weight, self.eps)


def later_layer_name(i: int) -> str:
    """The attribute (and tensor-name prefix) of plain layer i >= 1: `layer1`, ..."""
    return f"layer{i}"


def split_later_layer_key(key: str) -> tuple[int, str] | None:
    """(i, the rest) of a tensor name `layer{i}.rest`, else None."""
    match = re.fullmatch(r"layer([1-9][0-9]*)\.(.+)", key)
    return (int(match[1]), match[2]) if match else None


class Attention(nn.Module):
    def __init__(self, config: DraftConfig, width: int):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(width, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A plain Llama decoder layer over the draft's hidden [.., H]: the layers after the
    first. `qkv` before and `finish` after an attention the caller runs."""

    def __init__(self, config: DraftConfig, width: int | None = None, hidden_norm: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if hidden_norm:  # registered here: the state dict's order stays the one-layer head's
            self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, width or config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def qkv(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [B,T,H] -> q [B,nh,T,hd], k, v [B,nkv,T,hd], residual [B,T,H]."""
        return (*self.project(self.input_layernorm(hidden), cos, sin), hidden)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn_out [B,nh,T,hd] -> the layer's pre-norm output [B,T,H]."""
        b, _, t, _ = attn_out.shape
        h = self.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1)) + residual
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Layer(DecoderLayer):
    """The `midlayer`: a decoder layer whose q/k/v read the normed embedding and the
    normed hidden side by side (2H wide), with its own norm for the hidden."""

    def __init__(self, config: DraftConfig):
        super().__init__(config, 2 * config.hidden_size, hidden_norm=True)
        self.norm_before_residual = config.norm_before_residual

    def qkv(  # type: ignore[override]  # the first layer also reads the token embedding
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds, hidden [B,T,H] -> q [B,nh,T,hd], k, v [B,nkv,T,hd], residual [B,T,H]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        return (*self.project(x, cos, sin), residual)


@dataclass(frozen=True)
class DecodeWeights:
    """What `Eagle3Draft.decode` multiplies and rotates by, beside the module's own weights.

    Decoding runs a handful of rows per call, where each product and each small
    op costs about as much as its arithmetic: q/k/v become one product and
    gate/up another (5 products per forward instead of 8), and RoPE is a
    lookup in a table made once instead of ~10 ops per call. The separate
    weights stay the module's (the checkpoint keys, what training multiplies).
    """

    source: tuple[tuple[int, int], ...]  # (storage, version) of each weight fused
    qkv: tuple[torch.Tensor, ...]  # per layer [(nh + 2 nkv) * hd, 2H or H]: q, k, v rows
    gate_up: tuple[torch.Tensor, ...]  # per layer [2I, H]: gate, up rows
    # [max_position_embeddings, 2, 1, hd]: cos and sin per position, sin with the sign
    # of `rotate_half` folded in (x.roll(hd/2) * sin == rotate_half(x) * |sin|, exactly)
    rope: torch.Tensor


def weight_identity(weight: torch.Tensor) -> tuple[int, int]:
    """Tells a weight changed: its storage (`.to()`) or its version (in-place updates);
    inference tensors keep no version."""
    return weight.data_ptr(), 0 if weight.is_inference() else weight._version


@dataclass
class DraftKVCache:
    """Static K/V storage for decoding, [n_layers, B, n_kv_heads, max_len, head_dim].

    `layers` holds each layer's (K, V) views, made once: a view per decode call is
    one more op dispatched, and the decoder calls the draft a few times a step."""

    k: torch.Tensor
    v: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0), strict=True))

    @classmethod
    def allocate(
        cls,
        config: DraftConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> DraftKVCache:
        shape = (
            config.num_hidden_layers, batch_size, config.num_key_value_heads, max_len,
            config.head_dim,
        )  # fmt: skip
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )


class DraftHead(nn.Module):
    """What every kind's draft shares: the target's frozen embeddings, an output norm and
    a head over the draft vocabulary with `d2t`/`t2d`, RoPE, and decoding through fused
    weights (`decode_weights`, `_decode_layer`). A kind brings its layers (`draft_layers`)
    and how the target's states enter them."""

    config: DraftConfig

    def _add_embeddings(self, config: DraftConfig) -> None:
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen

    def _add_output(self, config: DraftConfig) -> None:
        """The output norm and head, RoPE and the vocabulary maps, registered after the
        layers (the checkpoint's key order), then every product initialised."""
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.apply(self._init_weights)
        self._decode_weights: DecodeWeights | None = None  # made by the first `decode`

    def draft_layers(self) -> list[DecoderLayer]:
        """Every layer a draft forward runs, in order."""
        raise NotImplementedError

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    @classmethod
    def from_target(
        cls,
        model: nn.Module,
        draft_vocab=None,
        aux_layer_ids: list[int] | None = None,
        init_head_from_target: bool = True,
        **overrides,
    ) -> DraftHead:
        """A draft sized from a Hugging Face target: same width, heads and RoPE.

        The embeddings are copied and frozen. With `init_head_from_target`, the
        output norm and `lm_head` start as the target's (draft-vocab rows only),
        so step 0 begins near the target's own distribution.
        """
        from eagletools.vocab import DraftVocab

        tc = anatomy.text_config(model.config)
        aux_layer_ids = anatomy.resolve_aux_layer_ids(aux_layer_ids, tc.num_hidden_layers)
        vocab_size = tc.vocab_size
        if draft_vocab is None:
            draft_vocab = DraftVocab.identity(vocab_size)
        rope_theta, rope_scaling = anatomy.rope_of(tc)
        fields = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=tc.num_key_value_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            vocab_size=vocab_size,
            draft_vocab_size=int(draft_vocab.d2t.numel()),
            target_hidden_size=tc.hidden_size,
            num_aux_states=len(aux_layer_ids),
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=tc.max_position_embeddings,
        )
        fields.update(overrides)
        draft = cls(DraftConfig(**fields))
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(anatomy.embed_tokens(model).weight.float())
            draft.d2t.copy_(draft_vocab.d2t)
            draft.t2d.copy_(draft_vocab.t2d)
            if init_head_from_target and draft.config.hidden_size == tc.hidden_size:
                rows = torch.arange(draft.config.draft_vocab_size) + draft_vocab.d2t
                draft.lm_head.weight.copy_(anatomy.lm_head(model).weight[rows].float())
                draft.norm.weight.copy_(anatomy.final_norm(model).weight.float())
        return draft

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, dtype)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def decode_weights(self) -> DecodeWeights:
        """The fused weights and RoPE table `decode` uses, made again when a weight changes.

        The table holds every position below `max_position_embeddings`, from
        fp32 frequencies, as training rotates: the module's `inv_freq` buffer
        follows `.to(bfloat16)`, and its rounded frequencies turn up to 8
        degrees away from training's by position 100, 80 by position 1000
        (SmolLM2's RoPE).
        """
        if torch.compiler.is_compiling() and self._decode_weights is not None:
            return self._decode_weights  # compiled steps freeze the weights anyway
        layers = self.draft_layers()
        qkv = [(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in layers)]
        gate_up = [(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in layers]
        source = tuple(weight_identity(p.weight) for parts in (*qkv, *gate_up) for p in parts)
        if self._decode_weights is None or self._decode_weights.source != source:
            weight = layers[0].self_attn.q_proj.weight
            c = self.config
            rotary = RotaryEmbedding(
                c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
            ).to(weight.device)
            positions = torch.arange(c.max_position_embeddings, device=weight.device)
            cos, sin = rotary(positions, weight.dtype)
            sin[:, : c.head_dim // 2].neg_()
            self._decode_weights = DecodeWeights(
                source,
                tuple(torch.cat([p.weight for p in parts]) for parts in qkv),
                tuple(torch.cat([p.weight for p in parts]) for parts in gate_up),
                torch.stack([cos, sin], dim=1)[:, :, None],
            )
        return self._decode_weights

    def _decode_layer(
        self,
        i: int,
        x: torch.Tensor,
        residual: torch.Tensor,
        fused: DecodeWeights,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: DraftKVCache,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        last_only: bool,
    ) -> torch.Tensor:
        """Layer i of `decode`: its normed input x [B,n,W] and residual [B,n,H] -> its
        output [B,n,H] (the last row's alone with `last_only`); its K/V go to the
        cache's entry i at `slots`."""
        layer = self.draft_layers()[i]
        qkv_weight, gate_up_weight = fused.qkv[i], fused.gate_up[i]
        cos, sin = rope
        keys, values = cache.layers[i]
        attn = layer.self_attn
        b, n, _ = x.shape
        nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qk, v = linear(x, qkv_weight, None).split([(nh + nkv) * hd, nkv * hd], dim=-1)
        qk = qk.view(b, n, nh + nkv, hd)
        if hasattr(attn, "q_norm"):
            q, k = qk.split([nh, nkv], dim=2)
            qk = torch.cat([attn.q_norm(q), attn.k_norm(k)], dim=2)
        qk = qk * cos + qk.roll(hd // 2, -1) * sin  # q and k heads in one pass
        q, k = qk.transpose(1, 2).split([nh, nkv], dim=1)
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v.view(b, n, nkv, hd).transpose(1, 2))
        if last_only:
            q, residual, n = q[:, :, -1:], residual[:, -1:], 1
            mask = None if mask is None else mask[..., -1:, :]
        if mask is None:  # a long causal run (a prompt): fused kernels, no mask
            length = int(slots[-1]) + 1
            out = causal_attention(q, keys[:, :, :length], values[:, :, :length])
        else:
            length = mask.shape[-1]
            k, v = heads_for_mask(q, keys[:, :, :length]), heads_for_mask(q, values[:, :, :length])
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != nh
            )
        h = linear(out.transpose(1, 2).reshape(b, n, nh * hd), attn.o_proj.weight, None) + residual
        gate, up = linear(layer.post_attention_layernorm(h), gate_up_weight, None).chunk(2, -1)
        return h + linear(F.silu(gate) * up, layer.mlp.down_proj.weight, None)


class Eagle3Draft(DraftHead):
    """EAGLE-3 draft head; `state_dict()` keys are the `eagle` checkpoint keys."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self._add_embeddings(config)
        self.fc = nn.Linear(
            config.num_aux_states * config.target_hidden_size, config.hidden_size, bias=False
        )
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                for _ in range(config.num_aux_states)
            )
        if config.norm_before_fc:  # one norm over all states: vLLM's and speculators' name
            self.input_norm = RMSNorm(
                config.num_aux_states * config.target_hidden_size, config.rms_norm_eps
            )
        self.midlayer = Eagle3Layer(config)
        # children of the draft itself, as `midlayer`: FSDP2 wraps any module past a size,
        # and refuses a ModuleList or ModuleDict (containers without a forward)
        for i in range(1, config.num_hidden_layers):
            self.add_module(later_layer_name(i), DecoderLayer(config))
        self._add_output(config)

    def later_layers(self) -> list[DecoderLayer]:
        """The plain layers after `midlayer`, in order (none for a one-layer head)."""
        return [getattr(self, later_layer_name(i)) for i in range(1, self.config.num_hidden_layers)]

    def draft_layers(self) -> list[DecoderLayer]:
        """`midlayer`, then the plain layers: every layer a draft step runs, in order."""
        return [self.midlayer, *self.later_layers()]

    def fuse_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux states [.., A*Ht] -> draft hidden [.., H].

        With `fc_norm` each state is normalised on its own first: a target's
        layers differ in scale (SmolLM2: RMS 3 at layer 2, 64 at layer 15,
        single values up to 25k), which a shared `fc` would otherwise inherit.
        With `norm_before_fc` one norm (`input_norm`) covers the whole concatenation.
        """
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            parts = aux.split(self.config.target_hidden_size, dim=-1)
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(aux)

    def head(self, layer_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output [.., H] -> (draft-vocab logits [.., Vd], the hidden
        the next step takes [.., H]).

        EAGLE-3 carries the output on before `norm`; EAGLE-3.1 (`norm_output`)
        carries the normed one, so later steps see inputs of one scale.
        """
        normed = self.norm(layer_out)
        return self.lm_head(normed), normed if self.config.norm_output else layer_out

    @torch.no_grad()
    def refresh(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftKVCache,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over rows the target has run: aux [B,n,A*Ht] and the tokens after
        them [B,n] -> `decode`'s output (the first proposal grows from its last row)."""
        return self.decode(self.fuse_aux(aux), input_ids, positions, cache, slots, mask, last_only)

    @torch.no_grad()
    def decode(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftKVCache,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over n new tokens for decoding.

        hidden [B,n,H] (`fuse_aux` output or the previous step's `head`
        output), input_ids [B,n], positions [n] or [B,n] (below
        `max_position_embeddings`). K/V are written at cache `slots` [n]; the
        queries attend over cache slots `[0, mask.shape[-1])` where `mask`
        [n, L] (or [B,1,n,L]) is True, or, with mask None (a prompt), causally
        over slots up to `slots[-1]` (read back once); the cache holds K/V in the
        draft's dtype. Returns (draft logits [B,n,Vd], the hidden the next step
        takes [B,n,H]). The layers of `midlayer.qkv` and `finish`, through
        `decode_weights()`; with a mask its shapes depend on n and L only, and
        nothing is read back from the device. `last_only` (a prompt's pass): every
        token's K/V is written, but attention, MLP and head run for the last token
        alone, the only one whose outputs a tree grows from (a 16k prompt's
        [n, Vd] logits and [n, I] MLP products are 0.5-1.4 GB at 8B widths).
        """
        fused = self.decode_weights()
        layers = self.draft_layers()
        normed = self.midlayer.hidden_norm(hidden)
        embeds = self.midlayer.input_layernorm(self.embed_tokens(input_ids).to(hidden.dtype))
        x = torch.cat([embeds, normed], dim=-1)
        residual = normed if self.midlayer.norm_before_residual else hidden
        rope = fused.rope[positions].unbind(-3)  # cos, sin [.., n, 1, hd]
        last = len(layers) - 1  # with `last_only`, earlier layers still feed every row on
        step = functools.partial(self._decode_layer, fused=fused, rope=rope, cache=cache,
                                 slots=slots, mask=mask)  # fmt: skip
        h = step(0, x, residual, last_only=last_only and last == 0)
        for i, layer in enumerate(layers[1:], 1):  # its own norm, the residual unnormed
            h = step(i, layer.input_layernorm(h), h, last_only=last_only and i == last)
        return self.head(h)
