"""Lossless sampling through the whole loop: with drafters whose q differs from the target's p, the generated
tokens are distributed as the target's (warped) softmax (chi-square tests with fixed seeds, so deterministic)."""

from __future__ import annotations

import pytest
import torch

from eyas.serving.loop import generate
from eyas.serving.proposers import Eagle3Proposer, PromptLookupProposer
from eyas.serving.tree import TreeConfig
from eyas.serving.verify import SamplingConfig, warp_probs
from tests.conftest import make_tiny_target
from tests.serving.test_speculative_loop import make_drafter, one_thread  # noqa: F401  (autouse fixture)
from tests.serving.test_verify import chi_square_pvalue

VOCAB = 24


def iid_target():
    """A tiny llama whose next-token distribution ignores the context: every token embeds to the same vector
    and the layers add nothing, so each generated token is an independent draw from one fixed p."""
    target = make_tiny_target("llama", vocab_size=VOCAB, hidden_size=32, num_layers=2)
    m = target.model
    with torch.no_grad():
        m.get_input_embeddings().weight.copy_(
            torch.randn(32, generator=torch.Generator().manual_seed(2)).expand(VOCAB, 32)
        )
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.copy_(torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(3)) * 0.3)
    return target


def context_drafter(target, seed: int):
    """A drafter over 16 of the 24 tokens whose q resembles the target's p (copy weights, so drafts get
    accepted) but differs from it: the 8 missing tokens have q = 0, and a random attention output mixed with
    its own random embedding makes q depend on the context even where p does not."""
    drafter = make_drafter(target, seed=seed, draft_vocab=16, copy=True)
    with torch.no_grad():
        drafter.embed_tokens.weight.normal_(0, 1)
        drafter.midlayer.self_attn.o_proj.weight.normal_(0, 0.3)
    return drafter


@pytest.mark.parametrize(
    "mode,proposer_kind,sampling",
    [
        ("chain", "eagle3", SamplingConfig(temperature=1.0, seed=11)),
        ("chain", "eagle3", SamplingConfig(temperature=0.7, top_p=0.8, seed=12)),
        ("tree", "eagle3", SamplingConfig(temperature=1.0, top_p=0.9, seed=13)),
        ("chain", "prompt_lookup", SamplingConfig(temperature=1.0, seed=14)),
    ],
)
def test_loop_tokens_follow_the_target_distribution_iid_target(mode, proposer_kind, sampling):
    target = iid_target()
    n_tokens = 800
    p = warp_probs(
        target.forward(torch.tensor([[3, 4, 5]]), logits="last").logits[0, -1],
        sampling.temperature,
        sampling.top_p,
    )
    if proposer_kind == "eagle3":
        proposer = Eagle3Proposer(context_drafter(target, 1), chain_length=3, tree=TreeConfig(3, 3, 8))
    else:
        proposer = PromptLookupProposer(max_ngram=2, num_tokens=3)
    res = generate(target, proposer, [3, 4, 5], n_tokens, sampling=sampling, mode=mode, stop_on_eos=False)
    assert len(res.tokens) == n_tokens
    assert sum(s.num_accepted for s in res.steps) > 100  # speculation really happened
    counts = torch.bincount(torch.tensor(res.tokens), minlength=VOCAB)
    assert chi_square_pvalue(counts, p) > 1e-3


def test_first_verified_tokens_follow_the_target_marginals():
    """Context-dependent target: over many seeds, the tokens produced by speculative steps (the second and third
    generated ones) have the exact marginals sum_t1 p(t1) p(t2 | t1) and sum_t1,t2 p(t1) p(t2 | t1) p(t3 | t1, t2)
    (the third is the bonus token when the draft was accepted, else the next step's token)."""
    v = 32
    target = make_tiny_target("llama", vocab_size=v, hidden_size=32, num_layers=2)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(8)  # a context-dependent p with a clear shape
    warp = dict(temperature=0.8, top_p=0.9)
    prompt = torch.tensor([5, 9, 17, 3])
    p1 = warp_probs(target.forward(prompt[None], logits="last").logits[0, -1], **warp)  # [V]
    grid = torch.stack(torch.meshgrid(torch.arange(v), torch.arange(v), indexing="ij"), -1).reshape(-1, 2)
    seqs = torch.cat([prompt.expand(v * v, -1), grid], dim=1)  # every (t1, t2) after the prompt
    logits = target.forward(seqs, logits="all").logits  # [V*V, P+2, V]
    p2_given = warp_probs(logits[::v, -2], **warp)  # [V (t1), V]
    p3_given = warp_probs(logits[:, -1], **warp).reshape(v, v, v)  # [t1, t2, V]
    p2 = p1 @ p2_given
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)

    proposer = Eagle3Proposer(context_drafter(target, 2), chain_length=2)
    runs = 1200
    toks, accepted = [], 0
    for seed in range(runs):
        res = generate(
            target, proposer, prompt, 3, sampling=SamplingConfig(seed=seed, **warp), stop_on_eos=False
        )
        toks.append(res.tokens)
        accepted += res.steps[0].num_accepted
    assert 0.05 * runs < accepted < 0.95 * runs  # drafts are sometimes accepted, sometimes not: q != p
    toks = torch.tensor(toks)  # [runs, 3]
    for i, p in enumerate([p1, p2, p3]):
        assert chi_square_pvalue(torch.bincount(toks[:, i], minlength=v), p) > 1e-3, f"token {i + 1}"


def test_greedy_ignores_the_seed_and_sampling_is_reproducible():
    target = iid_target()
    drafter = context_drafter(target, 3)
    greedy = [
        generate(target, Eagle3Proposer(drafter), [3, 4], 20, sampling=SamplingConfig(seed=s)).tokens
        for s in (0, 1)
    ]
    assert greedy[0] == greedy[1]
    runs = [
        generate(
            target,
            Eagle3Proposer(drafter),
            [3, 4],
            40,
            sampling=SamplingConfig(1.0, seed=s),
            stop_on_eos=False,
        ).tokens
        for s in (5, 5, 6)
    ]
    assert runs[0] == runs[1] != runs[2]
