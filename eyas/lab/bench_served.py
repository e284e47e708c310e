"""Where served chains start: ``python -m eyas.lab.bench_served bench_served.export_dir=<export>``.

The trainer reports simulated acceptance (τ_sim) from one teacher-forced unroll over held-out data, scoring
*every* row as if a chain started there. Greedy chain decoding starts a chain only where the previous one ended:
right after a draft the target rejected (or after K accepted drafts). This benchmark measures what that
difference is worth for one drafter on one prompt set:

1. greedy chain decoding in the bundled loop (``serving.loop.generate``): τ and the conditional acceptance at
   each depth (``P(depth j accepted | depth j - 1 accepted)``);
2. one teacher-forced unroll over each prompt plus what decoding emitted, scored by the trainer's own code
   (``train.losses.DistillationModel`` with the chain counts): over every row (``tau_chain``, the τ_sim of the
   training log and the recipe table) and over the rows the served chains start from (``tau_served``,
   :func:`train.losses.served_chains`), each with its conditional acceptance per depth.

Design decisions:
- The held-out text is the target's own greedy output (what decoding emitted), so every row of the unroll sees
  the inputs serving fed it, and ``tau_served`` must come out at the loop's τ up to the numerics of one full
  forward against the cached verify forwards (``tests/train/test_losses.py`` checks equality on a tiny fp32
  target). The gap between ``tau_chain`` and the loop's τ is then what starting chains only after misses costs.
- The first generated token comes from prefill, not from a draft, so the unroll's loss mask starts one token
  later, as the loop's first chain does.
- Numerics are evaluation's speculative ones (``eval.stage.EvalStageConfig.verify_numerics``: bf16 with row-exact
  attention on CPUs with bf16 units), and the target reads the drafter's aux layers, as ``eyas eval`` loads it.
- A Hydra app like every command (``conf/bench_served.yaml``, typed by :class:`BenchServedConfig`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eyas.command import Command


@dataclass
class BenchServedConfig:
    """``python -m eyas.lab.bench_served`` (``bench_served`` in ``conf/bench_served.yaml``)."""

    export_dir: str = "auto"
    """The exported drafter (a trainer checkpoint or run directory also loads), or ``auto`` (the newest drafter
    under ``runs/``)."""
    source: str = "ood_reasoning"
    """Prompt source (what ``eval.prompt_sets[].source`` takes); the default is out-of-distribution hard reasoning
    (reasoning-gym tasks no training mixture uses)."""
    n: int = 12
    """Prompts drawn from the source (seeded by ``seed``)."""
    max_new_tokens: int = 192
    chain_length: int = 6
    """K: drafts per step, and the depth the unroll is scored to."""
    seed: int = 0
    dtype: str = "auto"
    """Target numerics, as ``eval.dtype``."""
    threads: int = 2
    out: str | None = None
    """Also write the results as JSON here."""

    def __post_init__(self) -> None:
        for name in ("n", "max_new_tokens", "chain_length", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench_served.{name} must be >= 1, got {getattr(self, name)}")


def _loop_counts(steps, start: int, length: int, k: int) -> tuple[list[int], list[int]]:
    """Per depth j: the loop's chains that tried depth j inside ``length`` tokens, and those that hit it."""
    reach, hits, t = [0] * k, [0] * k, start
    for s in steps:
        for j in range(min(k, s.draft_depth)):
            if t + j + 2 < length and s.num_accepted >= j:
                reach[j] += 1
                hits[j] += s.num_accepted >= j + 1
        t += s.num_accepted + 1
    return reach, hits


def decoded_chain_counts(target, drafter, prompt: list[int], tokens: list[int], k: int):
    """The trainer's :class:`train.losses.ChainCounts` (served counts included) of one teacher-forced unroll of
    ``drafter`` over ``prompt + tokens`` (what greedy decoding emitted), scored to depth ``k``. The first emitted
    token came from prefill, not from a draft, so the loss mask starts one token later, as the loop's first
    chain does."""
    import torch

    from eyas.data.types import Batch
    from eyas.train.losses import DistillationModel, VocabMaps, build_teacher

    seq = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        out = target.forward(seq, logits="none")
        loss = torch.zeros_like(seq, dtype=torch.bool)
        loss[0, len(prompt) + 1 :] = True
        batch = Batch(
            input_ids=seq,
            loss_mask=loss,
            position_ids=torch.arange(seq.shape[1])[None],
            segment_ids=torch.ones_like(seq),
            aux=out.aux,
            target_hidden=out.hidden,
        )
        maps = VocabMaps.from_draft_ids(drafter.draft_to_target, target.vocab_size)
        teacher = build_teacher(batch, maps, form="hidden", head=target.head)
        return DistillationModel(drafter, [1.0] * k)(
            seq, out.aux, batch.position_ids, batch.segment_ids, teacher, 1.0, with_chain=True
        ).chain


