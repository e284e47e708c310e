"""Draft trees: structure derived from parents, EAGLE-2 construction against a brute-force reference, and
a chain as a tree of width 1 (tree verification of a chain-shaped tree == chain verification)."""

from __future__ import annotations

import pytest
import torch

from eyas.serving.tree import DraftTree, TreeConfig, build_dynamic_tree, chain_tree
from eyas.serving.verify import (
    verify_chain_greedy,
    verify_chain_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)


def ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_from_parents_derives_depths_mask_children_and_paths():
    parents = [-1, 0, 0, 1, 1, 2, 4]
    tree = DraftTree.from_parents(torch.arange(10, 17), torch.tensor(parents))
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    for i in range(7):
        assert set(tree.mask[i].nonzero().flatten().tolist()) == ancestors(parents, i)
    assert tree.children == [[1, 2], [3, 4], [5], [], [6], [], []]
    assert tree.paths.tolist() == [[0, 1, 3, -1], [0, 2, 5, -1], [0, 1, 4, 6]]
    assert tree.max_depth == 3 and tree.num_draft == 6 and not tree.is_chain


def test_chain_tree_equals_the_general_construction():
    chain = chain_tree(torch.tensor(5), torch.tensor([7, 8, 9]))
    ref = DraftTree.from_parents(torch.tensor([5, 7, 8, 9]), torch.tensor([-1, 0, 1, 2]))
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(chain, name), getattr(ref, name)), name
    assert chain.children == ref.children and chain.is_chain
    assert chain_tree(torch.tensor(5), torch.tensor([], dtype=torch.long)).size == 1


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], [-1, -1]])
def test_invalid_parents_are_rejected(parents):
    with pytest.raises(ValueError, match="parents"):
        DraftTree.from_parents(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents))


