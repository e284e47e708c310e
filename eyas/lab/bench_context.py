"""The long-context experiment: ``python -m eyas.lab.bench_context``.

Two drafters for the embedded target, trained at equal training tokens on the same feature store, then τ
against context length (``eval.context``) for each, and for prompt lookup:

- ``short``: every row at most ``short`` tokens (long conversations truncated to it), as eyas trains by default;
- ``mix``: ``loader.length_mix`` = {short: 1 - f, window: f} (``long_share`` f of the tokens in rows of whole
  long conversations, up to the target's window).

Design decisions:
- Data is real chat: ShareGPT's training split, single (user, assistant) pairs for the short samples and
  conversations of many pairs up to ``long`` tokens (:func:`data.long_context.long_conversations`) for the
  long ones; the evaluation prefixes come from its held-out split. The teacher is the target's own distribution
  (distillation through its head), as in every eyas run.
- Equal training tokens: each recipe's ``max_steps`` is the number of batches of its own loader plan whose row
  tokens first reach ``budget`` (a batch of 8k-token rows counts 8k tokens, one of 512-token rows 512).
- The trainer, loader, store and evaluation are the stages' own (``train.setup.run``, ``data.extract``,
  ``eval.context.run``); this module only chooses their settings. A Hydra app like every command
  (``conf/bench_context.yaml``, typed by :class:`BenchContextConfig`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.command import Command


@dataclass
class BenchContextConfig:
    """``python -m eyas.lab.bench_context`` (``bench_context`` in ``conf/bench_context.yaml``)."""

    out: str = "runs/bench_context"
    """Work directory (store, checkpoints, reports)."""
    budget: int = 200_000
    """Training tokens per recipe."""
    short: int = 512
    """Tokens per short row."""
    long: int = 7680
    """Tokens per long conversation (at most the target's window)."""
    n_short: int = 700
    n_long: int = 16
    long_share: float = 0.5
    """Share of the ``mix`` recipe's tokens in long rows."""
    conversations: int = 3000
    """ShareGPT conversations read for turn pairs."""
    recipes: list[str] = field(default_factory=lambda: ["short", "mix"])
    """``short`` and/or ``mix``; the first also measures prompt lookup."""
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 2048, 4096, 7168])
    prompts: int = 3
    max_new_tokens: int = 64
    threads: int = 2
    lr: float = 1e-3
    draft_vocab: int = 8192

    def __post_init__(self) -> None:
        bad = sorted(set(self.recipes) - {"short", "mix"})
        if bad or not self.recipes:
            raise ValueError(f"bench_context.recipes: 'short' and/or 'mix', not {self.recipes}")
        if not 0.0 < self.long_share < 1.0:
            raise ValueError(f"bench_context.long_share must be in (0, 1), got {self.long_share}")


def build_samples(target, n_short: int, short: int, n_long: int, long: int, conversations: int):
    """(short samples, long samples) from ShareGPT's training split, under the target's chat template."""
    from eyas.data.chat import format_conversation
    from eyas.data.long_prefixes import long_conversations, turn_pairs
    from eyas.data.types import Conversation

    pairs = turn_pairs("sharegpt", conversations, split="train")
    if len(pairs) < n_short + 8:
        raise ValueError(
            f"{len(pairs)} turn pairs in {conversations} conversations: raise bench_context.conversations"
        )
    shorts = []
    for i, pair in enumerate(pairs[:n_short]):
        s = format_conversation(Conversation(f"short-{i}", list(pair), "sharegpt"), target.tokenizer, short)
        if s is not None:
            shorts.append(s)
    longs = []
    for conv in long_conversations(pairs[n_short:], target.tokenizer, long, n_long):
        s = format_conversation(conv, target.tokenizer, long)
        if s is not None:
            longs.append(s)
    return shorts, longs


def steps_for_budget(store, loader: dict[str, Any], budget: int) -> tuple[int, int]:
    """(batches, tokens): the first batches of the loader's plan (epoch after epoch) holding ``budget`` tokens."""
    from eyas.data.loader import FeatureLoader, LoaderConfig

    fl = FeatureLoader(store, LoaderConfig(**loader, split="all"))
    limit = fl.cfg.row_limit
    tokens, steps, epoch = 0, 0, 0
    while tokens < budget:
        for batch in fl.global_plan(epoch):
            tokens += sum(min(int(store.lengths[i]), limit) for row in batch for i in row)
            steps += 1
            if tokens >= budget:
                break
        epoch += 1
    return steps, tokens


