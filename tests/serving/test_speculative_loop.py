"""The speculative loop: greedy speculative output == plain greedy (full recomputation, no cache) for every
drafter and both modes; the verify forward and the drafter's cache path == uncached recomputation; clear errors
before any model runs; stop conditions and step statistics."""

from __future__ import annotations

import pytest
import torch

from eyas.serving.loop import commit, generate, prefill, tree_forward
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.proposers import (
    DraftContext,
    DraftProposal,
    Eagle3Proposer,
    Eagle3ProposerConfig,
    NoProposer,
    PromptLookupProposer,
)
from eyas.serving.tree import DraftTree, TreeConfig, chain_tree
from eyas.serving.verify import SamplingConfig, warp_probs
from tests.conftest import make_tiny_target


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and on a shared, oversubscribed CPU a second thread turns every
    small op into a multi-millisecond barrier wait. Results do not depend on it (reference and loop share it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- drafters used by the tests ----------------------------------------------------------------------------------
def make_drafter(
    target, seed: int = 0, draft_vocab: int | None = None, copy: bool = False, window: int | None = None
) -> Eagle3Drafter:
    """A random-init EAGLE-3 drafter for ``target``; with ``copy``, weights that make its context rows repeat the
    target's own prediction: fc passes the last aux layer (the output of layer L-2), the drafter block computes
    the target's last layer on it (llama-style targets; elsewhere it adds nothing), norm and head are the
    target's. ``window``: its attention_window."""
    v = target.vocab_size
    draft_vocab = draft_vocab or v
    cfg = DrafterConfig.from_target(
        target.model.config, list(target.aux_layers), draft_vocab, attention_window=window
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg).to(target.dtype)
    drafter.set_embedding(target.model.get_input_embeddings().weight)
    to_target = torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    drafter.set_vocab_map(to_target)
    if copy:
        h = cfg.hidden_size
        assert target.aux_layers[-1] == len(target.layers) - 2
        last, block = target.layers[-1], drafter.midlayer
        with torch.no_grad():
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, -h:] = torch.eye(h)
            drafter.norm.weight.copy_(target.model.get_decoder().norm.weight)
            drafter.lm_head.weight.copy_(target.head.weight[to_target])
            if hasattr(last.self_attn, "q_proj") and hasattr(last.mlp, "gate_proj"):
                for name in (
                    "q_proj",
                    "k_proj",
                    "v_proj",
                ):  # read only the hidden half of cat(embeds, hidden)
                    getattr(block.self_attn, name).weight.zero_()
                    getattr(block.self_attn, name).weight[:, h:] = getattr(last.self_attn, name).weight
                block.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
                block.hidden_norm.weight.copy_(last.input_layernorm.weight)
                block.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
                block.mlp.load_state_dict(last.mlp.state_dict())
            else:
                block.self_attn.o_proj.weight.zero_()
                block.mlp.down_proj.weight.zero_()
    return drafter


class FixedTokenProposer:
    """A deliberately bad drafter: always the same (wrong) token, as a chain or a small tree."""

    name = "bad"

    def __init__(self, token: int, k: int = 3):
        self.token, self.k = token, k

    def reset(self, prompt_ids, *, target, max_len):
        pass

    def propose(self, ctx: DraftContext) -> DraftProposal:
        root = ctx.tokens[ctx.length]
        k = min(self.k, ctx.max_depth, ctx.max_tokens)
        if ctx.mode == "chain" or k < 3:
            return DraftProposal(chain_tree(root, torch.full((k,), self.token)))
        tokens = torch.tensor([int(root), self.token, self.token + 1, self.token])
        return DraftProposal(DraftTree.from_parents(tokens, torch.tensor([-1, 0, 0, 1])))

    def accept(self, accepted):
        pass


