"""EAGLE-3: one draft forward per tree depth, trained by the training-time-test unroll."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagletools.draft import DraftConfig, Eagle3Draft
from eagletools.errors import UserError
from eagletools.kinds.base import Drafter, DraftKind

if TYPE_CHECKING:
    from eagletools.decode.tree import Tree


class Eagle3(DraftKind):
    name = "eagle3"
    title = "EAGLE-3"
    architectures = {
        "speculators": ("Eagle3DraftModel", "Eagle3Speculator"),
        "eagle": ("LlamaForCausalLMEagle3",),
    }
    layouts = ("eagle", "speculators", "gguf")
    # chains of 2 and 3 drafts pay on CPUs, where a wide verify costs much more than one
    # row (issue 16); topk 4, depth 5, 16 nodes where it pays (GPUs)
    shapes = ((1, 2, 3), (1, 3, 4), (2, 3, 6), (4, 5, 16))

    def module(self) -> type[nn.Module]:
        return Eagle3Draft

    def objective(self, draft: nn.Module, training: Any) -> nn.Module:
        from eagletools.train.ttt import TTTModel

        t = training
        return TTTModel(draft, t.ttt_steps, t.ttt_decay, t.attn_chunk, t.train_oov)

    def propose(
        self, drafter: Drafter, root: int | torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor
    ) -> Tree:
        """An EAGLE-2 dynamic tree: `depth` draft forwards, each over the frontier."""
        from eagletools.decode.tree import grow_tree

        d = drafter
        return grow_tree(d.step, root, logits, hidden, d.d2t, d.topk, d.depth, d.num_draft_tokens)

    def validate(self, config: DraftConfig, source: str) -> None:
        self.refuse_block(config, source)
        if config.mask_token_id is not None:
            raise UserError(
                f"{source}: field 'mask_token_id' is set ({config.mask_token_id}), which only "
                "a P-EAGLE draft uses; set kind to 'peagle' or drop the field"
            )


EAGLE3 = Eagle3()
