"""BENCH.md, docs/*.md and scripts/ stay reproducible: every ``eyas ...``/``python -m eyas...`` line they show or
run still parses (built as its command would, with :func:`eyas.command.dry_run`; a recipe's variants built into
their drafter and train configs too), every script BENCH.md cites is in the repository, and no number points at a
path on one machine. The scripts' helpers (pooled τ, the corpus's answers) are checked on small inputs."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from eyas.command import dry_run
from tests.cli.test_readme_command_lines import command, command_lines, commands_in

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "BENCH.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|home|root|mnt)/")


# -- shell scripts, read as bash would expand their command lines ------------------------------------------------
_ASSIGN = re.compile(r"^\s*(\w+)=(.*?)\s*$")
_FOR = re.compile(r"^\s*for (\w+) in (.+?); do\s*$")
_BRACED = re.compile(r"\$\{(\w+)([^}]*)\}")
_PLAIN = re.compile(r"\$(\w+|@)")


def _expand(text: str, env: dict[str, str | None], path: str) -> str:
    """``text`` with ``${VAR:-default}`` (the default unless ``env`` knows VAR), ``${VAR:+word}`` (empty: the
    script's optional settings are unset), ``$VAR`` and ``"$@"`` (empty) expanded; a value the script computes at
    run time (``$(...)``, an argument) becomes ``path``."""

    def braced(m: re.Match) -> str:
        name, op = m.group(1), m.group(2)
        if op.startswith(":+"):
            return ""
        if op.startswith(":-") and env.get(name) is None:
            return _expand(op[2:], env, path)
        value = env.get(name)
        return path if value is None else value

    text = _BRACED.sub(braced, text)
    text = re.sub(r'"\$@"', "", text)
    return _PLAIN.sub(lambda m: "" if m.group(1) == "@" else (env.get(m.group(1)) or path), text)


def shell_lines(text: str, path: str) -> list[str]:
    """The lines of a bash script (continuations joined) with its variables expanded: a literal assignment's value,
    a ``${VAR:-default}`` default, a ``for`` loop's first value; anything computed at run time is ``path``."""
    env: dict[str, str | None] = {}
    out = []
    for line in text.replace("\\\n", "").splitlines():  # bash drops a backslash-newline, in quotes too
        if line.lstrip().startswith("#"):
            continue
        if m := _ASSIGN.match(line):
            value = m.group(2).strip('"')
            braced = _BRACED.fullmatch(value)
            if braced and braced.group(2).startswith(":-") and "$" not in braced.group(2):
                value = braced.group(2)[2:]
            env[m.group(1)] = None if ("$" in value or "`" in value) else value
        elif m := _FOR.match(line):
            words = _expand(m.group(2), env, path).split()
            env[m.group(1)] = words[0] if words and "$(" not in m.group(2) else None
        out.append(_expand(line, env, path))
    return out


def script_command_lines(text: str, path: str) -> list[tuple[str, list[str]]]:
    return commands_in(shell_lines(text, path), path)


# -- building a line as its command would ------------------------------------------------------------------------
def build(name: str, overrides: list[str]):
    """The job of one command line; a recipe's variants are built into their drafter and train configs as the
    study builds them before it trains (a key renamed inside a variant fails here, not hours into a run)."""
    job = dry_run(command(name), overrides)
    if hasattr(job, "recipe"):
        from eyas.lab.recipe import variant_configs

        for v in job.recipe.variants:
            for seed in job.recipe.seeds:
                variant_configs(v, job.drafter, job.train, seed)
    return job


def failures(lines: list[tuple[str, list[str]]]) -> list[str]:
    failed = []
    for name, overrides in dict.fromkeys((n, tuple(o)) for n, o in lines):  # each distinct line once
        try:
            build(name, list(overrides))
        except Exception as e:  # noqa: BLE001 - every line is reported, not the first only
            failed.append(f"{name} {shlex.join(overrides)}: {type(e).__name__}: {e}")
    return failed


def test_every_bench_and_docs_command_line_parses(tmp_path):
    lines = {page.name: command_lines(page.read_text(), str(tmp_path)) for page in PAGES}
    # the extractor finds BENCH.md's indented blocks and wrapped spans (were it to find nothing, nothing is checked)
    assert {"eyas.lab.recipe", "eyas.eval", "eyas.lab.bench_train", "eyas.eval.context_sweep"} <= {
        name for name, _ in lines["BENCH.md"]
    }
    assert len(lines["BENCH.md"]) >= 40
    failed = failures([line for found in lines.values() for line in found])
    assert not failed, "BENCH.md/docs command lines that no longer parse:\n" + "\n".join(failed)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_command_line_parses(script, tmp_path):
    lines = script_command_lines(script.read_text(), str(tmp_path))
    assert lines, f"{script.name} runs no eyas command the test can find"
    failed = failures(lines)
    assert not failed, f"{script.name}: command lines that no longer parse:\n" + "\n".join(failed)


@pytest.mark.parametrize(
    "text",
    [
        # an indented code block, as BENCH.md writes its commands
        "Evaluated:\n\n    python -m eyas.eval eval=bench eval.checkpoint=runs/export/abc eval.profile=null \\\n"
        "      threads=2\n\nthen more prose",
        # an inline span wrapped onto the next line
        "(`python -m eyas.eval eval.checkpoint=runs/export/abc\neval.engine=vllm eval.profile=null`)",
        # a key renamed inside a recipe variant
        '    python -m eyas.lab.recipe train=bench "recipe.variants=[{name:v,train:{lr:1.0e-3,ttt_step:4}}]"',
    ],
)
def test_a_bench_line_that_no_longer_parses_fails(text, tmp_path):
    ((name, overrides),) = command_lines(text, str(tmp_path))
    with pytest.raises(ValueError):
        build(name, overrides)


def test_a_script_line_that_no_longer_parses_fails(tmp_path):
    script = """set -euo pipefail
export_dir=$(sed -n 's/^export: //p' log)
"$PY" -m eyas.eval eval.export_dir="$export_dir" eval.profile=null
"$PY" -m eyas.eval eval.checkpoint="$export_dir" eval.profile=null
"""
    lines = script_command_lines(script, str(tmp_path))
    assert [name for name, _ in lines] == ["eyas.eval", "eyas.eval"]
    assert failures(lines[:1]) == []
    (failed,) = failures(lines[1:])
    assert "eval.export_dir" in failed


def test_script_variables_are_expanded_as_bash_would(tmp_path):
    p = str(tmp_path)
    script = """SEEDS=${SEEDS:-3 4}
logs=runs/scripts/x
for seed in $SEEDS; do
  "$PY" -m eyas.lab.recipe train=bench ${STORE:+recipe.store_dir=$STORE} \\
    "recipe.seeds=[$seed]" "$@" | tee "$logs/seed$seed.log"
done
for round in $(seq "$ROUNDS"); do
  "$PY" -m eyas.lab.bench_train bench_train.out=$logs/$round.json
done
"""
    assert script_command_lines(script, p) == [
        ("eyas.lab.recipe", ["train=bench", "recipe.seeds=[3]"]),
        ("eyas.lab.bench_train", [f"bench_train.out=runs/scripts/x/{p}.json"]),
    ]


# -- every number has its command in the repository ---------------------------------------------------------------
def test_no_machine_paths_in_bench_docs_or_scripts():
    found = [
        f"{f.relative_to(REPO)}:{i}: {line.strip()}"
        for f in [*PAGES, *sorted((REPO / "scripts").iterdir())]
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, (
        "paths on one machine (commit the script, or write a path relative to the repository):\n"
        + ("\n".join(found))
    )


def test_every_script_bench_cites_is_committed_and_every_script_is_cited():
    text = "\n".join(p.read_text() for p in PAGES)
    cited = set(re.findall(r"scripts/([\w.-]+\.(?:sh|py))", text))
    present = {p.name for p in (REPO / "scripts").iterdir() if p.suffix in (".sh", ".py")}
    assert cited - present == set(), "BENCH.md/docs cite scripts that are not in scripts/"
    assert present - cited == set(), "scripts/ holds scripts BENCH.md does not say what they back"


# -- the scripts' helpers ----------------------------------------------------------------------------------------
def _script_module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _report(d: Path, rows: list[dict]) -> Path:
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"acceptance": {"results": rows}}))
    (d / "report.md").write_text("# report\n")
    return d / "report.md"