def run(args: BenchContextConfig) -> dict[str, Any]:
    """Store, then per recipe: train at the budget and measure τ against context (see the module docstring)."""
    import torch

    from eyas.data.extract import ExtractConfig, extract
    from eyas.data.store import FeatureStore
    from eyas.eval.acceptance import PromptSetSpec
    from eyas.eval.context_sweep import ContextConfig, ContextJob, markdown_table
    from eyas.eval.context_sweep import run as run_context
    from eyas.serving.models.target import TargetConfig, load_target
    from eyas.train.config import DataSourceConfig, DraftModelConfig, TrainConfig, TrainJob, WandbConfig
    from eyas.train.setup import run as run_train

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    target_cfg = TargetConfig(device="cpu")
    target = load_target(target_cfg)
    window = int(target.model.config.get_text_config().max_position_embeddings)
    t0 = time.perf_counter()
    store_dir = out / "store"
    shorts, longs = build_samples(
        target, args.n_short, args.short, args.n_long, args.long, args.conversations
    )
    print(
        f"samples: {len(shorts)} short ({sum(s.num_tokens for s in shorts)} tokens), {len(longs)} long "
        f"({sum(s.num_tokens for s in longs)} tokens, {min(s.num_tokens for s in longs)}.."
        f"{max(s.num_tokens for s in longs)} each)",
        flush=True,
    )
    extract(shorts + longs, target, store_dir, ExtractConfig(progress=True))  # resumes / reuses a whole store
    store = FeatureStore(store_dir, expect_target=target.info)
    extract_s = time.perf_counter() - t0
    loaders = {
        "short": {"batch_rows": 1, "max_tokens": args.short},
        "mix": {
            "batch_rows": 1,
            "length_mix": {args.short: 1 - args.long_share, window: args.long_share},
        },
    }
    summary: dict[str, Any] = {"args": asdict(args), "extract_s": extract_s, "recipes": {}}
    for i, name in enumerate(args.recipes):
        loader = loaders[name]
        steps, tokens = steps_for_budget(store, loader, args.budget)
        tcfg = TrainConfig(
            output_dir=str(out / "train" / name),
            max_steps=steps,
            lr=args.lr,
            warmup_ratio=0.03,
            eval_every=0,
            save_every=0,
            log_every=10,
            threads=args.threads,
            precision="bf16",
            progress=False,
            wandb=WandbConfig(mode="disabled"),
            data=DataSourceConfig(source="store", store_dir=str(store_dir), eval_fraction=0.0, loader=loader),
        )
        t1 = time.perf_counter()
        res = run_train(
            TrainJob(target_cfg, DraftModelConfig(draft_vocab_size=args.draft_vocab, init="random"), tcfg),
            target,
        )
        train_s = time.perf_counter() - t1
        print(f"{name}: {steps} steps, {tokens} tokens, {train_s:.0f} s -> {res.last_checkpoint}", flush=True)
        methods = ["eagle3-chain", "prompt-lookup", "none"] if i == 0 else ["eagle3-chain", "none"]
        ccfg = ContextConfig(
            checkpoint=res.last_checkpoint,
            lengths=args.lengths,
            prompts=PromptSetSpec("mt_bench", "mt_bench", args.prompts, "chat", args.max_new_tokens),
            prefix_corpus="sharegpt",  # the drafters train on ShareGPT's own training split (build_samples)
            methods=methods,
            threads=args.threads,
            out_dir=str(out / "context" / name),
        )
        ctx = run_context(
            ContextJob(target_cfg, ccfg), target, command=f"python -m eyas.lab.bench_context ({name})"
        )
        print(markdown_table(ctx), flush=True)
        summary["recipes"][name] = {
            "loader": loader,
            "steps": steps,
            "tokens": tokens,
            "train_s": train_s,
            "checkpoint": res.last_checkpoint,
            "context_report": str(ctx.out / "context.md"),
            "points": [asdict(pt) for pt in ctx.points],
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"summary: {out / 'summary.json'}")
    return summary


COMMAND = Command(
    "bench_context", "eyas.lab.bench_context", "bench_context", BenchContextConfig, run, key="bench_context"
)
main = COMMAND.main


if __name__ == "__main__":
    main()
