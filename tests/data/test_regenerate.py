"""Regeneration (decode loop == transformers generate, resume == uninterrupted, turn-by-turn) and the prepare stage."""

from __future__ import annotations

import json

import pytest
import torch

import eyas.data.regenerate as regen_mod
from eyas.data.chat import format_conversations, format_prompt
from eyas.data.corpora.config import CorpusConfig, SourceConfig
from eyas.data.prepare import PrepareConfig, prepare, read_conversations, read_samples
from eyas.data.regenerate import (
    RegenerateConfig,
    cut_at_stop,
    generate_batch,
    load_done_ids,
    regenerate,
    sample_next,
)
from eyas.data.types import Conversation
from tests.tokenizers import make_chat_tokenizer

QUESTIONS = [
    "What is two plus two?",
    "Tell me a story about a cat.",
    "Hello! How can I help you today?",
    "Compute 12 * 7.",
    "The quick brown fox jumps over the lazy dog. Why?",
    "Once upon a time a small cat lived in a big house near the sea. Then what?",
    "Answer briefly.",
]


@pytest.fixture(scope="module")
def chat_target():
    from eyas.serving.models.target import target_from_model
    from eyas.serving.models.tiny import tiny_model

    tok = make_chat_tokenizer("chatml")
    model = tiny_model("llama", seed=0, vocab_size=len(tok))
    return target_from_model(model, tok, name="tiny-chatml")


def _convs(n: int = 7) -> list[Conversation]:
    out = []
    for i in range(n):
        msgs = [
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
            {"role": "assistant", "content": f"reference {i}"},
        ]
        if i % 3 == 0:  # some multi-turn conversations
            msgs += [
                {"role": "user", "content": QUESTIONS[(i + 2) % len(QUESTIONS)]},
                {"role": "assistant", "content": f"reference {i}b"},
            ]
        if i == 4:
            msgs.insert(0, {"role": "system", "content": "Answer briefly."})
        out.append(Conversation(id=f"c{i}", messages=msgs, source="t", meta={"k": i}))
    return out


def _prompts(target) -> list[list[int]]:
    return [format_prompt([{"role": "user", "content": q}], target.tokenizer) for q in QUESTIONS]


def _frequent_token(target, prompts, cfg) -> int:
    """A token the model generates early in some rows, used as a stop token so rows end at different steps."""
    outs = generate_batch(target, prompts, cfg, 0, {0})
    return outs[0].token_ids[2]


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 7], {2}, 8).token_ids == [5, 6, 2]
    assert cut_at_stop([5, 6, 2, 7], {2}, 8).finish == "stop"
    g = cut_at_stop([5, 6, 7], {2}, 3)
    assert (g.token_ids, g.finish) == ([5, 6, 7], "length")


def test_decode_loop_matches_transformers_generate_and_unbatched_greedy(chat_target):
    prompts = _prompts(chat_target)
    cfg = RegenerateConfig(max_new_tokens=12, engine="loop")
    stop = {2, _frequent_token(chat_target, prompts, cfg)}
    loop = generate_batch(chat_target, prompts, cfg, 0, stop)
    hf = generate_batch(chat_target, prompts, RegenerateConfig(max_new_tokens=12, engine="hf"), 0, stop)
    assert [g.token_ids for g in loop] == [g.token_ids for g in hf]
    assert [g.finish for g in loop] == [g.finish for g in hf]
    finishes = {g.finish for g in loop}
    assert finishes == {"stop", "length"}, "the check needs rows that leave the batch early"
    # left padding and row dropping change nothing: each prompt alone gives the same answer
    alone = [generate_batch(chat_target, [p], cfg, 0, stop)[0].token_ids for p in prompts]
    assert alone == [g.token_ids for g in loop]


