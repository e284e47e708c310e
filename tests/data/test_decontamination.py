"""Decontamination: an evaluation prompt found in the training text is refused, naming the prompt and the record."""

from __future__ import annotations

import json

import pytest

from eyas.data.corpora.decontamination import ContaminationError, check_decontaminated, find_contamination
from eyas.data.types import Conversation
from eyas.eval.acceptance import PromptSetSpec
from eyas.eval.prompts import check_prompt_sets, load_prompts

SPAN = "the train leaves the station at nine and reaches the coast two hours later"  # 15 words


def _conv(cid: str, *turns: str) -> Conversation:
    roles = ["user", "assistant"] * len(turns)
    return Conversation(cid, [{"role": r, "content": t} for r, t in zip(roles, turns)], "test")


def test_a_verbatim_question_is_refused_with_the_prompt_and_the_record():
    prompts = {"word_problems": [_conv("wp/1", "What is 17 * 3?"), _conv("wp/2", "What is 17 + 3?")]}
    training = [_conv("chat/9", "hi", "Sure.  WHAT is 17*3 ? It is 51."), _conv("chat/10", "what is 17 3")]
    with pytest.raises(ContaminationError) as e:
        check_decontaminated(prompts, training, where="train/conversations.jsonl")
    msg = str(e.value)
    assert (
        "'wp/1'" in msg
        and "'word_problems'" in msg
        and "'chat/9'" in msg
        and "train/conversations.jsonl" in msg
    )
    assert "wp/2" not in msg  # 17 + 3 is another question: symbols count in a question
    # a short question is a question all the same: it is refused in an in-distribution set too
    assert [
        h.prompt_id for h in find_contamination(prompts, training, in_distribution={"word_problems"})
    ] == ["wp/1"]


def test_a_long_shared_span_refuses_an_out_of_distribution_prompt_only():
    prompt = _conv("p/1", f"Read this. {SPAN}. How long is the trip in minutes?")
    record = _conv("r/1", "Tell me a story.", f"Once upon a time {SPAN.upper()}, and then it rained.")
    hits = find_contamination({"ood": [prompt]}, [record])
    assert [(h.prompt_id, h.record_id, h.rule) for h in hits] == [("p/1", "r/1", "ngram")]
    assert hits[0].text in SPAN
    assert find_contamination({"x_in_dist": [prompt]}, [record], in_distribution={"x_in_dist"}) == []
    short = _conv("r/2", "q", " ".join(SPAN.split()[:12]))  # 12 words are not 13
    assert find_contamination({"ood": [prompt]}, [short]) == []
    assert len(find_contamination({"ood": [prompt]}, [short], ngram=12)) == 1
    # a span does not run across two turns of a record
    split = _conv("r/3", " ".join(SPAN.split()[:7]), " ".join(SPAN.split()[7:]))
    assert find_contamination({"ood": [prompt]}, [split]) == []
    # a code list is six words, not thirteen tokens
    code = _conv("c/1", "f([1, 2, 3, 4, 5, 6]) returns [1, 2, 3, 4, 5, 6] sorted, then [1, 2, 3, 4, 5, 6]")
    assert find_contamination({"ood": [code]}, [_conv("r/4", "x = [1, 2, 3, 4, 5, 6, 7]")]) == []


def test_eval_prompt_sets_are_checked_against_a_training_file(tmp_path):
    ood = PromptSetSpec("word_problems", "word_problems", n=4, half="report")
    in_dist = PromptSetSpec("reasoning_in_dist", "reasoning_gym", n=5, in_distribution=True)
    chosen = load_prompts(in_dist, seed=0)
    path = tmp_path / "conversations.jsonl"  # as the prepare stage writes it (Conversation.to_record)
    records = [
        _conv("rg/1", chosen[2].messages[0]["content"], "42").to_record(),
        Conversation(
            "chat/1",
            [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi", "reasoning": "r"}],
        ).to_record(),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    # a training question in an in-distribution set: left out, another prompt of the set drawn instead
    res = check_prompt_sets([ood, in_dist], 0, str(path))
    assert res.excluded("reasoning_in_dist") == {chosen[2].id} and res.checked == 9
    assert "reasoning_in_dist: left out 1" in res.describe(str(path), 13)
    kept = load_prompts(in_dist, 0, res.excluded("reasoning_in_dist"))
    assert len(kept) == 5 and chosen[2].id not in {c.id for c in kept}
    # the same text in an out-of-distribution set refuses the evaluation
    problem = load_prompts(ood, seed=0)[1]
    records.append(
        {"id": "chat/2", "conversations": [{"role": "user", "content": "Hi"}, problem.messages[0]]}
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(
        ContaminationError, match=f"'{problem.id}' of eval prompt set 'word_problems'.*'chat/2'"
    ):
        check_prompt_sets([ood, in_dist], 0, str(path))


def test_the_eval_stage_refuses_before_the_target_loads(tmp_path):
    from eyas.eval.stage import EvalJob, EvalStageConfig, run

    sets = [
        {"name": "reasoning_in_dist", "source": "reasoning_gym", "n": 2, "in_distribution": True},
        {"name": "ood_reasoning", "source": "ood_reasoning", "n": 2, "half": "report"},
    ]
    question = load_prompts(PromptSetSpec(**sets[1]), seed=0)[0].messages[0]["content"]
    path = tmp_path / "train.jsonl"
    path.write_text(
        json.dumps({"id": "t/1", "conversations": [{"role": "user", "content": question}]}) + "\n"
    )
    ecfg = EvalStageConfig(prompt_sets=sets, export_dir=str(tmp_path / "no-export"), training_text=str(path))
    assert [s.name for s in ecfg.prompt_sets] == [
        "ood_reasoning",
        "reasoning_in_dist",
    ]  # out of distribution first
    with pytest.raises(ContaminationError, match="'t/1'"):
        run(EvalJob(eval=ecfg, work_dir=str(tmp_path)))  # no target, no export: refused before either is read


def test_the_pipeline_checks_against_its_prepared_training_split(tmp_path):
    from eyas.data.prepare import PrepareResult
    from eyas.eval.stage import EvalStageConfig
    from eyas.pipeline import eval_settings

    ecfg = EvalStageConfig(prompt_sets=[{"name": "w", "source": "word_problems", "n": 1}])
    prep = PrepareResult(out_dir=tmp_path, splits={}, corpus_stats=[])
    assert eval_settings(ecfg, prep).training_text == str(tmp_path / "train" / "conversations.jsonl")


def test_a_set_marked_in_distribution_is_named_so():
    with pytest.raises(ValueError, match="_in_dist"):
        PromptSetSpec("reasoning", "reasoning_gym", in_distribution=True)
    with pytest.raises(ValueError, match="_in_dist"):
        PromptSetSpec("reasoning_in_dist", "reasoning_gym")
