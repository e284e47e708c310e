"""The trainer: ``Trainer(cfg, drafter, data, ...).train() -> TrainResult`` (``fit`` is that one line).

In torchtitan's shape: :class:`Trainer`'s construction does the setup (the run's identity, the output directory's
lock, the teacher, model / optimizer / scheduler through accelerate or DeepSpeed, resume, the logger);
:meth:`Trainer.train_step`, :meth:`Trainer.evaluate` and :meth:`Trainer.save` are methods and
:meth:`Trainer.train` is the loop over them.

Design decisions:
- accelerate carries every distribution mode: plain data parallel (DDP on GPU, gloo on CPU), DeepSpeed ZeRO-2/3
  (``accelerate launch --config_file conf/accelerate/zero3.yaml``), multi-node. The model it wraps is
  :class:`train.losses.DistillationModel` (drafter + loss in one forward); the frozen target head that builds the
  teacher stays outside it, replicated, since nothing trains it.
- The optimizer step consumes ``grad_accum`` micro-batches per process; their supervised-token count, summed over
  all processes, normalizes the loss (see train/losses.py), so DP x accumulation gives the gradient of one big
  batch. accelerate (and DeepSpeed) divide by ``grad_accum`` and DDP averages over processes, which the
  normalizer undoes exactly.
- The scheduler steps once per optimizer step (``step_scheduler_with_optimizer=False``: accelerate would
  otherwise step it once per process). Cosine decay with linear warm-up.
- A non-finite loss is checked on every micro-batch on every process (one small all-reduce) and stops the run
  with the step and the offending sample ids; checkpoints are only written after good steps, so the last one
  stays good.
- Checkpoints at ``save_every`` and at the end; held-out evaluation (simulated acceptance) at ``eval_every`` and
  at the end, before the checkpoint of the same step; ``best/`` keeps the drafter with the best metric.
- Held-out acceptance is simulated for chains of ``train.eval_chain_length`` drafts whatever ``ttt_steps`` is
  (the unroll runs the longer of the two; the loss weighs the training steps only), so τ_sim compares across
  TTT settings and speaks of the chain length served.
- One trainer per output directory (``train.guards.OutputDirLock``); SIGTERM / SIGINT save a checkpoint of the
  step reached and end the run with :class:`~train.guards.TrainingInterrupted` (``train.guards.StopSignals``).
- A DFlash block drafter (``serving.models.dflash``) is trained by the same loop: each micro-batch's blocks are
  drawn first (:func:`train.block_loss.plan_blocks`), its teacher is built at the positions their slots read, and
  :class:`train.block_loss.BlockDistillationModel` stands in for the TTT model; evaluation takes every anchor.
- Time is split into data wait (fetching the batches and moving them to the device) and compute.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from eyas.common import ensure_out_dir, json_hash
from eyas.data.types import Batch
from eyas.serving.models.dflash import DFlashDrafter
from eyas.serving.models.drafter import Eagle3Drafter
from eyas.serving.models.target import TargetHead
from eyas.train.block_loss import BlockDistillationModel, plan_blocks
from eyas.train.checkpoint import (
    TrainerState,
    checkpoints_root,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_best,
    save_checkpoint,
    trainable_weights,
)
from eyas.train.config import TrainConfig, resolve_mixed_precision
from eyas.train.deepspeed_cpu import build_cpu_comm_op
from eyas.train.guards import OutputDirLock, StopSignals, TrainingInterrupted
from eyas.train.losses import (
    ChainCounts,
    DistillationModel,
    LossOutput,
    VocabMaps,
    build_teacher,
    draft_head,
    supervised_positions,
)
from eyas.train.metrics import AcceptanceEstimate, MetricsLogger, simulated_acceptance
from eyas.train.optim import build_optimizer, deepspeed_launch, resolve_optimizer
from eyas.train.sources import BatchSource

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; names the step and the samples of the offending micro-batches."""

    def __init__(self, message: str, step: int, sample_ids: list[str]):
        super().__init__(message)
        self.step = step
        self.sample_ids = sample_ids


class EmptyDataError(ValueError):
    """The training split has no batches."""


