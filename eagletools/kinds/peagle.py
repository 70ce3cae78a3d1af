"""P-EAGLE: the whole drafted block in one forward (`draft.parallel`), trained by the
unroll with the mask after its first step (`train.parallel`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagletools.draft import DraftConfig, PEagleDraft
from eagletools.errors import UserError
from eagletools.kinds.base import Drafter, DraftKind, block_tree

if TYPE_CHECKING:
    from eagletools.decode.tree import Tree


class PEagle(DraftKind):
    name = "peagle"
    title = "P-EAGLE"
    architectures = {"speculators": ("PEagleDraftModel", "PEagleSpeculator")}
    layouts = ("speculators",)  # vLLM's
    # a deeper block costs one forward all the same: longer chains than EAGLE-3's
    shapes = ((1, 3, 4), (1, 5, 6), (1, 7, 8), (2, 5, 10))

    def module(self) -> type[nn.Module]:
        return PEagleDraft

    def objective(self, draft: nn.Module, training: Any) -> nn.Module:
        from eagletools.train.parallel import ParallelModel

        t = training
        # the block it learns is the block vLLM drafts (speculators' speculative_tokens)
        draft.config.extra["speculative_tokens"] = t.ttt_steps
        return ParallelModel(draft, t.ttt_steps, t.ttt_decay, t.attn_chunk, t.train_oov)

    def propose(
        self, drafter: Drafter, root: int | torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor
    ) -> Tree:
        """The block's `depth` proposals from one forward over its `depth - 1` mask slots
        (the root's own row gave the first), as a tree (`kinds.base.block_tree`)."""
        rows = logits.view(1, -1)
        if drafter.depth > 1:
            ids, state = drafter.draft.mask_inputs(drafter.depth - 1, hidden.dtype)
            rows = torch.cat([rows, drafter.block(ids, state)[0]])
        return block_tree(rows, drafter, root)

    def validate(self, config: DraftConfig, source: str) -> None:
        self.refuse_block(config, source)
        if config.norm_output:
            raise UserError(
                f"{source}: field 'norm_output' is true, which no P-EAGLE step uses (no slot "
                "takes another's output): set it to false"
            )
        token = config.mask_token_id
        if token is None or not 0 <= token < config.vocab_size:
            raise UserError(
                f"{source}: field 'mask_token_id' is {token!r}; a P-EAGLE draft needs the id "
                f"of the token its parallel slots take, below vocab_size {config.vocab_size} "
                "(speculators writes it as mask_token_id)"
            )


PEAGLE = PEagle()
