"""EAGLE-2 dynamic tree: selection, ordering, masks, shape limits, no host reads."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_draft_config
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from eagletools.decode.tree import (
    ancestor_mask,
    check_tree_shape,
    grow_tree,
    max_tree_nodes,
    select_tree,
)
from eagletools.draft import DraftKVCache, Eagle3Draft
from eagletools.errors import UserError
from eagletools.kernels import topk_d2t_reference

VD = 50
aten = torch.ops.aten


def loop_ancestor_mask(parents: list[int]) -> torch.Tensor:
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


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
    assert torch.equal(tree.mask, loop_ancestor_mask(parents))
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


def reference_tree(step, root, logits, hidden, d2t, topk, depth, n):
    """The tree read literally from docs/design.md 3.6, one candidate at a time in Python:
    (tokens, parents, mask)."""
    lp, ids = topk_d2t_reference(logits[None], d2t, topk)
    cands = [(lp[0, c], int(ids[0, c]), -1) for c in range(topk)]  # (score, token, parent)
    frontier = list(range(topk))  # candidate index of each frontier row
    paths = [[] for _ in range(topk)]  # each row's ancestors' frontier rows, steps 1..j-1
    states = hidden[None].expand(topk, -1)
    for j in range(1, depth):
        rows = torch.zeros(topk, j * topk, dtype=torch.bool)
        for i in range(topk):
            for step_j, slot in enumerate([*paths[i], i]):
                rows[i, step_j * topk + slot] = True
        tokens = torch.tensor([cands[f][1] for f in frontier])
        out_logits, out_states = step(j, tokens, states, rows)
        lp, ids = topk_d2t_reference(out_logits, d2t, topk)
        level = len(cands)
        for i in range(topk):
            for c in range(topk):
                cands.append((cands[frontier[i]][0] + lp[i, c], int(ids[i, c]), frontier[i]))
        new = sorted(range(level, len(cands)), key=lambda c: -float(cands[c][0]))[:topk]
        parent_rows = [(c - level) // topk for c in new]
        paths = [[*paths[r], r] for r in parent_rows]
        frontier, states = new, out_states[parent_rows]
    chosen = sorted(sorted(range(len(cands)), key=lambda c: -float(cands[c][0]))[: n - 1])
    node_of = {c: i + 1 for i, c in enumerate(chosen)}
    parents = [-1] + [node_of.get(cands[c][2], 0) for c in chosen]
    tokens = [root] + [cands[c][1] for c in chosen]
    return tokens, parents, loop_ancestor_mask(parents)


def _tied_step(j, tokens, hidden, mask):
    """Logits in whole numbers: equal log probs, so ties between siblings and cousins."""
    g = torch.Generator().manual_seed(1000 * j + int(tokens.sum()))
    logits = (torch.randn(tokens.numel(), VD, generator=g) * 2).round()
    return logits + hidden[:, :1].round(), hidden + tokens[:, None].float()


@pytest.mark.parametrize("step", [_fake_step([]), _tied_step], ids=["random", "ties"])
@pytest.mark.parametrize("topk,depth,n", [(1, 5, 6), (2, 3, 6), (3, 3, 8), (4, 5, 16), (4, 4, 30)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grown_tree_is_the_literal_reading(step, topk, depth, n, seed):
    logits = (torch.randn(VD, generator=torch.Generator().manual_seed(seed)) * 3).round()
    d2t = torch.arange(VD) % 3 if seed else None
    tree = grow_tree(step, 99, logits, torch.zeros(4), d2t, topk, depth, n)
    tokens, parents, mask = reference_tree(step, 99, logits, torch.zeros(4), d2t, topk, depth, n)
    assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents
    assert torch.equal(tree.mask, mask)
    assert torch.equal(tree.depths, mask.sum(1) - 1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9, 17, 33])
def test_ancestor_mask_of_any_tree(n):
    g = torch.Generator().manual_seed(n)
    chain = list(range(-1, n - 1))  # the deepest tree: every doubling round counts
    bushy = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    for parents in (chain, bushy):
        assert torch.equal(ancestor_mask(torch.tensor(parents)), loop_ancestor_mask(parents))


HOST_READS = {
    aten._local_scalar_dense.default,  # .item(), int(), bool(), float() of a tensor
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,  # data-dependent shapes: boolean indexing, masked_select, ...
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
}


class HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's values back to the host (a sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class ToList(TorchFunctionMode):
    """`.tolist()` copies out below the dispatcher: caught as a function call."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.seen.append("tolist")
        return func(*args, **(kwargs or {}))


def draft_step(draft: Eagle3Draft, cache: DraftKVCache, base: int):
    """The decoder's draft step over a prefix of `base` cached entries (decode/engine.py)."""

    def step(j, tokens, hidden, rows):
        k = tokens.numel()
        slots = torch.arange(base + (j - 1) * k, base + j * k)
        positions = torch.full((k,), base + j - 1)
        mask = torch.cat([rows.new_ones(k, base), rows], dim=1)
        logits, out = draft.decode(hidden[None], tokens[None], positions, cache, slots, mask)
        return logits[0], out[0]

    return step


@pytest.mark.parametrize("root", ["int", "tensor"])
def test_growing_a_tree_reads_nothing_back_from_the_device(root):
    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_draft_config(intermediate_size=96)).eval()
    cache = DraftKVCache.allocate(draft.config, 1, 64, torch.float32, "cpu")
    base, (topk, depth, n) = 7, (4, 5, 16)
    step = draft_step(draft, cache, base)
    logits, hidden = torch.randn(draft.config.draft_vocab_size), torch.randn(64)
    root_token = 5 if root == "int" else torch.tensor([5])
    with HostReads() as reads, ToList(reads.seen):
        tree = grow_tree(step, root_token, logits, hidden, draft.d2t, topk, depth, n)
    assert reads.seen == []
    # the counter does see a read, and the tree is EAGLE-2's
    with HostReads() as reads, ToList(reads.seen):
        tree.parents.tolist()
        int(tree.tokens[0])
    assert reads.seen == ["tolist", "aten._local_scalar_dense.default"]
    tokens, parents, mask = reference_tree(step, 5, logits, hidden, draft.d2t, topk, depth, n)
    assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents
    assert torch.equal(tree.mask, mask)


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


@pytest.mark.parametrize("layers", [1, 2])
def test_a_prompt_pass_runs_the_layer_past_attention_for_its_last_token_alone(layers):
    """The prompt's draft pass writes every token's K/V but needs the outputs of its last
    token only: `last_only` gives those, equal to the full pass's last row, and the same
    cache, without the [n, Vd] logits and [n, I] MLP products of a long prompt. Earlier
    layers of a deeper draft run every row: the next layer's K/V read them."""
    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_draft_config(intermediate_size=96, num_hidden_layers=layers))
    draft.eval()
    n = 100  # past 64: the maskless causal path a prompt takes
    hidden, ids = torch.randn(1, n, draft.config.hidden_size), torch.randint(0, 256, (1, n))
    slots = torch.arange(n)
    caches = [DraftKVCache.allocate(draft.config, 1, 128, torch.float32, "cpu") for _ in "ab"]
    full = draft.decode(hidden, ids, slots, caches[0], slots, None)
    last = draft.decode(hidden, ids, slots, caches[1], slots, None, last_only=True)
    for whole, one in zip(full, last, strict=True):
        assert one.shape[1] == 1
        torch.testing.assert_close(one, whole[:, -1:])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
