"""The engine agreement check can fail (eval/engine_eval.py: check_agreement): an export that an engine serves wrong
is told from one it serves right, and a drafter too weak to tell them apart gives "inconclusive", not a pass.

No vLLM here: :func:`serve_like_vllm` stands in for it. It does with an export directory what vLLM does: reads the
aux layer ids from ``config.json`` in vLLM's numbering (eyas id + 1), captures those layers of the target, loads
the weights as written (bf16), and drafts chains of K, counting drafts and accepted tokens per position as vLLM's
spec-decode counters do. The bundled side is eyas's evaluation of the drafter it trained (in memory)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.eval.acceptance import PromptSetSpec, default_methods, prompt_fingerprint, run_acceptance
from eyas.eval.engine_eval import AgreementRule, EnginePromptRecord, EngineSetResult, check_agreement
from eyas.serving.export import WEIGHTS, export, load_exported
from eyas.serving.loop import generate
from eyas.serving.models.target import target_from_model
from eyas.serving.proposers import Eagle3Proposer
from tests.conftest import _TinyTokenizer, make_tiny_target
from tests.serving.test_speculative_loop import make_drafter

K = 4
NEW = 48
# prompt seeds whose greedy continuations (5-layer tiny llama) run in repeats, which the copy drafter
# (tests/test_loop.py) predicts: bundled τ ≈ 2.5 at K = 4, a drafter good enough for a broken export (τ ≈ 1) to show
SEEDS = (0, 2, 12, 15)


def prompts() -> list[list[int]]:
    return [torch.randint(3, 256, (14,), generator=torch.Generator().manual_seed(s)).tolist() for s in SEEDS]


def serve_like_vllm(export_dir: Path, model, k: int = K) -> EngineSetResult:
    """The export served as vLLM serves it (see the module docstring), one greedy request per prompt."""
    config = json.loads((export_dir / "config.json").read_text())
    aux = [int(i) - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]  # vLLM's ids are eyas's + 1
    target = target_from_model(copy.deepcopy(model), _TinyTokenizer(model.config.vocab_size), aux_layers=aux)
    drafter = load_exported(export_dir, target)
    # vLLM's drafter consumes whatever states the target captured; it has no layer ids of its own to check
    drafter.config.aux_layer_ids = type(drafter.config.aux_layer_ids)(aux)
    records, per_pos = [], [0] * k
    for p in prompts():
        res = generate(target, Eagle3Proposer(drafter, chain_length=k), p, NEW, stop_on_eos=False)
        accepted = sum(s.num_accepted for s in res.steps)
        mine = [float(sum(s.num_accepted > i for s in res.steps)) for i in range(k)]
        records.append(
            EnginePromptRecord(
                len(res.tokens),
                res.total_s,
                len(res.steps),
                accepted,
                prompt_fingerprint(p),
                prompt_fingerprint(list(res.tokens)),
                mine,
            )  # fmt: skip
        )
        for i, a in enumerate(mine):
            per_pos[i] += int(a)
    drafts = sum(r.drafts for r in records)
    accepted = sum(r.accepted for r in records)
    return EngineSetResult(
        prompt_set="p",
        engine="vllm",
        prompts=len(records),
        tokens=sum(r.tokens for r in records),
        tau=1 + accepted / drafts,
        acceptance_by_position=[a / drafts for a in per_pos],
        tokens_per_s=0.0,
        mean_ttft_ms=0.0,
        drafts=drafts,
        accepted=accepted,
        seconds=0.0,
        per_prompt=records,
    )


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The tiny target, the copy drafter, its export, and the bundled loop's eagle3-chain result on the prompts."""
    model = make_tiny_target("llama", num_layers=5).model
    # aux layers 1, 2, 3 of 5 (the copy drafter reads the last, L - 2), so a shift by one still names real layers
    target = target_from_model(model, _TinyTokenizer(model.config.vocab_size), aux_layers=[1, 2, 3])
    drafter = make_drafter(target, seed=4, draft_vocab=200, copy=True)
    out = tmp_path_factory.mktemp("agreement") / "export"
    export(drafter, target, out)
    spec = PromptSetSpec("p", "ids", len(SEEDS), "repeats", max_new_tokens=NEW)
    acc = run_acceptance(target, drafter, {"p": (spec, prompts())}, default_methods(K, with_tree=False)[:1])
    return target, drafter, out, acc.get("p", "eagle3-chain")


def broken_copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        dst.joinpath(f.name).write_bytes(f.read_bytes())
    return dst


def test_an_export_served_right_agrees(case):
    target, _, out, bundled = case
    assert bundled.tau >= 1.8  # the check is conclusive with this drafter
    served = serve_like_vllm(out, target.model)
    verdict = check_agreement(served, bundled)
    assert verdict.verdict == "agree", verdict.reasons
    # the same target decodes the same tokens: judged on every prompt, each with the same output
    assert verdict.basis == "same outputs" and verdict.same_outputs == verdict.prompts == len(SEEDS)
    assert verdict.tau_engine == pytest.approx(bundled.tau) and verdict.tau_bundled == pytest.approx(
        bundled.tau
    )


def drifted(served: EngineSetResult, i: int) -> EngineSetResult:
    """``served`` with prompt i decoded to another text (as two engines' greedy decoding can drift apart on
    bf16), on which the engine accepted none of its drafts: the set's τ falls far below the bundled loop's."""
    out = copy.deepcopy(served)
    r = out.per_prompt[i]
    out.accepted -= r.accepted
    r.output, r.accepted, r.accepted_per_pos = "another-text", 0.0, [0.0] * len(r.accepted_per_pos)
    out.tau = 1 + out.accepted / out.drafts
    out.acceptance_by_position = [
        sum(p.accepted_per_pos[j] for p in out.per_prompt) / out.drafts
        for j in range(len(r.accepted_per_pos))
    ]
    return out


