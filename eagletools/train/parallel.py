"""P-EAGLE's objective: the training-time-test unroll with every step after the first fed
the mask (docs/design.md 3.5).

Step j of the unroll at position t is the draft's slot j of a block anchored at
t: RoPE position t+j, attending over the context up to t and its own block's
slots 1..j, taught the token t+2+j, exactly as the unroll of an EAGLE-3 draft.
What differs is its input: the mask token and `mask_hidden` instead of the
next real token and the previous step's output, so no step waits on another's
prediction, and at decode time one forward over the block's slots gives them
all. Every anchor trains every depth: speculators' COD sampling subsamples the
anchors of later depths to save memory, and the unroll already keeps memory
linear in the sequence (`train.ttt`).
"""

from __future__ import annotations

import torch

from eagletools.train.ttt import TTTModel


class ParallelModel(TTTModel):
    """`TTTModel` over a `PEagleDraft`: steps after the first take the mask's inputs."""

    def step_inputs(
        self, j: int, input_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if j == 0:
            return super().step_inputs(j, input_ids, hidden)
        b, t = input_ids.shape
        ids, state = self.draft.mask_inputs(1, hidden.dtype)
        embeds = self.draft.embed_tokens(ids).to(hidden.dtype)
        return embeds.expand(b, t, -1), state.expand(b, t, -1)

    def register_fsdp_methods(self) -> None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        super().register_fsdp_methods()
        register_fsdp_forward_method(self.draft, "mask_inputs")