class OracleProposer:
    """Drafts from the known greedy continuation: in chain mode the truth with one planted error (sometimes
    none); in tree mode the true path with a wrong sibling (with its own child) placed before or after the true
    node at every depth, so accepted paths are scattered through the tree."""

    name = "oracle"

    def __init__(self, reference: list[int], prompt_len: int, k: int = 5, seed: int = 0, vocab: int = 256):
        self.ref, self.prompt_len, self.k, self.seed, self.vocab = reference, prompt_len, k, seed, vocab

    def reset(self, prompt_ids, *, target, max_len):
        self.g = torch.Generator().manual_seed(self.seed)

    def _wrong(self, truth: int) -> int:
        return (truth + 1 + int(torch.randint(0, self.vocab - 1, (1,), generator=self.g))) % self.vocab

    def propose(self, ctx: DraftContext) -> DraftProposal:
        i = ctx.length - self.prompt_len  # index of the pending token among the generated ones
        k = min(self.k, ctx.max_depth, ctx.max_tokens // 3)
        truth = self.ref[i + 1 : i + 1 + k]
        root = ctx.tokens[ctx.length]
        if ctx.mode == "chain":
            draft = list(truth)
            if draft and int(torch.randint(0, 3, (1,), generator=self.g)):
                j = int(torch.randint(0, len(draft), (1,), generator=self.g))
                draft[j] = self._wrong(draft[j])
            return DraftProposal(chain_tree(root, torch.tensor(draft, dtype=torch.long)))
        tokens, parents, node = [int(root)], [-1], 0
        for t in truth:
            wrong_first = bool(torch.randint(0, 2, (1,), generator=self.g))
            w = self._wrong(t)
            order = [w, t] if wrong_first else [t, w]
            ids = {}
            for tok in order:
                tokens.append(tok)
                parents.append(node)
                ids[tok] = len(tokens) - 1
            tokens.append(self._wrong(t))  # a child under the wrong sibling
            parents.append(ids[w])
            node = ids[t]
        return DraftProposal(DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents)))

    def accept(self, accepted):
        pass


def plain_greedy(target, prompt: torch.Tensor, n: int, eos: set[int]) -> list[int]:
    """Reference: argmax of a full forward of the whole sequence for every token (no cache)."""
    ids, out = prompt.tolist(), []
    for _ in range(n):
        tok = int(target.forward(torch.tensor([ids]), logits="last").logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok in eos:
            break
    return out


# -- speculative greedy == plain greedy --------------------------------------------------------------------------
N_NEW = 32
TINY = {}


def tiny_case(arch: str):
    """(target, prompt, plain greedy reference), built once per architecture."""
    if arch not in TINY:
        target = make_tiny_target(arch)
        # prompt seeds whose greedy continuations repeat (runs, cycles), so plausible drafters get accepted
        seed = {"llama": 6, "deepseek_v3": 3}[arch]
        prompt = torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(seed))
        TINY[arch] = (target, prompt, plain_greedy(target, prompt, N_NEW, {2}))
    return TINY[arch]


def proposer_for(kind: str, target, prompt, ref):
    tree = TreeConfig(topk=3, depth=4, total_tokens=10)
    if kind == "eagle3_random":
        return Eagle3Proposer(make_drafter(target, seed=3, draft_vocab=200), chain_length=4, tree=tree)
    if kind == "eagle3_copy":
        return Eagle3Proposer(
            make_drafter(target, seed=4, draft_vocab=200, copy=True), chain_length=4, tree=tree
        )
    if kind == "prompt_lookup":
        return PromptLookupProposer(max_ngram=3, num_tokens=5)
    if kind == "bad":
        return FixedTokenProposer(next(t for t in range(3, 256) if t not in ref))
    if kind == "oracle":
        return OracleProposer(ref, prompt.numel())
    return NoProposer()


KINDS = ["none", "eagle3_random", "eagle3_copy", "prompt_lookup", "bad", "oracle"]


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_speculative_greedy_equals_plain_greedy(arch, kind, mode):
    target, prompt, ref = tiny_case(arch)
    res = generate(target, proposer_for(kind, target, prompt, ref), prompt, N_NEW, mode=mode)
    assert res.tokens == ref
    assert len(res.steps) >= 1 and 1 + sum(s.num_emitted for s in res.steps) == len(res.tokens)
    if kind == "oracle":  # drafts that are right most of the time must be accepted most of the time
        assert res.tau > 2.0
    if arch == "llama" and kind in ("eagle3_copy", "prompt_lookup"):
        # not a speed claim: plausible drafters must get something accepted on this repetitive target, so
        # that multi-token paths are exercised with real drafters too
        assert res.tau > 1.1


