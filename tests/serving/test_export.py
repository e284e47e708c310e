"""Drafter export: export → load gives identical logits; every validation failure is named before writing."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.serving.export import ExportConfig, TargetSpec, export
from eyas.serving.export_format import ExportError, check_tensors, expected_tensors
from eyas.serving.load import describe_export, load_exported
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.models.target import default_aux_layers
from eyas.serving.models.tiny import tiny_config

DRAFT_VOCAB = 48


def make_drafter(arch: str = "llama", seed: int = 0, aux=None, **overrides):
    """A random drafter for a tiny target of ``arch``; every norm differs so swapped names would show."""
    cfg = tiny_config(arch)
    aux = default_aux_layers(cfg.num_hidden_layers) if aux is None else aux
    dcfg = DrafterConfig.from_target(cfg, aux, DRAFT_VOCAB, **overrides)
    torch.manual_seed(seed)
    d = Eagle3Drafter(dcfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        d.embed_tokens.weight.normal_(0, 0.5)
    d.set_vocab_map(torch.randperm(dcfg.vocab_size)[:DRAFT_VOCAB])
    return d.eval(), cfg


@torch.no_grad()
def run_both(d: Eagle3Drafter, seed: int = 1):
    """Cached prefill + two chained draft steps, and a 3-step TTT unroll, on fixed random inputs."""
    g = torch.Generator().manual_seed(seed)
    b, t = 2, 7
    ids = torch.randint(0, d.config.vocab_size, (b, t + 3), generator=g)
    aux = torch.randn(b, t, d.config.fc_in_features, generator=g).to(d.fc.weight.dtype)
    cache = d.new_cache(16)
    cache.prepare(torch.arange(t))
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t)
    pos = torch.arange(t).expand(b, t)
    out = d(ids[:, 1 : t + 1], aux, pos, cache, mask, hidden_is_aux=True)
    logits = [out.logits]
    hidden = out.hidden[:, -1:]
    for j in range(2):
        n = t + j
        cache.prepare(torch.tensor([n]))
        step = d(
            ids[:, t + 1 + j : t + 2 + j],
            hidden,
            torch.full((b, 1), n),
            cache,
            torch.ones(b, 1, 1, n + 1, dtype=torch.bool),
            hidden_is_aux=False,
        )
        logits.append(step.logits)
        hidden = step.hidden
    ttt = d.forward_ttt(ids[:, :t], aux, steps=3)
    return logits, [d.logits(x) for x in ttt.hidden]


def spec_for(cfg, **kw) -> TargetSpec:
    return TargetSpec.from_config(cfg, name="tiny-target", **kw)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_export_then_load_gives_identical_logits(tmp_path, fmt, arch):
    d, cfg = make_drafter(arch)
    res = export(d, spec_for(cfg), tmp_path / "out", fmt, config=ExportConfig(dtype="float32"))
    assert res.embedding_included == (fmt == "speculators")
    emb = None if res.embedding_included else d.embed_tokens.weight
    loaded = load_exported(tmp_path / "out", embedding=emb)
    assert loaded.config.aux_layer_ids == d.config.aux_layer_ids
    assert torch.equal(loaded.draft_to_target, d.draft_to_target)
    ref_inf, ref_ttt = run_both(d)
    got_inf, got_ttt = run_both(loaded)
    for a, b in zip(ref_inf + ref_ttt, got_inf + got_ttt):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_bf16_export_holds_the_bf16_weights(tmp_path):
    d, cfg = make_drafter()
    export(d, spec_for(cfg), tmp_path / "out")  # default: bfloat16, SGLang format
    raw = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in d.trainable_state_dict().items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert raw[name].dtype == expected.dtype and torch.equal(raw[name], expected), name
    loaded = load_exported(tmp_path / "out", embedding=d.embed_tokens.weight, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.rotary.inv_freq.dtype == torch.float32
    for p in d.parameters():
        p.data = p.data.to(torch.bfloat16)
    for a, b in zip(*[sum(run_both(m), []) for m in (d, loaded)]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_sglang_config_and_tensor_names(tmp_path):
    d, cfg = make_drafter()
    res = export(d, spec_for(cfg), tmp_path / "out", "sglang")
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False
    assert (c["vocab_size"], c["draft_vocab_size"], c["hidden_size"]) == (256, DRAFT_VOCAB, 64)
    assert c["torch_dtype"] == c["dtype"] == "bfloat16"
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: output of layer i
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM reads this one first: input of layer i
    assert "target_hidden_size" not in c  # SGLang tests hasattr(); a null here would break fc
    assert c["max_position_embeddings"] == cfg.max_position_embeddings
    names = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert names == set(expected_tensors(d.config, include_embedding=False)) == set(res.tensor_names)
    assert "embed_tokens.weight" not in names


def test_speculators_config_and_tensor_names(tmp_path):
    d, cfg = make_drafter()
    export(d, spec_for(cfg), tmp_path / "out", "speculators", config=ExportConfig(speculative_tokens=4))
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3"
    assert c["norm_before_residual"] is False  # vLLM defaults a missing key to True
    assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in d.config.aux_layer_ids]
    layer = c["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 256
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert (
        c["speculators_config"]["verifier"]["name_or_path"] is None
    )  # not a hub id: readers must not fetch it
    export(d, TargetSpec.from_config(cfg, name="org/model"), tmp_path / "hub", "speculators")
    hub = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert hub["speculators_config"]["verifier"]["name_or_path"] == "org/model"
    names = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and "embed_tokens.weight" in names
    assert not any(n.startswith("midlayer.") for n in names)
    info = describe_export(tmp_path / "out")
    assert info["format"] == "speculators" and info["aux_layers_sglang"] == d.config.aux_layer_ids
    assert info["aux_layers_vllm"] == [i + 1 for i in d.config.aux_layer_ids]


def test_yarn_rope_of_the_target_is_carried(tmp_path):
    from transformers import LlamaConfig

    d, cfg = make_drafter("deepseek_v3")
    export(d, spec_for(cfg), tmp_path / "out", "sglang")
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    target_rope = cfg.rope_parameters
    assert c["rope_parameters"]["rope_type"] == "yarn"
    for key in (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    ):
        assert c["rope_parameters"][key] == target_rope[key] == c["rope_scaling"][key], key
    assert c["rope_scaling"]["type"] == c["rope_scaling"]["rope_type"] == "yarn"
    assert c["rope_theta"] == c["rope_parameters"]["rope_theta"] == target_rope["rope_theta"]
    assert c["max_position_embeddings"] == cfg.max_position_embeddings
    # what a transformers-based reader (SGLang/vLLM build a LlamaConfig from this file) ends up with
    read = LlamaConfig.from_pretrained(tmp_path / "out").rope_parameters
    for key, value in target_rope.items():
        assert read[key] == value, key


@pytest.mark.parametrize("mscale_keys", [True, False])
def test_yarn_cos_sin_scale_agrees_with_sglang_and_vllm(tmp_path, mscale_keys):
    """SGLang/vLLM YaRN: mscale = (0.1·ln(factor) + 1) · attn_factor, ignoring mscale/mscale_all_dim."""
    rope = dict(tiny_config("deepseek_v3").rope_parameters)
    if not mscale_keys:
        rope = {k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim")}
    d, cfg = make_drafter("deepseek_v3", rope_parameters=rope)
    export(d, _spec_with_rope(cfg, rope), tmp_path / "out")
    scaling = json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"]
    served = (0.1 * math.log(scaling["factor"]) + 1) * scaling.get("attn_factor", 1.0)
    assert served == pytest.approx(d.rotary.scaling, rel=1e-12)
    assert ("attn_factor" in scaling) == mscale_keys  # DeepSeek-style keys make transformers use 1.0


def _spec_with_rope(cfg, rope) -> TargetSpec:
    spec = spec_for(cfg)
    return TargetSpec(**{**spec.__dict__, "rope_parameters": rope})


# -- validation -------------------------------------------------------------------------------------------------
def _export_fails(tmp_path, d, target, match, **kw):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=match):
        export(d, target, out, **kw)
    assert not out.exists()  # nothing written


def test_shapes_inconsistent_with_config_are_named(tmp_path):
    d, cfg = make_drafter()
    d.config.intermediate_size += 1
    _export_fails(
        tmp_path,
        d,
        spec_for(cfg),
        r"midlayer\.mlp\.gate_proj\.weight has shape \(128, 64\), the "
        r"config implies \(129, 64\)",
    )


def test_extra_tensor_is_named(tmp_path):
    d, cfg = make_drafter()
    d.register_buffer("scratch", torch.zeros(3))
    _export_fails(tmp_path, d, spec_for(cfg), r"unexpected tensors \['scratch'\]")


def test_missing_tensor_is_named():
    d, _ = make_drafter()
    tensors = d.trainable_state_dict()
    del tensors["midlayer.hidden_norm.weight"]
    assert check_tensors(tensors, d.config, False) == [
        "drafter: missing tensors ['midlayer.hidden_norm.weight']"
    ]


def test_d2t_collision_is_named(tmp_path):
    d, cfg = make_drafter()
    ids = d.draft_to_target
    d.d2t[5] = ids[4] - 5  # draft 5 now maps onto draft 4's target id
    _export_fails(tmp_path, d, spec_for(cfg), r"d2t maps 1 draft ids onto target ids already taken")


def test_d2t_out_of_range_is_named(tmp_path):
    d, cfg = make_drafter()
    d.d2t[0] = 10_000
    _export_fails(tmp_path, d, spec_for(cfg), r"outside the target vocabulary \[0, 256\)")


def test_t2d_disagreeing_with_d2t_is_named(tmp_path):
    d, cfg = make_drafter()
    ids = d.draft_to_target
    free = next(i for i in range(256) if not d.t2d[i])
    d.t2d[ids[0]] = False
    d.t2d[free] = True
    _export_fails(tmp_path, d, spec_for(cfg), r"t2d .* disagrees with d2t \+ arange")


def test_short_max_position_embeddings_is_refused(tmp_path):
    d, cfg = make_drafter(max_position_embeddings=1024)
    _export_fails(
        tmp_path, d, spec_for(cfg), r"max_position_embeddings 1024 is smaller than the target's 2048"
    )


@pytest.mark.parametrize(
    "aux,why",
    [
        ([0, 2, 5], r"5 outside \[0, 2\] for a 4-layer target"),
        (
            [0, 1, 3],
            r"3 outside \[0, 2\] for a 4-layer target",
        ),  # the last layer: SGLang/vLLM never capture it
        ([2, 0, 1], "not strictly increasing"),  # would permute fc's input blocks at serve time
        ([0, 1, 1], "not strictly increasing"),  # duplicates crash the engines
    ],
)
def test_aux_layers_the_engines_capture_differently_are_refused(tmp_path, aux, why):
    d, cfg = make_drafter()
    d.config.aux_layer_ids = aux  # past DrafterConfig's own check, as a hand-edited config would be
    _export_fails(tmp_path, d, spec_for(cfg), rf"aux layer ids .* are invalid \({why}.*\[0, L-2\]")


def test_aux_layers_must_be_three(tmp_path):
    d, cfg = make_drafter(aux=[0, 2])
    _export_fails(tmp_path, d, spec_for(cfg), r"fuses 2 aux layers; SGLang and vLLM build fc for exactly 3")


def test_aux_layers_disagreeing_with_the_target_runner_are_refused(tmp_path):
    d, cfg = make_drafter()
    _export_fails(tmp_path, d, spec_for(cfg, aux_layers=[0, 1]), r"built for aux layers \[0, 1, 2\]")


def test_export_with_invalid_aux_layers_is_refused_at_load(tmp_path):
    d, cfg = make_drafter()
    export(d, spec_for(cfg), tmp_path / "out", "sglang")
    path = tmp_path / "out" / "config.json"
    c = json.loads(path.read_text())
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 0, 1]
    path.write_text(json.dumps(c))
    with pytest.raises(ExportError, match=r"config\.json: drafter aux_layer_ids: .*not strictly increasing"):
        load_exported(tmp_path / "out", embedding=d.embed_tokens.weight)


def test_rope_differing_from_the_target_is_refused(tmp_path):
    d, cfg = make_drafter(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    _export_fails(tmp_path, d, spec_for(cfg), r"drafter rope .* differs from the target's")


def test_non_finite_weights_are_refused(tmp_path):
    d, cfg = make_drafter()
    with torch.no_grad():
        d.lm_head.weight[3, 3] = float("nan")
    _export_fails(tmp_path, d, spec_for(cfg), r"lm_head\.weight holds NaN or Inf")


def test_embedding_scale_needs_consent(tmp_path):
    d, cfg = make_drafter("gemma3_text")
    _export_fails(tmp_path, d, spec_for(cfg), r"scales its embedding by 8")
    export(d, spec_for(cfg), tmp_path / "ok", config=ExportConfig(allow_embed_scale=True, dtype="float32"))
    loaded = load_exported(tmp_path / "ok", embedding=d.embed_tokens.weight)
    assert loaded.config.embed_scale == d.config.embed_scale == 8.0


def test_existing_export_is_kept_unless_overwrite(tmp_path):
    d, cfg = make_drafter()
    out = tmp_path / "out"
    export(d, spec_for(cfg), out, config=ExportConfig(dtype="float32"))
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match=r"exists and is not empty \(set export.overwrite=true"):
        export(d, spec_for(cfg), out)
    assert (out / "model.safetensors").read_bytes() == before
    export(d, spec_for(cfg), out, config=ExportConfig(overwrite=True))  # bfloat16 now
    assert (out / "model.safetensors").read_bytes() != before
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directories left behind


def test_overwrite_replaces_only_an_earlier_export(tmp_path):
    """A directory holding anything else than an export's files, or one without the eyas sidecar, is refused
    even with overwrite, and nothing in it changes; a plain file is never replaced."""
    d, cfg = make_drafter()
    overwrite = ExportConfig(overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("earlier work")
    with pytest.raises(ExportError, match=r"other holds \['keep.txt'\]: it is not an earlier eyas export"):
        export(d, spec_for(cfg), other, config=overwrite)
    assert [p.name for p in other.iterdir()] == ["keep.txt"]

    extra = tmp_path / "extra"
    export(d, spec_for(cfg), extra)
    (extra / "notes.md").write_text("mine")
    with pytest.raises(ExportError, match=r"extra holds \['notes.md'\]"):
        export(d, spec_for(cfg), extra, config=overwrite)
    assert (extra / "notes.md").read_text() == "mine"

    foreign = tmp_path / "foreign"  # a model directory of the same shape, not written by eyas
    foreign.mkdir()
    for name in ("config.json", "model.safetensors"):
        (foreign / name).write_text("{}")
    with pytest.raises(
        ExportError, match="foreign has no eyas_export.json: it is not an earlier eyas export"
    ):
        export(d, spec_for(cfg), foreign, config=overwrite)
    assert (foreign / "config.json").read_text() == "{}"

    plain = tmp_path / "plain"
    plain.write_text("a file")
    with pytest.raises(ExportError, match="plain is a file, not a directory"):
        export(d, spec_for(cfg), plain, config=overwrite)
    assert plain.read_text() == "a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra", "foreign", "other", "plain"]


def test_exported_files_are_readable_by_others(tmp_path):
    d, cfg = make_drafter()
    old = os.umask(0o077)  # a private umask must not make the export private
    try:
        export(d, spec_for(cfg), tmp_path / "out", "speculators")
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "eyas_export.json": 0o644}


def test_the_target_embedding_is_written_when_given(tmp_path):
    d, cfg = make_drafter()
    emb = torch.randn(256, 64)
    export(
        d, spec_for(cfg, embedding=emb), tmp_path / "out", "speculators", config=ExportConfig(dtype="float32")
    )
    raw = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(raw["embed_tokens.weight"], emb)


# -- load errors ------------------------------------------------------------------------------------------------
def test_load_without_embedding_asks_for_it(tmp_path):
    d, cfg = make_drafter()
    export(d, spec_for(cfg), tmp_path / "out", "sglang")
    with pytest.raises(ExportError, match="holds no embed_tokens.weight; pass embedding="):
        load_exported(tmp_path / "out")


def test_load_names_the_file_and_the_missing_tensor(tmp_path):
    d, cfg = make_drafter()
    export(d, spec_for(cfg), tmp_path / "out", "sglang")
    path = tmp_path / "out" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ExportError, match=r"model\.safetensors: missing tensors \['norm\.weight'\]"):
        load_exported(tmp_path / "out", embedding=d.embed_tokens.weight)


def test_load_refuses_speculators_config_without_explicit_norm_before_residual(tmp_path):
    d, cfg = make_drafter()
    export(d, spec_for(cfg), tmp_path / "out", "speculators")
    path = tmp_path / "out" / "config.json"
    c = json.loads(path.read_text())
    del c["norm_before_residual"]
    path.write_text(json.dumps(c))
    with pytest.raises(ExportError, match="norm_before_residual is None"):
        load_exported(tmp_path / "out")


def test_the_export_records_how_to_serve_it_and_an_evaluation_can_change_k(tmp_path):
    from eyas.serving.export import record_serving
    from eyas.serving.load import describe_export

    d, cfg = make_drafter()
    out = tmp_path / "out"
    export(d, spec_for(cfg), out, "sglang", config=ExportConfig(speculative_tokens=5))
    serve = describe_export(out)["serve"]
    assert serve["num_speculative_tokens"] == 5 and serve["source"] == "export.speculative_tokens"
    vllm, sglang = serve["commands"]["vllm"], serve["commands"]["sglang"]
    spec = json.loads(vllm.split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 5}
    assert vllm.startswith("vllm serve tiny-target ")
    assert "--speculative-num-steps 5 " in sglang and sglang.endswith("--speculative-num-draft-tokens 6")
    assert f"--speculative-draft-model-path {out.resolve()}" in sglang

    old = os.umask(0o077)
    try:
        serve = record_serving(out, 2, "eval report r.md")
    finally:
        os.umask(old)
    assert describe_export(out)["serve"] == serve
    assert serve["num_speculative_tokens"] == 2 and serve["source"] == "eval report r.md"
    assert '"num_speculative_tokens":2' in serve["commands"]["vllm"]
    assert stat.S_IMODE((out / "eyas_export.json").stat().st_mode) == 0o644
    serve = record_serving(out, 0, "eval report r.md")  # plain decoding measured fastest: no command
    assert "commands" not in serve and "plain decoding" in serve["note"]


# -- sliding-window drafters ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_round_trip_keeps_the_window(tmp_path, fmt):
    d, cfg = make_drafter(attention_window=3)  # run_both reaches position 8: the window hides keys
    export(d, spec_for(cfg), tmp_path / "out", fmt, config=ExportConfig(dtype="float32"))
    loaded = load_exported(tmp_path / "out", embedding=d.embed_tokens.weight)
    assert loaded.config.attention_window == 3
    for a, b in zip(*[sum(run_both(m), []) for m in (d, loaded)]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    full, _ = make_drafter()  # same weights, no window: different logits, so the window was exercised
    assert not torch.equal(sum(run_both(full), [])[-1], sum(run_both(loaded), [])[-1])


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_exported_window_is_where_vllm_reads_it(tmp_path, fmt):
    """vLLM 0.32 (vllm/model_executor/models/llama.py, LlamaAttention.__init__): the layer named
    ``model.layers.{L}`` after an L-layer target (llama_eagle3.py: start_layer_id = target_layer_count = L) is
    sliding iff ``layer_types[L - target_layer_count] == "sliding_attention"``, with ``config.sliding_window``.
    The config is what transformers' LlamaConfig keeps of the file (speculators: of transformer_layer_config)."""
    from transformers import LlamaConfig

    d, cfg = make_drafter(attention_window=5)
    export(d, spec_for(cfg), tmp_path / "out", fmt)
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    layer = raw["transformer_layer_config"] if fmt == "speculators" else raw
    hf = LlamaConfig(**{k: v for k, v in layer.items() if k != "architectures"})
    target_layer_count = cfg.num_hidden_layers
    layer_idx = int(f"model.layers.{target_layer_count}.self_attn".split(".")[2])  # extract_layer_index
    assert hf.layer_types[layer_idx - target_layer_count] == "sliding_attention"
    assert hf.sliding_window == 5
    d, cfg = make_drafter()
    export(d, spec_for(cfg), tmp_path / "full", fmt)
    raw = json.loads((tmp_path / "full" / "config.json").read_text())
    layer = raw["transformer_layer_config"] if fmt == "speculators" else raw
    assert "layer_types" not in layer and "sliding_window" not in layer  # full attention: as before


