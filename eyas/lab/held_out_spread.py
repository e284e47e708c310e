"""How many held-out batches ``best/`` needs: ``python -m eyas.lab.held_out_spread held_out_spread.run_dir=<run>
held_out_spread.store_dir=<store>``.

The trainer evaluates its checkpoints on the first ``train.eval_batches`` held-out batches and keeps the best by
``tau_served`` (``train.trainer.Trainer.evaluate``). Two questions decide how many batches that takes, and this
answers both from a finished run (its checkpoints under ``<run>/checkpoints``: keep two or more with
``train.keep_last``) and the store it trained on, evaluating each checkpoint on every held-out batch once:

- the spread of one estimate: the std of ``tau_served`` over random sets of ``n`` batches, and the same from the
  two disjoint halves of ``2n`` batches (``sqrt(mean((τ_A - τ_B)^2) / 2)``);
- the spread of a choice: between the last two checkpoints, the std over random sets of ``n`` batches of the
  *paired* difference of their ``tau_served`` (both on the same batches, as the trainer compares them), and how
  often its sign differs from the sign on all batches (how often ``best/`` would keep the other checkpoint).

Sets of ``n`` batches are drawn without replacement from the held-out split, so ``n`` goes up to half of it. The
loader settings are the run's (``batch_rows``, ``max_tokens``); the supervised tokens per batch are printed, so
another batch shape converts by token count (a spread falls as one over the square root of the tokens).

A Hydra app like every command (``conf/held_out_spread.yaml``, typed by :class:`HeldOutSpreadConfig`).

The run behind ``train.eval_batches``'s default (the demo's data and recipe, with 30% of the store held out so
that there are enough held-out batches to draw from; ``W`` a scratch directory)::

    EYAS_WORK=W python -m eyas.data.prepare corpus=demo prepare=demo
    python -m eyas.data.extract extract.samples=W/prepare/<hash>/train/samples.jsonl extract.out_dir=W/store
    python -m eyas.train train=demo train.save_every=100 train.keep_last=2 train.eval_every=0 \
        train.data.eval_fraction=0.3 train.data.store_dir=W/store train.output_dir=W/train
    python -m eyas.lab.held_out_spread held_out_spread.run_dir=W/train held_out_spread.store_dir=W/store \
        held_out_spread.eval_fraction=0.3 held_out_spread.draws=1000
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.command import Command


@dataclass
class HeldOutSpreadConfig:
    """``python -m eyas.lab.held_out_spread`` (``held_out_spread`` in ``conf/held_out_spread.yaml``)."""

    run_dir: str = "runs/train"
    """A training run's output_dir: its ``checkpoints/step_*`` are evaluated (two at least for the paired
    difference)."""
    store_dir: str = "runs/store"
    """The feature store the run trained on."""
    eval_fraction: float = 0.02
    """The held-out share, as the run's ``train.data.eval_fraction``."""
    batch_rows: int = 1
    max_tokens: int = 512
    """The run's ``train.data.loader`` batch shape (packed rows)."""
    chain_length: int = 6
    """K of the τ estimates, as ``train.eval_chain_length``."""
    draws: int = 400
    """Random batch sets per set size."""
    threads: int = 2
    out: str | None = None
    """Also write the results as JSON here."""

    def __post_init__(self) -> None:
        for name in ("batch_rows", "max_tokens", "chain_length", "draws", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"held_out_spread.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"held_out_spread.eval_fraction must be in (0, 1), got {self.eval_fraction}")


def batch_counts(args: HeldOutSpreadConfig) -> dict[str, Any]:
    """Per checkpoint, per held-out batch: the six chain counts at ``chain_length`` ([n_batches, 6, K])."""
    from eyas.serving.models.drafter import load_trained_drafter
    from eyas.serving.models.target import TargetConfig, load_target
    from eyas.train.checkpoint import list_checkpoints
    from eyas.train.config import TrainConfig
    from eyas.train.losses import DistillationModel, build_teacher, supervised_positions
    from eyas.train.setup import run_data
    from eyas.train.trainer import teacher_kwargs

    target = load_target(TargetConfig(dtype="float32"))
    loader = {"batch_rows": args.batch_rows, "max_tokens": args.max_tokens, "packing": "packed"}
    data = {
        "source": "store",
        "store_dir": args.store_dir,
        "eval_fraction": args.eval_fraction,
        "loader": loader,
    }
    cfg = TrainConfig(output_dir=args.run_dir, data=data)
    batches = run_data(target, cfg, rank=0, world=1).eval
    embedding = target.model.get_input_embeddings().weight
    out: dict[str, Any] = {
        "batches": len(batches),
        "supervised_tokens": [int(supervised_positions(b).sum()) for b in batches],
        "checkpoints": {},
    }
    for ckpt in list_checkpoints(Path(args.run_dir) / "checkpoints"):
        drafter = load_trained_drafter(ckpt, embedding).float().eval()
        ttt = json.loads((ckpt / "trainer_state.json").read_text())["identity"]["train"]["ttt_steps"]
        model = DistillationModel(drafter, [1.0] * ttt)
        kw = teacher_kwargs(cfg, drafter, target.head, torch.device("cpu"))
        rows = []
        with torch.no_grad():
            for b in batches:
                teacher = build_teacher(b, **kw)
                res = model(
                    b.input_ids,
                    b.aux,
                    b.position_ids,
                    b.segment_ids,
                    teacher,
                    1.0,
                    with_chain=True,
                    chain_steps=args.chain_length,
                )
                rows.append(torch.stack(res.chain.tensors()))
        out["checkpoints"][ckpt.name] = torch.stack(rows)  # [n_batches, 6, K]
        print(f"{ckpt.name}: {len(rows)} batches scored", flush=True)
    return out


def tau_served(counts: torch.Tensor) -> float:
    """``tau_served`` of summed counts [6, K] (``train.metrics.simulated_acceptance``)."""
    from eyas.train.losses import ChainCounts
    from eyas.train.metrics import simulated_acceptance

    return simulated_acceptance(ChainCounts(*counts)).tau_served


def spread(per_batch: dict[str, torch.Tensor], draws: int, seed: int = 0) -> list[dict[str, Any]]:
    """Per set size ``n``: the spreads described in the module docstring (last checkpoint; last two for the
    paired difference)."""
    names = sorted(per_batch)
    last = per_batch[names[-1]]
    prev = per_batch[names[-2]] if len(names) > 1 else None
    n_batches = last.shape[0]
    rng = random.Random(seed)
    rows = []
    n = 1
    while 2 * n <= n_batches:
        single, halves, diffs = [], [], []
        for _ in range(draws):
            pick = rng.sample(range(n_batches), 2 * n)
            a, b = pick[:n], pick[n:]
            ta, tb = tau_served(last[a].sum(0)), tau_served(last[b].sum(0))
            single.append(ta)
            halves.append((ta - tb) ** 2)
            if prev is not None:
                diffs.append(ta - tau_served(prev[a].sum(0)))
        row: dict[str, Any] = {
            "n": n,
            "std_tau_served": _std(single),
            "std_from_halves": math.sqrt(sum(halves) / len(halves) / 2),
        }
        if prev is not None:
            full = tau_served(last.sum(0)) - tau_served(prev.sum(0))
            row["paired_diff_all"] = full
            row["std_paired_diff"] = _std(diffs)
            row["wrong_sign"] = sum((d > 0) != (full > 0) for d in diffs) / len(diffs)
        rows.append(row)
        n *= 2
    return rows


def _std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))


