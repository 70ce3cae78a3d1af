"""Rotary position embeddings shared by the draft head and the target runtime.

The frequencies come from transformers' own RoPE initialisers, so every
scaling type a target uses (llama3, linear, yarn, longrope, ...) gives the
draft and our runtime exactly the target's rotation.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_frequencies(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 2048,
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32 on the CPU, attention scaling) for a RoPE configuration.

    On the CPU even under a meta-device context: a module built on meta
    (shape checks, weight copies) still gets real frequencies, and no meta op
    pulls in torch._dynamo (~170 MB).
    """
    with torch.device("cpu"):
        return _frequencies(head_dim, rope_theta, rope_scaling, max_position_embeddings)


def _frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (rope_theta**exponent), 1.0

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        known = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
        raise ValueError(f"unknown rope_scaling type {rope_type!r}; known: {known}")
    params = {k: v for k, v in rope_scaling.items() if k not in ("type", "rope_theta")}
    # the transformers 4 spelling, which transformers 5 still accepts and converts
    config = LlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rope_scaling={**params, "rope_type": rope_type},
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit positions (trees and shifted TTT steps need them)."""

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict | None = None,
        max_position_embeddings: int = 2048,
    ):
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(
            head_dim, rope_theta, rope_scaling, max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] -> cos, sin [..., T, head_dim] in `dtype`."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [T, hd] or [B, T, hd]."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
