"""Shared fixtures: the embedded default target (loaded once per session) and tiny random targets."""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread: tiny-model tests are dominated by per-op overhead, which threads only add to.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test starts on one thread, whatever an earlier test (or the code it ran) set."""
    torch.set_num_threads(1)


class _TinyTokenizer:
    """Just enough tokenizer for Target on tiny models (ids only; no chat template)."""

    chat_template = None
    all_special_tokens: list[str] = []
    eos_token_id = 2
    pad_token_id = 0

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab_size)}


def make_tiny_target(arch: str = "llama", seed: int = 0, **kw):
    from eyas.serving.models.target import target_from_model
    from eyas.serving.models.tiny import tiny_model

    model = tiny_model(arch, seed=seed, **kw)
    return target_from_model(model, _TinyTokenizer(model.config.vocab_size), name=f"tiny-{arch}")


@pytest.fixture(scope="session")
def embedded_target_fp32():
    """SmolLM2-135M-Instruct in fp32 (exactness tests)."""
    from eyas.serving.models.target import TargetConfig, load_target

    return load_target(TargetConfig(dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny llama + chat tokenizer saved as a model directory (what ``target.path`` takes in a launched job)."""
    from eyas.serving.models.tiny import tiny_model
    from tests.tokenizers import make_chat_tokenizer

    d = tmp_path_factory.mktemp("tiny_target")
    tok = make_chat_tokenizer("chatml")
    tiny_model("llama", seed=0, vocab_size=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def tiny_target():
    """Factory: tiny_target(arch="llama", seed=0, **sizes) -> Target over a random-init model."""
    return make_tiny_target


def run_app(main, argv, monkeypatch, tmp_path) -> int:
    """Run a Hydra app in this process as ``python -m ... argv`` would; its exit status."""
    monkeypatch.chdir(tmp_path)  # Hydra writes its run directory under the working directory
    monkeypatch.setattr(sys, "argv", ["app", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code
