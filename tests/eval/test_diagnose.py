"""diagnose: the throughput model's recommendation on curves whose optimum is known by hand, the acceptance curve
against brute force, the predicted-against-measured flag, bad input, and one measured run on a tiny target in which
an injected per-step delay must be flagged and localised."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from eyas.eval.acceptance import PromptSetSpec
from eyas.eval.diagnose.__main__ import COMMAND, main
from eyas.eval.diagnose.config import DiagnoseConfig, DiagnoseError
from eyas.eval.diagnose.context_prompts import ContextPrompts, prompts_from_ids
from eyas.eval.diagnose.measure import check_contexts
from eyas.eval.diagnose.report import write_report
from eyas.eval.diagnose.run import diagnose
from eyas.eval.throughput import (
    AcceptanceCurve,
    CostCurves,
    check_mismatch,
    isotonic,
    levers,
    predict_chain,
    price_step,
    sweep_chain,
)
from eyas.serving.load import DrafterLoadError, find_drafter, load_drafter, random_drafter
from eyas.serving.proposers import PromptLookupProposer
from tests.conftest import make_tiny_target


# -- synthetic curves ---------------------------------------------------------------------------------------------
def flat_costs(verify, draft_ms: float = 0.0, k_max: int = 12, lengths=(100, 1000)) -> CostCurves:
    """Costs that do not depend on context: ``verify(n)`` for n tokens; every drafter forward costs ``draft_ms``
    (so a chain of K costs K × draft_ms: one context forward plus K - 1 steps)."""
    n = len(lengths)
    return CostCurves(
        list(lengths),
        {t: [float(verify(t))] * n for t in range(1, k_max + 2)},
        draft_rows_ms={m: [draft_ms] * n for m in range(1, k_max + 2)},
        draft_step_ms=[draft_ms] * n,
    )


def geometric_tau(alpha: float, k: int) -> float:
    """1 + α + α² + ... + α^K: τ of a chain whose every position is accepted with probability α."""
    return sum(alpha**i for i in range(k + 1))


def test_optimal_k_by_hand_constant_verify():
    # verify 10 ms for any width, 1 ms per draft token, α = 0.8: tokens/s(K) = 1000 τ(K) / (10 + K).
    # τ(5) = 3.689, τ(6) = 3.951, τ(7) = 4.161 -> 245.9, 247.0, 244.8 tok/s: K = 6 is the maximum.
    costs = flat_costs(lambda n: 10.0, draft_ms=1.0)
    curve = AcceptanceCurve.from_rates([0.8] * 12)
    sweep = sweep_chain(costs, curve, 500, 12, "model")
    assert sweep.best_k == 6
    for k, opt in enumerate(sweep.options):
        assert opt.tau == pytest.approx(geometric_tau(0.8, k))
        assert opt.tokens_per_s == pytest.approx(1000 * geometric_tau(0.8, k) / (10 + k))
    assert sweep.options[0].draft_ms == 0  # K = 0 is plain decoding: no drafter runs at all
    assert sweep.break_even_tau(4) == pytest.approx(
        14 / 10
    )  # a 14 ms step must emit 1.4 tokens to match 10 ms


def test_optimal_k_by_hand_verify_grows_with_width():
    # free drafts (prompt lookup with zero search time), verify 10 + 2n ms for n tokens, α = 0.5:
    # tokens/s(K) = 1000 (2 - 0.5^K) / (12 + 2K) -> 83.3, 107.1, 109.4, 104.2: K = 2.
    costs = flat_costs(lambda n: 10.0 + 2.0 * n)
    curve = AcceptanceCurve.from_rates([0.5] * 6)
    sweep = sweep_chain(costs, curve, 500, 6, "lookup")
    assert sweep.best_k == 2
    assert sweep.best.tokens_per_s == pytest.approx(1000 * 1.75 / 16)


def test_nothing_accepted_means_no_speculation():
    sweep = sweep_chain(
        flat_costs(lambda n: 10.0, draft_ms=0.5), AcceptanceCurve.from_rates([0.0] * 4), 500, 4, "model"
    )
    assert sweep.best_k == 0
    assert [o.tau for o in sweep.options] == [1.0] * 5


def test_k_beyond_measured_is_refused_or_marked_extrapolated():
    costs = flat_costs(lambda n: 10.0)
    curve = AcceptanceCurve.from_rates([1.0] * 4)  # measured up to K = 4, every draft accepted, drafts free
    with pytest.raises(ValueError, match="beyond the measured draft positions"):
        sweep_chain(costs, curve, 500, 8, "lookup")
    sweep = sweep_chain(costs, curve, 500, 8, "lookup", extrapolate=True)
    assert sweep.best_k == 8  # free drafts, all accepted, flat verify: longer is always better
    assert [o.extrapolated for o in sweep.options] == [False] * 5 + [True] * 4
    assert sweep.best.tau == pytest.approx(9.0)


def test_curve_from_steps_prices_shorter_chains_like_truncated_steps():
    g = torch.Generator().manual_seed(0)
    drafted = torch.randint(0, 6, (400,), generator=g)
    drafted[::7] = 0  # prompt lookup: steps without a match draft nothing
    accepted = (torch.rand(400, generator=g) * (drafted + 1)).floor().long().clamp(max=drafted)
    curve = AcceptanceCurve.from_steps(accepted.tolist(), drafted.tolist(), k=5)
    verify = {1: 10.0, 2: 11.0, 3: 13.0, 4: 14.0, 5: 17.0, 6: 18.0}
    costs = CostCurves([100, 1000], {n: [v, v] for n, v in verify.items()}, propose_ms=[0.5, 0.5])
    for k in range(1, 6):
        acc_k, dr_k = accepted.clamp(max=k), drafted.clamp(max=k)
        pred = predict_chain(costs, curve, 500, k, "lookup")
        assert pred.tau == pytest.approx(1 + acc_k.float().mean().item())  # the reach telescopes to counts
        assert pred.verify_tokens == pytest.approx(1 + dr_k.float().mean().item())
        brute = sum(verify[int(d) + 1] for d in dr_k) / len(dr_k)  # expected cost, not cost at the mean width
        assert pred.verify_ms == pytest.approx(brute)
        assert pred.draft_ms == 0.5


def test_price_step_chain_and_tree_drafter_work():
    costs = flat_costs(lambda n: 20.0, draft_ms=0.0)
    costs.draft_rows_ms = {m: [float(m), float(m)] for m in range(1, 14)}  # m rows cost m ms
    costs.draft_step_ms = [3.0, 3.0]
    # chain: always 4 drafts, accepted 0 or 2 (half each): rows 1 or 3 -> 2 ms; 3 single-row steps -> 9 ms
    chain = price_step(costs, 500, [0, 0, 0, 0, 1.0], [0.5, 0, 0.5], "model")
    assert chain.draft_ms == pytest.approx(2 + 9)
    assert chain.tau == pytest.approx(2.0)
    from eyas.serving.tree import TreeConfig

    tree = price_step(
        costs, 500, [0] * 10 + [1.0], [1.0], "model", TreeConfig(topk=3, depth=4, total_tokens=10)
    )
    assert tree.draft_ms == pytest.approx(1 + 3 * 3)  # one committed row, then 3 expansions of 3 rows
    assert tree.verify_tokens == 11


def test_levers_price_the_what_ifs():
    costs = flat_costs(lambda n: 10.0, draft_ms=1.0)
    curve = AcceptanceCurve.from_rates([0.6] * 6)
    out = {lv.name: lv for lv in levers(costs, curve, 500, 3, 6, "model", [0.2], 0.25, 0.5)}
    assert out["as run (K=3)"].tokens_per_s == pytest.approx(1000 * geometric_tau(0.6, 3) / 13)
    assert out["best K"].tokens_per_s >= out["as run (K=3)"].tokens_per_s
    better = out["drafter: acceptance +0.20 per position"]
    assert better.tau == pytest.approx(geometric_tau(0.8, better.k))
    assert out["ceiling: every draft accepted"].tau == pytest.approx(7.0)  # all 6 drafts + the bonus
    cheap = sweep_chain(costs.scaled(verify=0.75), curve, 500, 6, "model").best
    assert out["verify 25% cheaper"].tokens_per_s == pytest.approx(cheap.tokens_per_s)


def test_monotone_costs_remove_dips():
    assert isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert isotonic([5, 4, 3]) == [4, 4, 4]
    c = CostCurves([10], {1: [10.0], 2: [14.0], 3: [12.0]}).monotone()
    assert c.verify_ms == {1: [10.0], 2: [13.0], 3: [13.0]}


def test_costs_refuse_unmeasured_widths_and_ragged_series():
    costs = CostCurves([10, 20], {1: [1.0, 2.0], 3: [3.0, 4.0]})
    assert costs.verify(15, 2) == pytest.approx(2.5)  # interpolated in context and width
    with pytest.raises(ValueError, match="not measured"):
        costs.verify(15, 5)
    with pytest.raises(ValueError, match="one value per context length"):
        CostCurves([10, 20], {1: [1.0]})


# -- predicted against measured -----------------------------------------------------------------------------------
def test_mismatch_within_noise_is_not_flagged():
    c = check_mismatch(100.0, 97.0, [1.04, 1.01, 1.05])
    assert not c.flagged and c.threshold == pytest.approx(0.10)  # noise is small: the tolerance decides


def test_systematic_mismatch_is_flagged_with_direction():
    slow = check_mismatch(150.0, 100.0, [1.5, 1.48, 1.52])
    assert slow.flagged and "slower" in slow.verdict
    fast = check_mismatch(60.0, 100.0, [0.6, 0.61, 0.59])
    assert fast.flagged and "faster" in fast.verdict


def test_noise_widens_the_threshold():
    ratios = [0.6, 1.4, 1.0]  # std 0.4 around 1.0 -> threshold 3 × 0.4 / sqrt(3) = 0.693
    c = check_mismatch(130.0, 100.0, ratios)
    assert c.noise == pytest.approx(0.4)
    assert c.threshold == pytest.approx(3 * 0.4 / 3**0.5)
    assert not c.flagged and "too noisy" in c.verdict
    single = check_mismatch(130.0, 100.0, [1.3])  # one repeat: no noise estimate, so no verdict
    assert not single.flagged and single.verdict.startswith("UNCHECKED")
    with pytest.raises(ValueError, match="positive"):
        check_mismatch(0.0, 100.0)


# -- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"chain_length": 0}, r"^diagnose.chain_length \(K\) must be >= 1"),
        ({"k_max": -1}, r"^diagnose.k_max \(K\) must be >= 1"),
        ({"chain_length": 3, "k_max": 6}, "exceeds the measured diagnose.chain_length"),
        ({"methods": ["medusa"]}, "^diagnose.methods: unknown methods"),
        ({"methods": []}, "^diagnose.methods is empty"),
        ({"methods": ["eagle3-tree"]}, "needs tree shapes: diagnose.trees="),
        ({"prompt_sets": []}, "^diagnose.prompt_sets is empty"),
        ({"contexts": [0]}, "^diagnose.contexts must be positive"),
        ({"export_dir": "random"}, "^diagnose.export_dir=random: leave diagnose.export_dir null"),
    ],
)
def test_bad_settings_name_the_problem(kw, match):
    with pytest.raises(DiagnoseError, match=match):
        DiagnoseConfig(**kw)


def test_empty_prompt_set_and_context_over_the_limit():
    spec = PromptSetSpec("empty", "ids", 1)
    with pytest.raises(DiagnoseError, match="empty"):
        prompts_from_ids(spec, [], [1, 2, 3], [8])
    with pytest.raises(DiagnoseError, match="no prompts"):
        ContextPrompts(spec, {8: []})
    target = make_tiny_target("llama")  # max_position_embeddings 2048
    cfg = DiagnoseConfig(
        methods=["prompt-lookup"], contexts=[64, 4000], prompt_sets=[PromptSetSpec("s", "x", 1)]
    )
    with pytest.raises(DiagnoseError, match="supported maximum of 2048 tokens"):
        check_contexts(cfg, target)


def test_entry_point_config_and_plan(tmp_path, capsys, monkeypatch):
    from hydra.errors import MissingConfigException

    from eyas.command import dry_run
    from eyas.eval.plan import main as plan_main
    from tests.conftest import run_app

    job = dry_run(COMMAND, ["diagnose=smoke", "diagnose.chain_length=5", "diagnose.contexts=[32,64]"])
    cfg = job.diagnose
    assert cfg.chain_length == 5 and cfg.contexts == [32, 64] and cfg.methods == ["prompt-lookup"]
    with pytest.raises(MissingConfigException, match="diagnose/nope"):
        dry_run(COMMAND, ["diagnose=nope"])
    assert run_app(main, ["diagnose.chain_length=0"], monkeypatch, tmp_path) == 2
    assert "chain_length (K) must be >= 1" in capsys.readouterr().err
    # plan is eval.plan: KV per token of an MLA model, the limit when a context is impossible, missing fields
    kimi = ["plan.model=kimi_k2", "plan.gpu_mem_gib=141", "plan.num_gpus=8"]
    assert run_app(plan_main, [*kimi, "plan.dp_attention=8"], monkeypatch, tmp_path) == 0
    assert "68.62 KiB" in capsys.readouterr().out  # (512 + 64) × 61 layers × 2 bytes = 70272 B
    assert run_app(plan_main, [*kimi, "plan.context=1000000"], monkeypatch, tmp_path) == 2
    assert "supported maximum of 262144" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    assert run_app(plan_main, [f"plan.model={tmp_path}"], monkeypatch, tmp_path) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


# -- drafters -----------------------------------------------------------------------------------------------------
def test_drafters_load_from_exports_and_trainer_checkpoints(tmp_path):
    from eyas.serving.export import ExportConfig, export
    from eyas.train.checkpoint import save_weights

    target = make_tiny_target("llama")
    d = random_drafter(target, 64, seed=3)
    assert find_drafter(tmp_path / "runs") is None
    with pytest.raises(DrafterLoadError, match="no exported or trained drafter"):
        load_drafter("auto", target, runs_dir=tmp_path / "runs")
    export(d, target, tmp_path / "runs" / "export", "sglang", config=ExportConfig(dtype="float32"))
    best = tmp_path / "runs" / "train" / "best"  # what the trainer's save_best writes
    best.mkdir(parents=True)
    save_weights(best, d.trainable_state_dict(), d.config.to_dict())
    for spec in (tmp_path / "runs" / "export", tmp_path / "runs" / "train", "auto"):
        loaded = load_drafter(str(spec), target, runs_dir=tmp_path / "runs")
        assert loaded.trained
        for name, value in d.trainable_state_dict().items():
            assert torch.equal(loaded.drafter.state_dict()[name], value), (spec, name)
    with pytest.raises(DrafterLoadError, match="neither random, auto nor a directory"):
        load_drafter(str(tmp_path / "missing"), target)


def test_a_target_loaded_for_a_drafter_reads_the_drafters_aux_layers(tmp_path):
    """A drafter trained on other layers than the default (the embedded target's drafters read layer 28, not
    L-4) is evaluated on a target that captures its layers without restating them, as vLLM and SGLang do."""
    from eyas.serving.export import ExportConfig, export
    from eyas.serving.load import drafter_aux_layers, with_drafter_aux_layers
    from eyas.serving.models.target import TargetConfig, load_target
    from eyas.serving.models.tiny import tiny_model
    from eyas.serving.proposers import Eagle3Proposer
    from eyas.train.checkpoint import save_weights
    from tests.tokenizers import make_chat_tokenizer

    tok = make_chat_tokenizer("chatml")
    tiny_model("llama", seed=0, vocab_size=len(tok), num_layers=6).save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    base = TargetConfig(path=str(tmp_path / "target"), dtype="float32", device="cpu")
    trained_on = load_target(replace(base, aux_layers=[1, 3, 4]))  # the 6-layer default is [0, 2, 4]
    d = random_drafter(trained_on, 64, seed=3)
    export(d, trained_on, tmp_path / "export", "speculators", config=ExportConfig(dtype="float32"))
    ckpt = tmp_path / "train" / "best"
    ckpt.mkdir(parents=True)
    save_weights(ckpt, d.trainable_state_dict(), d.config.to_dict())
    for where in (tmp_path / "export", tmp_path / "train"):
        assert drafter_aux_layers(where) == [1, 3, 4], where
        target = load_target(with_drafter_aux_layers(base, where))
        assert target.aux_layers == (1, 3, 4)
        Eagle3Proposer(load_drafter(str(where), target).drafter).check_target(target.info)
    # the default target does not fit this drafter, and says how to make it fit
    with pytest.raises(
        ValueError, match=r"aux layers \[1, 3, 4\] vs the target's \[0, 2, 4\].*TargetConfig.aux_layers"
    ):
        Eagle3Proposer(d).check_target(load_target(base).info)
    # layers the user set win; no drafter, or none there, leaves the config as it is
    chosen = replace(base, aux_layers=[0, 2, 4])
    assert with_drafter_aux_layers(chosen, tmp_path / "export") is chosen
    assert with_drafter_aux_layers(base, None) is base
    assert with_drafter_aux_layers(base, tmp_path / "missing") is base
    # load_drafter's specs: auto is the newest drafter under runs_dir; random (or auto over nothing) reads none
    assert with_drafter_aux_layers(base, "auto", tmp_path).aux_layers == [1, 3, 4]
    assert with_drafter_aux_layers(base, "auto", tmp_path / "missing") is base
    assert with_drafter_aux_layers(base, "random") is base


# -- one measured run ---------------------------------------------------------------------------------------------
class SlowAcceptLookup(PromptLookupProposer):
    """Prompt lookup whose per-step follow-up costs ``delay`` seconds the profile never sees: a loop regression."""

    def __init__(self, delay: float, **kw):
        super().__init__(**kw)
        self.delay = delay

    def accept(self, accepted) -> None:
        if accepted.verify is not None:  # only after verify steps, as a per-step regression would
            time.sleep(self.delay)


def test_injected_loop_delay_is_flagged_and_localised(tmp_path):
    torch.manual_seed(0)
    target = make_tiny_target("llama")
    period = [11, 12, 13, 14, 15, 16]
    spec = PromptSetSpec("periodic", "ids", 1, "predictable", max_new_tokens=8)
    filler = torch.randint(20, 200, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = {"periodic": prompts_from_ids(spec, [period * 4], filler, [24, 96])}
    cfg = DiagnoseConfig(
        methods=["prompt-lookup"],
        chain_length=3,
        contexts=[24, 96],
        prompt_sets=[spec],
        rounds=2,
        profile_repeats=3,
        statistic="median",  # a scheduling spike in one repeat must not inflate the prediction
        tolerance=0.5,
        n_sigma=0.0,
        out_dir=str(tmp_path),
    )
    delay = 0.25
    result = diagnose(
        target, cfg, prompts=prompts, proposers={"prompt-lookup": SlowAcceptLookup(delay, num_tokens=3)}
    )
    assert [c.context for c in result.cells] == [24, 96]
    for cell in result.cells:
        assert cell.check.flagged and "slower" in cell.check.verdict
        assert cell.check.ratio > 1.5
        # the loop's own draft timer holds the delay (proposer.accept is drafter work); the profile's does not
        assert cell.measured_draft_ms > cell.prediction.draft_ms + 1e3 * delay * 0.9
        p = cell.prediction
        assert p.tokens_per_s == pytest.approx(1e3 * cell.tau / (p.draft_ms + p.verify_ms + p.bookkeeping_ms))
    # τ agrees with eval.acceptance's own aggregation of the same generations
    for r in result.acceptance_by_context.results:
        cell = next(c for c in result.cells if f"{c.prompt_set} @ {c.context}" == r.prompt_set)
        assert cell.tau == pytest.approx(r.tau)
        assert (
            cell.acceptance_by_position[0] <= r.acceptance_by_position[0] + 1e-9
        )  # reach <= conditional rate
    path = write_report(result, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert [c["check"]["ratio"] for c in data["cells"]] == pytest.approx(
        [c.check.ratio for c in result.cells]
    )
    assert "LIKELY BUG" in path.read_text()
    for png in ("step_time.png", "predicted_vs_measured.png", "tau.png", "k_sweep.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_contexts_are_padded_with_real_chat_turns():
    from transformers import AutoTokenizer

    from eyas.data.chat import format_prompt
    from eyas.eval.diagnose.context_prompts import filler_pairs, pad_to_context
    from eyas.eval.prompts import builtin_predictable
    from eyas.serving.models.embedded import ensure_embedded

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded()))
    msgs = builtin_predictable(3)
    kinds = [m[0]["content"].split()[0] for m in msgs]
    assert kinds == ["Copy", "Count", "Write"]
    pairs = filler_pairs("sharegpt", limit=8)
    bare = format_prompt(msgs[1], tok)
    tail = tok.decode(bare)[-120:]  # the prompt's user turn and the assistant header
    for length in (300, 1500):
        ids = pad_to_context(msgs[1], pairs, tok, length)
        assert length - 40 <= len(ids) <= length
        assert tok.decode(ids).endswith(tail)
    assert pad_to_context(msgs[1], pairs, tok, 10) == bare  # a prompt longer than L is never cut


def test_generations_are_priced_with_the_samples_that_bracket_them():
    from eyas.eval.diagnose.measure import Generation, Measurements
    from eyas.eval.profile import StepProfile
    from eyas.serving.loop import GenerationResult

    def sample(length: int, ms: float) -> StepProfile:
        return StepProfile([length], {1: [ms], 2: [ms + 1]})

    # samples alternate between the shortest and the longest context of L = 100: 90, 130, 90
    samples = {(0, 100): [sample(90, 10.0), sample(130, 20.0), sample(90, 30.0)]}
    result = GenerationResult(tokens=[1, 2])
    gens = [Generation(0, 100, "s", "none", i, result, sample_before=i) for i in range(2)]
    m = Measurements(gens, samples, {}, [100], 0.0)
    assert m.costs(gens[0]).verify(110, 1) == pytest.approx(15.0)  # between 10 at 90 and 20 at 130
    assert m.costs(gens[1]).verify(110, 1) == pytest.approx(25.0)  # between 30 at 90 and 20 at 130
    assert m.mean_costs(100).verify(90, 2) == pytest.approx(21.0)  # every sample at 90 averaged
