"""FlatTree / TreeBatch: the packed tree representation everything shares."""
import random

import pytest
import torch

from vllm_ptd.tree import FlatTree, TreeBatch


def random_tree(rng: random.Random, n: int, vocab: int = 20, with_draft: bool = True) -> FlatTree:
    """A valid random tree: verify nodes first (only verify parents), then draft nodes."""
    nv = rng.randint(0, n) if with_draft else n
    parents = []
    for i in range(n):
        hi = min(i, nv) if i < nv else i
        parents.append(rng.randrange(-1, hi) if hi > 0 else -1)
    causal = rng.random() < 0.5
    return FlatTree([rng.randrange(vocab) for _ in range(n)], parents, nv,
                    nv if causal else -1)


def test_depths_children_paths():
    t = FlatTree([5, 6, 7, 8, 9], [-1, 0, 0, 1, -1])
    assert t.depths() == [1, 2, 2, 3, 1]
    assert t.children() == [[0, 4], [1, 2], [3], [], [], []]
    assert t.path_to(3) == [0, 1, 3]
    assert t.num_verify == 5 and t.causal_from == 5


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2]])
def test_invalid_parents_raise(parents):
    with pytest.raises(ValueError):
        FlatTree([1] * len(parents), parents)


def test_other_invalid_trees_raise():
    with pytest.raises(ValueError, match="length"):
        FlatTree([1, 2], [-1])
    with pytest.raises(ValueError, match="causal"):
        FlatTree([1, 2, 3], [-1, 0, 1], num_verify=2, causal_from=1)


def test_truncation_is_prefix_valid():
    rng = random.Random(1)
    for _ in range(80):
        t = random_tree(rng, rng.randint(0, 20))
        for n in range(-1, t.num_nodes + 2):
            c = t.truncated(n)
            k = max(0, min(n, t.num_nodes))
            assert c.num_nodes == k
            assert c.tokens == t.tokens[:k] and c.parents == t.parents[:k]
            assert c.num_verify == min(t.num_verify, k)
            assert c.causal_from == min(t.causal_from, k)
            assert c.depths() == t.depths()[:k]
            # the cut tree's mask is the top-left block of the full mask
            assert torch.equal(c.ancestor_mask(), t.ancestor_mask()[: k + 1, : k + 1])
        assert t.verify_part().num_nodes == t.num_verify


def test_ancestor_mask_tree_and_causal_tail():
    t = FlatTree([1, 2, 3, 4, 5], [-1, 0, -1, -1, 3], num_verify=3, causal_from=3)
    m = t.ancestor_mask()
    # row r = node r-1; tree rows see root + ancestors + self
    assert m[0].tolist() == [True, False, False, False, False, False]
    assert m[2].tolist() == [True, True, True, False, False, False]
    assert m[3].tolist() == [True, False, False, True, False, False]
    # causal-tail rows see every earlier row
    assert m[4].tolist() == [True, True, True, True, True, False]
    assert m[5].tolist() == [True] * 6
    tree_only = FlatTree(t.tokens, t.parents, num_verify=3)
    assert tree_only.ancestor_mask()[5].tolist() == [True, False, False, False, True, True]


def test_mask_matches_paths_random():
    rng = random.Random(2)
    for _ in range(100):
        t = random_tree(rng, rng.randint(1, 15))
        m = t.ancestor_mask()
        for i in range(t.num_nodes):
            if i >= t.causal_from:
                want = set(range(i + 2))
            else:
                want = {0} | {j + 1 for j in t.path_to(i)}
            assert {c for c in range(t.num_nodes + 1) if m[i + 1, c]} == want


def test_tree_batch_roundtrip():
    rng = random.Random(3)
    trees = [random_tree(rng, rng.randint(0, 12)) for _ in range(6)]
    b = TreeBatch.from_trees(trees)
    assert b.batch_size == 6 and b.num_nodes == sum(t.num_nodes for t in trees)
    assert b.offsets.tolist()[-1] == b.num_nodes
    for i, t in enumerate(trees):
        u = b.tree(i)
        assert (u.tokens, u.parents, u.num_verify, u.causal_from) == \
            (t.tokens, t.parents, t.num_verify, t.causal_from)
        s = int(b.offsets[i])
        assert b.depths[s: s + t.num_nodes].tolist() == t.depths()
    assert b.tokens.dtype == torch.int64 and b.parents.dtype == torch.int32


def test_depth_first_keeps_the_tree_and_leads_with_its_longest_path():
    from vllm_ptd.integration.step import chain_prefix

    rng = random.Random(7)
    for _ in range(200):
        t = random_tree(rng, rng.randint(0, 16))
        nv = t.num_verify
        t.scores = [rng.random() for _ in range(nv)]
        t.groups = [rng.randrange(3) for _ in range(nv)]
        d = t.depth_first()

        def labelled(tree):  # every node by the tokens on its path: the tree itself
            return sorted((tuple(tree.tokens[a] for a in tree.path_to(i)), i < tree.num_verify,
                           tree.scores[i] if i < tree.num_verify else None,
                           tree.groups[i] if i < tree.num_verify else None)
                          for i in range(tree.num_nodes))

        assert labelled(d) == labelled(t)
        assert (d.num_verify, d.causal_from, d.num_nodes) == (nv, t.causal_from, t.num_nodes)
        assert d.tokens[nv:] == t.tokens[nv:]
        height = max(t.depths()[:nv], default=0)
        assert min(chain_prefix(d), nv) == height  # the longest path leads, as a chain
        assert d.depth_first().parents == d.parents  # already depth first: unchanged
