"""Bad inputs a new user meets, each refused in one line that names the file and the fix: empty corpus files and
samples files, a corpus that yields no training sample, samples tokenized by another tokenizer, output
directories that are files, lie under a file or cannot be created."""

from __future__ import annotations

import json

import pytest

from eyas.common import InputError
from eyas.data.corpora.config import CorpusConfig, SourceConfig
from eyas.data.extract import ExtractConfig, ExtractJob, ExtractStage, extract, read_samples_jsonl, run
from eyas.data.prepare import PrepareConfig, prepare, read_samples
from eyas.data.store import MANIFEST, StoreMismatchError
from eyas.data.types import Sample
from eyas.serving.models.target import tokenizer_hash
from tests.conftest import make_tiny_target, run_app
from tests.tokenizers import make_chat_tokenizer


def _corpus(path) -> CorpusConfig:
    return CorpusConfig(
        name="local", sources=[SourceConfig(name="local", kind="file", path=str(path))], seed=0
    )


def _prepare_cfg(tmp_path, path) -> PrepareConfig:
    return PrepareConfig(corpus=_corpus(path), out_dir=str(tmp_path / "prep"), max_len=64, progress=False)


def _chats(n: int, assistant: bool = True) -> str:
    lines = []
    for i in range(n):
        conv = [{"role": "user", "content": f"question {i}"}]
        if assistant:
            conv.append({"role": "assistant", "content": f"answer number {i}"})
        lines.append(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")
    return "".join(lines)


@pytest.fixture(scope="module")
def tok():
    return make_chat_tokenizer("chatml")


def test_prepare_refuses_an_empty_corpus_file(tmp_path, tok):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(InputError, match="holds no records") as e:
        prepare(_prepare_cfg(tmp_path, path), tokenizer=tok)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "prep" / "summary.json").exists()  # nothing marked done


def test_prepare_refuses_a_corpus_without_training_samples(tmp_path, tok):
    path = tmp_path / "no_answers.jsonl"
    path.write_text(_chats(6, assistant=False))  # records, but nothing to learn from
    with pytest.raises(InputError, match="yields no training samples") as e:
        prepare(_prepare_cfg(tmp_path, path), tokenizer=tok)
    assert str(path) in str(e.value) and "no_assistant" in str(e.value)
    assert not (tmp_path / "prep" / "summary.json").exists()


