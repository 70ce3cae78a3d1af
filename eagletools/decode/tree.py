"""EAGLE-2 dynamic draft tree (docs/design.md 3.6).

The tree grows by beam: each draft step expands the `topk` best frontier
nodes into `topk` children each; the `num_draft_tokens - 1` best nodes by
cumulative log prob over everything expanded form the tree. Log probs only
fall along a path, so that selection is a connected subtree; a stable sort in
creation order breaks ties parent-first and keeps siblings in score order,
which lossless sampling relies on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagletools import kernels
from eagletools.errors import UserError

# step(j, tokens [k], hidden [k,H], mask [k, j*k]) -> (draft logits [k,Vd], hidden [k,H]):
# one draft forward over the frontier at tree depth j; `mask` covers the draft
# tree slots of steps 1..j (this step's k slots last), True = attend.
DraftStep = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


@dataclass
class Tree:
    tokens: torch.Tensor  # [N] target ids, root first
    parents: torch.Tensor  # [N] index of the parent node, -1 for the root
    depths: torch.Tensor  # [N] root 0
    mask: torch.Tensor  # [N, N] bool, ancestor-or-self

    def __len__(self) -> int:
        return self.tokens.numel()


def max_tree_nodes(topk: int, depth: int) -> int:
    """Nodes a (topk, depth) expansion can offer, root included."""
    return 1 + topk + (depth - 1) * topk * topk


def check_tree_shape(topk: int, depth: int, num_draft_tokens: int) -> None:
    if topk < 1 or depth < 1:
        raise UserError(f"--topk ({topk}) and --depth ({depth}) must be at least 1")
    most = max_tree_nodes(topk, depth)
    if not 2 <= num_draft_tokens <= most:
        raise UserError(
            f"--num-draft-tokens {num_draft_tokens} is outside what --topk {topk} and "
            f"--depth {depth} can produce: 2..{most} (root included); lower it or raise "
            "--topk/--depth"
        )


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] (-1 for a root) -> [N, N] ancestor-or-self mask, on the device.

    By pointer doubling: after round r each row holds the node's ancestors up
    to 2^r generations back, so ceil(log2(N - 1)) rounds of a gather and an
    `or` cover any tree, whatever its shape, without reading it on the host.
    """
    n = parents.numel()
    nodes = torch.arange(n, device=parents.device)
    up = torch.where(parents < 0, nodes, parents)  # a root is its own parent
    mask = (nodes[:, None] == nodes) | (up[:, None] == nodes)
    for _ in range(max(n - 2, 0).bit_length()):
        mask = mask | mask[up]
        up = up[up]
    return mask


def grow_tree(
    step: DraftStep,
    root_token: int | torch.Tensor,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    d2t: torch.Tensor | None,
    topk: int,
    depth: int,
    num_draft_tokens: int,
) -> Tree:
    """Draft a tree under `root_token` (an int, or a one-element tensor on the device).

    `logits` [Vd] and `hidden` [H] are the draft's output for the root (the
    last position of its refresh over accepted tokens): they give the root's
    children without another forward. Every shape follows from the tree's
    (topk, depth, num_draft_tokens) and no value is read back to the host, so
    the step can be queued (or captured) whole.
    """
    device = logits.device
    logprobs, ids = kernels.topk_d2t(logits.view(1, -1), d2t, topk)
    scores, tokens = [logprobs[0]], [ids[0]]
    parents = [torch.full((topk,), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(topk, device=device)  # candidate indices
    frontier_scores, frontier_tokens = logprobs[0], ids[0]
    frontier_hidden = hidden.view(1, -1).expand(topk, -1)
    rows = torch.zeros(topk, 0, dtype=torch.bool, device=device)  # draft-tree mask rows
    eye = torch.eye(topk, dtype=torch.bool, device=device)
    offset = topk  # candidates so far
    for j in range(1, depth):
        rows = torch.cat([rows, eye], dim=1)
        out_logits, out_hidden = step(j, frontier_tokens, frontier_hidden, rows)
        logprobs, ids = kernels.topk_d2t(out_logits, d2t, topk)  # [k, k]
        cumulative = (frontier_scores[:, None] + logprobs).flatten()
        ids = ids.flatten()
        scores.append(cumulative)
        tokens.append(ids)
        parents.append(frontier[:, None].expand(topk, topk).flatten())
        if j == depth - 1:
            break
        best = torch.sort(cumulative, descending=True, stable=True).indices[:topk]
        parent_row = best // topk
        frontier = offset + best
        offset += topk * topk
        frontier_scores, frontier_tokens = cumulative[best], ids[best]
        frontier_hidden = out_hidden[parent_row]
        rows = rows[parent_row]
    return select_tree(
        torch.cat(scores), torch.cat(tokens), torch.cat(parents), root_token, num_draft_tokens
    )


def select_tree(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    root_token: int | torch.Tensor,
    num_draft_tokens: int,
) -> Tree:
    """Best `num_draft_tokens - 1` candidates (parent -1 = root) plus the root.

    A child never scores above its parent and ties keep the parent first, so
    the choice is connected (tests/test_decode_tree.py checks it; checking
    here would read the tree back to the host). Should NaN scores ever break
    that, a node whose parent was left out gets parent -1: verification never
    reaches it.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[: num_draft_tokens - 1]
    chosen = order.sort().values  # creation order: parents before children
    index_of = torch.full_like(parents, -1)
    index_of[chosen] = torch.arange(1, chosen.numel() + 1, device=chosen.device)
    cand_parents = parents[chosen]
    node_parents = torch.where(
        cand_parents < 0, torch.zeros_like(cand_parents), index_of[cand_parents.clamp(min=0)]
    )
    tree_parents = torch.cat([node_parents.new_full((1,), -1), node_parents])
    if isinstance(root_token, torch.Tensor):
        root = root_token.view(1).to(tokens.dtype)
    else:  # a fill, not a copy from the host (which waits for the device on CUDA)
        root = tokens.new_full((1,), root_token)
    tree_tokens = torch.cat([root, tokens[chosen]])
    mask = ancestor_mask(tree_parents)
    return Tree(tree_tokens, tree_parents, mask.sum(1) - 1, mask)
