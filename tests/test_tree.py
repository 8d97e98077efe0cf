"""DraftTree: depth, ancestor mask, positions, children, root-to-leaf paths and validation, on hand-worked trees."""

from __future__ import annotations

import pytest
import torch

from specloom.tree import DraftTree


# -- a chain: root 7 followed by drafts 3, 9, 4 ------------------------------------------------------------------

def test_chain_of_four():
    t = DraftTree.chain(7, [3, 9, 4])
    assert t.tokens == [7, 3, 9, 4]
    assert t.parents == [-1, 0, 1, 2]
    assert t.draft_probs is None
    assert len(t) == 4
    assert t.is_chain
    assert t.depth == [0, 1, 2, 3]
    assert t.max_depth == 3
    assert t.positions(10) == [10, 11, 12, 13]
    assert t.positions(0) == [0, 1, 2, 3]
    mask = t.ancestor_mask()
    assert mask.dtype == torch.bool and mask.shape == (4, 4)
    assert torch.equal(mask, torch.tensor([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ], dtype=torch.bool))  # a chain is plain causal attention
    assert [t.children(i) for i in range(4)] == [[1], [2], [3], []]
    assert t.paths() == [[0, 1, 2, 3]]


def test_chain_equals_explicit_constructor():
    a = DraftTree.chain(7, [3, 9, 4])
    b = DraftTree([7, 3, 9, 4], [-1, 0, 1, 2])
    assert (a.tokens, a.parents, a.depth, a.paths()) == (b.tokens, b.parents, b.depth, b.paths())
    assert torch.equal(a.ancestor_mask(), b.ancestor_mask())


def test_root_only():
    t = DraftTree.chain(5, [])
    assert t.tokens == [5] and t.parents == [-1]
    assert t.depth == [0] and t.max_depth == 0
    assert t.is_chain
    assert t.positions(10) == [10]
    assert torch.equal(t.ancestor_mask(), torch.tensor([[True]]))
    assert t.children(0) == []
    assert t.paths() == [[0]]


# -- a branching tree ----------------------------------------------------------------------------------------------
#
#            0
#          /   \
#         1     2
#        / \     \
#       3   4     5

BRANCH_PARENTS = [-1, 0, 0, 1, 1, 2]
BRANCH_TOKENS = [100, 11, 12, 13, 14, 15]


def branching() -> DraftTree:
    return DraftTree(BRANCH_TOKENS, BRANCH_PARENTS)


def test_branching_depth_and_positions():
    t = branching()
    assert not t.is_chain
    assert t.depth == [0, 1, 1, 2, 2, 2]
    assert t.max_depth == 2
    assert t.positions(10) == [10, 11, 11, 12, 12, 12]  # siblings share a position


def test_branching_ancestor_mask():
    expect = torch.tensor([
        # 0  1  2  3  4  5
        [1, 0, 0, 0, 0, 0],  # 0: itself
        [1, 1, 0, 0, 0, 0],  # 1: 0, 1
        [1, 0, 1, 0, 0, 0],  # 2: 0, 2 (not its sibling 1)
        [1, 1, 0, 1, 0, 0],  # 3: 0, 1, 3
        [1, 1, 0, 0, 1, 0],  # 4: 0, 1, 4 (not its sibling 3)
        [1, 0, 1, 0, 0, 1],  # 5: 0, 2, 5
    ], dtype=torch.bool)
    m = branching().ancestor_mask()
    assert m.dtype == torch.bool
    assert torch.equal(m, expect)
    assert m.device.type == "cpu"
    assert torch.equal(branching().ancestor_mask("cpu"), expect)


def test_branching_children_and_paths():
    t = branching()
    assert [t.children(i) for i in range(6)] == [[1, 2], [3, 4], [5], [], [], []]
    assert t.paths() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    # the paths' tokens are what each branch would emit
    assert [[t.tokens[i] for i in p] for p in t.paths()] == [[100, 11, 13], [100, 11, 14], [100, 12, 15]]


def test_paths_in_leaf_order_with_uneven_depths():
    #      0
    #    / | \
    #   1  2  3
    #   |     |
    #   4     5
    #         |
    #         6
    t = DraftTree([0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 1, 3, 5])
    assert t.depth == [0, 1, 1, 1, 2, 2, 3]
    assert t.paths() == [[0, 2], [0, 1, 4], [0, 3, 5, 6]]  # ordered by leaf index: 2, 4, 6
    m = t.ancestor_mask()
    assert m[6].nonzero().flatten().tolist() == [0, 3, 5, 6]
    assert m[4].nonzero().flatten().tolist() == [0, 1, 4]
    assert m.sum().item() == sum(d + 1 for d in t.depth)  # each node sees exactly depth + 1 nodes


def test_mask_agrees_with_paths():
    t = branching()
    m = t.ancestor_mask()
    for path in t.paths():
        for k, node in enumerate(path):
            assert m[node].nonzero().flatten().tolist() == sorted(path[: k + 1])


# -- validation ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, parents", [
    ([], []),  # no root
    ([1, 2], [0, 0]),  # root without parent -1
    ([1, 2], [-1]),  # fewer parents than tokens
    ([1], [-1, 0]),  # more parents than tokens
    ([1, 2, 3], [-1, 0, 2]),  # parents[2] == 2: a node its own parent
    ([1, 2, 3], [-1, 2, 0]),  # parents[1] == 2 > 1: a forward reference
    ([1, 2, 3], [-1, 0, -1]),  # a second root
    ([1, 2, 3], [-1, 0, -2]),  # negative parent
])
def test_invalid_parents_raise(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_draft_probs_rows_must_match_nodes():
    q = torch.full((3, 5), 0.2)
    DraftTree([1, 2, 3], [-1, 0, 0], q)  # fine: one row per node (row 0 unused)
    with pytest.raises(ValueError):
        DraftTree([1, 2, 3], [-1, 0, 0], q[:2])  # one row per *drafted* node is not enough
    with pytest.raises(ValueError):
        DraftTree([1, 2, 3], [-1, 0, 0], torch.full((4, 5), 0.2))


def test_chain_with_draft_probs_prepends_a_zero_row():
    q = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]])
    t = DraftTree.chain(2, [0, 1], q)
    assert t.tokens == [2, 0, 1]
    assert t.draft_probs.shape == (3, 3)
    assert torch.equal(t.draft_probs[0], torch.zeros(3))
    assert torch.equal(t.draft_probs[1:], q)
    assert t.draft_probs.dtype == q.dtype
    # the row count must match the drafts
    with pytest.raises(ValueError):
        DraftTree.chain(2, [0], q)
    # an empty draft with an empty (0, V) q is a valid root-only tree
    t = DraftTree.chain(2, [], torch.zeros(0, 3))
    assert t.tokens == [2] and t.draft_probs.shape == (1, 3)