@pytest.mark.slow
def test_embedded_speculative_greedy_equals_plain_greedy(embedded_target_fp32):
    target = embedded_target_fp32
    tok = target.tokenizer
    text = "The quick brown fox jumps over the lazy dog. " * 2
    msgs = [{"role": "user", "content": f"Repeat exactly: {text}"}]
    prompt = torch.tensor(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    n = 12
    ref = plain_greedy(target, prompt, n, set())
    drafter = make_drafter(target, seed=0, draft_vocab=2048)
    cases = [
        (PromptLookupProposer(num_tokens=6), "chain"),
        (Eagle3Proposer(drafter, chain_length=3, tree=TreeConfig(3, 3, 8)), "tree"),
        (OracleProposer(ref, prompt.numel(), k=4, vocab=target.vocab_size), "tree"),
    ]
    for proposer, mode in cases:
        res = generate(target, proposer, prompt, n, mode=mode, stop_on_eos=False)
        assert res.tokens == ref, proposer.name


# -- cached == uncached ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "qwen3"])
def test_tree_verify_forward_and_keep_equal_uncached_forwards(arch):
    target = make_tiny_target(arch)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (17,), generator=g)
    n = 12
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    tree = DraftTree.from_parents(torch.randint(3, 256, (n,), generator=g), parents)
    cache = target.new_cache(64)
    prefill(target, cache, prompt)
    out = tree_forward(target, cache, tree)
    for i in range(n):
        path = tree.mask[i].nonzero().flatten()
        full = target.forward(torch.cat([prompt, tree.tokens[path]])[None], logits="last")
        torch.testing.assert_close(out.logits[0, i], full.logits[0, -1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.aux[0, i], full.aux[0, -1], rtol=1e-4, atol=1e-4)
    # keep the deepest path, then continue with a chain: equal to one uncached forward of everything
    path = tree.mask[int(tree.depths.argmax())].nonzero().flatten()
    commit(cache, path)
    more = chain_tree(torch.tensor(7), torch.tensor([9, 11]))
    out = tree_forward(target, cache, more)
    full = target.forward(torch.cat([prompt, tree.tokens[path], more.tokens])[None])
    torch.testing.assert_close(out.logits[0], full.logits[0, -3:], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def ttt_logits(
    drafter, aux: torch.Tensor, committed: torch.Tensor, pending: int, path: list[int]
) -> torch.Tensor:
    """Uncached reference: the drafter's distribution after ``path`` drafted past the committed context, from
    one training-time-test unroll over the whole sequence. aux: [1, L, n_aux*H] from one uncached target
    forward of the committed tokens (the last context row never reads the aux of later positions)."""
    seq = torch.cat([committed, torch.tensor([pending] + path, dtype=torch.long)])
    aux = torch.cat([aux, aux.new_zeros(1, len(path) + 1, aux.shape[-1])], dim=1)  # [1, L + 1 + len(path), .]
    out = drafter.forward_ttt(seq[None], aux, steps=len(path) + 1)
    return drafter.logits(out.hidden[len(path)][0, committed.numel() - 1])


@pytest.mark.parametrize("window", [None, 5])
def test_drafter_cache_path_equals_uncached_unroll(window, monkeypatch):
    """After a few steps of generation (accepted rows rebuilt from target aux, tree rows discarded), the
    proposer's chain (sampled q) and tree (every expanded node) distributions equal the uncached unroll; with a
    sliding window (5 tokens of a ~30-token context) too, at every draft depth."""
    import eyas.serving.proposers as proposers_mod

    target, prompt, ref = tiny_case("llama")
    # random: every input and the attention matter
    drafter = make_drafter(target, seed=5, draft_vocab=200, window=window)
    proposer = Eagle3Proposer(drafter, chain_length=3, tree=TreeConfig(topk=2, depth=3, total_tokens=6))
    res = generate(target, proposer, prompt, 15, mode="tree")
    committed = torch.cat([prompt, torch.tensor(res.tokens[:-1])])
    length, pending = committed.numel(), res.tokens[-1]
    assert proposer.cache.length == length
    seq = torch.cat([committed, torch.tensor([pending])])
    aux = target.forward(committed[None], logits="none").aux
    ctx = dict(
        tokens=seq, length=length, generator=torch.Generator().manual_seed(0), max_depth=3, max_tokens=6
    )

    to_target = drafter.draft_to_target
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    chain = proposer.propose(DraftContext(sampling=sampling, mode="chain", **ctx))
    drafts = chain.tree.tokens[1:].tolist()
    for j in range(len(drafts)):
        q = torch.zeros(target.vocab_size)
        q[to_target] = warp_probs(ttt_logits(drafter, aux, committed, pending, drafts[:j]), 0.9, 0.95)
        torch.testing.assert_close(chain.draft_probs[j + 1], q, rtol=1e-4, atol=1e-5)

    calls = []
    real_build = proposers_mod.build_dynamic_tree

    def recording_build(root, root_logprobs, expand, cfg, d2t):
        def rec(tokens, parent_slot, depth):
            calls.append((tokens.clone(), parent_slot.clone(), depth, expand(tokens, parent_slot, depth)))
            return calls[-1][3]

        calls.append((None, None, 0, root_logprobs))
        return real_build(root, root_logprobs, rec, cfg, d2t)

    monkeypatch.setattr(proposers_mod, "build_dynamic_tree", recording_build)
    proposer.propose(DraftContext(sampling=SamplingConfig(), mode="tree", **ctx))
    paths: list[list[int]] = [[]]
    for tokens, parent_slot, depth, logprobs in calls:
        if depth == 1:
            paths = [[int(t)] for t in tokens]
        elif depth > 1:
            paths = [paths[int(s)] + [int(t)] for t, s in zip(tokens, parent_slot)]
        for path, lp in zip(paths, logprobs.reshape(len(paths), -1)):
            ref_lp = torch.log_softmax(ttt_logits(drafter, aux, committed, pending, path), -1)
            torch.testing.assert_close(lp, ref_lp, rtol=1e-4, atol=1e-4)
    assert len(calls) == 3  # the root's distribution and two expanded depths


# -- errors before any model runs --------------------------------------------------------------------------------
@pytest.fixture
def counted_target(monkeypatch):
    target = make_tiny_target("llama", max_position_embeddings=64)
    calls = []
    real = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return target, calls


def test_drafter_for_another_target_is_rejected_before_any_forward(counted_target):
    target, calls = counted_target
    prompt = torch.arange(3, 10)
    other = make_tiny_target("llama", hidden_size=32, vocab_size=128)
    with pytest.raises(
        ValueError, match=r"hidden size 32 vs the target's 64.*vocabulary 128 vs the target's 256"
    ):
        generate(target, Eagle3Proposer(make_drafter(other)), prompt, 4)
    cfg = DrafterConfig.from_target(target.model.config, [0, 2], 256)
    with pytest.raises(ValueError, match=r"aux layers \[0, 2\] vs the target's \[0, 1, 2\]"):
        generate(target, Eagle3Proposer(Eagle3Drafter(cfg)), prompt, 4)
    assert not calls


def test_bad_inputs_are_rejected_before_any_forward(counted_target):
    target, calls = counted_target
    with pytest.raises(ValueError, match="empty prompt"):
        generate(target, NoProposer(), [], 4)
    with pytest.raises(ValueError, match="does not fit the target's context of 64"):
        generate(target, NoProposer(), torch.arange(3, 67), 4)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, NoProposer(), [3, 999], 4)
    with pytest.raises(ValueError, match="one sequence at a time"):
        generate(target, NoProposer(), torch.ones(2, 5, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="mode"):
        generate(target, NoProposer(), [3, 4], 4, mode="beam")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(target, NoProposer(), [3, 4], 0)
    with pytest.raises(ValueError, match="chain_length"):
        Eagle3ProposerConfig(chain_length=0)
    with pytest.raises(ValueError, match="num_tokens"):
        PromptLookupProposer(num_tokens=0)
    with pytest.raises(ValueError, match="topk"):
        TreeConfig(topk=0)
    assert not calls


def test_a_proposal_that_breaks_the_contract_is_named():
    target, prompt, ref = tiny_case("llama")

    class Rogue(NoProposer):
        name = "rogue"

        def __init__(self, wrong_root: bool):
            self.wrong_root = wrong_root

        def propose(self, ctx):
            root = ctx.tokens[ctx.length]
            if self.wrong_root:
                return DraftProposal(chain_tree(root + 1, torch.tensor([5])))
            return DraftProposal(chain_tree(root, torch.full((ctx.max_tokens + 1,), 5)))

    with pytest.raises(ValueError, match=r"'rogue' drafted 1 tokens .*must be the pending token"):
        generate(target, Rogue(wrong_root=True), prompt, 4)
    with pytest.raises(ValueError, match=r"'rogue' drafted \d+ tokens \(at most \d+ fit\)"):
        generate(target, Rogue(wrong_root=False), prompt, 4)


# -- stopping and statistics -------------------------------------------------------------------------------------
def test_stops_at_eos_and_at_max_new_tokens_exactly():
    target, prompt, ref = tiny_case("llama")
    eos = ref[7]
    first = ref.index(eos)
    oracle = OracleProposer(ref, prompt.numel(), k=6)
    res = generate(target, oracle, prompt, N_NEW, mode="tree", eos_token_ids=[eos])
    assert res.tokens == ref[: first + 1] and res.stop_reason == "eos"
    for n in (1, 2, 9):
        res = generate(target, OracleProposer(ref, prompt.numel(), k=6), prompt, n, mode="chain")
        assert res.tokens == ref[:n] and res.stop_reason == "length"


def test_step_statistics_count_only_tokens_emitted_before_eos():
    """An EOS among a step's accepted drafts ends the output there: the drafts accepted after it are never
    emitted, so they count neither as accepted nor as emitted (tau and acceptance describe the output)."""
    target, prompt, ref = tiny_case("llama")
    k = 4
    # an EOS that is one of the first k - 1 drafts of a step (steps emit ref[1 + i(k+1) .. (i+1)(k+1)])
    first = next(i for i in range(1, len(ref)) if ref.index(ref[i]) == i and (i - 1) % (k + 1) < k - 1)
    perfect = OracleProposer(ref, prompt.numel(), k=k)
    perfect._wrong = lambda t: t  # noqa: SLF001  (never plant an error)
    res = generate(target, perfect, prompt, N_NEW, mode="chain", eos_token_ids=[ref[first]])
    assert res.tokens == ref[: first + 1] and res.stop_reason == "eos"
    last = res.steps[-1]
    in_step = (first - 1) % (k + 1) + 1  # tokens of the last step up to and including the EOS
    assert (last.num_accepted, last.num_emitted) == (in_step, in_step)
    assert [s.num_accepted for s in res.steps[:-1]] == [k] * (len(res.steps) - 1)
    assert 1 + sum(s.num_emitted for s in res.steps) == len(res.tokens)
    assert res.tau == (len(res.tokens) - 1) / len(res.steps)


def test_context_limit_stops_generation():
    target = make_tiny_target("llama", max_position_embeddings=32)
    prompt = torch.arange(3, 23)
    res = generate(target, PromptLookupProposer(), prompt, 50, stop_on_eos=False)
    assert res.stop_reason == "context" and prompt.numel() + len(res.tokens) == 33
    assert res.tokens == plain_greedy(target, prompt, len(res.tokens), set())


def test_step_statistics_describe_the_steps():
    target, prompt, ref = tiny_case("llama")
    k = 4
    perfect = OracleProposer(ref, prompt.numel(), k=k)
    perfect._wrong = lambda t: t  # noqa: SLF001  (never plant an error)
    res = generate(target, perfect, prompt, 21, mode="chain")
    assert res.tokens == ref[:21]
    assert [s.num_accepted for s in res.steps] == [k] * 4 and res.tau == k + 1
    assert res.acceptance_by_position() == [1.0] * k
    assert [s.context_len for s in res.steps] == [prompt.numel() + i * (k + 1) for i in range(4)]
    assert all(s.draft_s >= 0 and s.verify_s > 0 and s.step_s >= s.verify_s for s in res.steps)
    bad = generate(target, proposer_for("bad", target, prompt, ref), prompt, 10)
    assert bad.tau == 1.0 and bad.acceptance_by_position() == [0.0] * 3
    assert bad.tokens_per_s > 0 and bad.summary()["steps"] == 9
