"""Source readers: ``(src, split, stats) -> conversations`` for each source kind."""

from __future__ import annotations

import difflib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from eyas.data.corpora.config import (
    DEFAULT_REASONING_GYM_TASKS,
    REASONING_GYM_SEED_STRIDE,
    SPLITS,
    CorpusError,
    RecordError,
    SourceConfig,
)
from eyas.data.corpora.readers import (
    JsonArrayStream,
    SourceStats,
    expand_paths,
    iter_jsonl,
    iter_records_file,
)
from eyas.data.corpora.records import conversation_from_record, normalize_message
from eyas.data.types import Conversation

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# source readers: (src, split, stats) -> conversations. Kinds in NATIVE_SPLIT_KINDS generate each split
# themselves; the others return every record and the mixture splits them by hash.
# ---------------------------------------------------------------------------------------------------------------
def _read_file_source(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    for path in expand_paths(src.path or ""):
        for loc, rec in iter_records_file(path, stats=stats):
            stats.read += 1
            try:
                yield conversation_from_record(rec, source=src.name, fallback_id=f"{src.name}/{loc}", src=src)
            except RecordError as e:
                raise CorpusError(f"{loc}: {e}") from None


def _read_sharegpt(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    from eyas.data.packaged import SHAREGPT

    path = SHAREGPT.path(src.requirement, src.path)
    stream = JsonArrayStream(path, is_record=lambda o: isinstance(o, dict) and "conversations" in o)
    for i, rec in enumerate(stream, 1):
        stats.read += 1
        try:
            conv = conversation_from_record(rec, source=src.name, fallback_id=f"sharegpt/{i}")
        except RecordError as e:
            stats.skip(f"unusable record ({str(e).split(';')[0]})")
            continue
        # ShareGPT splits long chats into parts, some of which start with the assistant: drop those turns.
        while conv.messages and conv.messages[0]["role"] == "assistant":
            conv.messages.pop(0)
        if not conv.messages:
            stats.skip("no user turn")
            continue
        yield conv
    stats.json_array.append(stream.stats)
    log.info("ShareGPT: %s", stream.stats.describe())


def _read_evals(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    """Registry data sets by name; ``subsets: ["*"]`` reads all of them (~1M records), skipping (and counting)
    files that are not valid JSONL, whereas a data set named explicitly must parse."""
    from eyas.data.packaged import EVALS, packaged_member_file, packaged_members

    local = src.path or os.environ.get(EVALS.env_var)
    requirement = src.requirement or EVALS.requirement
    if local:
        root = Path(local)
        known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

        def files_of(name: str) -> list[Path]:
            return sorted((root / name).glob("*.jsonl"))
    else:
        members = sorted(packaged_members(requirement, EVALS.member))
        known = sorted({m[len(EVALS.member) :].split("/")[0] for m in members if m.endswith(".jsonl")})

        def files_of(name: str) -> list[Path]:
            prefix = f"{EVALS.member}{name}/"
            return [
                packaged_member_file(requirement, m)
                for m in members
                if m.startswith(prefix) and m.endswith(".jsonl")
            ]

    everything = src.subsets == ["*"]
    for name in known if everything else src.subsets:
        files = files_of(name)
        if not files:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
            raise CorpusError(
                f"evals: no data set {name!r} (no .jsonl under registry/data/{name}); "
                f"did you mean {', '.join(close) or '-'}? {len(known)} known: {', '.join(known)}"
            )
        for path in files:
            try:
                for lineno, rec in iter_jsonl(path):
                    stats.read += 1
                    conv = _evals_record(rec, name, path, lineno, src.name)
                    if conv is None:
                        stats.skip("evals record without a chat/text input")
                        continue
                    yield conv
            except CorpusError as e:
                if not everything:
                    raise
                log.warning("evals: skipping the rest of %s: %s", path, e)
                stats.skip("malformed evals file (rest skipped)")


def _evals_record(rec: Any, subset: str, path: Path, lineno: int, source: str) -> Conversation | None:
    if not isinstance(rec, dict):
        return None
    inp = rec.get("input")
    if isinstance(inp, str):
        messages = [{"role": "user", "content": inp}]
    elif isinstance(inp, list) and inp and all(isinstance(m, dict) and "role" in m for m in inp):
        try:
            messages = [normalize_message({"role": m["role"], "content": m.get("content")}) for m in inp]
        except RecordError:
            return None
    else:
        return None
    ideal = rec.get("ideal")
    if isinstance(ideal, list):
        ideal = next((x for x in ideal if isinstance(x, str)), None)
    meta: dict[str, Any] = {"subset": subset}
    if isinstance(ideal, str) and ideal.strip():
        messages.append({"role": "assistant", "content": ideal})
        meta["ideal"] = ideal
    return Conversation(
        id=f"evals/{subset}/{path.stem}/{lineno}", messages=messages, source=source, meta=meta
    )


def reasoning_gym_seed(seed: int, split: str) -> int:
    """The reasoning-gym dataset seed of (seed, split); item i uses ``Random(dataset_seed + i)``.

    Every (seed, split) owns the interval [k * stride, (k + 1) * stride) with k = 2 * seed + (split == eval), so
    train and eval item seeds never meet, for any seeds and any size below the stride.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    return (2 * seed + SPLITS.index(split)) * REASONING_GYM_SEED_STRIDE


def _read_reasoning_gym(
    src: SourceConfig, split: str, stats: SourceStats, *, eval_fraction: float = 0.01, want: int | None = None
) -> Iterator[Conversation]:
    from reasoning_gym.factory import DATASETS

    tasks = src.subsets or list(DEFAULT_REASONING_GYM_TASKS)
    unknown = [t for t in tasks if t not in DATASETS]
    if unknown:
        raise CorpusError(f"reasoning_gym: unknown tasks {unknown}; known: {', '.join(sorted(DATASETS))}")
    size = src.size if split == "train" else (src.eval_size or max(1, round(src.size * eval_fraction)))
    if want is not None:  # a budget needs only its share of every task (items are a prefix: same seeds)
        size = min(size, -(-want // len(tasks)))
    base = reasoning_gym_seed(src.seed, split)
    yield from reasoning_gym_tasks(tasks, base, size, source=src.name, split=split, stats=stats)


REASONING_GYM_HASH_SEED = "0"
"""``PYTHONHASHSEED`` reasoning-gym items are generated under. Some generators iterate over sets of strings or
sympy objects (``polynomial_multiplication``'s monomials, ``isomorphic_strings``, ``ransom_note``), so their items
follow Python's per-process hash randomisation: the "same" prompt set would differ from one process to the next,
and two runs' results would not pair. Generation runs in a child process with this hash seed unless this process
already has it."""


def reasoning_gym_tasks(
    tasks: Iterable[str], base: int, size: int, *, source: str, split: str, stats: SourceStats | None = None
) -> Iterator[Conversation]:
    """Items ``base .. base + size - 1`` of every task in order (item ``i`` from ``Random(base + i)``), as
    (question, answer) conversations whose id names the item seed; generated in one go under the fixed hash seed
    (:data:`REASONING_GYM_HASH_SEED`): the same items in every process."""
    tasks = list(tasks)
    for task, pairs in zip(tasks, _generate_reasoning_gym(tasks, base, size)):
        for i, (question, answer) in enumerate(pairs):
            if stats is not None:
                stats.read += 1
            yield Conversation(
                id=f"reasoning_gym/{task}/{base + i}",
                messages=[{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                source=source,
                meta={"task": task, "answer": answer, "item_seed": base + i, "split": split},
            )


def _generate_reasoning_gym(tasks: list[str], base: int, size: int) -> list[list[tuple[str, str]]]:
    """(question, answer) of items ``base .. base + size - 1`` of every task: here when this process runs under
    :data:`REASONING_GYM_HASH_SEED`, else in one child process that does."""
    if runs_under_fixed_hash_seed():
        return generate_reasoning_gym_here(tasks, base, size)
    import json
    import subprocess

    env = {**os.environ, "PYTHONHASHSEED": REASONING_GYM_HASH_SEED}
    request = json.dumps({"tasks": tasks, "base": base, "size": size})
    proc = subprocess.run(
        [sys.executable, "-m", "eyas.data.corpora.reasoning_gym_worker"],
        input=request, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise CorpusError(f"reasoning-gym generation of {tasks} (items {base}+{size}) failed:\n{tail}")
    return [[(q, a) for q, a in pairs] for pairs in json.loads(proc.stdout)]


def runs_under_fixed_hash_seed() -> bool:
    """Whether this process hashes as under ``PYTHONHASHSEED=0`` (read from how it started, not from
    ``os.environ``, which a running program can change)."""
    return sys.flags.hash_randomization == 0


def generate_reasoning_gym_here(tasks: list[str], base: int, size: int) -> list[list[tuple[str, str]]]:
    """(question, answer) of items ``base .. base + size - 1`` of every task, in this process (its hash seed
    decides the items of the set-iterating generators: see :data:`REASONING_GYM_HASH_SEED`)."""
    import reasoning_gym

    out = []
    for task in tasks:
        ds = reasoning_gym.create_dataset(task, seed=base, size=size)
        out.append([(ds[i]["question"], str(ds[i]["answer"])) for i in range(size)])
    return out


def _read_mt_bench(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    from eyas.data.packaged import MT_BENCH

    path = MT_BENCH.path(src.requirement, src.path)
    for lineno, rec in iter_jsonl(path):
        stats.read += 1
        turns = rec.get("turns") if isinstance(rec, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise CorpusError(f"{path}:{lineno}: an MT-bench question needs `turns`, a list of strings")
        yield Conversation(
            id=f"mt_bench/{rec.get('question_id', lineno)}",
            messages=[{"role": "user", "content": t} for t in turns],
            source=src.name,
            meta={"category": rec.get("category", ""), "question_id": rec.get("question_id")},
        )


def _read_humaneval(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    from eyas.data.packaged import HUMANEVAL

    path = HUMANEVAL.path(src.requirement, src.path)
    for lineno, rec in iter_jsonl(path):
        stats.read += 1
        if not isinstance(rec, dict) or "prompt" not in rec:
            raise CorpusError(f"{path}:{lineno}: a HumanEval record needs `prompt`")
        prompt = (
            f"Complete the following Python function. Reply with the complete function in a Python code "
            f"block.\n\n```python\n{rec['prompt']}```"
        )
        yield Conversation(
            id=f"humaneval/{rec.get('task_id', lineno)}",
            messages=[{"role": "user", "content": prompt}],
            source=src.name,
            meta={
                "task_id": rec.get("task_id"),
                "entry_point": rec.get("entry_point"),
                "code_prompt": rec["prompt"],
            },
        )


def _read_hf(src: SourceConfig, split: str, stats: SourceStats) -> Iterator[Conversation]:
    import datasets

    try:
        ds = datasets.load_dataset(
            src.dataset, src.config_name, split=src.split, data_files=src.data_files, streaming=src.streaming
        )
    except (
        Exception
    ) as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError...)
        raise CorpusError(
            f"datasets.load_dataset({src.dataset!r}, {src.config_name!r}, split={src.split!r}) "
            f"failed: {type(e).__name__}: {e}"
        ) from e
    for i, rec in enumerate(ds):
        stats.read += 1
        loc = f"{src.dataset}[{src.split}] row {i}"
        try:
            yield conversation_from_record(rec, source=src.name, fallback_id=f"{src.name}/{i}", src=src)
        except RecordError as e:
            raise CorpusError(f"{loc}: {e}") from None


_READERS: dict[str, Callable[..., Iterator[Conversation]]] = {
    "file": _read_file_source,
    "sharegpt": _read_sharegpt,
    "evals": _read_evals,
    "reasoning_gym": _read_reasoning_gym,
    "mt_bench": _read_mt_bench,
    "humaneval": _read_humaneval,
    "hf": _read_hf,
}
NATIVE_SPLIT_KINDS = ("reasoning_gym",)


def read_source(
    src: SourceConfig,
    split: str = "train",
    stats: SourceStats | None = None,
    *,
    eval_fraction: float = 0.01,
    want: int | None = None,
) -> Iterator[Conversation]:
    """Every conversation of one source (``split`` matters only for kinds that generate their own splits;
    ``want``: how many the caller will keep at most, which lets generators stop early)."""
    stats = stats if stats is not None else SourceStats(src.name)
    if src.kind == "reasoning_gym":
        it: Iterable[Conversation] = _read_reasoning_gym(
            src, split, stats, eval_fraction=eval_fraction, want=want
        )
    else:
        it = _READERS[src.kind](src, split, stats)
    for n, conv in enumerate(it):
        if src.limit is not None and n >= src.limit:
            break
        yield conv