def run(args: HeldOutSpreadConfig) -> dict[str, Any]:
    """Score every checkpoint on every held-out batch, then print the spreads (see the module docstring)."""
    torch.set_num_threads(args.threads)
    counts = batch_counts(args)
    per_ckpt = counts["checkpoints"]
    toks = counts["supervised_tokens"]
    print(
        f"{counts['batches']} held-out batches of {args.batch_rows}x{args.max_tokens} tokens, "
        f"{sum(toks) / len(toks):.0f} supervised tokens per batch; K = {args.chain_length}"
    )
    names = sorted(per_ckpt)
    taus = {name: tau_served(per_ckpt[name].sum(0)) for name in names}
    for name in names:
        print(f"  {name}: tau_served {taus[name]:.4f} on all batches")
    rows = spread(per_ckpt, args.draws)
    pair = f"{names[-1]} - {names[-2]}" if len(names) > 1 else "(one checkpoint)"
    print(f"\n| batches | std tau_served | std from two halves | std of paired diff {pair} | wrong sign |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['n']} | {r['std_tau_served']:.4f} | {r['std_from_halves']:.4f} | "
            f"{r.get('std_paired_diff', float('nan')):.4f} | {r.get('wrong_sign', float('nan')):.2f} |"
        )
    result = {"config": asdict(args), "supervised_tokens": toks, "tau_served": taus, "spread": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


COMMAND = Command(
    "held_out_spread",
    "eyas.lab.held_out_spread",
    "held_out_spread",
    HeldOutSpreadConfig,
    run,
    key="held_out_spread",
)
main = COMMAND.main


if __name__ == "__main__":
    main()
