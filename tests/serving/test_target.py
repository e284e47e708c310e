"""The target runner: aux capture equals transformers' output_hidden_states; the slot cache equals a full forward."""

from __future__ import annotations

import re

import pytest
import torch

from eyas.serving.models.tiny import ARCHS
from tests.conftest import make_tiny_target


@pytest.mark.parametrize("arch", ARCHS)
def test_aux_capture_matches_output_hidden_states(arch):
    target = make_tiny_target(arch, num_layers=8)
    ids = torch.randint(3, 256, (2, 19))
    out = target.forward(ids)
    ref = target.model(ids, output_hidden_states=True)
    # SGLang id i = output of decoder layer i = transformers hidden_states[i + 1]
    expected = torch.cat([ref.hidden_states[i + 1] for i in target.aux_layers], dim=-1)
    assert target.aux_layers == (1, 3, 4)
    torch.testing.assert_close(out.aux, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=0, atol=0)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_slot_cache_incremental_equals_full_forward(arch):
    """Prefill + one-token steps through the slot cache give the logits of one uncached forward."""
    target = make_tiny_target(arch)
    ids = torch.randint(3, 256, (2, 24))  # longer than gemma3's tiny sliding window (16)
    full = target.forward(ids).logits
    cache = target.new_cache(64)
    n = 10
    cache.prepare(torch.arange(n))
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(2, 1, n, n)
    parts = [target.forward(ids[:, :n], cache=cache, attention_mask=mask).logits]
    cache.commit(n)
    for t in range(n, ids.shape[1]):
        cache.prepare(torch.tensor([t]))
        parts.append(
            target.forward(
                ids[:, t : t + 1], cache=cache, attention_mask=torch.ones(2, 1, 1, t + 1, dtype=torch.bool)
            ).logits
        )
        cache.commit(1)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_aux_layer_ids_must_increase_and_stop_before_the_last_layer():
    from eyas.common import ConfigError, build_config
    from eyas.serving.models.target import TargetConfig, target_from_model
    from eyas.serving.models.tiny import tiny_model
    from eyas.train.config import TrainJob
    from tests.conftest import _TinyTokenizer

    model = tiny_model("llama")  # 4 layers: valid ids lie in [0, 2]
    for ids, why in (
        ([0, 1, 9], r"9 outside \[0, 2\] for a 4-layer target"),
        ([0, 1, 3], r"3 outside \[0, 2\] for a 4-layer target"),  # the last layer: never captured
        ([0, 2, 1], "not strictly increasing"),
        ([0, 1, 1], "not strictly increasing"),
    ):
        with pytest.raises(
            ValueError, match=re.escape(f"aux layer ids {ids} are invalid (") + why + r".*\[0, L-2\]"
        ):
            target_from_model(model, _TinyTokenizer(256), aux_layers=ids)
    # the training job's config refuses them in one line, before any model loads
    with pytest.raises(
        ConfigError, match=r"^target.aux_layers: aux layer ids \[2, 1\] .*not strictly increasing"
    ):
        build_config(TrainJob, {"target": {"aux_layers": [2, 1]}})
    with pytest.raises(ConfigError, match=r"-1 negative"):
        TargetConfig(aux_layers=[-1, 1])
    assert target_from_model(model, _TinyTokenizer(256), aux_layers=[0, 2]).aux_layers == (0, 2)


def test_default_aux_layers_follow_sglang_and_are_valid_for_every_depth():
    from eyas.serving.models.target import aux_layer_problem, default_aux_layers

    assert default_aux_layers(30) == [1, 14, 26]
    assert default_aux_layers(61) == [1, 29, 57]  # DeepSeek-V3
    assert default_aux_layers(4) == [0, 1, 2] and default_aux_layers(2) == [0]
    for n in range(2, 80):
        assert aux_layer_problem(default_aux_layers(n), n) is None, n
    with pytest.raises(ValueError, match="1-layer target has no layer"):
        default_aux_layers(1)