# -- EAGLE-2 dynamic tree ----------------------------------------------------------------------------------------
class TableDrafter:
    """A deterministic fake drafter: the children's log-probs of a node depend on its whole path."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed
        self.frontiers: list[list[tuple[int, ...]]] = []  # paths of every frontier passed to expand

    def logprobs(self, path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, path)) % (2**31))
        return torch.log_softmax(torch.randn(self.vocab, generator=g) * 2, -1)

    def expand_fn(self):
        paths: list[tuple[int, ...]] = []

        def expand(tokens, parent_slot, depth):
            nonlocal paths
            prev = [()] * tokens.numel() if depth == 1 else [paths[int(s)] for s in parent_slot]
            paths = [p + (int(t),) for p, t in zip(prev, tokens)]
            self.frontiers.append(paths)
            return torch.stack([self.logprobs(p) for p in paths])

        return expand


def brute_force_eagle2(drafter: TableDrafter, cfg: TreeConfig) -> dict[tuple[int, ...], float]:
    """All EAGLE-2 candidates as {path: cumulative log-prob}, then the top ``total_tokens``."""
    k = cfg.topk
    root = drafter.logprobs(())
    s, ids = root.topk(k)
    cands = {(int(t),): float(v) for v, t in zip(s, ids)}
    frontier = list(cands)
    for _depth in range(1, cfg.depth):
        level = {}
        for path in frontier:
            cs, ci = drafter.logprobs(path).topk(k)
            for v, t in zip(cs, ci):
                level[path + (int(t),)] = cands[path] + float(v)
        frontier = sorted(level, key=lambda p: -level[p])[:k]
        cands.update(level)
    kept = sorted(cands, key=lambda p: -cands[p])[: cfg.total_tokens]
    return {p: cands[p] for p in kept}


@pytest.mark.parametrize(
    "cfg", [TreeConfig(3, 4, 12), TreeConfig(4, 3, 40), TreeConfig(2, 5, 8), TreeConfig(1, 4, 4)]
)
def test_dynamic_tree_matches_brute_force_eagle2(cfg):
    drafter = TableDrafter(vocab=11, seed=cfg.topk * 100 + cfg.depth)
    tree = build_dynamic_tree(torch.tensor(99), drafter.logprobs(()), drafter.expand_fn(), cfg)
    expected = brute_force_eagle2(drafter, cfg)
    paths = {}
    for i in range(1, tree.size):
        nodes = tree.mask[i].nonzero().flatten()[1:]  # ancestors-or-self without the root, by depth
        paths[tuple(tree.tokens[nodes].tolist())] = i
    assert set(paths) == set(expected)
    assert tree.size == min(cfg.total_tokens, cfg.num_candidates) + 1 and int(tree.tokens[0]) == 99
    assert len(drafter.frontiers) == cfg.depth - 1  # the last depth is never expanded
    # a valid tree: parents come first, sibling tokens are distinct, depth within bounds
    assert bool((tree.parents[1:] < torch.arange(1, tree.size)).all()) and tree.max_depth <= cfg.depth
    for kids in tree.children:
        assert len(set(tree.tokens[kids].tolist())) == len(kids)


def test_width_one_tree_is_the_greedy_draft_chain():
    drafter = TableDrafter(vocab=9, seed=3)
    tree = build_dynamic_tree(torch.tensor(0), drafter.logprobs(()), drafter.expand_fn(), TreeConfig(1, 5, 5))
    path: tuple[int, ...] = ()
    for _ in range(5):
        path += (int(drafter.logprobs(path).argmax()),)
    assert tree.is_chain and tree.tokens[1:].tolist() == list(path)


def test_dynamic_tree_maps_draft_ids_to_target_ids():
    drafter = TableDrafter(vocab=6, seed=5)
    to_target = torch.tensor([40, 11, 3, 27, 8, 19])
    plain = build_dynamic_tree(
        torch.tensor(1), drafter.logprobs(()), drafter.expand_fn(), TreeConfig(2, 3, 6)
    )
    to_draft = torch.zeros(41, dtype=torch.long)
    to_draft[to_target] = torch.arange(6)
    expand = drafter.expand_fn()  # keyed by draft ids: the builder must hand it target ids

    def expand_target_ids(tokens, parent_slot, depth):
        assert bool(torch.isin(tokens, to_target).all())
        return expand(to_draft[tokens], parent_slot, depth)

    mapped = build_dynamic_tree(
        torch.tensor(1), drafter.logprobs(()), expand_target_ids, TreeConfig(2, 3, 6), to_target
    )
    assert mapped.tokens[1:].tolist() == to_target[plain.tokens[1:]].tolist()
    assert torch.equal(mapped.parents, plain.parents)


# -- a chain is a tree of width 1 --------------------------------------------------------------------------------
def test_tree_verify_on_a_chain_equals_chain_verify():
    g = torch.Generator().manual_seed(0)
    v, k = 7, 4
    for trial in range(120):
        logits = torch.randn(k + 1, v, generator=g) * 2
        draft = torch.randint(0, v, (k,), generator=g)
        if trial % 2:  # make long acceptances common
            draft = torch.where(torch.rand(k, generator=g) < 0.8, logits[:k].argmax(-1), draft)
        chain = chain_tree(torch.tensor(3), draft)
        a, b = verify_chain_greedy(logits, draft), verify_tree_greedy(logits, chain)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.path, b.path)

        p = torch.softmax(logits, -1)
        q = torch.softmax(torch.randn(k, v, generator=g), -1) if trial % 3 else None
        rows = None if q is None else torch.cat([torch.zeros(1, v), q])
        seed = int(torch.randint(0, 2**30, (1,), generator=g))
        a = verify_chain_sampling(p, draft, q, torch.Generator().manual_seed(seed))
        b = verify_tree_sampling(p, chain, rows, torch.Generator().manual_seed(seed))
        assert (
            torch.equal(a.tokens, b.tokens)
            and torch.equal(a.path, b.path)
            and a.num_accepted == b.num_accepted
        )
