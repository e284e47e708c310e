"""The training loop: ``fit(cfg, drafter, data, ...) -> TrainResult``.

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
- Time is split into data wait (fetching the batches and moving them to the device) and compute.
"""

from __future__ import annotations

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
from eyas.serving.models.drafter import Eagle3Drafter
from eyas.serving.models.target import TargetHead
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
from eyas.train.losses import (
    ChainCounts,
    DistillationModel,
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
    """Teacher-forced accuracy over in-vocabulary loss rows (what the training log shows)."""

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


def _min_int(accelerator, n: int) -> int:
    if accelerator.num_processes == 1:
        return n
    t = torch.tensor([n], dtype=torch.long, device=accelerator.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


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
    accelerator, model, batches: Sequence[Batch], teacher_kw: dict[str, Any], step_weights: list[float]
) -> EvalResult | None:
    """Simulated acceptance and loss on held-out batches (every process its own list, same length)."""
    k = len(step_weights)
    dev = accelerator.device
    chain = ChainCounts(*(torch.zeros(k, device=dev) for _ in range(6)))
    ce = torch.zeros(k, device=dev)
    count = torch.zeros(k, device=dev)
    correct = torch.zeros(k, device=dev)
    positions = torch.zeros(1, device=dev)
    for b in batches:
        b = b.to(dev)
        teacher = build_teacher(b, **teacher_kw)
        out = model(b.input_ids, b.aux, b.position_ids, b.segment_ids, teacher, 1.0, with_chain=True)
        for total, part in zip(chain.tensors(), out.chain.tensors()):
            total.add_(part)
        ce += out.ce_sum
        count += out.count
        correct += out.correct
        positions += teacher.num_positions
    flat = _sum(
        accelerator,
        torch.cat([*chain.tensors(), ce, count, correct, positions]),
    )
    chain = ChainCounts(*(x.cpu() for x in flat[: 6 * k].view(6, k)))
    ce, count, correct = flat[6 * k : 7 * k], flat[7 * k : 8 * k], flat[8 * k : 9 * k]
    n = float(flat[-1])
    if n == 0:
        return None
    w = torch.tensor(step_weights, device=dev)
    return EvalResult(
        loss=float((w * ce).sum() / n),
        acceptance=simulated_acceptance(chain),
        step_loss=(ce / count.clamp(min=1)).tolist(),
        step_acc=(correct / count.clamp(min=1)).tolist(),
    )


# -- fit --------------------------------------------------------------------------------------------------------
def fit(
    cfg: TrainConfig,
    drafter: Eagle3Drafter,
    data: BatchSource,
    eval_data: Iterable[Batch] | None = None,
    *,
    head: TargetHead | None = None,
    target_info: Any = None,
    accelerator=None,
    extra_identity: dict[str, Any] | None = None,
) -> TrainResult:
    """Train ``drafter`` on this process's ``data`` (see the module docstring).

    head: the target's frozen LM head (needed for batches carrying ``target_hidden``). target_info: the target's
    TargetInfo (or its dict), recorded in checkpoints and checked against the data's manifest. accelerator: an
    existing ``accelerate.Accelerator`` (default: :func:`make_accelerator`). extra_identity: anything else a
    resumed run must share (e.g. the data's fingerprint).
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    acc = accelerator or make_accelerator(cfg)
    dev = acc.device
    world = acc.num_processes
    info = target_info.to_dict() if hasattr(target_info, "to_dict") else target_info
    _check_data_target(data, info)
    if hasattr(data, "__len__") and len(data) == 0:
        raise EmptyDataError("the training split is empty: no batches to train on (check the data source)")
    n_steps = total_steps(cfg, data)
    vocab_ids = drafter.draft_to_target.cpu()
    optimizer_name = resolve_optimizer(cfg.optimizer, deepspeed=acc.state.deepspeed_plugin is not None)
    muon_lr = cfg.muon_lr if optimizer_name == "muon" else None
    if acc.is_main_process:
        log.info(
            "optimizer: %s (train.optimizer=%s), lr %g%s, %s schedule",
            optimizer_name,
            cfg.optimizer,
            cfg.lr,
            f", Muon lr {muon_lr:g}" if muon_lr is not None else "",
            cfg.schedule,
        )
        if cfg.muon_lr is not None and muon_lr is None:
            log.warning("train.muon_lr=%g is not used: the optimizer resolved to AdamW", cfg.muon_lr)
    identity = {
        "train": cfg.identity(optimizer_name),
        "total_steps": n_steps,
        "drafter": drafter.config.to_dict(),
        "draft_vocab": json_hash({"ids": vocab_ids.tolist()}),
        "target": info,
        "world_size": world,
        **(extra_identity or {}),
    }
    chash = json_hash(identity)
    out_dir = ensure_out_dir(cfg.output_dir, "train.output_dir")
    root = checkpoints_root(out_dir)
    resume = _resume_path(cfg, root)

    # the teacher: frozen head copies on this device (the full head only where the OOV rule needs it)
    maps = VocabMaps.from_draft_ids(vocab_ids, drafter.config.vocab_size).to(dev)
    full_head = None
    if head is not None:
        full_head = TargetHead(
            head.weight.detach().to(dev),
            None if head.bias is None else head.bias.detach().to(dev),
            softcap=head.softcap,
            scale=head.scale,
        )
    teacher_kw = dict(
        maps=maps,
        form=cfg.teacher,
        oov_rule=cfg.oov_rule,
        temperature=cfg.teacher_temperature,
        head=full_head,  # the OOV rule teacher, and the acceptance metrics of either rule
        draft_rows_head=draft_head(full_head, maps)
        if full_head is not None and cfg.oov_rule == "label"
        else None,
    )

    drafter.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    model = DistillationModel(
        drafter,
        cfg.step_weights,
        bf16_head=cfg.bf16_lm_head,
        feature_weight=cfg.feature_weight,
        miss_weight=cfg.miss_weight,
        loss=cfg.loss,
        loss_weight=cfg.loss_weight,
    )
    optimizer = build_optimizer(
        model,
        optimizer_name,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=cfg.betas,
        eps=cfg.adam_eps,
        fused=dev.type in ("cpu", "cuda"),  # one kernel per step instead of a chain of foreach ops
        muon_lr=muon_lr,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg, n_steps))
    _configure_deepspeed(acc, cfg)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    if acc.gradient_accumulation_steps != cfg.grad_accum:
        raise ValueError(
            f"the DeepSpeed config sets gradient_accumulation_steps={acc.gradient_accumulation_steps} but "
            f'train.grad_accum={cfg.grad_accum}; set it to "auto" in the DeepSpeed config'
        )

    state = TrainerState(step=0, config_hash=chash, identity=identity, world_size=world)
    if resume is not None:
        loaded = load_checkpoint(
            resume,
            accelerator=acc,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            config_hash=chash,
            identity=identity,
        )
        state = loaded.state
        data.load_state_dict(loaded.data_state)
        if state.best_value is not None and state.best_metric != cfg.best_metric:
            log.warning(
                "best/ (step %s) was picked by %s; train.best_metric is now %s: the next evaluation starts a new best",
                state.best_step,
                state.best_metric or "an earlier metric",
                cfg.best_metric,
            )
            state.best_value = state.best_step = None
    state.best_metric = cfg.best_metric
    logger = MetricsLogger(
        out_dir,
        enabled=acc.is_main_process,
        wandb_cfg=cfg.wandb,
        run_config={"train": identity["train"], "drafter": drafter.config.to_dict(), "target": info},
        resume_step=state.step if resume is not None else None,
        wandb_id=state.wandb_id,
    )
    state.wandb_id = logger.wandb_id
    start_step = state.step

    eval_list: list[Batch] = []
    if eval_data is not None:
        eval_list = list(islice(eval_data, cfg.eval_batches) if cfg.eval_batches else eval_data)
        eval_list = eval_list[: _min_int(acc, len(eval_list))]
    drafter_cfg = drafter.config.to_dict()
    last_ckpt: Path | None = resume
    final_eval: EvalResult | None = None

    def run_eval(step: int) -> EvalResult | None:
        if not eval_list:
            return None
        res = evaluate(acc, model, eval_list, teacher_kw, cfg.step_weights)
        if res is None:
            return None
        logger.log(step, "eval", res.to_dict())
        if acc.is_main_process:
            log.info(
                "eval step %d: tau_chain %.3f tau_served %.3f tau_indep %.3f loss %.4f acc %s",
                step,
                res.acceptance.tau_chain,
                res.acceptance.tau_served,
                res.acceptance.tau_indep,
                res.loss,
                [round(a, 3) for a in res.acceptance.acc],
            )
        value = res.metric(cfg.best_metric)
        better = state.best_value is None or (
            value < state.best_value if cfg.best_metric == "loss" else value > state.best_value
        )
        if better:
            state.best_value, state.best_step = value, step
            weights = trainable_weights(acc, model)
            if acc.is_main_process:
                save_best(
                    out_dir / "best",
                    weights,
                    drafter_cfg,
                    {"step": step, "metric": cfg.best_metric, "value": value, **res.to_dict()},
                )
        return res

    def checkpoint(step: int) -> Path:
        state.step = step
        return save_checkpoint(
            root,
            state,
            accelerator=acc,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            data_state=data.state_dict(),
            drafter_config=drafter_cfg,
            keep_last=cfg.keep_last,
        )

    k = cfg.ttt_steps
    w = torch.tensor(cfg.step_weights, device=dev)
    batches = _Batches(data)
    bar = tqdm(
        total=n_steps,
        initial=start_step,
        desc="train",
        dynamic_ncols=True,
        disable=not (cfg.progress and acc.is_main_process),
    )
    window = _Window(k, dev)
    run_tokens, run_start = 0, time.perf_counter()
    last_train: dict[str, Any] = {}
    step = start_step
    try:
        while step < n_steps:
            t0 = time.perf_counter()
            micro = [batches.next().to(dev) for _ in range(cfg.grad_accum)]
            t1 = time.perf_counter()
            teachers = [build_teacher(b, **teacher_kw, keep_oov=False) for b in micro]
            n_local = sum(
                int(supervised_positions(b).sum()) for b in micro
            )  # OOV rows count: they are tokens
            # one all-reduce: supervised positions (the normalizer) and tokens (TrainerState.tokens_seen)
            counts = _sum(
                acc, torch.tensor([float(n_local), float(sum(b.num_tokens for b in micro))], device=dev)
            )
            n_global = counts[:1]
            normalizer = n_global.clamp(min=1.0) / (world * cfg.grad_accum)
            grad_norm = None
            for b, teacher in zip(micro, teachers):
                with acc.accumulate(model):
                    out = model(b.input_ids, b.aux, b.position_ids, b.segment_ids, teacher, normalizer)
                    _check_finite(acc, out.loss, step + 1, b)
                    acc.backward(out.loss)
                    if acc.sync_gradients:
                        grad_norm = acc.clip_grad_norm_(
                            model.parameters(), cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
                        )
                        if grad_norm is not None and not math.isfinite(float(grad_norm)):
                            ids = [s for mb in micro for row in mb.sample_ids for s in row]
                            raise NonFiniteLossError(
                                f"non-finite gradient norm at step {step + 1} (samples {ids[:20]}); the last good "
                                "checkpoint is kept. Lower train.lr or drop these samples and resume",
                                step=step + 1,
                                sample_ids=ids,
                            )
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
                window.add(out, b.num_tokens)
            if not acc.sync_gradients:
                raise RuntimeError("accelerate's accumulation counter is out of step with train.grad_accum")
            t2 = time.perf_counter()
            step += 1
            state.tokens_seen += int(counts[1].item())  # every real token of the step, all processes
            window.n_supervised += float(n_global.item())  # already summed over processes
            window.data_s += t1 - t0
            window.compute_s += t2 - t1
            bar.update(1)
            if step % max(cfg.log_every, 1) == 0 or step == n_steps:
                rec = window.flush(acc, w)
                rec.update(
                    lr=float(scheduler.get_last_lr()[0]),
                    grad_norm=None if grad_norm is None else float(grad_norm),
                )
                run_tokens += rec["tokens"]
                logger.log(step, "train", rec)
                last_train = rec
                bar.set_postfix(
                    loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc'][0]:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}"
                )
                log.debug("step %d %s", step, rec)
            if cfg.eval_every and step % cfg.eval_every == 0 or step == n_steps:
                res = run_eval(step)
                if step == n_steps:
                    final_eval = res
            if cfg.save_every and step % cfg.save_every == 0 or step == n_steps:
                last_ckpt = checkpoint(step)
        if start_step >= n_steps:
            log.info("nothing to train: the checkpoint is already at step %d of %d", start_step, n_steps)
            final_eval = run_eval(step)
    finally:
        bar.close()
        logger.close()
    elapsed = time.perf_counter() - run_start
    return TrainResult(
        steps=step,
        steps_this_run=step - start_step,
        output_dir=str(out_dir),
        resumed_from=None if resume is None else str(resume),
        last_checkpoint=None if last_ckpt is None else str(last_ckpt),
        best_dir=str(out_dir / "best") if state.best_value is not None else None,
        best_value=state.best_value,
        best_step=state.best_step,
        final_eval=None if final_eval is None else final_eval.to_dict(),
        last_train=last_train,
        tokens=run_tokens,
        train_seconds=elapsed,
        tokens_per_s=run_tokens / elapsed if elapsed > 0 else 0.0,
        metrics_path=str(logger.path),
    )


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
