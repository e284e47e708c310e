"""Verification as pure functions: greedy prefixes and tree walks, and the lossless rejection rule on hand-made
distributions (statistical checks use fixed seeds and a chi-square / binomial bound, so they are deterministic)."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.serving.tree import DraftTree, chain_tree
from eyas.serving.verify import (
    SamplingConfig,
    residual,
    verify,
    verify_chain_greedy,
    verify_chain_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
    warp_probs,
)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs``; bins expecting < 5 draws are pooled into one."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert counts[~keep].sum() == 0, "draws landed where the reference has no mass"
    counts, expected = counts[keep], expected[keep]
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))  # chi2 survival function


def peaked(v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(v, generator=g) * scale, -1)


# -- greedy -----------------------------------------------------------------------------------------------------
def one_hot_logits(ids: list[int], v: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float() * 5 + torch.rand(len(ids), v)


def test_chain_greedy_accepts_longest_matching_prefix_plus_bonus():
    logits = one_hot_logits([4, 7, 1, 9])  # target argmax after root, d1, d2, d3
    res = verify_chain_greedy(logits, torch.tensor([4, 7, 2]))
    assert res.num_accepted == 2 and res.tokens.tolist() == [4, 7, 1] and res.path.tolist() == [0, 1, 2]
    res = verify_chain_greedy(logits, torch.tensor([4, 7, 1]))
    assert res.num_accepted == 3 and res.tokens.tolist() == [4, 7, 1, 9]
    res = verify_chain_greedy(logits, torch.tensor([5, 7, 1]))  # later matches do not count after a miss
    assert res.num_accepted == 0 and res.tokens.tolist() == [4]
    res = verify_chain_greedy(logits[:1], torch.tensor([], dtype=torch.long))  # plain decoding
    assert res.num_accepted == 0 and res.tokens.tolist() == [4]


def brute_force_greedy_walk(logits: torch.Tensor, tree: DraftTree) -> list[int]:
    node, path = 0, [0]
    while True:
        best = int(logits[node].argmax())
        nxt = [c for c in tree.children[node] if int(tree.tokens[c]) == best]
        if not nxt:
            return path
        node = nxt[0]
        path.append(node)


def test_tree_greedy_follows_target_argmax_through_any_sibling():
    #        0
    #      / | \
    #     1  2  3          tokens 5 6 7
    #    /|     |
    #   4 5     6          tokens 8 9 | 8
    #   |
    #   7                  token 3
    tree = DraftTree.from_parents(
        torch.tensor([0, 5, 6, 7, 8, 9, 8, 3]), torch.tensor([-1, 0, 0, 0, 1, 1, 3, 5])
    )
    cases = {
        (6, 0, 0, 0, 0, 0, 0, 0): [0, 2],  # second sibling, a leaf: bonus from node 2
        (5, 9, 0, 0, 0, 3, 0, 0): [0, 1, 5, 7],  # deepest path through the second grandchild
        (7, 0, 0, 8, 0, 0, 0, 0): [0, 3, 6],
        (2, 0, 0, 0, 0, 0, 0, 0): [0],  # nothing matches
    }
    for argmaxes, expected in cases.items():
        logits = one_hot_logits(list(argmaxes))
        res = verify_tree_greedy(logits, tree)
        assert res.path.tolist() == expected == brute_force_greedy_walk(logits, tree)
        assert res.tokens.tolist() == tree.tokens[res.path[1:]].tolist() + [argmaxes[expected[-1]]]
        assert res.num_accepted == len(expected) - 1


def test_tree_greedy_matches_brute_force_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(2, 20, (1,), generator=g))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        tokens = torch.randint(0, 4, (n,), generator=g)
        # distinct tokens among siblings, as every drafter produces
        for node in range(n):
            kids = (parents == node).nonzero().flatten()
            tokens[kids] = torch.randperm(8, generator=g)[: kids.numel()]
        tree = DraftTree.from_parents(tokens, parents)
        logits = torch.randn(n, 8, generator=g)
        logits[:, :4] += 1.5  # make matches common
        assert verify_tree_greedy(logits, tree).path.tolist() == brute_force_greedy_walk(logits, tree)


# -- the rejection rule on hand-made distributions ---------------------------------------------------------------
def run_chain(p: torch.Tensor, q: torch.Tensor | None, draft: int | None, runs: int, seed: int = 0):
    """Single-draft chain verification ``runs`` times; the draft is drawn from ``q`` unless fixed."""
    g = torch.Generator().manual_seed(seed)
    target = torch.stack([p, torch.full_like(p, 1 / p.numel())])  # [2, V]: p, then the bonus distribution
    accepted, first = torch.zeros(runs, dtype=torch.bool), torch.zeros(runs, dtype=torch.long)
    for i in range(runs):
        x = torch.multinomial(q, 1, generator=g) if draft is None else torch.tensor([draft])
        res = verify_chain_sampling(target, x, None if q is None else q[None], g)
        accepted[i], first[i] = res.num_accepted == 1, res.tokens[0]
    return accepted, first


def test_never_accepts_a_token_the_target_gives_zero_probability():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.3, 0.7])
    accepted, first = run_chain(p, q, None, 300)
    assert not accepted.any()
    assert set(first.tolist()) <= {0, 1}  # the replacement comes from the residual, i.e. from p's support
    accepted, _ = run_chain(p, None, 3, 100)  # a point-mass draft of a zero-probability token
    assert not accepted.any()


def test_always_accepts_when_draft_equals_target():
    p = peaked(16, 1)
    accepted, _ = run_chain(p, p.clone(), None, 500)
    assert accepted.all()


def test_acceptance_rate_is_overlap_mass_and_output_is_target():
    p, q = peaked(12, 2), peaked(12, 3)
    runs = 4000
    accepted, first = run_chain(p, q, None, runs)
    rate, expected = accepted.float().mean().item(), torch.minimum(p, q).sum().item()
    sigma = math.sqrt(expected * (1 - expected) / runs)
    assert abs(rate - expected) < 4.5 * sigma, (rate, expected)
    assert chi_square_pvalue(torch.bincount(first, minlength=12), p) > 1e-3
    # the replacement after a rejection is distributed as norm(max(0, p - q))
    res = (p - q).clamp(min=0)
    assert chi_square_pvalue(torch.bincount(first[~accepted], minlength=12), res / res.sum()) > 1e-3


def test_every_chain_position_follows_its_own_target_distribution():
    """K = 3 with a different p and q at every position: the token emitted at position j (when the step reaches
    it) is distributed as p_j, so a q or p row used at the wrong position would show."""
    v, k, runs = 8, 3, 3000
    p = torch.stack([peaked(v, 30 + j, 1.5) for j in range(k + 1)])  # [K+1, V]
    q = torch.stack([peaked(v, 40 + j, 1.5) for j in range(k)])  # [K, V]
    g = torch.Generator().manual_seed(3)
    at = [[] for _ in range(k + 1)]
    for _ in range(runs):
        draft = torch.multinomial(q, 1, generator=g).squeeze(1)  # one draft per position, each from its own q
        for j, tok in enumerate(verify_chain_sampling(p, draft, q, g).tokens.tolist()):
            at[j].append(tok)
    assert len(at[k]) > 100  # full acceptance (the bonus position) happens often enough to test
    for j in range(k + 1):
        assert chi_square_pvalue(torch.bincount(torch.tensor(at[j]), minlength=v), p[j]) > 1e-3, (
            f"position {j}"
        )


def test_point_mass_draft_is_accepted_with_target_probability():
    p = peaked(8, 4)
    x = int(p.argsort()[-2])  # a token with intermediate probability
    runs = 3000
    accepted, first = run_chain(p, None, x, runs)
    sigma = math.sqrt(p[x] * (1 - p[x]) / runs)
    assert abs(accepted.float().mean() - p[x]) < 4.5 * sigma
    assert chi_square_pvalue(torch.bincount(first, minlength=8), p) > 1e-3


def test_residual_is_p_when_nothing_is_left():
    p = peaked(6, 5)
    torch.testing.assert_close(residual(p, torch.tensor(1), p.clone()), p)
    left = residual(p, torch.tensor(1), None)
    assert left[1] == 0 and torch.isclose(left.sum(), torch.tensor(1.0))


def test_full_acceptance_draws_the_bonus_from_the_next_distribution():
    p0 = torch.tensor([0.0, 1.0, 0.0])
    bonus = torch.tensor([0.2, 0.0, 0.8])
    g = torch.Generator().manual_seed(0)
    seen = [
        verify_chain_sampling(torch.stack([p0, bonus]), torch.tensor([1]), None, g).tokens.tolist()
        for _ in range(200)
    ]
    assert all(s[0] == 1 and s[1] in (0, 2) for s in seen)
    assert 0.1 < sum(s[1] == 0 for s in seen) / 200 < 0.3


# -- trees -------------------------------------------------------------------------------------------------------
def test_tree_sampling_with_point_mass_siblings_is_lossless():
    """Root children [a, b, c] tried in order (EAGLE-2 candidates); node a has children [d, e].
    First token ~ p_root; given the first token is a, the second ~ p_a."""
    v = 10
    p = torch.stack([peaked(v, s) for s in range(10, 10 + 6)])  # [6, V] target at nodes 0..5
    order = p[0].argsort(descending=True).tolist()
    a, b, c = order[0], order[3], order[1]
    pa_order = p[1].argsort(descending=True).tolist()
    tree = DraftTree.from_parents(
        torch.tensor([0, a, b, c, pa_order[1], pa_order[0]]), torch.tensor([-1, 0, 0, 0, 1, 1])
    )
    g = torch.Generator().manual_seed(1)
    firsts, seconds = [], []
    for _ in range(4000):
        res = verify_tree_sampling(p, tree, None, g)
        firsts.append(int(res.tokens[0]))
        if res.tokens[0] == a:
            assert res.path[1] == 1 and res.tokens.numel() >= 2
            seconds.append(int(res.tokens[1]))
    assert chi_square_pvalue(torch.bincount(torch.tensor(firsts), minlength=v), p[0]) > 1e-3
    assert chi_square_pvalue(torch.bincount(torch.tensor(seconds), minlength=v), p[1]) > 1e-3


def test_tree_sampling_with_siblings_sampled_without_replacement_is_lossless():
    """Recursive rejection: the root's 3 children are drawn from q without replacement; each child's q row is the
    distribution it was drawn from given its earlier siblings."""
    v = 8
    p, q = peaked(v, 20, 1.5), peaked(v, 21, 1.5)
    g = torch.Generator().manual_seed(2)
    target = torch.stack([p] + [torch.full((v,), 1 / v)] * 3)
    firsts = []
    for _ in range(4000):
        left, toks, rows = q.clone(), [], []
        for _sibling in range(3):
            rows.append(left / left.sum())
            x = int(torch.multinomial(rows[-1], 1, generator=g))
            toks.append(x)
            left[x] = 0
        tree = DraftTree.from_parents(torch.tensor([0] + toks), torch.tensor([-1, 0, 0, 0]))
        probs = torch.stack([torch.zeros(v)] + rows)
        firsts.append(int(verify_tree_sampling(target, tree, probs, g).tokens[0]))
    assert chi_square_pvalue(torch.bincount(torch.tensor(firsts), minlength=v), p) > 1e-3


# -- warping and dispatch ----------------------------------------------------------------------------------------
def test_warp_probs_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    torch.testing.assert_close(warp_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    base = torch.softmax(logits / 0.7, -1)[0]
    for top_p in (0.3, 0.6, 0.9, 0.999):
        out = warp_probs(logits, 0.7, top_p)[0]
        # the smallest set of most likely tokens whose mass reaches top_p
        k = int((base.cumsum(0) < top_p).sum()) + 1
        expected = torch.zeros_like(base)
        expected[:k] = base[:k] / base[:k].sum()
        torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="temperature"):
        warp_probs(logits, 0.0)


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1, top_p=0)


def test_chain_mode_rejects_a_branching_tree():
    tree = DraftTree.from_parents(torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="mode='tree'"):
        verify(torch.randn(3, 5), tree, None, SamplingConfig(), torch.Generator(), chain=True)


def test_greedy_ignores_the_generator_and_sampling_is_reproducible():
    logits = torch.randn(4, 9)
    tree = chain_tree(torch.tensor(0), torch.tensor([3, 1, 4]))
    greedy = [
        verify(logits, tree, None, SamplingConfig(), torch.Generator().manual_seed(s), True) for s in (0, 1)
    ]
    assert torch.equal(greedy[0].tokens, greedy[1].tokens)
    cfg = SamplingConfig(temperature=1.0)
    runs = [verify(logits, tree, None, cfg, torch.Generator().manual_seed(7), True).tokens for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
