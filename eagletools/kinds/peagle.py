"""P-EAGLE: the whole drafted block in one forward (`draft.parallel`), trained by the
unroll with the mask after its first step (`train.parallel`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagletools.draft import DraftConfig, PEagleDraft
from eagletools.errors import UserError
from eagletools.kinds.base import Drafter, DraftKind

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
        self,
        drafter: Drafter,
        root: int | torch.Tensor,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        d2t: torch.Tensor | None,
        topk: int,
        depth: int,
        num_draft_tokens: int,
    ) -> Tree:
        """The block's `depth` proposals from one forward over its `depth - 1` mask slots
        (the root's own row gave the first), as a tree: at each depth the `topk` best
        tokens, children of the best one at the depth before (a chain at topk 1)."""
        from eagletools import kernels
        from eagletools.decode.tree import select_tree

        rows = logits.view(1, -1)
        if depth > 1:
            ids, state = drafter.draft.mask_inputs(depth - 1, hidden.dtype)
            rows = torch.cat([rows, drafter.block(ids, state)[0]])
        logprobs, ids = kernels.topk_d2t(rows, d2t, topk)  # [depth, topk], best first
        best = logprobs[:, :1].cumsum(0)  # the best path's score down to each depth
        scores = torch.cat([logprobs[:1], best[:-1] + logprobs[1:]])
        first = torch.arange(depth, device=logits.device) * topk  # each depth's best node
        parents = torch.cat([first.new_full((1,), -1), first[:-1]]).repeat_interleave(topk)
        return select_tree(scores.flatten(), ids.flatten(), parents, root, num_draft_tokens)

    def validate(self, config: DraftConfig, source: str) -> None:
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