def test_sampling_follows_the_distribution_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, 4)
    gen = torch.Generator().manual_seed(0)
    draws = sample_next(logits, 1.0, 1.0, gen)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)
    p = torch.softmax(logits[0], -1)  # [0.64, 0.24, 0.09, 0.03]: top_p=0.8 keeps the first two tokens
    draws = sample_next(logits, 1.0, 0.8, torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert freq[2:].sum() == 0 and abs(freq[0] - p[0] / (p[0] + p[1])) < 0.03
    assert torch.equal(sample_next(logits[:3], 0.0, 1.0, None), torch.zeros(3, dtype=torch.long))


def _run(chat_target, convs, path, **kw):
    cfg = RegenerateConfig(max_new_tokens=6, batch_size=3, **kw)
    return regenerate(convs, chat_target, cfg, path, progress=False)


def test_regenerated_turns_are_the_targets_answers_turn_by_turn(chat_target, tmp_path):
    convs = _convs()
    res = _run(chat_target, convs, tmp_path / "r.jsonl")
    recs = {r["id"]: r for r in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    assert res.written == len(convs) == len(recs)
    tok = chat_target.tokenizer
    cfg = RegenerateConfig(max_new_tokens=6)
    for conv in convs:
        r = recs[conv.id]
        msgs = r["conversations"]
        assert [m["content"] for m in msgs if m["role"] != "assistant"] == [
            m["content"] for m in conv.messages if m["role"] != "assistant"
        ]
        meta = r["meta"]
        assert meta["regenerated"] is True and meta["k"] == conv.meta["k"]
        assert meta["reference"] == [m["content"] for m in conv.messages if m["role"] == "assistant"]
        assert meta["generated_tokens"] == sum(meta["tokens_per_turn"])
        # every assistant turn is the greedy answer to the conversation so far, with earlier *regenerated* turns
        n_assist = 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            g = generate_batch(chat_target, [format_prompt(msgs[:i], tok)], cfg, 0, {2})[0]
            assert m["content"] == tok.decode([t for t in g.token_ids if t != 2]).strip()
            assert meta["tokens_per_turn"][n_assist] == len(g.token_ids)
            assert meta["finish_reasons"][n_assist] == g.finish
            n_assist += 1
        assert n_assist == len(meta["finish_reasons"]) == sum(m["role"] == "user" for m in conv.messages)
    assert res.generated_tokens == sum(r["meta"]["generated_tokens"] for r in recs.values())


def test_max_turns_caps_the_regenerated_turns(chat_target, tmp_path):
    conv = _convs(1)[0]  # two user turns
    _run(chat_target, [conv], tmp_path / "r.jsonl", max_turns=1)
    (rec,) = map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())
    assert [m["role"] for m in rec["conversations"]] == ["user", "assistant"]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_interrupted_and_resumed_run_writes_what_an_uninterrupted_one_does(
    chat_target, tmp_path, monkeypatch, temperature
):
    convs = _convs()
    whole = tmp_path / "whole.jsonl"
    _run(chat_target, convs, whole, temperature=temperature, seed=5)

    part = tmp_path / "part.jsonl"
    real = regen_mod.generate_batch
    calls = {"n": 0}

    def dies_on_third_call(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(regen_mod, "generate_batch", dies_on_third_call)
    with pytest.raises(KeyboardInterrupt):
        _run(chat_target, convs, part, temperature=temperature, seed=5)
    monkeypatch.setattr(regen_mod, "generate_batch", real)
    written = part.read_text().splitlines()
    assert 0 < len(written) < len(convs)
    with open(part, "a") as f:  # and the job died while writing the next batch
        f.write('{"id": "c9", "conversations": [{"ro')
    res = _run(chat_target, convs, part, temperature=temperature, seed=5)
    assert res.already_done == len(written) and res.written == len(convs) - len(written)
    assert part.read_text() == whole.read_text()
    # a third run has nothing left to do
    assert _run(chat_target, convs, part, temperature=temperature, seed=5).written == 0


def test_sampling_seed_changes_the_answers(chat_target, tmp_path):
    convs = _convs(3)
    a = _run(chat_target, convs, tmp_path / "a.jsonl", temperature=1.0, seed=1)
    _run(chat_target, convs, tmp_path / "b.jsonl", temperature=1.0, seed=2)
    assert a.written == 3
    assert (tmp_path / "a.jsonl").read_text() != (tmp_path / "b.jsonl").read_text()


def test_load_done_ids_cuts_a_torn_last_line(tmp_path):
    p = tmp_path / "o.jsonl"
    good = json.dumps({"id": "a", "conversations": []}) + "\n"
    p.write_text(good + '{"id": "b", "conv')
    assert load_done_ids(p) == {"a"} and p.read_text() == good


# -- the prepare stage ----------------------------------------------------------------------------------------------
def _corpus(tmp_path) -> CorpusConfig:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c.to_record()) + "\n" for c in _convs()))
    return CorpusConfig(
        name="local",
        sources=[SourceConfig(name="local", kind="file", path=str(path))],
        eval_fraction=0.3,
        seed=0,
    )


