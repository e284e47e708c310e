"""One prefill per prompt and target copy (serving.loop.PrefillMemo, eval.acceptance's share_prefill): the methods
of a run continue from a copy of it, with outputs, per-step acceptance and reported prefill times as if each had
run its own."""

from __future__ import annotations

import time

import pytest
import torch

import eyas.eval.acceptance as acceptance
from eyas.eval.acceptance import REFERENCE, PromptSetSpec, default_methods, run_acceptance
from eyas.serving.load import random_drafter
from eyas.serving.models.exact_attention import EXACT
from eyas.serving.tree import TreeConfig
from tests.conftest import make_tiny_target

PROMPTS = [[11, 12, 13, 14, 15, 16] * 3, [40, 41, 42, 40, 41, 42, 40], [7, 8, 9, 10, 7, 8]]
REAL_GENERATE, REAL_MAKE = acceptance.generate, acceptance.make_proposer  # before any test patches them
PREFILL_S = 0.02  # what a prefill forward sleeps: a timing that a restored copy must report, not its copy's


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def counted(target, prefills: list):
    """``target`` whose prefill forwards (logits at the last position only) are recorded and take PREFILL_S."""
    forward = target.forward

    def spy(input_ids, **kwargs):
        if kwargs.get("logits") == "last":
            prefills.append((target, tuple(input_ids[0].tolist())))
            time.sleep(PREFILL_S)
        return forward(input_ids, **kwargs)

    target.forward = spy
    return target


def run(share: bool, monkeypatch, across: bool = False):
    """One run of every method (chain, tree, prompt lookup, plain decoding on an sdpa copy, the row-exact
    reference) over PROMPTS: (prefill forwards, method -> the generation of each prompt, the result)."""
    base = make_tiny_target("llama")
    prefills: list = []
    verify = counted(base.with_dtype(torch.bfloat16, EXACT), prefills)
    baseline = counted(base.with_dtype(torch.bfloat16, "sdpa"), prefills)
    drafter = random_drafter(verify, 64, seed=3)
    gens: dict[str, list] = {}
    method_of = {}

    def make(spec, d):
        proposer = REAL_MAKE(spec, d)
        method_of[id(proposer)] = spec.name
        return proposer

    def spy(target, proposer, prompt, n, *args, **kwargs):
        out = REAL_GENERATE(target, proposer, prompt, n, *args, **kwargs)
        gens.setdefault(method_of[id(proposer)], []).append(out)
        return out

    monkeypatch.setattr(acceptance, "make_proposer", make)
    monkeypatch.setattr(acceptance, "generate", spy)
    methods = default_methods(3, TreeConfig(topk=2, depth=3, total_tokens=6))
    spec = PromptSetSpec("s", "ids", len(PROMPTS), "s", max_new_tokens=12)
    acc = run_acceptance(
        verify,
        drafter,
        {"s": (spec, PROMPTS)},
        methods,
        baseline=baseline,
        share_prefill=share,
        prefill_across_copies=across,
    )
    return prefills, gens, acc, (verify, baseline)


def steps(gen) -> list[tuple[int, int, int, int, int]]:
    return [(s.context_len, s.num_drafted, s.draft_depth, s.num_accepted, s.num_emitted) for s in gen.steps]


def test_methods_share_one_prefill_per_prompt_and_target_with_identical_outputs_and_steps(monkeypatch):
    shared_prefills, shared, acc, (verify, baseline) = run(True, monkeypatch)
    own_prefills, own, _, (own_verify, _) = run(False, monkeypatch)
    names = ["eagle3-chain", "eagle3-tree", "prompt-lookup", "none", REFERENCE]
    assert sorted(shared) == sorted(own) == sorted(names)
    for name in names:  # token for token, step for step
        assert [g.tokens for g in shared[name]] == [g.tokens for g in own[name]], name
        assert [steps(g) for g in shared[name]] == [steps(g) for g in own[name]], name
    # the row-exact copy decodes four methods: one prefill of each prompt instead of four (the warm-up's of the
    # first prompt first); the baseline its own
    once = [tuple(p) for p in [PROMPTS[0], *PROMPTS]]
    assert [p for t, p in shared_prefills if t is verify] == once
    assert [p for t, p in shared_prefills if t is baseline] == once
    assert sum(t is own_verify for t, _ in own_prefills) == 4 * len(once)
    for name in names:  # a restored prefill reports the real prefill's time, not its copy's
        for g in shared[name]:
            assert g.prefill_s >= PREFILL_S
            assert g.total_s >= g.prefill_s + 0.999 * sum(s.step_s for s in g.steps)
    assert all(r.mean_ttft_ms >= 1e3 * PREFILL_S for r in acc.results)


def test_the_two_numerics_copies_can_share_one_prefill_per_prompt(monkeypatch):
    """``prefill_across_copies`` (eyas context's one_prefill): the row-exact copy and the sdpa copy continue from
    one prefill of each prompt, the one the prompt's first method ran; methods on the copy that prefilled decode
    as they do from their own copy's prefill, and the greedy match against plain decoding still holds."""
    prefills, across, acc, (verify, baseline) = run(True, monkeypatch, across=True)
    _, per_copy, _, _ = run(True, monkeypatch)
    once = [tuple(p) for p in [PROMPTS[0], *PROMPTS]]
    assert [p for _, p in prefills] == once  # one prefill per prompt over both copies (warm-up included)
    methods = default_methods(3, TreeConfig(topk=2, depth=3, total_tokens=6))
    plan = acceptance.plan_run(methods, verify, baseline, True)
    order = [m.name for m in plan.methods]
    on_baseline = {"none"}
    for i, (t, _) in enumerate(prefills[1:]):  # the prompt's first method chose the copy
        first = acceptance.method_order(plan.methods, i)[0].name
        assert (t is baseline) == (first in on_baseline)
        same_copy = [n for n in order if (n in on_baseline) == (t is baseline)]
        for name in same_copy:
            assert across[name][i].tokens == per_copy[name][i].tokens, (name, i)
    for r in acc.results:
        if r.method in ("eagle3-chain", "prompt-lookup"):
            assert r.match_rate == 1.0