@dataclass
class EvalResult:
    """Held-out metrics at one step."""

    loss: float
    """Weighted CE per supervised token (the training objective) on the held-out split."""
    acceptance: AcceptanceEstimate
    step_loss: list[float]
    step_acc: list[float]
    """Teacher-forced accuracy over in-vocabulary loss rows (what the training log shows), per unrolled step."""
    chain_length: int
    """Drafts per simulated chain (``train.eval_chain_length``): the K of the τ estimates."""

    def metric(self, name: str) -> float:
        return {
            "tau_chain": self.acceptance.tau_chain,
            "tau_served": self.acceptance.tau_served,
            "tau_indep": self.acceptance.tau_indep,
            "loss": self.loss,
        }[name]

    def to_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss,
            "step_loss": self.step_loss,
            "step_acc": self.step_acc,
            "tau_chain": self.acceptance.tau_chain,
            "tau_indep": self.acceptance.tau_indep,
            "acc": self.acceptance.acc,
            "cond_acc": self.acceptance.cond_acc,
            "tau_served": self.acceptance.tau_served,
            "served_cond_acc": self.acceptance.served_cond_acc,
            "rows": self.acceptance.rows,
            "chain_length": self.chain_length,
        }


@dataclass
class TrainResult:
    """What a finished (or already finished) run reports."""

    steps: int
    """Optimizer steps the run has reached (total, including resumed ones)."""
    steps_this_run: int
    output_dir: str
    resumed_from: str | None
    last_checkpoint: str | None
    best_dir: str | None
    best_value: float | None
    best_step: int | None
    final_eval: dict[str, Any] | None
    last_train: dict[str, Any] = field(default_factory=dict)
    """The last logged training metrics."""
    tokens: int = 0
    """Tokens processed in this run (all processes)."""
    train_seconds: float = 0.0
    tokens_per_s: float = 0.0
    metrics_path: str = ""


