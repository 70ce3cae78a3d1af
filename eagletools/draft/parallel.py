"""The P-EAGLE draft head: an EAGLE-3 head that drafts a block of tokens in one forward.

After the last real token, each further slot of the block takes the mask token
(`mask_token_id`, through the frozen embeddings) and a learned `mask_hidden` in
place of the target's concatenated aux states; `mask_hidden` goes through the
same norms and `fc` as they do. Slot d sits at position +d and sees the context
and the slots before it, so one forward over the K-1 slots gives the proposals
for depths 2..K (the last real token's row gives depth 1). As speculators 0.9.0
`peagle` builds it and vLLM 0.32.0 serves it with `parallel_drafting`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from eagletools.draft.config import DraftConfig
from eagletools.draft.model import Eagle3Draft, weight_identity


class PEagleDraft(Eagle3Draft):
    """`state_dict()` is the EAGLE-3 head's plus `mask_hidden` [1, 1, A*Ht]."""

    def __init__(self, config: DraftConfig):
        super().__init__(config)
        width = config.num_aux_states * config.target_hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, width))  # speculators' init
        self._mask_state: tuple[tuple[Any, ...], torch.Tensor] | None = None

    @classmethod
    def from_target(cls, model: nn.Module, draft_vocab=None, **fields: Any) -> PEagleDraft:
        """`Eagle3Draft.from_target`, the mask token by default the target's last id (a
        reserved special token in Llama 3's vocabulary, a rare one elsewhere)."""
        from eagletools.targets import anatomy

        if fields.get("mask_token_id") is None:
            fields["mask_token_id"] = anatomy.text_config(model.config).vocab_size - 1
        return super().from_target(model, draft_vocab, **fields, kind="peagle")

    def mask_state(self, dtype: torch.dtype) -> torch.Tensor:
        """`mask_hidden` through the norms and `fc` [H]: what every parallel slot takes as
        its hidden. Kept between calls while the weights stay (one `fc` product over a
        row is ~100 MB of weights read at 8B widths)."""
        weights = [self.mask_hidden, self.fc.weight, *self.parameters_before_fc()]
        key = (dtype, *(weight_identity(w) for w in weights))
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            return self.fuse_aux(self.mask_hidden.view(-1).to(dtype))
        if self._mask_state is None or self._mask_state[0] != key:
            self._mask_state = (key, self.fuse_aux(self.mask_hidden.view(-1).to(dtype)))
        return self._mask_state[1]

    def parameters_before_fc(self) -> list[nn.Parameter]:
        """The norms `fuse_aux` applies before `fc` (none, or EAGLE-3.1's)."""
        norms = [*getattr(self, "fc_norm", ()), *filter(None, [getattr(self, "input_norm", None)])]
        return [norm.weight for norm in norms]

    def mask_inputs(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """n parallel slots' inputs: the mask token ids [n] and hidden [n, H]."""
        device = self.mask_hidden.device
        ids = torch.full((n,), self.config.mask_token_id, dtype=torch.long, device=device)
        return ids, self.mask_state(dtype).expand(n, -1)