def test_a_prompt_decoded_to_another_text_is_left_out_of_the_judgement(case):
    """Prompts both sides decoded identically are judged; one the engine decoded to another text is not (its
    counts are on another sequence), so a served-right export still agrees. Without enough same-output prompts
    the verdict falls back to the whole set, where the drift shows as a disagreement."""
    target, _, out, bundled = case
    served = drifted(serve_like_vllm(out, target.model), 0)
    assert served.tau < bundled.tau * 0.95  # the whole set would disagree
    verdict = check_agreement(served, bundled)
    assert verdict.verdict == "agree", verdict.reasons
    assert verdict.basis == "same outputs" and verdict.same_outputs == len(SEEDS) - 1
    strict = check_agreement(served, bundled, AgreementRule(min_same_outputs=len(SEEDS)))
    assert strict.basis == "all prompts" and strict.verdict == "disagree"
    assert any("τ" in r for r in strict.reasons)


def test_the_report_row_shows_the_judged_prompts_tau_beside_the_whole_sets(case):
    """The report's engine row: the whole set's τ on both sides, and the τ the verdict was judged on (here the 3
    prompts decoded identically), so a reader sees why a whole-set gap can still agree."""
    from eyas.eval.acceptance import AcceptanceResult
    from eyas.eval.report import ENGINE_COLUMNS, engine_rows

    target, _, out, bundled = case
    served = drifted(serve_like_vllm(out, target.model), 0)
    (row,) = engine_rows([served], AcceptanceResult([bundled], {}))
    cells = dict(zip(ENGINE_COLUMNS, row))
    judged = check_agreement(served, bundled)
    assert (
        cells["τ engine / bundled, judged prompts"] == f"{judged.tau_engine:.2f} / {judged.tau_bundled:.2f}"
    )
    assert cells["τ engine"].startswith(f"{served.tau:.2f}") and cells["τ bundled"].startswith(
        f"{bundled.tau:.2f}"
    )
    assert (
        cells["agreement"] == f"agree (judged on same outputs; same output on {len(SEEDS) - 1}/{len(SEEDS)})"
    )


def test_same_output_prompts_that_accept_less_in_the_engine_disagree(case):
    """On the prompts both decoded identically, an engine that accepts less at the second draft position (its
    counts halved there) is caught, even though every prompt kept its output."""
    target, _, out, bundled = case
    served = serve_like_vllm(out, target.model)
    for r in served.per_prompt:
        cut = r.accepted_per_pos[1] / 2
        r.accepted_per_pos = [r.accepted_per_pos[0], cut] + [min(a, cut) for a in r.accepted_per_pos[2:]]
        r.accepted = sum(r.accepted_per_pos)
    served.accepted = sum(r.accepted for r in served.per_prompt)
    served.tau = 1 + served.accepted / served.drafts
    verdict = check_agreement(served, bundled)
    assert verdict.basis == "same outputs" and verdict.verdict == "disagree"
    assert any("position 2" in r for r in verdict.reasons)


def test_an_export_with_its_aux_layers_shifted_by_one_is_detected(case, tmp_path):
    """config.json carries eyas's aux ids where vLLM reads its own (eyas + 1): vLLM captures the layers one lower."""
    target, _, out, bundled = case
    bad = broken_copy(out, tmp_path / "shifted")
    config = json.loads((bad / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (bad / "config.json").write_text(json.dumps(config))
    served = serve_like_vllm(bad, target.model)
    verdict = check_agreement(served, bundled)
    assert served.tau < bundled.tau - 0.3  # what vLLM would measure: near 1
    assert verdict.verdict == "disagree" and any("τ" in r for r in verdict.reasons)
    assert verdict.basis == "same outputs"  # lossless: the same tokens, verified with a worse drafter


def test_an_export_with_shuffled_weights_is_detected(case, tmp_path):
    """The drafter block's MLP rows written in another order (a wrong transpose or name mapping in an export)."""
    target, _, out, bundled = case
    bad = broken_copy(out, tmp_path / "shuffled")
    tensors = load_file(str(bad / WEIGHTS))
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    g = torch.Generator().manual_seed(0)
    tensors[name] = tensors[name][torch.randperm(tensors[name].shape[0], generator=g)].contiguous()
    save_file(tensors, str(bad / WEIGHTS))
    verdict = check_agreement(serve_like_vllm(bad, target.model), bundled)
    assert verdict.verdict == "disagree"


def test_a_weak_drafter_makes_the_check_inconclusive_even_when_served_wrong(case, tmp_path):
    """The committed check of old: a drafter at τ ≈ 1.1 and |Δτ| ≤ 0.15 passed an export served completely wrong.
    Below the rule's bundled τ the verdict is inconclusive, whatever the engine measures."""
    target, _, _, _ = case
    weak = make_drafter(target, seed=3, draft_vocab=200)  # random: τ barely above 1
    spec = PromptSetSpec("p", "ids", len(SEEDS), "repeats", max_new_tokens=NEW)
    bundled = run_acceptance(target, weak, {"p": (spec, prompts())}, default_methods(K, with_tree=False)[:1])
    out = tmp_path / "weak"
    export(weak, target, out)
    bad = broken_copy(out, tmp_path / "weak-shifted")
    config = json.loads((bad / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (bad / "config.json").write_text(json.dumps(config))
    served = serve_like_vllm(bad, target.model)
    b = bundled.get("p", "eagle3-chain")
    assert b.tau < 1.8 and abs(served.tau - b.tau) <= 0.15  # what the old check passed
    verdict = check_agreement(served, b)
    assert verdict.verdict == "inconclusive" and "below" in verdict.reasons[0]
