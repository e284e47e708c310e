"""Every ``eyas <command> ...`` and ``python -m eyas... ...`` line the README shows still parses: each is checked
and built as its command would (:func:`eyas.command.dry_run`: old spellings, unknown keys, Hydra's composition,
types and values), with its placeholders (``<exported dir>``, ``...``) filled with a test path, and never run."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from eyas.cli import COMMANDS
from eyas.command import Command, dry_run

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


def indented_blocks(text: str) -> list[str]:
    """Markdown's indented code blocks: runs of lines indented four spaces or more after a blank line."""
    blocks: list[str] = []
    cur: list[str] | None = None
    prev_blank = True
    for line in text.split("\n"):
        if cur is not None:
            if line.startswith("    ") or not line.strip():
                cur.append(line)
                continue
            blocks.append("\n".join(cur))
            cur = None
        if prev_blank and line.startswith("    ") and line.strip():
            cur = [line]
        prev_blank = not line.strip()
    if cur is not None:
        blocks.append("\n".join(cur))
    return blocks


def snippets(text: str) -> list[str]:
    """A Markdown page's code: each line of its fenced and indented code blocks (continuations joined) and each
    inline code span (one that wraps onto the next line read as one line, as Markdown renders it)."""
    out = []
    prose = FENCE.sub("", text)
    blocks = indented_blocks(prose)
    for block in FENCE.findall(text) + blocks:
        out += block.replace("\\\n", " ").splitlines()
    for block in blocks:
        prose = prose.replace(block, "")
    for paragraph in re.split(r"\n\s*\n", prose):
        out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", paragraph)]
    return out


def _tokens(snippet: str, path: str) -> list[str]:
    """Shell words of ``snippet`` with placeholders filled (``<...>`` and ``=...`` values: ``path``; a lone ``...``
    dropped) and ``bash -c '...'`` scripts opened."""
    snippet = re.sub(r"<[^<>`]*>", path, snippet)
    snippet = re.sub(r"=\.\.\.(?=\s|$)", f"={path}", snippet)
    try:
        words = shlex.split(snippet, comments=True)
    except ValueError:  # prose in backticks that is no shell line
        return []
    out = []
    for prev, w in zip([""] + words, words):
        out += _tokens(w, path) if prev == "-c" else [w]  # a quoted value with a space stays one word
    return [w for w in out if w != "..."]


def commands_in(lines: list[str], path: str) -> list[tuple[str, list[str]]]:
    """``(command, overrides)`` of every command line in ``lines`` (shell lines or code snippets): ``command`` is an
    ``eyas`` command name or a module run with ``-m``."""
    found = []
    for snippet in lines:
        words = _tokens(snippet, path)
        i = 0
        while i < len(words):
            nxt = words[i + 1] if i + 1 < len(words) else ""
            module = re.fullmatch(r"eyas(\.\w+)+", nxt)  # not `python -m eyas.<stage>` (a placeholder)
            if not ((words[i] == "eyas" and nxt in COMMANDS) or (words[i] == "-m" and module)):
                i += 1
                continue
            name = nxt
            j = i + 2
            while j < len(words) and "=" in words[j] and not words[j].startswith("-"):
                j += 1
            found.append((name, words[i + 2 : j]))
            i = j
    return found


def command_lines(text: str, path: str) -> list[tuple[str, list[str]]]:
    """``(command, overrides)`` of every command line in a Markdown page's code (:func:`snippets`)."""
    return commands_in(snippets(text), path)


def command(name: str) -> Command:
    """The :class:`~eyas.command.Command` of an ``eyas`` command name or a ``python -m`` module."""
    module = importlib.import_module(COMMANDS[name][0] if name in COMMANDS else name)
    if not hasattr(module, "COMMAND"):
        module = importlib.import_module(module.__name__ + ".__main__")
    return module.COMMAND


def test_every_readme_command_line_parses(tmp_path):
    lines = command_lines(README.read_text(), str(tmp_path))
    names = {name for name, _ in lines}
    # the extractor finds what the README shows (were it to find nothing, nothing would be checked)
    assert {"prepare", "extract", "train", "export", "eval", "context", "diagnose", "plan", "recipe"} <= names
    assert {"eyas.pipeline", "eyas.train", "eyas.data.extract", "eyas.lab.recipe"} <= names
    assert ("diagnose", [f"diagnose.export_dir={tmp_path}"]) in lines
    failed = []
    for name, overrides in dict.fromkeys((n, tuple(o)) for n, o in lines):  # each distinct line once
        overrides = list(overrides)
        try:
            dry_run(command(name), overrides)
        except Exception as e:  # noqa: BLE001 - every line is reported, not the first only
            failed.append(f"{name} {shlex.join(overrides)}: {type(e).__name__}: {e}")
    assert not failed, "README command lines that no longer parse:\n" + "\n".join(failed)


@pytest.mark.parametrize(
    "line",
    [
        "`eyas eval eval.checkpoint=<exported dir>`",  # an old spelling
        "`eyas diagnose drafter=<dir>`",  # diagnose's old key, the trainer's config group
        "```bash\neyas train +trian.lr=1e-3   # a typo\n```",
        "`python -m eyas.train train.max_steps=many`",  # a wrong type
        "`eyas plan plan.model=kimi_k2 plan.num_gpus=0`",  # a value the config refuses
    ],
)
def test_a_line_that_no_longer_parses_fails(line, tmp_path):
    ((name, overrides),) = command_lines(line, str(tmp_path))
    with pytest.raises(ValueError):
        dry_run(command(name), overrides)


def test_placeholders_and_shell_around_a_command_are_read_as_a_user_would(tmp_path):
    text = """```bash
srun bash -c 'accelerate launch --config_file conf/accelerate/zero3.yaml \\
    --num_processes $((SLURM_NNODES * 8)) \\
    -m eyas.train target=hf target.path=<hub id or dir> train.output_dir=/shared/run'   # training
```
| `make demo` = `python -m eyas.pipeline` | `eyas extract extract.samples=... extract.out_dir=...` |
`python -m eyas.data.extract ... extract.backend=vllm`"""
    p = str(tmp_path)
    assert command_lines(text, p) == [
        ("eyas.train", ["target=hf", f"target.path={p}", "train.output_dir=/shared/run"]),
        ("eyas.pipeline", []),
        ("extract", [f"extract.samples={p}", f"extract.out_dir={p}"]),
        ("eyas.data.extract", ["extract.backend=vllm"]),
    ]
