"""Drafter-training throughput and peak memory on this machine: ``python -m eyas.lab.bench_train``.

What it measures: the real training step of :func:`train.trainer.fit` (teacher from the stored final hidden state
through the frozen target head, TTT unroll, loss, backward, optimizer step), for the embedded default target
(SmolLM2-135M-Instruct), 512-token samples (one per micro-batch; ``bench_train.seq_len=[512,2048,8192]`` for long rows), TTT 7,
over draft vocabularies and precisions.
Tokens/s counts every sequence token of a step (SpecForge's convention), from the step timings ``fit`` logs,
after ``warmup`` steps. Peak memory is the resident set of the training process (sampled every 20 ms), with
the part above the pre-training baseline (inputs, head and embedding already loaded) shown separately.
``bench_train.attention=[block,dense]`` times the TTT attention alone instead (7 unroll steps, forward and backward, SmolLM2's heads):
the trainer's :func:`serving.ttt_attention.ttt_attention` (``block``: one call over a short row, blocks over a long
one, checkpointed beyond ~1.4k tokens) against the dense-mask reference, per row length.

Design decisions:
- The target runs once in the parent to make the features (as a bf16 feature store would hold them); each
  configuration then trains in a fresh child process that never loads the target model, so peak memory is the
  trainer's, not the target's, and configurations cannot disturb each other.
- Inputs are uniform random tokens with the last ``loss_fraction`` of each sample marked as assistant tokens:
  throughput depends on the token count, the loss-row fraction and the draft vocabulary, not on the text.
- A Hydra app like every eyas command (``conf/bench_train.yaml``, typed by :class:`BenchTrainConfig`: a bad key
  or type is named in one line): lists sweep, e.g. ``bench_train.vocab=[8192,32768] bench_train.modes=[bf16]``.
  Each configuration runs in a child process that gets its settings as one JSON argument (:func:`child_main`),
  not through Hydra, so children make no run directories and cannot be started by mistake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from eyas.command import Command
from eyas.train.optim import OPTIMIZERS

MODES = {
    "fp32": dict(precision="fp32", bf16_lm_head=False),
    "bf16_head": dict(precision="fp32", bf16_lm_head=True),
    "bf16": dict(precision="bf16", bf16_lm_head=False),
}


@dataclass
class BenchTrainConfig:
    """``python -m eyas.lab.bench_train`` (``bench_train`` in ``conf/bench_train.yaml``)."""

    vocab: list[int] = field(default_factory=lambda: [8192, 32768])
    """Draft vocabulary sizes (one run each)."""
    modes: list[str] = field(default_factory=lambda: list(MODES))
    """Precisions: ``fp32``, ``bf16_head`` (fp32 with a bf16 lm_head), ``bf16``."""
    oov: str = "teacher"
    """``train.oov_rule``: ``teacher`` or ``label``."""
    seq_len: list[int] = field(default_factory=lambda: [512])
    """Tokens per row (one run per length)."""
    samples: int = 6
    """Samples (= micro-batches) the steps cycle over."""
    steps: int = 4
    """Timed optimizer steps."""
    warmup: int = 1
    """Untimed steps first."""
    threads: int = 2
    ttt: int = 7
    """Training-time-test unroll length."""
    loss_fraction: float = 0.7
    """Share of each sample marked as assistant (loss) tokens."""
    optimizer: str = "auto"
    """``train.optimizer``: ``auto`` (the trainer's default: Muon here), ``muon`` or ``adamw``."""
    out: str | None = None
    """Also write the results as JSON here."""
    attention: list[str] | None = None
    """Time the TTT attention alone instead of training: ``[block]``, ``[dense]`` or both (``[]`` = both)."""
    rope_scaling: dict[str, Any] | None = None
    """The embedded target's rope scaling (as ``target.rope_scaling``), e.g. ``{rope_type: yarn, factor: 4.0,
    original_max_position_embeddings: 8192}`` (``target=smollm2_yarn``) for rows beyond its 8k window; the drafter's
    config takes it from the target as training does."""
    features: str = "target"
    """``target``: the target's own features of the random rows (one target forward per sample; ~5 min for a 32k
    row on 2 cores). ``random``: Gaussian aux and final hidden states of the same shapes and dtype, no target
    forward. A step's tokens/s and memory depend on the shapes, not on the values, so ``random`` measures long rows
    at the cost of the training alone."""

    def __post_init__(self) -> None:
        bad = sorted(set(self.modes) - set(MODES))
        if bad:
            raise ValueError(f"bench_train.modes: unknown {bad} (known: {list(MODES)})")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"bench_train.optimizer must be one of {OPTIMIZERS}, not {self.optimizer!r}")
        if self.oov not in ("teacher", "label"):
            raise ValueError(f"bench_train.oov must be 'teacher' or 'label', not {self.oov!r}")
        if self.attention is not None and set(self.attention) - {"block", "dense"}:
            raise ValueError(f"bench_train.attention: 'block' and/or 'dense', not {self.attention}")
        if self.features not in ("target", "random"):
            raise ValueError(f"bench_train.features must be 'target' or 'random', not {self.features!r}")
        if min(self.vocab + self.seq_len + [self.samples, self.steps, self.threads, self.ttt]) < 1:
            raise ValueError("bench_train: vocab, seq_len, samples, steps, threads and ttt must be positive")


