"""The preparation stage reuses a finished output only when its inputs are the same: the same settings and the same
content of the corpus files (sha256, or size and mtime above ``HASH_LIMIT``), not merely the same file names."""

from __future__ import annotations

import json
import os

import pytest

import eyas.data.prepare as prepare_module
from eyas.common import InputError
from eyas.data.corpora.config import CorpusConfig, SourceConfig
from eyas.data.prepare import PrepareConfig, format_summary, prepare

from ..tokenizers import make_chat_tokenizer


def _chats(n: int, word: str = "answer") -> str:
    return "".join(
        json.dumps(
            {
                "id": f"c{i}",
                "conversations": [
                    {"role": "user", "content": f"question {i}"},
                    {"role": "assistant", "content": f"{word} number {i}"},
                ],
            }
        )
        + "\n"
        for i in range(n)
    )


def _cfg(tmp_path, corpus, **kw) -> PrepareConfig:
    src = SourceConfig(name="local", kind="file", path=str(corpus))
    return PrepareConfig(
        corpus=CorpusConfig(name="local", sources=[src], eval_fraction=0.0),
        work_dir=str(tmp_path / "runs"),
        max_len=64,
        progress=False,
        **kw,
    )


@pytest.fixture(scope="module")
def tok():
    return make_chat_tokenizer("chatml")


def test_a_grown_corpus_file_is_prepared_again_not_reused(tmp_path, tok):
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text(_chats(6))
    first = prepare(_cfg(tmp_path, corpus), tokenizer=tok)
    assert not first.reused and first.corpus_stats[0]["read"] == 6
    assert prepare(_cfg(tmp_path, corpus), tokenizer=tok).reused  # same command, same file
    corpus.write_text(_chats(30))
    grown = prepare(_cfg(tmp_path, corpus), tokenizer=tok)
    text = format_summary(grown)
    assert not grown.reused and "(reused)" not in text and "read 30" in text
    assert grown.splits["train"].samples == 30 and grown.out_dir != first.out_dir


def test_same_size_same_mtime_other_content_is_not_reused(tmp_path, tok):
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text(_chats(6, "answer"))
    first = prepare(_cfg(tmp_path, corpus), tokenizer=tok)
    st = corpus.stat()
    corpus.write_text(_chats(6, "ANSWER"))  # same bytes count
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert corpus.stat().st_size == st.st_size
    again = prepare(_cfg(tmp_path, corpus), tokenizer=tok)
    assert not again.reused and again.out_dir != first.out_dir


def test_above_the_hash_limit_size_and_mtime_key_the_file(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(prepare_module, "HASH_LIMIT", 10)
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text(_chats(6))
    first = prepare(_cfg(tmp_path, corpus), tokenizer=tok)
    assert prepare(_cfg(tmp_path, corpus), tokenizer=tok).reused
    st = corpus.stat()
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: possibly changed
    assert prepare(_cfg(tmp_path, corpus), tokenizer=tok).out_dir != first.out_dir


def test_a_fixed_out_dir_names_the_changed_file(tmp_path, tok):
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text(_chats(6))
    out = tmp_path / "prep"
    prepare(_cfg(tmp_path, corpus, out_dir=str(out)), tokenizer=tok)
    corpus.write_text(_chats(30))
    with pytest.raises(InputError) as e:
        prepare(_cfg(tmp_path, corpus, out_dir=str(out)), tokenizer=tok)
    msg = str(e.value)
    assert f"prepare.out_dir={out}" in msg and f"the corpus files changed since: {corpus}" in msg
    assert "\n" not in msg