# -- setup helpers ----------------------------------------------------------------------------------------------
def make_accelerator(cfg: TrainConfig):
    """The Accelerator for ``cfg`` (the launch config picks DDP / DeepSpeed / CPU; this picks precision)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    handlers: list[Any] = [DistributedDataParallelKwargs(broadcast_buffers=False)]
    deepspeed = deepspeed_launch()
    gpu = torch.cuda.is_available()
    if deepspeed and not gpu:
        # accelerate finds no device backend on a CPU-only machine and would leave every DeepSpeed process
        # thinking it is alone (rank 0 of 1); naming gloo makes it set up the real process group
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
        # DeepSpeed JIT-builds its CPU collective op here; a dead build's lock file would hang this run forever
        build_cpu_comm_op()
    from accelerate.state import AcceleratorState

    mixed = resolve_mixed_precision(cfg.precision)
    state = AcceleratorState._shared_state
    if (
        state
        and state.get("_mixed_precision") not in (None, mixed)
        and not torch.distributed.is_initialized()
    ):
        # a single process that trains twice with another precision (the pipeline, tests): accelerate's state
        # is a process-wide singleton that refuses the change, so start it afresh
        AcceleratorState._reset_state()
    return Accelerator(
        # without GPUs, plain data parallel must be told it runs on CPUs (then it joins a gloo group)
        cpu=not gpu and not deepspeed,
        gradient_accumulation_steps=cfg.grad_accum,
        mixed_precision=mixed,
        kwargs_handlers=handlers,
        step_scheduler_with_optimizer=False,
    )


def cosine_with_warmup(warmup: int, total: int, min_ratio: float):
    """LR multiplier of optimizer step ``s`` (0-based): linear warm-up to 1, then cosine to ``min_ratio``."""

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def wsd_with_warmup(warmup: int, total: int, min_ratio: float, decay_ratio: float):
    """LR multiplier of optimizer step ``s`` (0-based): linear warm-up to 1, held there, then a linear decay to
    ``min_ratio`` over the last ``decay_ratio`` of the ``total`` steps (warm-up, stable, decay)."""
    decay = max(1, round(decay_ratio * total))
    start = max(warmup, total - decay)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if s < start:
            return 1.0
        progress = min(1.0, (s - start) / max(1, total - start))
        return 1.0 - (1.0 - min_ratio) * progress

    return factor


def lr_schedule(cfg: TrainConfig, total: int):
    """The LR multiplier of ``train.schedule`` over ``total`` optimizer steps."""
    warmup = cfg.warmup_for(total)
    if cfg.schedule == "wsd":
        return wsd_with_warmup(warmup, total, cfg.min_lr_ratio, cfg.decay_ratio)
    return cosine_with_warmup(warmup, total, cfg.min_lr_ratio)


def total_steps(cfg: TrainConfig, data: Any) -> int:
    if cfg.epochs is None:
        return cfg.max_steps
    if not hasattr(data, "__len__"):
        raise ValueError("train.epochs needs a data source with a length; set train.max_steps instead")
    return max(1, math.ceil(cfg.epochs * len(data) / cfg.grad_accum))


def _configure_deepspeed(accelerator, cfg: TrainConfig) -> None:
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = 1  # batches come from our own source; the value is nominal
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = float(cfg.max_grad_norm)
    if "optimizer" in ds or "scheduler" in ds:
        raise ValueError(
            "the DeepSpeed config declares an optimizer/scheduler; eyas passes its own optimizer and cosine schedule "
            "(train.lr...), so remove those sections (see conf/deepspeed/*.json)"
        )


def _check_data_target(data: Any, target_info: dict[str, Any] | None) -> None:
    """Refuse a feature store written by another target or tokenizer (when the source exposes its manifest)."""
    if target_info is None:
        return
    manifest = getattr(data, "manifest", None)
    for attr in ("source", "store"):  # data.loader.FeatureLoader keeps its FeatureStore as .source
        manifest = manifest or getattr(getattr(data, attr, None), "manifest", None)
    if manifest is None:
        return
    from eyas.data.store import check_target

    check_target(manifest.target, target_info, where=f"the training data ({type(data).__name__})")


def _resume_path(cfg: TrainConfig, root: Path) -> Path | None:
    if cfg.resume == "never":
        if list_checkpoints(root):
            raise FileExistsError(
                f"{root} already holds checkpoints and train.resume=never; pick another train.output_dir or "
                "resume with train.resume=auto"
            )
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(root)
    p = Path(cfg.resume)
    if not p.is_dir():
        raise FileNotFoundError(f"train.resume={cfg.resume}: no such checkpoint directory")
    return p


class _Batches:
    """Endless iteration over epochs of a BatchSource; a source empty twice in a row is an error."""

    def __init__(self, source: BatchSource):
        self.source = source
        self.it = iter(source)

    def next(self) -> Batch:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.source)
            try:
                return next(self.it)
            except StopIteration:
                raise EmptyDataError(
                    "the training split has no batches: check the feature store / corpus (and the held-out "
                    "fraction), or lower the number of processes"
                ) from None


# -- distributed helpers ----------------------------------------------------------------------------------------
def _sum(accelerator, x: torch.Tensor) -> torch.Tensor:
    return accelerator.reduce(x, "sum") if accelerator.num_processes > 1 else x


def _reduce_int(accelerator, n: int, op) -> int:
    if accelerator.num_processes == 1:
        return n
    t = torch.tensor([n], dtype=torch.long, device=accelerator.device)
    torch.distributed.all_reduce(t, op=op)
    return int(t.item())


def _min_int(accelerator, n: int) -> int:
    return _reduce_int(accelerator, n, torch.distributed.ReduceOp.MIN)


def _max_int(accelerator, n: int) -> int:
    return _reduce_int(accelerator, n, torch.distributed.ReduceOp.MAX)


def _check_finite(accelerator, loss: torch.Tensor, step: int, batch: Batch) -> None:
    bad = torch.tensor([0.0 if bool(torch.isfinite(loss.detach())) else 1.0], device=accelerator.device)
    if float(_sum(accelerator, bad).item()) == 0.0:
        return
    from accelerate.utils import gather_object

    mine = [sid for row in batch.sample_ids for sid in row] if not bool(torch.isfinite(loss.detach())) else []
    ids = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    culprits = [s for part in ids for s in part]
    raise NonFiniteLossError(
        f"non-finite loss at step {step} on samples {culprits[:20]}; the last good checkpoint is kept. Drop these "
        "samples (or lower train.lr) and resume",
        step=step,
        sample_ids=culprits,
    )


# -- evaluation -------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    accelerator,
    model,
    batches: Sequence[Batch],
    teacher_kw: dict[str, Any],
    step_weights: list[float],
    chain_length: int | None = None,
    blocks: bool = False,
) -> EvalResult | None:
    """Simulated acceptance of chains of ``chain_length`` drafts (default: ``len(step_weights)``) and the loss on
    held-out batches (every process its own list, same length). The drafter is unrolled
    ``max(chain_length, len(step_weights))`` steps; the loss weighs the training steps only. ``blocks``: a DFlash
    drafter's model, given every anchor of each batch (``train.block_loss``)."""
    k = chain_length or len(step_weights)
    n = max(k, len(step_weights))
    dev = accelerator.device
    chain = ChainCounts(*(torch.zeros(k, device=dev) for _ in range(6)))
    ce, count, correct = (torch.zeros(n, device=dev) for _ in range(3))
    positions = torch.zeros(1, device=dev)
    for b in batches:
        b = b.to(dev)
        teacher = build_teacher(b, **teacher_kw)
        extra = {"anchors": plan_blocks(b, n).anchors} if blocks else {}
        out = model(
            b.input_ids,
            b.aux,
            b.position_ids,
            b.segment_ids,
            teacher,
            1.0,
            with_chain=True,
            chain_steps=k,
            **extra,
        )
        for total, part in zip(chain.tensors(), out.chain.tensors()):
            total.add_(part)
        ce += out.ce_sum
        count += out.count
        correct += out.correct
        positions += teacher.num_positions
    flat = _sum(accelerator, torch.cat([*chain.tensors(), ce, count, correct, positions]))
    chain = ChainCounts(*(x.cpu() for x in flat[: 6 * k].view(6, k)))
    ce, count, correct = flat[6 * k : 6 * k + 3 * n].view(3, n)
    if float(flat[-1]) == 0:
        return None
    w = torch.tensor(list(step_weights) + [0.0] * (n - len(step_weights)), device=dev)
    return EvalResult(
        loss=float((w * ce).sum() / flat[-1]),
        acceptance=simulated_acceptance(chain),
        step_loss=(ce / count.clamp(min=1)).tolist(),
        step_acc=(correct / count.clamp(min=1)).tolist(),
        chain_length=k,
    )