def test_pooled_tau_weighs_each_set_by_its_steps(tmp_path):
    pooled = _script_module("pooled_tau")
    chain = {"method": "eagle3-chain", "prompt_set": "reasoning"}
    a = _report(tmp_path / "a", [{**chain, "prompts": 2, "tokens": 42, "steps": 20, "tau": 2.0}])
    b = _report(
        tmp_path / "b",
        [
            {**chain, "prompts": 6, "tokens": 186, "steps": 60, "tau": 3.0},
            {
                "method": "none",
                "prompt_set": "reasoning",
                "prompts": 6,
                "tokens": 186,
                "steps": 180,
                "tau": 1.0,
            },
        ],
    )
    p = pooled.pooled_tau([a, b.parent])
    # (42 - 2 + 186 - 6) / (20 + 60) = 2.75, not the mean of the two sets' τ (2.5)
    assert (p.tau, p.prompts, p.steps, p.emitted) == (2.75, 8, 80, 220)
    with pytest.raises(SystemExit, match="no eagle3-tree results"):
        pooled.pooled_tau([a], method="eagle3-tree")
    with pytest.raises(SystemExit, match="no results.json"):
        pooled.pooled_tau([tmp_path])


def test_corpus_answers_keeps_the_regenerated_ids_with_the_corpus_answers(tmp_path):
    answers = _script_module("corpus_answers")
    conv = [
        {
            "id": f"c{i}",
            "conversations": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ],
        }
        for i in range(6)
    ]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conv))
    (tmp_path / "corpus.yaml").write_text(
        f"name: t\nkind: file\npath: {tmp_path / 'corpus.jsonl'}\neval_fraction: 0.0\nseed: 0\n"
    )
    regen = [
        {**c, "conversations": [c["conversations"][0], {"role": "assistant", "content": "target"}]}
        for c in conv
    ]
    (tmp_path / "regen.jsonl").write_text("".join(json.dumps(c) + "\n" for c in regen[1:4]))
    out = tmp_path / "out" / "train.jsonl"
    w = answers.write_corpus_answers(tmp_path / "regen.jsonl", str(tmp_path / "corpus.yaml"), out)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert w.conversations == 3
    assert sorted(r["id"] for r in got) == ["c1", "c2", "c3"]
    assert {r["id"]: r["conversations"][1]["content"] for r in got} == {"c1": "a1", "c2": "a2", "c3": "a3"}
    (tmp_path / "other.jsonl").write_text(json.dumps({**regen[0], "id": "elsewhere"}) + "\n")
    with pytest.raises(SystemExit, match="not in corpus=.*elsewhere"):
        answers.write_corpus_answers(tmp_path / "other.jsonl", str(tmp_path / "corpus.yaml"), out)