def test_the_embedded_target_reads_layer_28_on_top_and_other_targets_sglangs_default(tiny_target_dir):
    from eyas.serving.models.target import EMBEDDED_AUX_LAYERS, TargetConfig, aux_layer_problem, load_target

    assert TargetConfig().chosen_aux_layers() == [1, 14, 28] == list(EMBEDDED_AUX_LAYERS)
    assert aux_layer_problem(EMBEDDED_AUX_LAYERS, 30) is None  # 28 = L-2: the highest an engine captures
    assert TargetConfig(aux_layers=[1, 14, 26]).chosen_aux_layers() == [1, 14, 26]
    other = TargetConfig(path=str(tiny_target_dir), dtype="float32", device="cpu")
    assert other.chosen_aux_layers() is None
    assert load_target(other).aux_layers == (0, 1, 2)  # default_aux_layers(4)


def test_commit_keeps_written_rows_or_a_tree_path_and_refuses_unwritten_ones():
    from eyas.serving.models.kv_cache import SlotCache

    cache = SlotCache(num_layers=1, max_len=16)
    keys = torch.arange(6, dtype=torch.float32).reshape(1, 1, 6, 1)  # row i holds the value i
    cache.prepare(torch.arange(6), 6)
    cache.update(keys, keys, 0)
    cache.commit(2)
    assert cache.length == 2
    cache.commit(path=torch.tensor([1, 3]))  # nodes 1 and 3 after the committed prefix: rows 3 and 5
    assert cache.length == 4
    assert cache.layers[0].keys[0, 0, :4, 0].tolist() == [0.0, 1.0, 3.0, 5.0]
    with pytest.raises(ValueError, match="cannot commit 3 rows at 4"):
        cache.commit(3)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_eager_and_exact_attention_obey_the_custom_masks_as_sdpa_does(arch):
    """Prefill (causal) and tree verify (prefix + ancestors only) through the slot cache give the same aux states
    and logits with eager and exact attention as with sdpa, and speculative decoding equals plain greedy."""
    from eyas.serving.loop import generate, prefill, tree_forward
    from eyas.serving.proposers import Eagle3Proposer
    from eyas.serving.tree import DraftTree, TreeConfig
    from tests.serving.test_speculative_loop import OracleProposer, make_drafter, plain_greedy

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (20,), generator=g)  # longer than gemma3's tiny sliding window (16)
    n = 8
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3])  # siblings at every depth: they must not see each other
    tree = DraftTree.from_parents(torch.randint(3, 256, (n,), generator=g), parents)
    outs = {}
    for impl in ("sdpa", "eager", "exact"):
        target = make_tiny_target(arch, attn_implementation=impl)
        cache = target.new_cache(64)
        outs[impl] = (prefill(target, cache, prompt), tree_forward(target, cache, tree))
    for impl in ("eager", "exact"):
        for sdpa, other in zip(outs["sdpa"], outs[impl]):
            torch.testing.assert_close(other.aux, sdpa.aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(other.logits, sdpa.logits, rtol=1e-5, atol=1e-5)

    ref = plain_greedy(target, prompt, 12, set())
    tree_cfg = TreeConfig(topk=3, depth=3, total_tokens=8)
    for proposer in (
        Eagle3Proposer(make_drafter(target, seed=3, draft_vocab=200), tree=tree_cfg),
        OracleProposer(ref, prompt.numel(), k=4),
    ):
        res = generate(target, proposer, prompt, 12, mode="tree", stop_on_eos=False)
        assert res.tokens == ref, proposer.name


def test_attention_backends_that_ignore_custom_masks_are_refused():
    from eyas.serving.models.target import TargetConfig

    with pytest.raises(ValueError, match=r"attn_implementation must be one of \('sdpa', 'eager', 'exact'\)"):
        TargetConfig(attn_implementation="flash_attention_2")
    model = tiny_model_with_backend("flex_attention")
    from eyas.serving.models.target import target_from_model
    from tests.conftest import _TinyTokenizer

    with pytest.raises(ValueError, match="'flex_attention' ignores the custom 4-D masks"):
        target_from_model(model, _TinyTokenizer(256))


def tiny_model_with_backend(name: str):
    from eyas.serving.models.tiny import tiny_model

    model = tiny_model("llama")
    model.config._attn_implementation = name  # noqa: SLF001  (what from_pretrained(attn_implementation=) sets)
    return model


def test_a_target_in_another_dtype_is_a_copy_with_its_own_aux_capture(tiny_target):
    bf16 = tiny_target("llama").with_dtype(torch.bfloat16)
    fp32 = bf16.with_dtype(torch.float32)
    assert bf16.with_dtype(torch.bfloat16) is bf16
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    ids = torch.randint(3, bf16.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    a, b = bf16.forward(ids), fp32.forward(ids)
    assert a.aux.dtype == torch.bfloat16 and b.aux.dtype == torch.float32
    assert torch.allclose(a.aux.float(), b.aux, atol=0.1)
    assert not bf16._captured and not fp32._captured


def test_eval_numerics_on_cpu_bf16_exact_where_the_probe_passes_else_fp32(tiny_target, monkeypatch):
    import eyas.eval.stage as stage
    from eyas.eval.stage import EvalStageConfig

    t = tiny_target("llama").with_dtype(torch.bfloat16)
    sets = [{"name": "p", "source": "builtin:predictable", "n": 1}]
    auto = EvalStageConfig(prompt_sets=sets)
    monkeypatch.setattr(stage, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(stage, "probe", lambda target, sizes: None)
    chosen = auto.numerics(t)
    assert (chosen.verify.dtype, chosen.verify.attention) == (
        torch.bfloat16,
        "exact",
    ) and "probe" in chosen.note
    assert t.attention == "sdpa"  # the shared target is left as it was
    monkeypatch.setattr(stage, "probe", lambda target, sizes: "row 3 differs")
    chosen = auto.numerics(t)
    assert (chosen.verify.dtype, chosen.verify.attention) == (
        torch.float32,
        "sdpa",
    ) and "row 3 differs" in chosen.note
    monkeypatch.setattr(stage, "cpu_has_bf16", lambda: False)
    assert auto.numerics(t).verify.dtype == torch.float32
    chosen = EvalStageConfig(prompt_sets=sets, dtype="target").numerics(t)
    assert chosen.verify is t and chosen.baseline is t
    assert EvalStageConfig(prompt_sets=sets, dtype="float32").numerics(t).verify.attention == "sdpa"
    with pytest.raises(ValueError, match="eval.dtype must be"):
        EvalStageConfig(prompt_sets=sets, dtype="fp8")


# -- rope scaling over the target's own (a YaRN-extended target) ----------------------------------------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}


def test_rope_scaling_reaches_the_model_the_drafter_and_the_export(tmp_path, monkeypatch):
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas.serving.export import ExportConfig, TargetSpec, export
    from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
    from eyas.serving.models.target import TargetConfig, model_source
    from eyas.serving.models.tiny import tiny_model

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny"
    tiny_model("llama", max_position_embeddings=512).save_pretrained(src)
    path, name = model_source(TargetConfig(path=str(src), rope_scaling=YARN))
    assert name.endswith("+yarnx4") and path != str(src)
    assert json.loads((src / "config.json").read_text())["max_position_embeddings"] == 512  # source untouched
    model = AutoModelForCausalLM.from_pretrained(path)  # weights linked from the source
    c = model.config
    assert c.max_position_embeddings == 2048
    assert {k: c.rope_parameters[k] for k in YARN} == YARN
    assert AutoConfig.from_pretrained(path).rope_parameters["rope_type"] == "yarn"

    dcfg = DrafterConfig.from_target(c, [0, 1, 2], 32)
    assert dcfg.max_position_embeddings == 2048 and dcfg.rope_parameters["rope_type"] == "yarn"
    yarn, plain = (
        Eagle3Drafter(dcfg).rotary,
        Eagle3Drafter(DrafterConfig.from_target(AutoConfig.from_pretrained(src), [0, 1, 2], 32)).rotary,
    )
    assert yarn.scaling > 1.0 and not torch.equal(
        yarn.inv_freq, plain.inv_freq
    )  # the drafter's rope is YaRN's

    d = Eagle3Drafter(dcfg)
    d.set_vocab_map(torch.arange(32))
    export(d, TargetSpec.from_config(c, name=name), tmp_path / "out", config=ExportConfig(dtype="float32"))
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["max_position_embeddings"] == 2048
    assert {k: out["rope_parameters"][k] for k in YARN} == YARN
    assert out["rope_scaling"]["factor"] == 4.0


def test_bad_rope_scaling_is_named():
    from eyas.common import ConfigError
    from eyas.serving.models.target import TargetConfig

    with pytest.raises(ConfigError, match="target.rope_scaling"):
        TargetConfig(rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ConfigError, match="factor"):
        TargetConfig(rope_scaling={"rope_type": "yarn"})