def teacher_kwargs(
    cfg: TrainConfig, drafter: Eagle3Drafter | DFlashDrafter, head: TargetHead | None, dev
) -> dict[str, Any]:
    """How :func:`train.losses.build_teacher` builds this run's teachers: frozen head copies on this device (the
    full head only where the OOV rule or the acceptance metrics need it)."""
    maps = VocabMaps.from_draft_ids(drafter.draft_to_target.cpu(), drafter.config.vocab_size).to(dev)
    full_head = None
    if head is not None:
        full_head = TargetHead(
            head.weight.detach().to(dev),
            None if head.bias is None else head.bias.detach().to(dev),
            softcap=head.softcap,
            scale=head.scale,
        )
    return dict(
        maps=maps,
        form=cfg.teacher,
        oov_rule=cfg.oov_rule,
        temperature=cfg.teacher_temperature,
        head=full_head,  # the OOV rule teacher, and the acceptance metrics of either rule
        draft_rows_head=draft_head(full_head, maps)
        if full_head is not None and cfg.oov_rule == "label"
        else None,
    )


def _best_chain_length(out_dir: Path) -> int | None:
    """The chain length ``best/`` was measured at (None: no best/, or one from before the setting)."""
    try:
        return json.loads((out_dir / "best" / "metrics.json").read_text()).get("chain_length")
    except (OSError, ValueError, AttributeError):
        return None


# -- the trainer ------------------------------------------------------------------------------------------------
@dataclass
class StepOutput:
    """One optimizer step on this process."""

    losses: list[LossOutput]
    """Each micro-batch's loss and statistics."""
    tokens: list[int]
    """Each micro-batch's real (non-padding) tokens."""
    supervised: float
    """Supervised positions of the step over all processes (the loss normalizer)."""
    grad_norm: Any = None
    """The global gradient norm before clipping (None where accelerate does not report it)."""


