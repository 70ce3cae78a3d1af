"""The DFlash draft: a stack of Qwen3-style layers that fills a whole block in one
non-causal forward, conditioned on the target's states through every layer's keys
and values (docs/design.md 3.7).

The target's aux states at each context position go once through `fc` and
`hidden_norm` (the context c); each layer projects c with its own `k_proj` and
`v_proj` (then `k_norm` and RoPE at the context position) and puts these keys
and values before the block's. The block is the token after the context (the
bonus token) then `block_size - 1` mask tokens at the following positions,
embedded by the target's frozen embeddings; every slot sees the whole context
and every slot of its block, and slot k proposes the token at its own position.
c never enters the token stream. As speculators 0.9.0 `dflash` builds it (with
every layer full-attention and non-causal) and vLLM 0.32.0 serves it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from eagletools.cpu_ops import linear
from eagletools.draft.config import DraftConfig
from eagletools.draft.model import DecoderLayer, DraftHead, DraftKVCache, RMSNorm

DEFAULT_BLOCK_SIZE = 8  # speculators' default: the bonus token and 7 proposals


class DFlashDraft(DraftHead):
    """`state_dict()` keys are speculators' `dflash` keys: `fc`, `hidden_norm`,
    `layers.{i}.*`, `norm`, `lm_head`, with the target's `embed_tokens`."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self._add_embeddings(config)
        width = config.num_aux_states * config.target_hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self._add_output(config)

    @classmethod
    def from_target(cls, model: nn.Module, draft_vocab=None, **fields: Any) -> DFlashDraft:
        """`DraftHead.from_target` with Qwen3's q/k norms, the block 8 slots and the mask
        token the target's last id, unless given."""
        from eagletools.targets import anatomy

        if fields.get("mask_token_id") is None:
            fields["mask_token_id"] = anatomy.text_config(model.config).vocab_size - 1
        fields.setdefault("block_size", DEFAULT_BLOCK_SIZE)
        return super().from_target(model, draft_vocab, **fields, qk_norm=True, kind="dflash")

    def draft_layers(self) -> list[DecoderLayer]:
        return list(self.layers)

    def fuse_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux states [.., A*Ht] -> the context c [.., H]."""
        return self.hidden_norm(self.fc(aux))

    def context_kv(
        self, layer: DecoderLayer, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values of the context c [B,T,H] -> k, v [B,nkv,T,hd]."""
        from eagletools.rope import apply_rope

        attn = layer.self_attn
        b, t, _ = context.shape
        k = attn.k_norm(attn.k_proj(context).view(b, t, attn.num_kv_heads, attn.head_dim))
        v = attn.v_proj(context).view(b, t, attn.num_kv_heads, attn.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def block_ids(self, first: int | torch.Tensor, n: int | None = None) -> torch.Tensor:
        """A block's input ids [n]: `first` (the bonus token), then the mask."""
        n = n or self.config.block_size
        ids = torch.full((n,), self.config.mask_token_id, device=self.fc.weight.device)
        ids[0] = first
        return ids

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
        """Context entries at cache `slots` from the target's aux states [B,n,A*Ht] at
        `positions`: every layer's K/V of c, no attention. It proposes nothing (its
        logits are empty, [B,n,0]); the block does. `input_ids`, `mask` and `last_only`
        are the other kinds' (their refresh runs the draft)."""
        context = self.fuse_aux(aux)
        fused = self.decode_weights()
        cos, sin = fused.rope[positions].unbind(-3)
        b, n, _ = context.shape
        for layer, qkv, (keys, values) in zip(self.layers, fused.qkv, cache.layers, strict=True):
            attn = layer.self_attn
            nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
            k, v = linear(context, qkv[nh * hd :], None).view(b, n, 2 * nkv, hd).chunk(2, 2)
            k = attn.k_norm(k)
            k = k * cos + k.roll(hd // 2, -1) * sin
            keys.index_copy_(2, slots, k.transpose(1, 2))
            values.index_copy_(2, slots, v.transpose(1, 2))
        return context.new_zeros(b, n, 0), context

    @torch.no_grad()
    def decode(
        self,
        hidden: torch.Tensor | None,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftKVCache,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over a block: input_ids [B,n] at `positions`, its K/V written at
        cache `slots`, each slot attending over the cache slots where `mask` [n, L] is
        True (the context and the whole block) -> (draft logits [B,n,Vd], the normed
        output [B,n,H]). `hidden` is the other kinds' (DFlash's slots take none)."""
        fused = self.decode_weights()
        x = self.embed_tokens(input_ids).to(self.fc.weight.dtype)
        rope = fused.rope[positions].unbind(-3)
        for i, layer in enumerate(self.layers):
            x = self._decode_layer(
                i, layer.input_layernorm(x), x, fused, rope, cache, slots, mask, last_only=False
            )
        out = self.norm(x)
        return self.lm_head(out), out
