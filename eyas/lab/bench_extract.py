"""Benchmark: feature extraction speed against a bare target forward over the same tokens, and store size.

``python -m eyas.lab.bench_extract [bench_extract.samples=64 bench_extract.max_len=512 ...]`` (Hydra,
``conf/bench_extract.yaml``, typed by :class:`BenchExtractConfig`)

Measured on the same length-sorted, padded micro-batches the extraction uses:
- ``bare CausalLM``: ``target.model(input_ids)``, the plain transformers forward including logits at every
  position (what any distillation pipeline pays at least once);
- ``bare base``: the decoder stack alone, no vocabulary projection (the floor for the ``hidden`` option);
- ``extract <option>``: the whole job (forward, aux capture, encoding, top-k, shard serialization, sha256,
  fsync) writing a real store into a temporary directory.
Each path runs ``repeats`` times, interleaved; the best time counts (the first pass also warms kernels up).
The bare paths and the timer are the product's (:mod:`eyas.data.extract_speed`, the pipeline's speed check),
the layouts :data:`eyas.data.store.NAMED_OPTIONS`.
Tokens/s counts real tokens only (no padding).
"""

from __future__ import annotations

import json
import logging
import random
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.command import Command
from eyas.data.extract import ExtractConfig, extract
from eyas.data.extract_speed import bare_forward, timed
from eyas.data.store import NAMED_OPTIONS, bytes_per_token
from eyas.data.types import Sample


@dataclass
class BenchExtractConfig:
    """``python -m eyas.lab.bench_extract`` (``bench_extract`` in ``conf/bench_extract.yaml``)."""

    target: str = "embedded"
    """``TargetConfig.path`` (``embedded``: the embedded SmolLM2-135M)."""
    dtype: str = "auto"
    device: str = "auto"
    samples: int = 64
    min_len: int = 128
    max_len: int = 512
    max_batch_tokens: int = 4096
    max_batch_rows: int = 256
    shard_size: int = 32
    repeats: int = 2
    threads: int = 0
    """torch CPU threads (0: torch's default)."""
    options: list[str] = field(default_factory=lambda: list(NAMED_OPTIONS))
    """Store layouts to extract (a subset of :data:`NAMED_OPTIONS`)."""
    writer_thread: bool = True
    """Serialize shards on a writer thread (false: on the compute thread)."""
    out: str | None = None
    """Also write the results as JSON here."""

    def __post_init__(self) -> None:
        unknown = [n for n in self.options if n not in NAMED_OPTIONS]
        if unknown:
            raise ValueError(f"bench_extract.options: unknown {unknown}; choose from {list(NAMED_OPTIONS)}")
        if not 0 < self.min_len <= self.max_len:
            raise ValueError(
                f"bench_extract: need 0 < min_len <= max_len, got {self.min_len}, {self.max_len}"
            )


def make_samples(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(min_len, max_len)
        out.append(
            Sample(
                id=f"b{i}",
                input_ids=[rng.randrange(vocab) for _ in range(k)],
                loss_mask=[j > k // 3 for j in range(k)],
            )
        )
    return out


def run(args: BenchExtractConfig, argv: list[str] | None = None) -> list[dict]:
    """Time every path (see the module docstring); print the table and write ``args.out``."""
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    from eyas.serving.models.target import TargetConfig, load_target

    target = load_target(TargetConfig(path=args.target, dtype=args.dtype, device=args.device))
    info = target.info
    samples = make_samples(args.samples, args.min_len, args.max_len, info.vocab_size, seed=0)
    tokens = sum(s.num_tokens for s in samples)
    names = list(args.options)

    paths: dict[str, Callable[[], object]] = {
        "bare CausalLM": bare_forward(
            target, samples, args.max_batch_tokens, args.max_batch_rows, base_only=False
        ),
        "bare base": bare_forward(
            target, samples, args.max_batch_tokens, args.max_batch_rows, base_only=True
        ),
    }
    for name in names:
        cfg = ExtractConfig(
            store=NAMED_OPTIONS[name],
            shard_size=args.shard_size,
            max_batch_tokens=args.max_batch_tokens,
            max_batch_rows=args.max_batch_rows,
            writer_thread=args.writer_thread,
            progress=False,
        )

        def job(cfg: ExtractConfig = cfg) -> None:
            with tempfile.TemporaryDirectory(prefix="eyas-bench-") as d:
                extract(samples, target, d, cfg)

        paths[f"extract {name}"] = job
    best = {k: float("inf") for k in paths}
    for _ in range(args.repeats):
        for k, fn in paths.items():
            best[k] = min(best[k], timed(fn, target.device))

    cmd = "python -m eyas.lab.bench_extract " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    print(f"# {cmd}")
    print(
        f"# target {info.name} ({target.dtype}, {target.device}, torch threads {torch.get_num_threads()}), H={info.hidden_size}, "
        f"{len(info.aux_layers)} aux layers, V={info.vocab_size}; {len(samples)} samples, {tokens} tokens, "
        f"micro-batches <= {args.max_batch_tokens} padded tokens; best of {args.repeats}"
    )
    base_lm, base = best["bare CausalLM"], best["bare base"]
    print(f"{'path':<22}{'tok/s':>10}{'vs CausalLM':>13}{'vs base':>10}{'bytes/tok':>11}{'vs 4H bf16':>12}")
    rows = []
    for k, sec in best.items():
        tps = tokens / sec
        size = ""
        row = {"path": k, "tokens_per_s": tps, "vs_causal_lm": base_lm / sec, "vs_base": base / sec}
        if k.startswith("extract "):
            b = bytes_per_token(
                info.hidden_size, len(info.aux_layers), NAMED_OPTIONS[k.split(" ", 1)[1]], info.vocab_size
            )
            size = f"{b.total:>11}{b.ratio_to_anchor:>12.3f}"
            row.update(bytes_per_token=b.total, ratio_to_anchor=b.ratio_to_anchor)
        rows.append(row)
        print(f"{k:<22}{tps:>10.0f}{base_lm / sec:>13.3f}{base / sec:>10.3f}{size}")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": cmd, "tokens": tokens, "results": rows}, indent=1))
    return rows


COMMAND = Command(
    "bench_extract", "eyas.lab.bench_extract", "bench_extract", BenchExtractConfig, run, key="bench_extract"
)
main = COMMAND.main


if __name__ == "__main__":
    main()
