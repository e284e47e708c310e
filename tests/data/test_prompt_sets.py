"""Evaluation prompt sets: out-of-distribution sources, seeds that draw their own items, calib/report halves."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from eyas.data.corpora import (
    CONF_CORPUS_DIR,
    DEFAULT_REASONING_GYM_TASKS,
    CorpusError,
    SourceConfig,
    known_corpora,
    load_corpus_config,
    load_prompt_set,
    read_source,
)
from eyas.data.corpora.prompt_sets import OOD_REASONING_GYM_TASKS, WORD_PROBLEMS_FILE


def _question(c) -> str:
    return next(m["content"] for m in c.messages if m["role"] == "user")


def test_eval_seeds_draw_disjoint_reasoning_gym_prompts():
    """The bench's 12 prompts at seed 0 and 36 at seed 1 were re-draws from one pool: they shared items."""
    first, others = (
        load_prompt_set("reasoning_gym", n=12, seed=0),
        load_prompt_set("reasoning_gym", n=36, seed=1),
    )
    assert len(first) == 12 and len(others) == 36
    assert not {c.id for c in first} & {c.id for c in others}
    assert not {_question(c) for c in first} & {_question(c) for c in others}
    whole = {s: load_prompt_set("reasoning_gym", seed=s) for s in (0, 1)}  # the whole pools too
    assert not {c.id for c in whole[0]} & {c.id for c in whole[1]}
    assert not {c.meta["item_seed"] for c in whole[0]} & {c.meta["item_seed"] for c in whole[1]}


def test_prompts_never_meet_the_training_mixtures_own_eval_split():
    """A corpus's eval split (where training picks best/) holds the first eval_size items of the eval interval; the
    prompt sets start far past it."""
    for name in ("demo", "bench", "reasoning_mix"):
        (src,) = [s for s in load_corpus_config(name).sources if s.kind == "reasoning_gym"]
        held = {c.id for c in read_source(src, "eval")}
        assert held and not held & {c.id for c in load_prompt_set("reasoning_gym", seed=src.seed)}, name


def test_no_training_mixture_uses_an_out_of_distribution_task():
    trained: set[str] = set()
    for name in known_corpora():
        try:
            cfg = load_corpus_config(name)
        except CorpusError:  # a template that needs the user's values (hf, jsonl): no reasoning-gym in it
            assert "reasoning_gym" not in (CONF_CORPUS_DIR / f"{name}.yaml").read_text()
            continue
        for src in cfg.sources:
            if src.kind == "reasoning_gym" and not src.eval_only:
                trained |= set(src.subsets or DEFAULT_REASONING_GYM_TASKS)
    assert trained >= set(DEFAULT_REASONING_GYM_TASKS)
    assert not trained & set(OOD_REASONING_GYM_TASKS)
    assert len(set(OOD_REASONING_GYM_TASKS)) == 12


def test_out_of_distribution_reasoning_covers_every_task_and_has_no_repeats():
    pool = load_prompt_set("ood_reasoning")
    per_task = Counter(c.meta["task"] for c in pool)
    assert set(per_task) == set(OOD_REASONING_GYM_TASKS) and min(per_task.values()) >= 45
    assert len({_question(c) for c in pool}) == len(pool)
    twelve = load_prompt_set("ood_reasoning", n=12, seed=0, half="report")
    assert {c.meta["task"] for c in twelve} == set(OOD_REASONING_GYM_TASKS)  # round-robin over the tasks
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in twelve)  # no answer
    one = load_prompt_set("ood_reasoning/aiw,dice", n=4, seed=3)
    assert {c.meta["task"] for c in one} == {"aiw", "dice"}