def test_prepare_writes_samples_that_match_its_conversations(chat_target, tmp_path):
    cfg = PrepareConfig(
        corpus=_corpus(tmp_path),
        work_dir=str(tmp_path / "runs"),
        max_len=64,
        regenerate=True,
        regen=RegenerateConfig(max_new_tokens=5, batch_size=4),
        progress=False,
    )
    res = prepare(cfg, chat_target)
    assert not res.reused and res.out_dir.parent == tmp_path / "runs" / "prepare"
    total = 0
    for split in ("train", "eval"):
        s = res.splits[split]
        convs = read_conversations(s.conversations_path)
        total += len(convs)
        assert all(c.meta["regenerated"] for c in convs)
        expected = format_conversations(convs, chat_target.tokenizer, 64)
        got = read_samples(s.samples_path)
        assert [(x.id, x.input_ids, x.loss_mask) for x in got] == [
            (x.id, x.input_ids, x.loss_mask) for x in expected.samples
        ]
        assert s.tokens == sum(x.num_tokens for x in got) and s.loss_tokens == sum(
            x.num_loss_tokens for x in got
        )
        assert s.regen is not None and s.regen.written == len(convs)
    assert total == len(_convs())
    again = prepare(cfg, chat_target)
    assert again.reused and again.out_dir == res.out_dir
    assert again.splits["train"].samples == res.splits["train"].samples
    # the tokenizer alone is enough without regeneration, and the output goes elsewhere
    plain = prepare(
        PrepareConfig(corpus=_corpus(tmp_path), work_dir=str(tmp_path / "runs"), max_len=64, progress=False),
        tokenizer=chat_target.tokenizer,
    )
    assert plain.out_dir != res.out_dir
    convs = read_conversations(plain.splits["train"].conversations_path)
    assert all("regenerated" not in c.meta for c in convs)


def test_hydra_config_composes_into_a_prepare_config(tmp_path):
    from hydra import compose, initialize_config_dir

    from eyas.data.corpora.config import CONF_CORPUS_DIR
    from eyas.data.prepare import prepare_config_from_hydra

    with initialize_config_dir(config_dir=str(CONF_CORPUS_DIR.parent), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "corpus=reasoning_gym",
                "corpus.size=5",
                "prepare.regenerate=true",
                "prepare.regen.max_new_tokens=7",
                f"work_dir={tmp_path}",
            ],
        )
    p = prepare_config_from_hydra(cfg)
    assert p.regenerate and p.regen.max_new_tokens == 7 and p.work_dir == str(tmp_path)
    assert p.corpus.name == "reasoning_gym" and p.corpus.sources[0].size == 5


def test_time_budget_keeps_originals_and_a_later_run_continues(chat_target, tmp_path):
    """A run out of time leaves the rest with their original answers; the next run finishes the job, and the
    result equals one uninterrupted run."""
    from eyas.data.regenerate import RegenerateConfig, read_regenerated, regenerate

    convs = _convs(6)
    cfg = RegenerateConfig(max_new_tokens=6, batch_size=2)
    full = regenerate(convs, chat_target, cfg, tmp_path / "full.jsonl", progress=False)
    assert full.remaining == 0
    tiny = RegenerateConfig(max_new_tokens=6, batch_size=2, time_budget_s=1e-9)
    first = regenerate(convs, chat_target, tiny, tmp_path / "part.jsonl", progress=False)
    assert first.written == 2 and first.remaining == 4  # one batch always runs, then the budget is spent
    while True:
        r = regenerate(convs, chat_target, tiny, tmp_path / "part.jsonl", progress=False)
        if r.remaining == 0:
            break
    a = {c.id: c.messages for c in read_regenerated(tmp_path / "full.jsonl")}
    b = {c.id: c.messages for c in read_regenerated(tmp_path / "part.jsonl")}
    assert a == b


