"""EAGLE-2 dynamic tree: selection, ordering, masks, shape limits."""

from __future__ import annotations

import pytest
import torch

from eagletools.decode.tree import (
    ancestor_mask,
    check_tree_shape,
    grow_tree,
    max_tree_nodes,
    select_tree,
)
from eagletools.errors import UserError

VD = 50


def _fake_step(calls):
    """A 'draft' whose logits depend on the token and hidden it is fed."""

    def step(j, tokens, hidden, mask):
        calls.append((j, tokens.clone(), mask.clone()))
        g = torch.Generator().manual_seed(1000 * j + int(tokens.sum()))
        logits = torch.randn(tokens.numel(), VD, generator=g) * 3
        return logits + hidden[:, :1], hidden + tokens[:, None].float()

    return step


@pytest.mark.parametrize("topk,depth,n", [(1, 5, 6), (3, 3, 10), (4, 5, 20), (2, 2, 7)])
def test_grown_tree_is_a_connected_best_first_subtree(topk, depth, n):
    calls = []
    logits = torch.randn(VD, generator=torch.Generator().manual_seed(0)) * 3
    d2t = torch.arange(VD) % 3  # draft id i -> target id i + d2t[i]
    tree = grow_tree(_fake_step(calls), 99, logits, torch.zeros(4), d2t, topk, depth, n)
    assert len(tree) == n and tree.tokens[0] == 99
    assert len(calls) == depth - 1
    parents = tree.parents.tolist()
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    assert torch.equal(tree.mask, ancestor_mask(tree.parents))
    assert torch.equal(tree.depths[1:], tree.depths[tree.parents[1:]] + 1)
    assert int(tree.depths.max()) <= depth
    # siblings are distinct tokens and never more than topk
    for p in set(parents[1:]):
        kids = [int(tree.tokens[i]) for i, q in enumerate(parents) if q == p]
        assert len(kids) == len(set(kids)) <= topk
    # draft ids were mapped to target ids after the top-k
    mapped = set((torch.arange(VD) + d2t).tolist())
    assert set(tree.tokens[1:].tolist()) <= mapped
    if topk == 1:
        assert parents == list(range(-1, n - 1))
    # step j attends over the draft slots of its own ancestors only
    for j, _tokens, mask in calls:
        assert mask.shape == (topk, j * topk)
        assert torch.equal(mask[:, -topk:], torch.eye(topk, dtype=torch.bool))
        assert (mask.sum(1) == j).all()


def test_selection_takes_best_scores_and_keeps_sibling_order():
    # candidates: 0,1 under the root; 2,3 under 0; 4,5 under 1
    scores = torch.tensor([-0.1, -0.5, -0.3, -2.0, -0.6, -0.7])
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    parents = torch.tensor([-1, -1, 0, 0, 1, 1])
    tree = select_tree(scores, tokens, parents, 7, 5)
    assert tree.tokens.tolist() == [7, 10, 11, 12, 14]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2]


def test_ties_keep_parents_first():
    scores = torch.zeros(4)  # a child can tie its parent (log prob 0)
    tree = select_tree(scores, torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 1, 2]), 0, 3)
    assert tree.parents.tolist() == [-1, 0, 1]


def test_tree_shape_limits():
    assert max_tree_nodes(1, 5) == 6
    assert max_tree_nodes(8, 6) == 1 + 8 + 5 * 64
    check_tree_shape(4, 3, 37)
    with pytest.raises(UserError, match="--num-draft-tokens 38 .*--topk 4 and --depth 3.*2..37"):
        check_tree_shape(4, 3, 38)
    with pytest.raises(UserError, match="--topk"):
        check_tree_shape(0, 3, 4)
