"""The draft head's configuration: every field a serving engine needs to load it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from eagletools.errors import UserError


@dataclass
class DraftConfig:
    """Sizes of an EAGLE-3 head (docs/design.md 3.3).

    `aux_layer_ids` use Hugging Face `output_hidden_states` indexing (index k is
    the output of decoder layer k-1); formats convert on read and write.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    num_aux_states: int = 3
    num_hidden_layers: int = 1  # the EAGLE-3 layer, then plain Llama layers
    aux_layer_ids: list[int] | None = None  # None: unknown (old checkpoints)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each aux state before `fc`
    norm_before_fc: bool = False  # EAGLE-3.1 as vLLM/speculators name it: one RMSNorm
    # (`input_norm`) over the concatenated aux states before `fc`; not with fc_norm
    norm_output: bool = False  # EAGLE-3.1: the next step gets the output after `norm`
    qk_norm: bool = False  # Qwen3-style per-head q/k RMSNorm
    hidden_act: str = "silu"
    kind: str = "eagle3"  # which draft this is (`eagletools.kinds`): eagle3, peagle, dflash
    mask_token_id: int | None = None  # P-EAGLE, DFlash: the token their block's slots take
    block_size: int | None = None  # DFlash: the slots one forward fills (the bonus, then masks)
    extra: dict[str, Any] = field(default_factory=dict)  # fields we carry but do not use

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, source: str = "draft config") -> None:
        def bad(name: str, why: str) -> UserError:
            return UserError(f"{source}: field {name!r} {why}")

        for name in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size",
            "num_aux_states", "num_hidden_layers", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, f"must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                "num_key_value_heads",
                f"({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})",
            )
        if self.draft_vocab_size > self.vocab_size:
            raise bad(
                "draft_vocab_size",
                f"({self.draft_vocab_size}) exceeds the target vocab_size ({self.vocab_size})",
            )
        if self.aux_layer_ids is not None:
            if len(self.aux_layer_ids) != self.num_aux_states:
                raise bad(
                    "aux_layer_ids",
                    f"has {len(self.aux_layer_ids)} ids but num_aux_states is {self.num_aux_states}",
                )
            if any(i < 0 for i in self.aux_layer_ids):
                raise bad("aux_layer_ids", f"must be non-negative, got {self.aux_layer_ids}")
        if self.hidden_act != "silu":
            raise bad("hidden_act", f"{self.hidden_act!r} is not supported (only 'silu')")
        if self.norm_before_fc and self.fc_norm:
            raise bad(
                "norm_before_fc",
                "and 'fc_norm' are both true: they are two ways to norm the aux states before "
                "fc (one norm over the concatenation, or one per state) and speculators refuses "
                "both together; set one of them to false",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "draft config") -> DraftConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UserError(f"{source}: unknown fields {unknown}; known: {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as err:
            raise UserError(f"{source}: {err}") from None
