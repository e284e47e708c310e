"""Training samples for a length mixture (issue 39, item 2): a prepare stage's samples plus long conversations.

    python scripts/long_samples.py --samples runs/prepare/<hash>/train/samples.jsonl --out <dir>/samples.jsonl \
        --long 32000 --n 3 [--corpus demo] [--conversations 2000]

Writes every sample of ``--samples`` unchanged, then ``--n`` long conversations of whole (user, assistant) turn pairs
of the corpus's *training* split (``data.long_prefixes.turn_pairs``: the same split the corpus's held-out pairs are
kept out of, which is where ``eyas context`` takes its prefixes), each as long as fits in ``--long`` tokens under the
target's chat template, with assistant-only loss masks (``data.chat.format_conversation``). The turn pairs start
past the first ``--offset`` pairs. The answers in them are the corpus's (ShareGPT's), not the target's: regenerating
32k-token conversations with the target is out of reach on 2 CPU cores; the teacher is still the target, whose
distribution the drafter learns at every position of these texts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", required=True, help="a prepare stage's samples.jsonl (copied first)")
    ap.add_argument("--out", required=True, help="the samples.jsonl to write")
    ap.add_argument("--long", type=int, default=32000, help="tokens per long conversation (at most)")
    ap.add_argument("--n", type=int, default=3, help="long conversations")
    ap.add_argument(
        "--corpus", default="demo", help="conf/corpus name whose training split gives the turn pairs"
    )
    ap.add_argument(
        "--conversations", type=int, default=2000, help="conversations of the corpus read for pairs"
    )
    ap.add_argument(
        "--offset", type=int, default=0, help="turn pairs skipped before the first long conversation"
    )
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from eyas.data.chat import format_conversation
    from eyas.data.long_prefixes import long_conversations, turn_pairs
    from eyas.data.prepare import read_samples, sample_record
    from eyas.serving.models.embedded import ensure_embedded
    from eyas.serving.models.target import tokenizer_hash

    tok = AutoTokenizer.from_pretrained(ensure_embedded())
    fp = tokenizer_hash(tok)
    base = read_samples(args.samples)
    if any(s.tokenizer and s.tokenizer != fp for s in base):
        raise SystemExit(f"{args.samples}: samples of another tokenizer than the embedded target's")
    pairs = turn_pairs(args.corpus, args.conversations, "train")
    longs = []
    for conv in long_conversations(pairs, tok, args.long, args.n, offset=args.offset):
        s = format_conversation(conv, tok, args.long)
        if s is not None:
            longs.append(s)
    if len(longs) < args.n:
        raise SystemExit(f"only {len(longs)} of {args.n} long conversations could be formatted")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tmp.open("w") as f:
        for s in [*base, *longs]:
            f.write(json.dumps(sample_record(s, fp)) + "\n")
    tmp.replace(out)
    print(
        f"{out}: {len(base)} samples of {args.samples} ({sum(s.num_tokens for s in base)} tokens) + {len(longs)} long "
        f"conversations of {[s.num_tokens for s in longs]} tokens ({[s.num_loss_tokens for s in longs]} with loss)"
    )


if __name__ == "__main__":
    main()