def test_empty_samples_file_is_refused_and_no_store_is_written(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "samples.jsonl"
    empty.write_text("\n")
    out = tmp_path / "store"
    job = ExtractJob(extract=ExtractStage(samples=str(empty), out_dir=str(out), progress=False))
    with pytest.raises(InputError, match="holds no samples") as e:
        run(job, target=make_tiny_target())
    assert str(empty) in str(e.value)
    with pytest.raises(InputError, match="the input is empty"):
        extract([], make_tiny_target(), out, ExtractConfig(progress=False))
    assert not (out / MANIFEST).exists()
    # the command: one line, exit status 2, before any model is loaded
    from eyas.data.extract import main

    argv = [f"extract.samples={empty}", f"extract.out_dir={out}"]
    assert run_app(main, argv, monkeypatch, tmp_path) == 2
    assert f"error: extract.samples={empty}: holds no samples" in capsys.readouterr().err


def test_samples_carry_the_tokenizer_fingerprint_and_extraction_refuses_another(tmp_path, tok):
    from eyas.serving.models.target import target_from_model
    from eyas.serving.models.tiny import tiny_model

    path = tmp_path / "chats.jsonl"
    path.write_text(_chats(8))
    res = prepare(_prepare_cfg(tmp_path, path), tokenizer=tok)
    samples_path = res.splits["train"].samples_path
    fp = tokenizer_hash(tok)
    assert {s.tokenizer for s in read_samples(samples_path)} == {fp}
    assert {s.tokenizer for s in read_samples_jsonl(samples_path)} == {fp}
    # the same tokenizer: extracted
    own = target_from_model(tiny_model("llama", vocab_size=len(tok)), tok, name="tiny-chatml")
    extract(read_samples_jsonl(samples_path), own, tmp_path / "ok", ExtractConfig(progress=False))
    # another tokenizer whose vocabulary covers the ids: refused, both fingerprints named, nothing written
    other = make_tiny_target(vocab_size=len(tok) + 64)
    assert other.info.tokenizer_hash != fp
    with pytest.raises(StoreMismatchError) as e:
        extract(read_samples_jsonl(samples_path), other, tmp_path / "bad", ExtractConfig(progress=False))
    msg = str(e.value)
    assert fp in msg and other.info.tokenizer_hash in msg and "eyas prepare" in msg
    assert not (tmp_path / "bad" / MANIFEST).exists()
    # samples that say nothing about their tokenizer (made by hand) are taken as they are
    plain = [Sample(id="x", input_ids=[3, 4, 5], loss_mask=[False, True, True])]
    extract(plain, other, tmp_path / "plain", ExtractConfig(progress=False))


def _bad_dirs(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return {
        "file": (f, "is a file, not a directory"),
        "under_file": (f / "sub" / "dir", f"cannot be created, {f} is a file"),
        "uncreatable": ("/proc/eyas-out", "/proc accepts no new directories"),
    }


@pytest.mark.parametrize("case", ["file", "under_file", "uncreatable"])
def test_bad_out_dirs_are_named_in_one_line(tmp_path, tok, monkeypatch, capsys, case):
    bad, why = _bad_dirs(tmp_path)[case]
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text(_chats(4))
    cfg = PrepareConfig(corpus=_corpus(corpus), out_dir=str(bad), max_len=64, progress=False)
    with pytest.raises(InputError) as e:
        prepare(cfg, tokenizer=tok)
    msg = str(e.value)
    assert msg.startswith(f"prepare.out_dir={bad}: ") and why in msg and "\n" not in msg
    assert "point it at a" in msg
    samples = [Sample(id="x", input_ids=[3, 4, 5], loss_mask=[False, True, True])]
    with pytest.raises(InputError, match=rf"^extract.out_dir={bad}: .*{why}"):
        extract(samples, make_tiny_target(), bad, ExtractConfig(progress=False))
    # export: refused with the other problems, before anything is written
    from eyas.serving.export import export
    from eyas.serving.export_format import ExportError
    from tests.train.test_trainer import tiny_setup

    target, drafter, _ = tiny_setup(num_samples=2)
    exp = bad if case != "file" else bad / "drafter"  # a file itself is the overwrite rule's to refuse
    with pytest.raises(ExportError, match=rf"export.out_dir={exp}: cannot be created"):
        export(drafter, target, exp)
    # the training command: one line on stderr, exit status 2, before the target is loaded
    from eyas.train.__main__ import main

    assert (
        run_app(main, [f"train.output_dir={bad}", "train.data.source=synthetic"], monkeypatch, tmp_path) == 2
    )
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: train.output_dir={bad}: ")


def test_online_training_refuses_another_tokenizers_samples(tmp_path):
    from eyas.train.setup import run_data
    from tests.train.test_trainer import tiny_cfg

    target = make_tiny_target()
    path = tmp_path / "samples.jsonl"
    rec = {"id": "a", "input_ids": [3, 4, 5], "loss_mask": [0, 1, 1], "tokenizer": "0123456789abcdef"}
    path.write_text(json.dumps(rec) + "\n")
    cfg = tiny_cfg(tmp_path / "run", data={"source": "online", "samples": str(path), "eval_fraction": 0.0})
    with pytest.raises(StoreMismatchError, match="0123456789abcdef"):
        run_data(target, cfg, rank=0, world=1)
    path.write_text("")
    with pytest.raises(InputError, match="holds no samples"):
        run_data(target, cfg, rank=0, world=1)


def test_a_non_utf8_samples_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    good = json.dumps({"id": "a", "input_ids": [3, 4], "loss_mask": [0, 1]}).encode()
    path.write_bytes(good + b"\n" + b'{"id": "b\xff", "input_ids": [3], "loss_mask": [1]}\n')
    with pytest.raises(Exception, match=rf"{path}:2") as e:
        list(read_samples_jsonl(path))
    assert not isinstance(e.value, UnicodeDecodeError)