class Trainer:
    """One training run (see the module docstring). Construction does the setup: the run's identity, the output
    directory's lock, the teacher, model / optimizer / scheduler through accelerate (or DeepSpeed), resume and
    the metrics logger; :meth:`train` is the loop over :meth:`train_step`, :meth:`evaluate` and :meth:`save`.

    head: the target's frozen LM head (needed for batches carrying ``target_hidden``). target_info: the target's
    TargetInfo (or its dict), recorded in checkpoints and checked against the data's manifest. accelerator: an
    existing ``accelerate.Accelerator`` (default: :func:`make_accelerator`). extra_identity: anything else a
    resumed run must share (e.g. the data's fingerprint).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        drafter: Eagle3Drafter | DFlashDrafter,
        data: BatchSource,
        eval_data: Iterable[Batch] | None = None,
        *,
        head: TargetHead | None = None,
        target_info: Any = None,
        accelerator=None,
        extra_identity: dict[str, Any] | None = None,
    ):
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg, self.drafter, self.data = cfg, drafter, data
        # a DFlash block drafter trains on blocks at anchors (train.block_loss), not on a TTT unroll
        self.blocks = isinstance(drafter, DFlashDrafter)
        self.acc = accelerator or make_accelerator(cfg)
        self.device = self.acc.device
        self.info = target_info.to_dict() if hasattr(target_info, "to_dict") else target_info
        _check_data_target(data, self.info)
        if hasattr(data, "__len__") and len(data) == 0:
            raise EmptyDataError(
                "the training split is empty: no batches to train on (check the data source)"
            )
        self.total_steps = total_steps(cfg, data)
        self.optimizer_name = self._resolve_optimizer()
        self.identity = self._run_identity(extra_identity)
        self.out_dir = ensure_out_dir(cfg.output_dir, "train.output_dir")
        self.lock = OutputDirLock(self.out_dir, self.acc)  # before anything is written into the directory
        self.logger: MetricsLogger | None = None
        try:
            self.root = checkpoints_root(self.out_dir)
            self.resumed_from = _resume_path(cfg, self.root)
            self.teacher_kw = teacher_kwargs(cfg, drafter, head, self.device)
            self.model, self.optimizer, self.scheduler = self._prepare()
            self.state = self._initial_state()
            self.logger = self._open_logger()
            self.eval_batches = self._held_out(eval_data)
        except BaseException:
            self.close()
            raise
        self.step = self.state.step
        self.last_checkpoint: Path | None = self.resumed_from
        self.drafter_config = drafter.config.to_dict()
        self.weights = torch.tensor(cfg.step_weights, device=self.device)
        self.run_tokens = 0
        self.last_train: dict[str, Any] = {}

    # -- setup ----------------------------------------------------------------------------------------------
    def _resolve_optimizer(self) -> str:
        cfg = self.cfg
        name = resolve_optimizer(cfg.optimizer, deepspeed=self.acc.state.deepspeed_plugin is not None)
        if self.acc.is_main_process:
            muon_lr = cfg.muon_lr if name == "muon" else None
            log.info(
                "optimizer: %s (train.optimizer=%s), lr %g%s, %s schedule",
                name,
                cfg.optimizer,
                cfg.lr,
                f", Muon lr {muon_lr:g}" if muon_lr is not None else "",
                cfg.schedule,
            )
            if cfg.muon_lr is not None and muon_lr is None:
                log.warning("train.muon_lr=%g is not used: the optimizer resolved to AdamW", cfg.muon_lr)
        return name

    def _run_identity(self, extra: dict[str, Any] | None) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it (its hash is the checkpoint's config_hash)."""
        return {
            "train": self.cfg.identity(self.optimizer_name),
            "total_steps": self.total_steps,
            "drafter": self.drafter.config.to_dict(),
            "draft_vocab": json_hash({"ids": self.drafter.draft_to_target.cpu().tolist()}),
            "target": self.info,
            "world_size": self.acc.num_processes,
            **(extra or {}),
        }

    def _prepare(self):
        """The distillation model, optimizer and LR schedule, wrapped by accelerate (DDP or DeepSpeed)."""
        cfg = self.cfg
        if self.blocks:  # the DFlash head is the target's, frozen
            return self._wrap(
                BlockDistillationModel(
                    self.drafter,
                    cfg.step_weights,
                    bf16_head=cfg.bf16_lm_head,
                    loss=cfg.loss,
                    loss_weight=cfg.loss_weight,
                )
            )
        self.drafter.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
        model = DistillationModel(
            self.drafter,
            cfg.step_weights,
            bf16_head=cfg.bf16_lm_head,
            feature_weight=cfg.feature_weight,
            miss_weight=cfg.miss_weight,
            loss=cfg.loss,
            loss_weight=cfg.loss_weight,
        )
        return self._wrap(model)

    def _wrap(self, model):
        """``model``'s optimizer and LR schedule, all three wrapped by accelerate (DDP or DeepSpeed)."""
        cfg, acc = self.cfg, self.acc
        optimizer = build_optimizer(
            model,
            self.optimizer_name,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=cfg.betas,
            eps=cfg.adam_eps,
            # fused: one kernel per step instead of a chain of foreach ops
            fused=self.device.type in ("cpu", "cuda"),
            muon_lr=cfg.muon_lr if self.optimizer_name == "muon" else None,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg, self.total_steps))
        _configure_deepspeed(acc, cfg)
        model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
        if acc.gradient_accumulation_steps != cfg.grad_accum:
            raise ValueError(
                f"the DeepSpeed config sets gradient_accumulation_steps={acc.gradient_accumulation_steps} but "
                f'train.grad_accum={cfg.grad_accum}; set it to "auto" in the DeepSpeed config'
            )
        return model, optimizer, scheduler

    def _initial_state(self) -> TrainerState:
        """A fresh state, or the resumed checkpoint's (model, optimizer, schedule, RNG and data loaded in place)."""
        cfg = self.cfg
        state = TrainerState(
            step=0,
            config_hash=json_hash(self.identity),
            identity=self.identity,
            world_size=self.acc.num_processes,
        )
        if self.resumed_from is not None:
            loaded = load_checkpoint(
                self.resumed_from,
                accelerator=self.acc,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                config_hash=state.config_hash,
                identity=self.identity,
            )
            state = loaded.state
            self.data.load_state_dict(loaded.data_state)
            self._forget_incomparable_best(state)
        state.best_metric = cfg.best_metric
        return state

    def _forget_incomparable_best(self, state: TrainerState) -> None:
        """A best value of another metric, or of τ at another chain length, says nothing about this run's values
        (a loss of ~4 is never below a tau_chain of ~1; τ at 7 drafts beats τ at 6): start a new best."""
        cfg = self.cfg
        if state.best_value is None:
            return
        k = _best_chain_length(self.out_dir)
        if state.best_metric != cfg.best_metric:
            why = f"was picked by {state.best_metric or 'an earlier metric'}; train.best_metric is now {cfg.best_metric}"
        elif cfg.best_metric != "loss" and k != cfg.eval_chain_length:
            why = f"was picked on chains of {k or 'ttt_steps'} drafts; train.eval_chain_length is now {cfg.eval_chain_length}"
        else:
            return
        log.warning("best/ (step %s) %s: the next evaluation starts a new best", state.best_step, why)
        state.best_value = state.best_step = None

    def _open_logger(self) -> MetricsLogger:
        logger = MetricsLogger(
            self.out_dir,
            enabled=self.acc.is_main_process,
            wandb_cfg=self.cfg.wandb,
            run_config={
                "train": self.identity["train"],
                "drafter": self.drafter.config.to_dict(),
                "target": self.info,
            },
            resume_step=self.state.step if self.resumed_from is not None else None,
            wandb_id=self.state.wandb_id,
        )
        self.state.wandb_id = logger.wandb_id
        return logger

    def _held_out(self, eval_data: Iterable[Batch] | None) -> list[Batch]:
        """The first ``eval_batches`` held-out batches (as many on every process)."""
        if eval_data is None:
            return []
        n = self.cfg.eval_batches
        batches = list(islice(eval_data, n) if n else eval_data)
        return batches[: _min_int(self.acc, len(batches))]

    # -- the loop -------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Step to ``total_steps``, evaluating and saving on schedule (see the module docstring). SIGTERM or
        SIGINT: a checkpoint of the step reached, then :class:`TrainingInterrupted`."""
        cfg, start = self.cfg, self.step
        batches = _Batches(self.data)
        bar = tqdm(
            total=self.total_steps,
            initial=start,
            desc="train",
            dynamic_ncols=True,
            disable=not (cfg.progress and self.acc.is_main_process),
        )
        window = _Window(cfg.ttt_steps, self.device)
        final_eval: EvalResult | None = None
        run_start = time.perf_counter()
        try:
            with StopSignals() as signals:
                while self.step < self.total_steps:
                    t0 = time.perf_counter()
                    micro = [batches.next().to(self.device) for _ in range(cfg.grad_accum)]
                    t1 = time.perf_counter()
                    out = self.train_step(micro)
                    window.add_step(out, data_s=t1 - t0, compute_s=time.perf_counter() - t1)
                    bar.update(1)
                    self._log_train(window, out.grad_norm, bar)
                    res = self._evaluate_and_save_on_schedule()
                    if self.step == self.total_steps:
                        final_eval = res
                    self._stop_if_signalled(signals)
            if start >= self.total_steps:
                log.info(
                    "nothing to train: the checkpoint is already at step %d of %d", start, self.total_steps
                )
                final_eval = self.evaluate()
        finally:
            bar.close()
            self.close()
        return self._result(start, final_eval, time.perf_counter() - run_start)

    def train_step(self, micro: list[Batch]) -> StepOutput:
        """One optimizer step over ``grad_accum`` micro-batches (on the device) on every process."""
        acc, cfg = self.acc, self.cfg
        plans = [plan_blocks(b, cfg.ttt_steps, cfg.block_anchors) if self.blocks else None for b in micro]
        teachers = [
            build_teacher(b, **self.teacher_kw, keep_oov=False, only=None if p is None else p.targets)
            for b, p in zip(micro, plans)
        ]
        n_local = sum(int(supervised_positions(b).sum()) for b in micro)  # OOV rows count: they are tokens
        # one all-reduce: supervised positions (the normalizer) and tokens (TrainerState.tokens_seen)
        counts = _sum(
            acc, torch.tensor([float(n_local), float(sum(b.num_tokens for b in micro))], device=self.device)
        )
        normalizer = counts[:1].clamp(min=1.0) / (acc.num_processes * cfg.grad_accum)
        losses, grad_norm = [], None
        for b, teacher, plan in zip(micro, teachers, plans):
            extra = {} if plan is None else {"anchors": plan.anchors}
            with acc.accumulate(self.model):
                out = self.model(
                    b.input_ids, b.aux, b.position_ids, b.segment_ids, teacher, normalizer, **extra
                )
                _check_finite(acc, out.loss, self.step + 1, b)
                acc.backward(out.loss)
                if acc.sync_gradients:
                    grad_norm = self._optimizer_step(micro)
            losses.append(out)
        if not acc.sync_gradients:
            raise RuntimeError("accelerate's accumulation counter is out of step with train.grad_accum")
        self.step += 1
        self.state.tokens_seen += int(counts[1].item())  # every real token of the step, all processes
        return StepOutput(losses, [b.num_tokens for b in micro], float(counts[0].item()), grad_norm)

    def _optimizer_step(self, micro: list[Batch]):
        """Clip (a non-finite norm stops the run, naming the samples), step the optimizer and the schedule."""
        cfg = self.cfg
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
        grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), max_norm)
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            ids = [s for mb in micro for row in mb.sample_ids for s in row]
            raise NonFiniteLossError(
                f"non-finite gradient norm at step {self.step + 1} (samples {ids[:20]}); the last good "
                "checkpoint is kept. Lower train.lr or drop these samples and resume",
                step=self.step + 1,
                sample_ids=ids,
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _log_train(self, window: _Window, grad_norm, bar) -> None:
        step = self.step
        if not (step % max(self.cfg.log_every, 1) == 0 or step == self.total_steps):
            return
        rec = window.flush(self.acc, self.weights)
        rec.update(
            lr=float(self.scheduler.get_last_lr()[0]),
            grad_norm=None if grad_norm is None else float(grad_norm),
        )
        self.run_tokens += rec["tokens"]
        self.logger.log(step, "train", rec)
        self.last_train = rec
        bar.set_postfix(
            loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc'][0]:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}"
        )
        log.debug("step %d %s", step, rec)

    def _evaluate_and_save_on_schedule(self) -> EvalResult | None:
        """Evaluate, then save, where ``eval_every`` / ``save_every`` fall on this step (both at the last step)."""
        cfg, step, last = self.cfg, self.step, self.step == self.total_steps
        res = self.evaluate() if cfg.eval_every and step % cfg.eval_every == 0 or last else None
        if cfg.save_every and step % cfg.save_every == 0 or last:
            self.save()
        return res

    def _stop_if_signalled(self, signals: StopSignals) -> None:
        """After a step: if any process got SIGTERM / SIGINT, all save this step (unless just saved) and stop."""
        signum = _max_int(self.acc, signals.signum or 0)
        if not signum:
            return
        if self.state.step != self.step:
            self.save()
        raise TrainingInterrupted(signum, self.step, str(self.last_checkpoint))

    # -- evaluation and checkpoints -------------------------------------------------------------------------
    def evaluate(self) -> EvalResult | None:
        """Held-out metrics at the current step (chains of ``train.eval_chain_length`` drafts), logged; ``best/``
        replaced when they are the best so far."""
        if not self.eval_batches:
            return None
        cfg = self.cfg
        res = evaluate(
            self.acc,
            self.model,
            self.eval_batches,
            self.teacher_kw,
            cfg.step_weights,
            cfg.eval_chain_length,
            blocks=self.blocks,
        )
        if res is None:
            return None
        self.logger.log(self.step, "eval", res.to_dict())
        if self.acc.is_main_process:
            log.info(
                "eval step %d (K=%d): tau_chain %.3f tau_served %.3f tau_indep %.3f loss %.4f acc %s",
                self.step,
                res.chain_length,
                res.acceptance.tau_chain,
                res.acceptance.tau_served,
                res.acceptance.tau_indep,
                res.loss,
                [round(a, 3) for a in res.acceptance.acc],
            )
        self._keep_best(res)
        return res

    def _keep_best(self, res: EvalResult) -> None:
        cfg, state = self.cfg, self.state
        value = res.metric(cfg.best_metric)
        better = state.best_value is None or (
            value < state.best_value if cfg.best_metric == "loss" else value > state.best_value
        )
        if not better:
            return
        state.best_value, state.best_step = value, self.step
        weights = trainable_weights(self.acc, self.model)  # collective under ZeRO-3
        if self.acc.is_main_process:
            save_best(
                self.out_dir / "best",
                weights,
                self.drafter_config,
                {"step": self.step, "metric": cfg.best_metric, "value": value, **res.to_dict()},
            )

    def save(self) -> Path:
        """A checkpoint of the current step (collective: every process calls it)."""
        self.state.step = self.step
        self.last_checkpoint = save_checkpoint(
            self.root,
            self.state,
            accelerator=self.acc,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data_state=self.data.state_dict(),
            drafter_config=self.drafter_config,
            keep_last=self.cfg.keep_last,
        )
        return self.last_checkpoint

    def close(self) -> None:
        """Close the logger and release the output directory (idempotent)."""
        if self.logger is not None:
            self.logger.close()
        self.lock.release()

    def _result(self, start: int, final_eval: EvalResult | None, elapsed: float) -> TrainResult:
        state = self.state
        return TrainResult(
            steps=self.step,
            steps_this_run=self.step - start,
            output_dir=str(self.out_dir),
            resumed_from=None if self.resumed_from is None else str(self.resumed_from),
            last_checkpoint=None if self.last_checkpoint is None else str(self.last_checkpoint),
            best_dir=str(self.out_dir / "best") if state.best_value is not None else None,
            best_value=state.best_value,
            best_step=state.best_step,
            final_eval=None if final_eval is None else final_eval.to_dict(),
            last_train=self.last_train,
            tokens=self.run_tokens,
            train_seconds=elapsed,
            tokens_per_s=self.run_tokens / elapsed if elapsed > 0 else 0.0,
            metrics_path=str(self.logger.path),
        )


def fit(
    cfg: TrainConfig,
    drafter: Eagle3Drafter | DFlashDrafter,
    data: BatchSource,
    eval_data: Iterable[Batch] | None = None,
    *,
    head: TargetHead | None = None,
    target_info: Any = None,
    accelerator=None,
    extra_identity: dict[str, Any] | None = None,
) -> TrainResult:
    """Train ``drafter`` on this process's ``data``: :class:`Trainer` (its arguments) set up, then trained."""
    return Trainer(
        cfg,
        drafter,
        data,
        eval_data,
        head=head,
        target_info=target_info,
        accelerator=accelerator,
        extra_identity=extra_identity,
    ).train()