def run(args: BenchServedConfig) -> dict[str, Any]:
    """Decode every prompt, unroll over what was emitted, and print the three acceptance estimates."""
    import torch
    from tqdm import tqdm

    from eyas.eval.acceptance import PromptSetSpec
    from eyas.eval.prompts import load_prompt_ids
    from eyas.eval.stage import EvalStageConfig
    from eyas.serving.load import load_drafter, load_target_for_drafter
    from eyas.serving.loop import generate
    from eyas.serving.models.target import TargetConfig
    from eyas.serving.proposers import Eagle3Proposer
    from eyas.train.losses import ChainCounts
    from eyas.train.metrics import simulated_acceptance

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    k = args.chain_length
    t0 = time.perf_counter()
    target = load_target_for_drafter(TargetConfig(), args.export_dir)
    spec = PromptSetSpec("held-out", args.source, args.n, "", args.max_new_tokens)
    ecfg = EvalStageConfig(prompt_sets=[asdict(spec)], chain_length=k, dtype=args.dtype, profile=None)
    target, numerics = ecfg.verify_numerics(target)
    loaded = load_drafter(args.export_dir, target)
    drafter = loaded.drafter
    prompts = load_prompt_ids(spec, target.tokenizer, args.seed)
    proposer = Eagle3Proposer(drafter, chain_length=k)

    emitted = steps = 0
    loop_reach, loop_hits = [0] * k, [0] * k
    total = None
    for prompt in tqdm(prompts, desc="prompts", unit="prompt"):
        res = generate(target, proposer, prompt, args.max_new_tokens)
        emitted += sum(s.num_emitted for s in res.steps)
        steps += len(res.steps)
        r, h = _loop_counts(res.steps, len(prompt) - 1, len(prompt) + len(res.tokens), k)
        loop_reach = [a + b for a, b in zip(loop_reach, r)]
        loop_hits = [a + b for a, b in zip(loop_hits, h)]
        counts = [
            x.float().cpu() for x in decoded_chain_counts(target, drafter, prompt, res.tokens, k).tensors()
        ]
        total = counts if total is None else [a + b for a, b in zip(total, counts)]

    chain = ChainCounts(*total)
    est = simulated_acceptance(chain)
    lr, lh = torch.tensor(loop_reach, dtype=torch.float32), torch.tensor(loop_hits, dtype=torch.float32)
    loop_est = simulated_acceptance(ChainCounts(lr, lh, lr, lh))
    every, served, loop = est.cond_acc, est.served_cond_acc, loop_est.cond_acc
    result = {
        "drafter": loaded.source,
        "numerics": numerics,
        "prompts": len(prompts),
        "source": args.source,
        "max_new_tokens": args.max_new_tokens,
        "chain_length": k,
        "loop_tau": emitted / max(steps, 1),
        "loop_cond_acc": loop,
        "loop_tau_from_cond": loop_est.tau_chain,
        "tau_served": est.tau_served,
        "served_cond_acc": served,
        "tau_chain": est.tau_chain,
        "cond_acc": every,
        "chains": int(chain.served_reach[0]),
        "rows": int(chain.reach[0]),
        "seconds": round(time.perf_counter() - t0, 1),
        "config": asdict(args),
    }
    fmt = " ".join
    print(f"drafter {loaded.source}; {len(prompts)} prompts of {args.source}, {numerics}")
    print(f"| estimate | τ (K = {k}) | conditional acceptance by depth |\n|---|---:|---|")
    print(
        f"| bundled loop, greedy chains ({steps} steps) | {result['loop_tau']:.3f} | {fmt(f'{c:.2f}' for c in loop)} |"
    )
    print(
        f"| unroll, rows served chains start from ({result['chains']}) | {result['tau_served']:.3f} "
        f"| {fmt(f'{c:.2f}' for c in served)} |"
    )
    print(
        f"| unroll, every row ({result['rows']}; τ_sim) | {result['tau_chain']:.3f} | {fmt(f'{c:.2f}' for c in every)} |"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


COMMAND = Command(
    "bench_served",
    "eyas.lab.bench_served",
    "bench_served",
    BenchServedConfig,
    run,
    key="bench_served",
    renamed={"bench_served.checkpoint": "bench_served.export_dir"},
)
main = COMMAND.main


if __name__ == "__main__":
    main()