def make_bundle(
    path: Path,
    samples: int,
    seq_len: int,
    loss_fraction: float,
    rope_scaling: dict[str, Any] | None = None,
    features: str = "target",
) -> None:
    """Run the embedded target over random sequences (or draw random features, ``features="random"``) and save
    everything the children need."""
    from eyas.serving.models.drafter import DrafterConfig
    from eyas.serving.models.target import TargetConfig, load_target
    from eyas.train.synthetic import batches_from_sequences, random_sequences
    from eyas.train.vocab import count_loss_tokens

    target = load_target(TargetConfig(device="cpu", rope_scaling=rope_scaling))
    seqs, masks = random_sequences(samples, seq_len, target.vocab_size, loss_fraction, seed=0)
    if features == "random":
        batches = random_feature_batches(target, seqs, masks)
    else:
        batches = batches_from_sequences(target, seqs, masks, batch_size=1, teacher="hidden")
    base = DrafterConfig.from_target(target.model.config, list(target.aux_layers), 1).to_dict()
    torch.save(
        {
            # plain dicts of tensors: the child loads the bundle with weights_only=True (no pickled classes)
            "batches": [{f.name: getattr(b, f.name) for f in fields(b)} for b in batches],
            "counts": count_loss_tokens(zip(seqs, masks), target.vocab_size),
            "drafter_config": base,
            "embedding": target.model.get_input_embeddings().weight.detach().float().clone(),
            "head_weight": target.head.weight.detach().clone(),
            "head_softcap": target.head.softcap,
            "head_scale": target.head.scale,
            "info": target.info.to_dict(),
            "target_dtype": str(target.dtype),
        },
        path,
    )


def random_feature_batches(target, seqs: list[torch.Tensor], masks: list[torch.Tensor]) -> list:
    """One batch per sequence with Gaussian aux [n, A * H] and final hidden [n, H] states in the target's dtype,
    the shapes :func:`train.synthetic.sample_features` gives, without running the target."""
    from eyas.train.sources import SampleFeatures, collate

    g = torch.Generator().manual_seed(0)
    width = len(target.aux_layers) * target.hidden_size
    out = []
    for i, (s, m) in enumerate(zip(seqs, masks)):
        n = s.numel()
        feats = SampleFeatures(
            id=f"s{i}",
            input_ids=s.long(),
            loss_mask=m.bool(),
            aux=torch.randn(n, width, generator=g).to(target.dtype),
        )
        feats.target_hidden = torch.randn(n, target.hidden_size, generator=g).to(target.dtype)
        out.append(collate([feats]))
    return out


class PeakRSS:
    """Peak resident set size of this process, sampled in a background thread."""

    def __init__(self, period: float = 0.02):
        import psutil

        self.proc = psutil.Process()
        self.period = period
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.period)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def run_child(args: SimpleNamespace) -> dict[str, Any]:
    """One configuration: build the drafter from the bundle, train, report tokens/s and memory."""
    import logging

    from eyas.data.types import Batch
    from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
    from eyas.serving.models.target import TargetHead
    from eyas.train.config import TrainConfig
    from eyas.train.sources import ListSource
    from eyas.train.trainer import fit
    from eyas.train.vocab import build_draft_vocab

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    b = torch.load(args.child, weights_only=True)
    b["batches"] = [Batch(**d) for d in b["batches"]]
    vocab = build_draft_vocab(b["counts"], args.vocab)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig(**{**b["drafter_config"], "draft_vocab_size": args.vocab}))
    drafter.set_embedding(b["embedding"])
    drafter.set_vocab_map(vocab.draft_to_target)
    head = TargetHead(b["head_weight"], softcap=b["head_softcap"], scale=b["head_scale"])
    del b["embedding"]
    out = Path(tempfile.mkdtemp(prefix="bench_train_"))
    cfg = TrainConfig(
        output_dir=str(out),
        max_steps=args.warmup + args.steps,
        lr=1e-4,
        warmup_steps=0,
        eval_every=0,
        save_every=0,
        log_every=1,
        threads=args.threads,
        progress=False,
        oov_rule=args.oov,
        wandb={"mode": "disabled"},
        ttt_steps=args.ttt,
        optimizer=args.optimizer,
        **MODES[args.mode],
    )
    baseline = PeakRSS().proc.memory_info().rss
    with PeakRSS() as mem:
        fit(cfg, drafter, ListSource(b["batches"], shuffle=False), None, head=head, target_info=b["info"])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in recs if r["kind"] == "train" and r["step"] > args.warmup]
    tokens = sum(r["tokens"] for r in timed)
    wall = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    return {
        "draft_vocab": args.vocab,
        "mode": args.mode,
        "oov_rule": args.oov,
        "threads": args.threads,
        "ttt_steps": args.ttt,
        "optimizer": args.optimizer,
        "tokens_per_s": tokens / wall,
        "step_s": wall / len(timed),
        "supervised_fraction": sum(r["supervised_tokens"] for r in timed) / tokens,
        "peak_rss_mib": mem.peak / 2**20,
        "peak_above_baseline_mib": (mem.peak - baseline) / 2**20,
        "coverage": vocab.coverage,
        "load_avg_1m": os.getloadavg()[0],
    }


