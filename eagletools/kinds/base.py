"""The interface every draft kind implements (`eagletools.kinds`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from eagletools.draft import DraftConfig
from eagletools.errors import UserError

if TYPE_CHECKING:
    from eagletools.decode.tree import DraftStep, Tree


@dataclass(frozen=True)
class Drafter:
    """The decoder's draft, its forwards and the tree it asks for, which a kind's
    `propose` composes: `depth` tokens deep, `topk` children per expanded node,
    `num_draft_tokens` nodes (root included); `d2t` None for an identity vocabulary.

    `step(j, tokens, hidden, rows)`: one forward over a tree's frontier at depth j
    (`decode.tree.DraftStep`). `block(tokens [n], hidden [n, H] or None)`: one forward
    over n rows after the context, each seeing the context and the rows before it, or
    with the kind's `block_causal` false all n (a block draft's slots) -> (draft
    logits [n, Vd], hidden [n, H]).
    """

    draft: nn.Module
    step: DraftStep
    block: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
    d2t: torch.Tensor | None
    topk: int
    depth: int
    num_draft_tokens: int


class DraftKind(ABC):
    """One kind of draft: its module, its training objective, how it proposes."""

    name: str  # the config's `kind`
    title: str  # for tables and messages
    # per checkpoint layout: the `architectures` values engines build this kind from,
    # the one this layout writes first
    architectures: Mapping[str, tuple[str, ...]]
    layouts: tuple[str, ...]  # the layouts an engine serves it from, the trainer's first
    # the (topk, depth, num_draft_tokens) shapes a tune times beside plain decoding
    shapes: tuple[tuple[int, int, int], ...]
    block_causal = True  # `Drafter.block`'s rows see those before them, not after

    def block_rows(self, config: DraftConfig) -> int:
        """Draft cache slots a step's block writes past the context, beyond a tree's."""
        return 0

    @abstractmethod
    def module(self) -> type[nn.Module]:
        """The draft's module class: built from a `DraftConfig`, its state dict the
        checkpoint's tensors."""

    def build(self, config: DraftConfig) -> nn.Module:
        return self.module()(config)

    def from_target(self, model: nn.Module, draft_vocab: Any = None, **fields: Any) -> nn.Module:
        """A fresh draft sized from a Hugging Face target (`Eagle3Draft.from_target`),
        checked as this kind's (`validate`)."""
        draft = self.module().from_target(model, draft_vocab, **fields)
        self.validate(draft.config, "the recipe's draft section")
        return draft

    @abstractmethod
    def objective(self, draft: nn.Module, training: Any) -> nn.Module:
        """The module the trainer optimises, set by `training` (the recipe's
        `TrainingSection`): `forward(input_ids, aux, loss_mask,
        teacher_probs, target_argmax, norm, steps, train_oov, documents)` ->
        (loss, `train.ttt.StepStats`), its `draft` the draft."""

    @abstractmethod
    def propose(
        self, drafter: Drafter, root: int | torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor
    ) -> Tree:
        """The tree of `drafter`'s shape a speculative step verifies under `root`, from the
        draft's output at the root (`logits` [Vd], `hidden` [H]); no value is read back
        to the host, so the step can be queued or compiled whole."""

    @abstractmethod
    def validate(self, config: DraftConfig, source: str) -> None:
        """Refuse a config this kind cannot run (naming the field and the fix)."""

    @staticmethod
    def refuse_block(config: DraftConfig, source: str) -> None:
        """An EAGLE head's config with a DFlash block is another kind's."""
        if config.block_size is not None:
            raise UserError(
                f"{source}: field 'block_size' is set ({config.block_size}), which only a "
                "DFlash draft uses; set kind to 'dflash' or drop the field"
            )


def block_tree(rows: torch.Tensor, drafter: Drafter, root: int | torch.Tensor) -> Tree:
    """A block draft's proposals as a tree: rows [depth, Vd], the draft's logits for each
    depth from one forward. At each depth the `drafter.topk` best tokens, children of the
    best one at the depth before (a chain at topk 1); the best `num_draft_tokens - 1` kept."""
    from eagletools import kernels
    from eagletools.decode.tree import select_tree

    depth, topk = rows.shape[0], drafter.topk
    logprobs, ids = kernels.topk_d2t(rows, drafter.d2t, topk)  # [depth, topk], best first
    best = logprobs[:, :1].cumsum(0)  # the best path's score down to each depth
    scores = torch.cat([logprobs[:1], best[:-1] + logprobs[1:]])
    first = torch.arange(depth, device=rows.device) * topk  # each depth's best node
    parents = torch.cat([first.new_full((1,), -1), first[:-1]]).repeat_interleave(topk)
    return select_tree(scores.flatten(), ids.flatten(), parents, root, drafter.num_draft_tokens)
