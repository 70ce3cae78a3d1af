"""DFlash: a block filled in one non-causal forward by a draft that reads the target's
states through its keys and values (`draft.dflash`), trained on every position's block
(`train.block`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagletools.draft import DFlashDraft, DraftConfig
from eagletools.errors import UserError
from eagletools.kinds.base import Drafter, DraftKind, block_tree

if TYPE_CHECKING:
    from eagletools.decode.tree import Tree

# options of the EAGLE heads that a DFlash draft has no place for
NOT_DFLASH = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")


class DFlash(DraftKind):
    name = "dflash"
    title = "DFlash"
    architectures = {"speculators": ("DFlashDraftModel", "DFlashSpeculator")}
    layouts = ("speculators",)  # vLLM's
    block_causal = False  # a block's slots see each other both ways
    # any depth up to the block costs one forward: chains as deep as the block
    shapes = ((1, 3, 4), (1, 5, 6), (1, 7, 8), (2, 5, 10))

    def module(self) -> type[nn.Module]:
        return DFlashDraft

    def block_rows(self, config: DraftConfig) -> int:
        return config.block_size or 0

    def objective(self, draft: nn.Module, training: Any) -> nn.Module:
        from eagletools.train.block import BlockModel

        t = training
        # the block it learns: the bonus token and ttt_steps proposals, as vLLM drafts it
        draft.config.block_size = t.ttt_steps + 1
        draft.config.extra["speculative_tokens"] = t.ttt_steps
        # the head is the target's rows, frozen, as speculators trains it: vLLM loads the
        # file's head, speculators the verifier's (full vocab), and both are then the same
        draft.lm_head.weight.requires_grad_(False)
        return BlockModel(draft, t.ttt_decay, t.attn_chunk, t.train_oov, t.anchor_share)

    def propose(
        self, drafter: Drafter, root: int | torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor
    ) -> Tree:
        """One forward over the whole trained block (`root`, then the mask: a shorter
        block computes other proposals, since its slots see each other), its first
        `depth` proposals as a tree (`kinds.base.block_tree`). The refresh's `logits`
        and `hidden` are empty: a DFlash refresh proposes nothing."""
        rows = drafter.block(drafter.draft.block_ids(root), None)[0]
        return block_tree(rows[1 : drafter.depth + 1], drafter, root)

    def validate(self, config: DraftConfig, source: str) -> None:
        def refuse(field: str, value: Any, why: str) -> UserError:
            return UserError(f"{source}: field {field!r} is {value!r}; {why}")

        size = config.block_size
        if not isinstance(size, int) or size < 2:
            raise refuse("block_size", size, "a DFlash block holds the bonus token and at "
                         "least one mask slot: set it to 2 or more (speculators: 8)")  # fmt: skip
        token = config.mask_token_id
        if token is None or not 0 <= token < config.vocab_size:
            raise refuse("mask_token_id", token, "a DFlash draft needs the id of the token its "
                         f"mask slots take, below vocab_size {config.vocab_size}")  # fmt: skip
        if not config.qk_norm:
            raise refuse("qk_norm", False, "DFlash layers are Qwen3's, with q/k norms: set it "
                         "to true")  # fmt: skip
        for name in NOT_DFLASH:
            if getattr(config, name):
                raise refuse(name, True, "an EAGLE head's option, which no DFlash layer "
                             "has: set it to false")  # fmt: skip


DFLASH = DFlash()