def test_export_attention_window_declares_a_window_the_drafter_was_not_trained_with(tmp_path):
    """``export.attention_window``: one checkpoint exported with a window (how ``eyas context`` measures it served)
    or without one; the loaded drafter drafts as the bundled loop does with that window, weights unchanged."""
    from eyas.serving.export import with_window

    d, cfg = make_drafter()
    export(with_window(d, 3), spec_for(cfg), tmp_path / "w3", "sglang", config=ExportConfig(dtype="float32"))
    raw = json.loads((tmp_path / "w3" / "config.json").read_text())
    assert (raw["sliding_window"], raw["layer_types"]) == (3, ["sliding_attention"])
    loaded = load_exported(tmp_path / "w3", embedding=d.embed_tokens.weight)
    windowed, _ = make_drafter(attention_window=3)  # the same seed's weights, trained config with the window
    for a, b in zip(*[sum(run_both(m), []) for m in (windowed, loaded)]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    export(with_window(loaded, 0), spec_for(cfg), tmp_path / "full", "sglang")  # 0: back to full attention
    assert "sliding_window" not in json.loads((tmp_path / "full" / "config.json").read_text())
    for bad in (-1, True, "512"):
        with pytest.raises(ExportError, match="attention_window"):
            with_window(d, bad)


def test_export_declaring_a_window_without_its_size_is_refused(tmp_path):
    d, cfg = make_drafter(attention_window=5)
    export(d, spec_for(cfg), tmp_path / "out", "sglang")
    path = tmp_path / "out" / "config.json"
    raw = json.loads(path.read_text())
    raw.pop("sliding_window")
    path.write_text(json.dumps(raw))
    with pytest.raises(ExportError, match="sliding_window"):
        load_exported(tmp_path / "out", embedding=d.embed_tokens.weight)


def test_recording_a_k_updates_a_speculators_config_and_says_where_it_was_chosen(tmp_path):
    """vLLM serves a speculators export at its config.json's speculative_tokens unless told otherwise: an
    evaluation's K must land there too, not only in eyas's sidecar; the serve entry names the hardware the K was
    profiled on and the prompts it was chosen on."""
    from eyas.serving.export import describe_export, record_serving

    d, cfg = make_drafter()
    out = tmp_path / "out"
    export(d, spec_for(cfg), out, "speculators", config=ExportConfig(speculative_tokens=5))
    config = lambda: json.loads((out / "config.json").read_text())  # noqa: E731
    methods = lambda: config()["speculators_config"]["proposal_methods"]  # noqa: E731
    assert [m["speculative_tokens"] for m in methods()] == [5]
    hw = {"cpu": "AMD EPYC", "threads": 2, "torch": "2.9.0"}
    chosen = {"split": "calibration", "prompts": {"reasoning": 4}}
    serve = record_serving(out, 2, "eval report r.md", profiled_on=hw, chosen_on=chosen)
    assert [m["speculative_tokens"] for m in methods()] == [2]
    assert serve["profiled_on"] == hw and serve["chosen_on"] == chosen
    assert describe_export(out)["serve"] == serve
    assert load_exported(out) is not None  # the rewritten config still loads
    record_serving(out, 0, "eval report r.md")  # plain decoding fastest: the config keeps a valid length
    assert [m["speculative_tokens"] for m in methods()] == [2]
