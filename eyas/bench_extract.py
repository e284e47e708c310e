"""Benchmark: feature extraction speed against a bare target forward over the same tokens, and store size.

``python -m eyas.bench_extract [--samples 64 --min-len 128 --max-len 512 --max-batch-tokens 4096 ...]``

Measured on the same length-sorted, padded micro-batches the extraction uses:
- ``bare CausalLM``: ``target.model(input_ids)``, the plain transformers forward including logits at every
  position (what any distillation pipeline pays at least once);
- ``bare base``: the decoder stack alone, no vocabulary projection (the floor for the ``hidden`` option);
- ``extract <option>``: the whole job (forward, aux capture, encoding, top-k, shard serialization, sha256,
  fsync) writing a real store into a temporary directory.
Each path runs ``--repeats`` times, interleaved; the best time counts (the first pass also warms kernels up).
Tokens/s counts real tokens only (no padding).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eyas.data.extract import ExtractConfig, extract, plan_microbatches
from eyas.data.store import StoreOptions, bytes_per_token
from eyas.data.types import Sample

OPTIONS = {
    "bf16+hidden": StoreOptions(),
    "bf16+top32": StoreOptions(distribution="topk", topk=32),
    "fp8+hidden": StoreOptions(aux_dtype="float8_e4m3"),
    "fp8+top32": StoreOptions(aux_dtype="float8_e4m3", distribution="topk", topk=32),
    "int4+top32": StoreOptions(aux_dtype="int4", int4_group_size=64, distribution="topk", topk=32),
}


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_forward(
    target, samples: list[Sample], max_batch_tokens: int, max_batch_rows: int, base_only: bool
) -> Callable[[], None]:
    """A function running the plain transformers forward over the extraction's micro-batches."""
    lengths = [s.num_tokens for s in samples]
    batches = []
    for mb in plan_microbatches(lengths, max_batch_tokens, max_batch_rows):
        t = lengths[mb[0]]
        ids = torch.zeros(len(mb), t, dtype=torch.long)
        for r, i in enumerate(mb):
            ids[r, : lengths[i]] = torch.tensor(samples[i].input_ids)
        batches.append(ids.to(target.device))
    model = target.base if base_only else target.model

    @torch.inference_mode()
    def run() -> None:
        for ids in batches:
            model(input_ids=ids)

    return run


def timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--target", default="embedded", help="TargetConfig.path (default: the embedded SmolLM2-135M)"
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--max-batch-rows", type=int, default=256)
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated subset of {list(OPTIONS)}")
    p.add_argument("--no-writer-thread", action="store_true", help="serialize shards on the compute thread")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    from eyas.serving.target import TargetConfig, load_target

    target = load_target(TargetConfig(path=args.target, dtype=args.dtype, device=args.device))
    info = target.info
    samples = make_samples(args.samples, args.min_len, args.max_len, info.vocab_size, seed=0)
    tokens = sum(s.num_tokens for s in samples)
    names = [n.strip() for n in args.options.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        p.error(f"unknown options {unknown}; choose from {list(OPTIONS)}")

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
            store=OPTIONS[name],
            shard_size=args.shard_size,
            max_batch_tokens=args.max_batch_tokens,
            max_batch_rows=args.max_batch_rows,
            writer_thread=not args.no_writer_thread,
            progress=False,
        )

        def run(cfg: ExtractConfig = cfg) -> None:
            with tempfile.TemporaryDirectory(prefix="eyas-bench-") as d:
                extract(samples, target, d, cfg)

        paths[f"extract {name}"] = run
    best = {k: float("inf") for k in paths}
    for _ in range(args.repeats):
        for k, fn in paths.items():
            best[k] = min(best[k], timed(fn, target.device))

    cmd = "python -m eyas.bench_extract " + " ".join(
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
                info.hidden_size, len(info.aux_layers), OPTIONS[k.split(" ", 1)[1]], info.vocab_size
            )
            size = f"{b.total:>11}{b.ratio_to_anchor:>12.3f}"
            row.update(bytes_per_token=b.total, ratio_to_anchor=b.ratio_to_anchor)
        rows.append(row)
        print(f"{k:<22}{tps:>10.0f}{base_lm / sec:>13.3f}{base / sec:>10.3f}{size}")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": cmd, "tokens": tokens, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
