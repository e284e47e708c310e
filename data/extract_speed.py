"""Extraction's speed against a bare target forward over the same tokens, in the same micro-batches.

The pipeline's extraction stage prints it beside the store (:func:`extraction_speed_check`); the extraction
benchmark (``eyas.lab.bench_extract``) times the same paths over its own samples.

Design decisions:
- The bare paths run the plain transformers modules over exactly the extraction's length-sorted, padded
  micro-batches (:func:`eyas.data.extract.plan_microbatches`): ``target.model`` with logits at every position
  (what any distillation pipeline pays at least once) and ``target.base``, the decoder stack alone (the floor of
  the ``hidden`` option). Tokens/s counts real tokens only.
- Each path runs ``repeats`` times, interleaved, and the best time counts (the first pass also warms kernels up);
  on CUDA the device is synchronized around each timed call.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from eyas.data.extract import ExtractConfig, extract, plan_microbatches

if TYPE_CHECKING:
    from eyas.data.types import Sample


def bare_forward(
    target, samples: Sequence[Sample], max_batch_tokens: int, max_batch_rows: int, base_only: bool
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes, with ``device``'s queued work finished before and after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def extraction_speed_check(
    samples, target, ecfg: ExtractConfig, max_tokens: int, repeats: int = 2
) -> dict[str, Any]:
    """Extraction against a bare transformers forward (logits at every position) over the same first
    ``max_tokens`` tokens of ``samples``, in the same micro-batches; best of ``repeats``, interleaved."""
    sub, n = [], 0
    for s in samples:
        if n >= max_tokens:
            break
        sub.append(s)
        n += s.num_tokens
    cfg = replace(ecfg, progress=False)
    bare = bare_forward(target, sub, cfg.max_batch_tokens, cfg.max_batch_rows, base_only=False)
    base = bare_forward(target, sub, cfg.max_batch_tokens, cfg.max_batch_rows, base_only=True)

    def run_extract() -> None:
        with tempfile.TemporaryDirectory(prefix="eyas-check-") as d:
            extract(sub, target, d, cfg)

    best_bare = best_base = best_ext = float("inf")
    for _ in range(repeats):
        best_bare = min(best_bare, timed(bare, target.device))
        best_base = min(best_base, timed(base, target.device))
        best_ext = min(best_ext, timed(run_extract, target.device))
    return {
        "check_tokens": n,
        "bare_forward_tokens_per_s": round(n / best_bare, 1),
        "bare_base_tokens_per_s": round(n / best_base, 1),
        "check_extract_tokens_per_s": round(n / best_ext, 1),
        "extract_time_vs_bare_forward": round(best_ext / best_bare, 3),
        "extract_time_vs_bare_base": round(best_ext / best_base, 3),
    }