class _Window:
    """Sums of the training statistics between two log lines."""

    def __init__(self, k: int, dev: torch.device):
        self.k, self.dev = k, dev
        self.reset()

    def reset(self) -> None:
        z = lambda: torch.zeros(self.k, device=self.dev)  # noqa: E731
        self.ce, self.count, self.correct = z(), z(), z()
        self.feature = torch.zeros(1, device=self.dev)
        self.tokens = 0
        self.n_supervised = 0.0
        self.data_s = self.compute_s = 0.0
        self.start = time.perf_counter()

    def add_step(self, step: StepOutput, data_s: float, compute_s: float) -> None:
        for out, tokens in zip(step.losses, step.tokens):
            self.add(out, tokens)
        self.n_supervised += step.supervised  # already summed over processes
        self.data_s += data_s
        self.compute_s += compute_s

    def add(self, out, tokens: int) -> None:
        self.ce += out.ce_sum
        self.count += out.count
        self.correct += out.correct
        if out.feature_sum is not None:
            self.feature += out.feature_sum
        self.tokens += tokens

    def flush(self, accelerator, w: torch.Tensor) -> dict[str, Any]:
        wall = time.perf_counter() - self.start
        flat = _sum(
            accelerator,
            torch.cat(
                [
                    self.ce,
                    self.count,
                    self.correct,
                    torch.tensor([float(self.tokens)], device=self.dev),
                    self.feature,
                ]
            ),
        )
        k = self.k
        ce, count, correct = flat[:k], flat[k : 2 * k], flat[2 * k : 3 * k]
        tokens, n_sup = int(flat[3 * k]), self.n_supervised
        rec = {
            "loss": float((w * ce).sum() / max(n_sup, 1.0)),
            "step_loss": (ce / count.clamp(min=1)).tolist(),
            "acc": (correct / count.clamp(min=1)).tolist(),
            "tokens": tokens,
            "supervised_tokens": int(n_sup),
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "data_wait_s": self.data_s,
            "compute_s": self.compute_s,
            "data_wait_frac": self.data_s / wall if wall > 0 else 0.0,
        }
        feature = float(flat[3 * k + 1])
        if feature > 0:
            rec["feature_loss"] = feature / max(n_sup, 1.0)
        self.reset()
        return rec
