"""The chain length to serve, read off an evaluation's own acceptance and step profile (eval/recommend.py)."""

from __future__ import annotations

import pytest

from eyas.eval.acceptance import AcceptanceResult, SetMethodResult
from eyas.eval.profile import StepProfile
from eyas.eval.recommend import ChainLengthRecommendation, recommend_chain_length


def _result(name: str, accepted: list[int], k: int = 6) -> SetMethodResult:
    steps = [(100, 0.001, 0.01, a, k) for a in accepted]
    return SetMethodResult(
        prompt_set=name,
        method="eagle3-chain",
        label=name,
        prompts=1,
        tokens=sum(a + 1 for a in accepted),
        steps=len(accepted),
        tau=1 + sum(accepted) / len(accepted),
        acceptance_by_position=[],
        tokens_per_s=0.0,
        decode_tokens_per_s=0.0,
        mean_draft_ms=1.0,
        mean_verify_ms=10.0,
        mean_context=100.0,
        step_records=steps,
    )


def _profile(verify_per_token_ms: float, draft_step_ms: float) -> StepProfile:
    lengths = [16, 1024]
    return StepProfile(
        context_lengths=lengths,
        verify_ms={n: [10.0 + verify_per_token_ms * (n - 1)] * 2 for n in (1, 7)},
        draft_step_ms=[draft_step_ms] * 2,
        draft_rows_ms={m: [draft_step_ms * (1 + 0.1 * (m - 1))] * 2 for m in (1, 7)},
    )


def test_a_drafter_accepted_everywhere_with_cheap_steps_is_served_at_the_measured_k():
    acc = AcceptanceResult([_result("a", [6] * 20), _result("b", [6, 5, 6, 6])], {})
    rec = recommend_chain_length(acc, _profile(0.1, 0.1))
    assert rec.best_k == 6 and [s.best_k for s in rec.sets] == [6, 6]
    assert rec.mean_speedup[0] == pytest.approx(1.0)
    assert rec.sets[0].tau[6] == pytest.approx(7.0) and rec.sets[0].tau[2] == pytest.approx(3.0)


def test_only_the_first_draft_accepted_gives_k1_and_nothing_accepted_gives_plain_decoding():
    first_only = AcceptanceResult([_result("a", [1] * 30)], {})
    assert recommend_chain_length(first_only, _profile(0.5, 1.0)).best_k == 1
    never = AcceptanceResult([_result("a", [0] * 30)], {})
    rec = recommend_chain_length(never, _profile(0.5, 1.0))
    assert rec.best_k == 0 and "Serve K = 0" in rec.markdown()


def test_the_mean_speedup_over_sets_picks_one_k_and_each_set_keeps_its_own():
    acc = AcceptanceResult([_result("easy", [6] * 20), _result("hard", [1] * 20)], {})
    rec = recommend_chain_length(acc, _profile(0.5, 1.0))
    easy, hard = rec.sets
    assert easy.best_k == 6 and hard.best_k == 1
    speedup = [
        (easy.tokens_per_s[k] / easy.tokens_per_s[0] + hard.tokens_per_s[k] / hard.tokens_per_s[0]) / 2
        for k in range(7)
    ]
    assert rec.best_k == max(range(7), key=lambda k: speedup[k])


def test_no_profile_or_no_drafter_costs_means_no_recommendation():
    acc = AcceptanceResult([_result("a", [6] * 4)], {})
    assert recommend_chain_length(acc, None) is None
    prof = _profile(0.1, 0.1)
    prof.draft_rows_ms = {}
    assert recommend_chain_length(acc, prof) is None


def test_the_recommended_k_is_a_method_of_the_reported_run_right_after_the_evaluated_k():
    """eval.measure_best_k: the chain at the recommended K joins the reported methods (so its speedup comes from
    the same interleaved run as every other), right after the chain at chain_length; nothing is added when the
    recommendation is the evaluated K or plain decoding."""
    from eyas.eval.stage import EvalStageConfig, methods_to_report

    ecfg = EvalStageConfig(
        prompt_sets=[{"name": "a", "source": "x", "n": 1}],
        chain_length=4,
        methods=["eagle3-chain", "prompt-lookup", "none"],
    )

    def names(best_k: int | None, cfg: EvalStageConfig = ecfg) -> list[str]:
        rec = None if best_k is None else ChainLengthRecommendation("eagle3-chain", 4, best_k, [1.0] * 5)
        return [m.name for m in methods_to_report(cfg, rec)]

    assert names(2) == ["eagle3-chain", "eagle3-chain-k2", "prompt-lookup", "none"]
    assert names(4) == names(0) == names(None) == ["eagle3-chain", "prompt-lookup", "none"]
    ecfg.measure_best_k = False
    assert names(2) == ["eagle3-chain", "prompt-lookup", "none"]