def test_max_batches_stops_at_a_fixed_point_and_a_larger_value_continues(chat_target, tmp_path):
    """max_batches regenerates exactly the first batches of the fixed order, whatever the machine's speed; a later
    run with a larger value continues, and the whole equals one uninterrupted run."""
    from eyas.data.regenerate import RegenerateConfig, read_regenerated, regenerate

    convs = _convs(7)

    def run(path, max_batches=None):
        cfg = RegenerateConfig(max_new_tokens=6, batch_size=2, max_batches=max_batches)
        return regenerate(convs, chat_target, cfg, tmp_path / path, progress=False)

    assert run("f.jsonl").remaining == 0
    first = run("p.jsonl", max_batches=2)
    assert first.written == 4 and first.remaining == 3
    again = run("p.jsonl", max_batches=2)
    assert again.written == 0 and again.remaining == 3  # the same stopping point: nothing more to do
    rest = run("p.jsonl", max_batches=9)
    assert rest.written == 3 and rest.remaining == 0
    a = {c.id: c.messages for c in read_regenerated(tmp_path / "f.jsonl")}
    b = {c.id: c.messages for c in read_regenerated(tmp_path / "p.jsonl")}
    assert a == b
    with pytest.raises(ValueError, match="max_batches"):
        RegenerateConfig(max_batches=0)


def _regenerating_prepare(tmp_path, **regen) -> PrepareConfig:
    """prepare() on the small corpus, regenerating 5-token answers in batches of 2 (``regen``: the rest)."""
    return PrepareConfig(
        corpus=_corpus(tmp_path),
        work_dir=str(tmp_path / "runs"),
        max_len=64,
        regenerate=True,
        regen=RegenerateConfig(max_new_tokens=5, batch_size=2, **regen),
        progress=False,
    )


@pytest.mark.parametrize("unfinished", ["keep", "drop"])
def test_prepare_with_a_spent_time_budget_keeps_or_drops_the_rest(chat_target, tmp_path, unfinished):
    """Out of time: the prepared split holds the regenerated conversations plus (keep) or without (drop) the
    others with their original answers; the summary marks the output unfinished, and the next run continues."""
    cfg = _regenerating_prepare(tmp_path, time_budget_s=1e-9, unfinished=unfinished)
    res = prepare(cfg, chat_target)
    s = res.splits["train"]
    convs = read_conversations(s.conversations_path)
    done = [c for c in convs if c.meta.get("regenerated")]
    assert len(done) == s.regen.written == 2 and s.regen.remaining > 0 and not res.complete
    assert len(convs) == (2 if unfinished == "drop" else 2 + s.regen.remaining)
    again = prepare(cfg, chat_target)
    assert not again.reused and again.splits["train"].regen.already_done == 2


def test_prepare_stopped_at_max_batches_is_reused_by_the_same_command_and_continued_by_a_larger_one(
    chat_target, tmp_path
):
    """A rerun with the same max_batches would find nothing to regenerate: it reuses the output instead of
    starting an engine (the server path pays minutes for that); a larger max_batches continues. A spent time
    budget is not reused (the test above)."""

    def cfg(max_batches):
        return _regenerating_prepare(tmp_path, max_batches=max_batches)

    first = prepare(cfg(1), chat_target)
    s = first.splits["train"]
    assert s.regen.written == 2 and s.regen.remaining > 0 and s.regen.past_max_batches == s.regen.remaining
    assert not first.complete
    again = prepare(cfg(1), chat_target)
    assert again.reused and again.out_dir == first.out_dir and not again.complete
    assert prepare(cfg(1), chat_target).splits["train"].regen.written == 2  # the summary's, as it was
    more = prepare(cfg(50), chat_target)
    assert not more.reused and more.complete and more.splits["train"].regen.already_done == 2


def test_a_fixed_out_dir_refuses_output_of_other_settings(chat_target, tmp_path):
    base = dict(corpus=_corpus(tmp_path), work_dir=str(tmp_path / "runs"), progress=False)
    out = str(tmp_path / "fixed")
    first = prepare(PrepareConfig(**base, max_len=64, out_dir=out), tokenizer=chat_target.tokenizer)
    assert prepare(PrepareConfig(**base, max_len=64, out_dir=out), tokenizer=chat_target.tokenizer).reused
    with pytest.raises(ValueError, match="other settings"):
        prepare(PrepareConfig(**base, max_len=32, out_dir=out), tokenizer=chat_target.tokenizer)
    assert first.out_dir == tmp_path / "fixed"
