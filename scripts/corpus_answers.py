"""The bench's training prompts with the answers their corpus ships, for ``corpus=jsonl``: BENCH.md, "The target's
answers or the corpus's" (scripts/recipe_corpus_answers.sh runs it, then the recipe on its output).

The bench trains on the target's own greedy answers to 3,456 of ``corpus=bench``'s prompts (its prepare stage
regenerates them). This writes the same conversations as the corpus has them instead (reasoning-gym's reference
answers, ShareGPT's and the OpenAI-evals answers): ``load_corpus`` of the corpus config, the training split kept to
the ids the bench regenerated, one docs/DESIGN.md record a line.

Reconstructed from BENCH.md's description (the session's own script was not committed).

Usage: python scripts/corpus_answers.py [--regenerated runs/bench/prepare/train/conversations.jsonl]
       [--corpus bench] [--out runs/bench-corpus/train.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.common import atomic_write_jsonl
from eyas.data.corpora.config import load_corpus_config
from eyas.data.corpora.mixtures import load_corpus
from eyas.data.prepare import read_conversations


@dataclass
class Written:
    """What :func:`write_corpus_answers` wrote."""

    path: Path
    conversations: int


def write_corpus_answers(regenerated: str | Path, corpus: str, out: str | Path) -> Written:
    """The training conversations of ``corpus`` (a name under conf/corpus/ or a .yaml path) whose ids are in the
    ``regenerated`` conversations file, with the corpus's answers, written to ``out`` in the corpus's order."""
    path = Path(regenerated)
    if not path.is_file():
        raise SystemExit(
            f"corpus_answers: no {path}; make the bench's regenerated data first (python -m eyas.data.prepare "
            "corpus=bench prepare=bench prepare.regen.max_batches=108 prepare.regen.time_budget_s=null)"
        )
    ids = {c.id for c in read_conversations(path)}
    kept = [c for c in load_corpus(load_corpus_config(corpus)).train if c.id in ids]
    missing = sorted(ids - {c.id for c in kept})
    if missing:
        raise SystemExit(
            f"corpus_answers: {len(missing)} of the {len(ids)} conversations in {path} are not in corpus={corpus}'s "
            f"training split (first: {missing[0]}); give the corpus that data was prepared from (--corpus)"
        )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(Path(out), (c.to_record() for c in kept))
    return Written(Path(out), len(kept))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regenerated", default="runs/bench/prepare/train/conversations.jsonl")
    ap.add_argument("--corpus", default="bench", help="the corpus config the regenerated data came from")
    ap.add_argument("--out", default="runs/bench-corpus/train.jsonl")
    a = ap.parse_args(argv)
    w = write_corpus_answers(a.regenerated, a.corpus, a.out)
    print(f"corpus_answers: {w.conversations} conversations with the corpus's answers -> {w.path}")


if __name__ == "__main__":
    main(sys.argv[1:])