@pytest.mark.parametrize("name", ["ood_reasoning", "word_problems", "reasoning_gym", "mt_bench"])
def test_calibration_and_report_halves_partition_the_set(name):
    whole = load_prompt_set(name, seed=0)
    calib, report = (load_prompt_set(name, seed=0, half=h) for h in ("calib", "report"))
    ids = {h: {c.id for c in convs} for h, convs in (("calib", calib), ("report", report))}
    assert not ids["calib"] & ids["report"]
    assert ids["calib"] | ids["report"] == {c.id for c in whole}
    tasks = {c.id: c.meta.get("task", c.meta.get("difficulty", "")) for c in whole}
    for task in set(tasks.values()):  # each task (hand-written: each difficulty) splits evenly
        sizes = [sum(tasks[i] == task for i in ids[h]) for h in ("calib", "report")]
        assert sizes[0] - sizes[1] in (0, 1), (task, sizes)
    if name in ("word_problems", "mt_bench"):  # fixed pools: the halves do not move with the seed
        assert {c.id for c in load_prompt_set(name, seed=5, half="calib")} == ids["calib"]
    small = load_prompt_set(name, n=3, seed=1, half="report")
    assert len(small) == 3 and {c.id for c in small} <= {
        c.id for c in load_prompt_set(name, seed=1, half="report")
    }
    with pytest.raises(ValueError, match="half"):
        load_prompt_set(name, half="test")


def test_the_hand_written_word_problems():
    records = [json.loads(line) for line in WORD_PROBLEMS_FILE.read_text().splitlines()]
    assert len(records) == 24 and len({r["id"] for r in records}) == 24
    assert Counter(r["meta"]["difficulty"] for r in records) == {"easy": 4, "medium": 12, "hard": 8}
    assert all(r["meta"]["answer"] and r["conversations"][0]["role"] == "user" for r in records)
    convs = list(read_source(SourceConfig(name="w", kind="file", path=str(WORD_PROBLEMS_FILE))))
    assert [c.id for c in convs] == [r["id"] for r in records]
    for half in ("calib", "report"):
        convs = load_prompt_set("word_problems", half=half)
        assert Counter(c.meta["difficulty"] for c in convs) == {"easy": 2, "medium": 6, "hard": 4}


def test_excluded_prompts_are_replaced_by_others_of_the_set():
    base = load_prompt_set("reasoning_gym", n=6, seed=0)
    out = load_prompt_set("reasoning_gym", n=6, seed=0, exclude={base[0].id})
    assert len(out) == 6 and base[0].id not in {c.id for c in out}
    assert len({c.id for c in base} & {c.id for c in out}) == 5


# these generators iterate over sets of strings or sympy objects: their items followed the hash seed
HASH_DEPENDENT_TASKS = ("polynomial_multiplication", "isomorphic_strings", "ransom_note")
_ITEMS_DIGEST = """
import hashlib, json
from eyas.data.corpora import load_prompt_set
from eyas.data.corpora.sources import reasoning_gym_tasks
items = list(reasoning_gym_tasks({tasks!r}, 1000, 20, source="x", split="train"))
prompts = load_prompt_set("ood_reasoning", n=12, half="report")
print(hashlib.sha256(json.dumps([c.messages for c in items + prompts]).encode()).hexdigest())
"""


def test_reasoning_gym_items_and_prompt_sets_are_the_same_in_every_process():
    """Two processes with other hash seeds (as any two runs of Python have) generate the same training items and
    the same out-of-distribution prompts, so results measured in two runs pair prompt by prompt. Before, one of
    the 12 report-half prompts (a polynomial_multiplication item) differed between runs."""
    import os
    import subprocess
    import sys

    code = _ITEMS_DIGEST.format(tasks=list(HASH_DEPENDENT_TASKS))
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1


def test_the_generation_worker_refuses_a_process_without_the_fixed_hash_seed():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONHASHSEED": "7"}
    out = subprocess.run(
        [sys.executable, "-m", "eyas.data.corpora.reasoning_gym_worker"],
        input='{"tasks": ["ransom_note"], "base": 0, "size": 2}', env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode != 0 and "PYTHONHASHSEED=0" in out.stderr