def run_attention_child(args: SimpleNamespace) -> dict[str, Any]:
    """One (implementation, row length): the TTT unroll's attention alone, forward and backward."""
    from eyas.serving.models.ttt_attention import dense_ttt_attention, ttt_attention

    torch.set_num_threads(args.threads)
    t, steps = args.seq_len, args.ttt
    heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2-135M
    g = torch.Generator().manual_seed(0)
    q = [torch.randn(1, heads, t, head_dim, generator=g).requires_grad_() for _ in range(steps)]
    k = [torch.randn(1, kv_heads, t, head_dim, generator=g).requires_grad_() for _ in range(steps)]
    v = [torch.randn(1, kv_heads, t, head_dim, generator=g).requires_grad_() for _ in range(steps)]
    seg = torch.ones(1, t, dtype=torch.long)
    fn = ttt_attention if args.child_attention == "block" else dense_ttt_attention

    def once() -> float:
        t0 = time.perf_counter()
        loss = sum(
            fn(q[j], k[0], v[0], k[1 : j + 1], v[1 : j + 1], seg, head_dim**-0.5).square().mean()
            for j in range(steps)
        )
        loss.backward()
        return time.perf_counter() - t0

    baseline = PeakRSS().proc.memory_info().rss
    with PeakRSS() as mem:
        times = [once() for _ in range(args.warmup + args.steps)][args.warmup :]
    return {
        "attention": args.child_attention,
        "seq_len": t,
        "ttt_steps": steps,
        "threads": args.threads,
        "fwd_bwd_ms": 1e3 * min(times),
        "peak_rss_mib": mem.peak / 2**20,
        "peak_above_baseline_mib": (mem.peak - baseline) / 2**20,
        "load_avg_1m": os.getloadavg()[0],
    }


def _child(cmd: list[str]) -> dict[str, Any]:
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode or line is None:
        raise RuntimeError(f"benchmark child failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    return json.loads(line[7:])


def child_main(spec: str) -> None:
    """A child run: ``spec`` is the JSON of one configuration (the parent's settings, one vocab/mode/length)."""
    args = SimpleNamespace(**json.loads(spec))
    res = run_attention_child(args) if args.child_attention else run_child(args)
    print("RESULT " + json.dumps(res), flush=True)


def _spawn(args: BenchTrainConfig, **one: Any) -> dict[str, Any]:
    spec = {**asdict(args), "child_attention": None, **one}
    code = "import sys; from eyas.lab.bench_train import child_main; child_main(sys.argv[1])"
    return _child([sys.executable, "-c", code, json.dumps(spec)])


def run(args: BenchTrainConfig) -> list[dict[str, Any]]:
    """Every configuration of the sweep, each in its own child process; printed, and written to ``args.out``."""
    results = []
    if args.attention is not None:
        for seq_len in args.seq_len:
            for impl in args.attention or ["block", "dense"]:
                res = _spawn(args, child_attention=impl, seq_len=seq_len)
                results.append(res)
                print(
                    f"attention {impl:<5}  {seq_len:>5} tokens  {res['fwd_bwd_ms']:8.0f} ms fwd+bwd  "
                    f"peak RSS {res['peak_rss_mib']:7.0f} MiB (+{res['peak_above_baseline_mib']:.0f})  "
                    f"load {res['load_avg_1m']:.1f}",
                    flush=True,
                )
    else:
        for seq_len in args.seq_len:
            results += _train_runs(args, seq_len)
    _write(args, results)
    return results


def _write(args: BenchTrainConfig, results: list[dict[str, Any]]) -> None:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"seq_lens": args.seq_len, "results": results}, indent=1))


def _train_runs(args: BenchTrainConfig, seq_len: int) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "bundle.pt"
        make_bundle(bundle, args.samples, seq_len, args.loss_fraction, args.rope_scaling, args.features)
        for v in args.vocab:
            for mode in args.modes:
                res = {
                    "seq_len": seq_len,
                    **_spawn(args, child=str(bundle), vocab=v, mode=mode, seq_len=seq_len),
                }
                results.append(res)
                print(
                    f"{seq_len:>5} tokens/row  vocab {v:>6}  {mode:<9}  {args.optimizer}  {res['tokens_per_s']:7.1f} tokens/s  {res['step_s']:6.2f} s/step  "
                    f"peak RSS {res['peak_rss_mib']:7.0f} MiB (+{res['peak_above_baseline_mib']:.0f} training)  "
                    f"load {res['load_avg_1m']:.1f}",
                    flush=True,
                )
    return results


COMMAND = Command(
    "bench_train", "eyas.lab.bench_train", "bench_train", BenchTrainConfig, run, key="bench_train"
)
main = COMMAND.main


if __name__ == "__main__":
    main()
