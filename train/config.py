"""Typed configs of the trainer (Hydra groups ``drafter/`` and ``train/``).

Design decisions:
- The Hydra ``DictConfig`` becomes these dataclasses at the entry point (:func:`eyas.common.load_job` into
  :class:`TrainJob`); only dataclasses go
  inward, so ``fit`` and the tests never see OmegaConf.
- :meth:`TrainConfig.identity` is what a checkpoint must share with the run that resumes it: every field that
  changes the trajectory (optimiser, schedule, loss, data order) and none that only changes bookkeeping (where to
  write, how often to log or save, wandb). Its hash is stored in every checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from eyas.common import ConfigError, build_config
from eyas.serving.models.target import TargetConfig
from eyas.train.losses import LOSSES
from eyas.train.optim import OPTIMIZERS

TEACHERS = ("auto", "hidden", "topk")
OOV_RULES = ("teacher", "label")
PRECISIONS = ("auto", "fp32", "bf16")
WANDB_MODES = ("online", "offline", "disabled")
DATA_SOURCES = ("store", "online", "synthetic")
BEST_METRICS = ("tau_chain", "tau_served", "tau_indep", "loss")
SCHEDULES = ("cosine", "wsd")
DRAFTER_FAMILIES = ("eagle3", "dflash")


@dataclass
class DraftModelConfig:
    """The drafter to train (conf/drafter/*.yaml); the sizes not listed here are the target's."""

    draft_vocab_size: int = 8192
    """N: the drafter predicts the N most frequent loss-masked target tokens of the training data (8192 against
    32k: BENCH.md, "Recipe"); the coverage it reaches is logged
    and kept in ``draft_vocab.json`` (raise N where it is low, e.g. a large multilingual target)."""
    intermediate_size: int | None = None
    """MLP width of the drafter layer; None takes the target's."""
    init: str = "target"
    """``target`` (the default: measured best, BENCH.md "Recipe") or ``random`` (nn.Linear default init): start the
    whole drafter from the target (:func:`train.setup.init_from_target`): the decoder layer from target layer
    ``init_layer``, ``fc`` as the identity on the top aux block, ``norm`` and ``lm_head`` from the target's final
    norm and head rows. Step 0 then reproduces the target's prediction of ``x_{t+1}`` (the row's own input token),
    not of ``x_{t+2}``, which row ``t`` is trained on: a start from the target's features, not from the objective."""
    init_layer: int | None = None
    """Target layer the drafter layer starts from (``init=target``); None: the layer after the top aux layer,
    which reads exactly the state ``fc`` passes through, so step 0 computes that layer of the target at row ``t``'s
    own position."""
    init_lm_head: str = "random"
    """``random`` (nn.Linear default init) or ``target``: start ``lm_head`` from the target head's draft rows
    (implied by ``init=target``)."""
    vocab_file: str | None = None
    """A JSON draft vocabulary written by :func:`train.vocab.DraftVocab.save`; None builds it from the data."""
    fc_norm: bool = False
    """EAGLE-3.1 (arXiv 2605.09992): an RMSNorm per aux layer before ``fc`` (``serving.drafter.DrafterConfig``);
    exported in the config field and weight names vLLM reads. With ``init=target`` the identity ``fc`` then passes
    the top aux state RMS-normalised: the layer's attention and MLP read it through their own norms, but the
    residual carries the new scale, so step 0 no longer reproduces the target layer exactly."""
    norm_output: bool = False
    """EAGLE-3.1: each draft step passes ``norm(out)`` on to the next instead of the pre-norm ``out``."""
    norm_before_fc: bool = False
    """One RMSNorm over the concatenated aux states before ``fc`` (speculators' gpt-oss option; vLLM reads it)."""
    parallel_drafting: bool = False
    """P-EAGLE (arXiv 2602.01469): train a drafter whose draft depths 1..K-1 are mask rows, all drafted in one
    forward (``serving.models.drafter``); ``train.ttt_steps`` is then the K it learns to draft."""
    mask_token_id: int | None = None
    """``parallel_drafting``: the target token id the mask rows carry; null: the target vocabulary's last id (the
    rows learn what they mean through the drafter's ``mask_hidden``, not through this token's embedding)."""
    attention_window: int | None = None
    """Sliding window of the drafter's attention in tokens (``DrafterConfig.attention_window``: used in training,
    in the bundled loop and written into the export); None: full attention."""
    family: str = "eagle3"
    """``eagle3`` (the EAGLE-3 drafter and its options above) or ``dflash``: a block drafter
    (``serving.models.dflash``) that drafts ``train.ttt_steps`` tokens in one forward from the pending token and
    that many mask slots, served by vLLM's ``dflash`` method. It takes ``draft_vocab_size``, ``intermediate_size``,
    ``init``, ``mask_token_id`` and ``num_layers`` from here; the EAGLE-3 options must stay off. Start it with
    ``init=random``: on the demo store it reached held-out τ_sim 1.39 after 300 steps against 1.17 started from the
    target (``train.setup.init_dflash_from_target``; docs/LOG.md)."""
    num_layers: int = 1
    """``family=dflash``: decoder layers. 1 by default: vLLM 0.32's CPU build normalises every layer's context
    keys with layer 0's ``k_norm`` (``_normalize_context_k``), so deeper drafters are served right on GPU only."""

    def __post_init__(self) -> None:
        if self.family not in DRAFTER_FAMILIES:
            raise ValueError(f"drafter.family must be one of {DRAFTER_FAMILIES}, not {self.family!r}")
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, not {self.num_layers}")
        if self.family == "dflash":
            on = [
                k
                for k in ("fc_norm", "norm_output", "norm_before_fc", "parallel_drafting")
                if getattr(self, k)
            ]
            if on or self.attention_window is not None:
                raise ValueError(
                    f"drafter.family=dflash has no EAGLE-3 options; turn off {on or ['attention_window']}"
                )
        elif self.num_layers != 1:
            raise ValueError(
                "drafter.num_layers is the DFlash drafter's depth; an EAGLE-3 drafter has one layer"
            )
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(
                f"drafter.attention_window must be a positive token count or null, not {self.attention_window}"
            )
        if self.draft_vocab_size < 1:
            raise ValueError(f"drafter.draft_vocab_size must be positive, not {self.draft_vocab_size}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(
                f"drafter.intermediate_size must be positive or null, not {self.intermediate_size}"
            )
        if self.init_lm_head not in ("random", "target"):
            raise ValueError(f"drafter.init_lm_head must be 'random' or 'target', not {self.init_lm_head!r}")
        if self.init not in ("random", "target"):
            raise ValueError(f"drafter.init must be 'random' or 'target', not {self.init!r}")
        if self.init_layer is not None and self.init_layer < 0:
            raise ValueError(f"drafter.init_layer must be a layer index or null, not {self.init_layer}")
        if self.mask_token_id is not None and not (self.parallel_drafting or self.family == "dflash"):
            raise ValueError(
                "drafter.mask_token_id is the mask token of parallel drafting or of a DFlash drafter; set it null "
                "without either"
            )

    def identity(self) -> dict[str, Any]:
        """All fields, but the EAGLE-3.1 and parallel-drafting options only when on, so the run keys of drafters
        without them (the pipeline's ``train_key``) are those from before the options existed."""
        d = asdict(self)
        for key in ("fc_norm", "norm_output", "norm_before_fc", "parallel_drafting", "mask_token_id"):
            if d[key] is None or d[key] is False:
                del d[key]
        if d["family"] == "eagle3":  # EAGLE-3 runs keep the keys they had before DFlash existed
            del d["family"], d["num_layers"]
        return d


@dataclass
class WandbConfig:
    """Weights & Biases logging; never needs the network unless ``mode=online``."""

    mode: str | None = None
    """``online``, ``offline`` or ``disabled``; None: ``$WANDB_MODE``, else ``offline``."""
    project: str = "eyas"
    entity: str | None = None
    name: str | None = None
    """Run name; None lets wandb pick one."""

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"train.wandb.mode must be one of {WANDB_MODES} or null, not {self.mode!r}")


@dataclass
class SyntheticDataConfig:
    """Random token sequences run through the target: smoke runs, launch tests and the training benchmark."""

    num_samples: int = 16
    """Training samples in all (process r takes samples r, r + W, ...)."""
    eval_samples: int = 4
    """Held-out samples in all (split across processes the same way)."""
    seq_len: int = 128
    batch_size: int = 1
    """Samples per micro-batch (padded to the longest)."""
    loss_fraction: float = 0.7
    """Each sample's last ``loss_fraction`` of tokens are marked as assistant tokens."""
    teacher: str = "hidden"
    """How the target distribution is stored in the batches: ``hidden`` or ``topk``."""
    topk: int = 32
    seed: int = 0
    shuffle: bool = True
    """Visit this process's batches in a new order every epoch (off: in sample order)."""

    def __post_init__(self) -> None:
        if self.num_samples < 0 or self.eval_samples < 0:
            raise ValueError("synthetic sample counts must be >= 0")
        if self.seq_len < 2 or self.batch_size < 1:
            raise ValueError("synthetic seq_len must be >= 2 and batch_size >= 1")
        if not 0.0 < self.loss_fraction <= 1.0:
            raise ValueError(f"synthetic loss_fraction must be in (0, 1], not {self.loss_fraction}")
        if self.teacher not in ("hidden", "topk"):
            raise ValueError(f"synthetic teacher must be 'hidden' or 'topk', not {self.teacher!r}")


@dataclass
class DataSourceConfig:
    """Where training batches come from."""

    source: str = "store"
    """``store`` (a feature store written by ``python -m eyas.data.extract``), ``online`` (the trainer runs the target
    over formatted samples itself) or ``synthetic`` (random tokens through the target; smoke tests, benchmarks)."""
    store_dir: str | None = None
    """Feature store directory (``source=store``)."""
    verify_checksums: bool = True
    """Check each shard's sha256 against the store's manifest the first time training reads it (a damaged shard
    stops the run, named); false skips the check."""
    samples: str | None = None
    """Formatted samples JSONL (``{"id", "input_ids", "loss_mask"}``, the chat stage's output; ``source=online``)."""
    eval_fraction: float = 0.02
    """Share of samples (by a hash of their id) held out for the simulated-acceptance metric."""
    loader: dict[str, Any] = field(default_factory=dict)
    """``data.loader.LoaderConfig`` settings (batch_rows, max_tokens, packing, shuffle seed, dtype...)."""
    online: dict[str, Any] = field(default_factory=dict)
    """``data.store.StoreOptions`` of the online mode (aux dtype, distribution, topk): the same rounding as a
    store made with them."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ValueError(f"train.data.source must be one of {DATA_SOURCES}, not {self.source!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"train.data.eval_fraction must be in [0, 1), not {self.eval_fraction}")
        if isinstance(self.synthetic, dict):
            self.synthetic = build_config(SyntheticDataConfig, self.synthetic, "train.data.synthetic")
        self.loader = dict(self.loader or {})
        self.online = dict(self.online or {})
        for key in ("split", "eval_fraction"):
            if key in self.loader:
                raise ValueError(
                    f"train.data.loader.{key} is set by the trainer; use train.data.eval_fraction"
                )
        check_loader_settings(self.loader)


def check_loader_settings(settings: dict[str, Any]) -> None:
    """Refuse loader settings the loader would refuse, now rather than after the stages before training (a
    recipe study's prepare and extract take hours): unknown keys and bad values, named ``train.data.loader.*``.
    ``max_tokens: window`` stands for the target's context window, which only the trainer knows."""
    from eyas.data.loader import WINDOW, LoaderConfig

    probe = dict(settings)
    if probe.get("max_tokens") == WINDOW:
        probe["max_tokens"] = LoaderConfig.max_tokens
    try:
        build_config(LoaderConfig, probe, "train.data.loader")
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"train.data.{e}") from None


def resolve_mixed_precision(precision: str) -> str:
    """accelerate's ``mixed_precision`` for ``train.precision``: ``bf16`` or ``no``."""
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() else "no"
    return "bf16" if precision == "bf16" else "no"


@dataclass
class TrainConfig:
    """One training run (conf/train/*.yaml). Steps count optimizer updates."""

    output_dir: str = "runs/train"
    """Checkpoints, metrics.jsonl, wandb files and the best drafter go here (a shared filesystem on multi-node)."""
    max_steps: int = 1000
    """Optimizer steps (each = grad_accum micro-batches on every process)."""
    epochs: float | None = None
    """If set, overrides max_steps with ceil(epochs * batches per epoch / grad_accum) (needs a sized source)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each process."""
    optimizer: str = "auto"
    """``muon``: ``torch.optim.Muon`` on the decoder layer's and ``fc``'s weight matrices (RMS matched to AdamW, so
    ``lr`` keeps its meaning), AdamW on ``lm_head``, norms and biases (``train.optim``); ``adamw``: AdamW on all;
    ``auto`` (the default): Muon under plain data parallel, AdamW under DeepSpeed ZeRO, which hands the optimizer
    flat parameter partitions instead of matrices. Muon learned more per token in the recipe study (BENCH.md)."""
    lr: float = 1e-4
    muon_lr: float | None = None
    """With Muon: the learning rate of the matrices Muon steps; ``lr`` stays that of the AdamW part (``lm_head``,
    norms, biases). None: ``lr`` for both."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    warmup_steps: int | None = None
    """Linear warm-up length; None uses ``warmup_ratio``."""
    warmup_ratio: float = 0.015
    schedule: str = "cosine"
    """After the warm-up: ``cosine`` decays from ``lr`` to ``lr * min_lr_ratio`` over the remaining steps;
    ``wsd`` (warm-up, stable, decay) holds ``lr`` and decays linearly to ``lr * min_lr_ratio`` over the last
    ``decay_ratio`` of the steps."""
    decay_ratio: float = 0.2
    """``schedule=wsd``: the fraction of the steps spent in the final linear decay."""
    min_lr_ratio: float = 0.0
    """The schedule ends at ``lr * min_lr_ratio`` at ``max_steps``."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip (0 disables)."""
    ttt_steps: int = 7
    """Training-time-test unroll length (draft steps trained per position); for a DFlash drafter
    (``drafter.family=dflash``) the mask slots of each training block (its K)."""
    step_decay: float = 0.8
    """Loss weight of TTT step j is step_decay ** j."""
    decay_gamma: float | None = None
    """When set, the loss weight of step j (0-based; DFlash: slot j + 1) is ``exp(-j / decay_gamma)`` instead of
    ``step_decay ** j`` (DFlash's form: gamma 7 for blocks of 16 in its paper, 4 for blocks of 8 in NVIDIA's)."""
    block_anchors: int = 128
    """``drafter.family=dflash``: blocks (anchors) drawn per packed row and training step, among the positions whose
    next token is supervised; evaluation takes every such position."""
    teacher: str = "auto"
    """Target distribution to distil from: ``hidden`` (stored final hidden state through the frozen target head,
    draft rows only), ``topk`` (stored top-k log-probs mapped into the draft vocabulary), ``auto`` (what the batch
    carries, hidden first)."""
    teacher_temperature: float = 1.0
    """The teacher is the target's distribution at this temperature (``p ** (1 / T)``, renormalised over the draft
    vocabulary): below 1 it leans towards the target's argmax, which is all greedy acceptance scores; its argmax,
    the acceptance metrics and the out-of-vocabulary rule do not change."""
    oov_rule: str = "teacher"
    """Which rows are dropped as out of the draft vocabulary: ``teacher`` (the target's argmax over the full
    vocabulary is not a draft token; exact, costs one full-vocabulary head pass per supervised token for
    ``hidden`` teachers) or ``label`` (the data's next token is not a draft token; draft rows only)."""
    freeze_lm_head: bool = False
    """Keep the drafter's ``lm_head`` as it was built (with ``drafter.init=target``: the target head's draft rows)
    and train only the layer, ``fc`` and norms, so the drafter learns to land in the target's own output space
    (EAGLE-1 shares the target's head this way). Saves the head's weight gradient."""
    feature_weight: float = 0.0
    """Weight of the feature term (``train.losses.DistillationModel``): each TTT step's output pulled towards the
    fused features of the position it stands in for at the next step. 0 (the default) leaves the distribution
    loss alone."""
    loss: str = "fkl"
    """The per-row objective of the distillation (``train.losses.OBJECTIVES``), each against the teacher restricted
    to the draft vocabulary, on hidden and top-k teachers alike: ``fkl`` (the default: soft cross-entropy, forward
    KL's gradient), ``rkl`` (reverse KL), ``jsd`` (Jensen-Shannon), ``tv`` (total variation, 1 - alpha with
    alpha = sum_v min(p_v, q_v) the acceptance rate), ``lk`` (-log alpha, LK's acceptance loss, arXiv 2602.23881),
    ``lk_hybrid`` (lam * KL + (1 - lam) * TV, see ``loss_weight``)."""
    loss_weight: float | None = None
    """``loss=lk_hybrid`` only: the KL part's weight lam in [0, 1]; null: the paper's adaptive weight per row,
    ``exp(-3 alpha)`` (alpha detached; ``train.losses.LK_ETA``)."""
    miss_weight: float = 0.0
    """Extra loss weight of the rows a served greedy chain starts from: row ``t`` weighs ``1 + miss_weight`` when
    the drafter's step 0 at row ``t - 1`` missed (``train.losses.ttt_loss``). 0 (the default): every row alike."""
    precision: str = "auto"
    """``auto`` (bf16 on GPU, fp32 on CPU), ``fp32`` or ``bf16`` (autocast, on CPU too: the layer, ``fc`` and
    ``lm_head`` matmuls in bf16; the loss's softmax in fp32)."""
    bf16_lm_head: bool = False
    """Run only the drafter's lm_head in bf16 (autocast) when ``precision=fp32``: the dominant matmul of a
    32k-token draft vocabulary, ~4x faster in bf16 on CPUs with bf16 units (see eyas/lab/bench_train.py)."""
    seed: int = 0
    eval_every: int = 200
    """Steps between simulated-acceptance evaluations on the held-out split (0: only at the end)."""
    eval_batches: int | None = 8
    """Held-out micro-batches per evaluation on each process (None or 0: all); only these are read from the
    held-out split. ``best/`` is picked on them, so they must hold enough supervised tokens for the choice not to
    be noise. Measured on the demo's drafter (``eyas.lab.held_out_spread``, tau_served 1.6 at K = 6 over 37
    held-out batches): the std of one tau_served estimate is about 6.6 / sqrt(supervised tokens) (0.10 at 4k
    tokens, 0.05 at 17k), that of the difference between two checkpoints on the same batches about
    0.3 / sqrt(tokens). 8 batches of the default 4 x 2048-token rows hold ~35k supervised tokens (std ~0.035);
    presets with smaller batches take more (``train=bench``: 32 one-row batches of 1024 tokens, ~18k)."""
    eval_chain_length: int = 6
    """K of the held-out τ estimates (``tau_chain``, ``tau_served``, ``tau_indep``): the evaluation unrolls the
    drafter this many steps, whatever ``ttt_steps`` is, so τ_sim compares across TTT settings and measures the
    chain length served (the bundled evaluation's default chain is 6 drafts)."""
    save_every: int = 200
    """Steps between checkpoints (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept (older ones deleted; ``best/`` is separate)."""
    best_metric: str = "tau_served"
    """Metric that picks ``best/``: ``tau_chain`` (conditional chain acceptance over every row), ``tau_served``
    (the same over the rows served greedy chains start from), ``tau_indep``, ``loss``."""
    resume: str = "auto"
    """``auto`` (latest checkpoint in output_dir, else start fresh), ``never`` (refuse if checkpoints exist),
    or a checkpoint directory."""
    log_every: int = 10
    """Steps between metric lines (metrics.jsonl, wandb, log)."""
    threads: int | None = None
    """torch intra-op threads per process (None: leave as is)."""
    progress: bool = True
    """tqdm progress bar on the main process."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    data: DataSourceConfig = field(default_factory=DataSourceConfig)

    def __post_init__(self) -> None:
        if isinstance(self.wandb, dict):
            self.wandb = build_config(WandbConfig, self.wandb, "train.wandb")
        if isinstance(self.data, dict):
            self.data = build_config(DataSourceConfig, self.data, "train.data")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if self.max_steps < 1:
            raise ValueError(f"train.max_steps must be >= 1, not {self.max_steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"train.epochs must be positive or null, not {self.epochs}")
        if self.grad_accum < 1:
            raise ValueError(f"train.grad_accum must be >= 1, not {self.grad_accum}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer must be one of {OPTIMIZERS}, not {self.optimizer!r}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be positive, not {self.lr}")
        if self.muon_lr is not None and self.muon_lr <= 0:
            raise ValueError(f"train.muon_lr must be positive or null, not {self.muon_lr}")
        if self.muon_lr is not None and self.optimizer == "adamw":
            raise ValueError(
                "train.muon_lr sets Muon's learning rate; train.optimizer=adamw has no Muon part"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"train.schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        if not 0.0 < self.decay_ratio <= 1.0:
            raise ValueError(f"train.decay_ratio must be in (0, 1], not {self.decay_ratio}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"train.warmup_ratio must be in [0, 1), not {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, not {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], not {self.min_lr_ratio}")
        if self.max_grad_norm < 0:
            raise ValueError(f"train.max_grad_norm must be >= 0, not {self.max_grad_norm}")
        if self.ttt_steps < 1:
            raise ValueError(f"train.ttt_steps must be >= 1, not {self.ttt_steps}")
        if self.eval_chain_length < 1:
            raise ValueError(f"train.eval_chain_length must be >= 1, not {self.eval_chain_length}")
        if self.eval_batches is not None and self.eval_batches < 0:
            raise ValueError(
                f"train.eval_batches must be >= 0 or null (0, null: all), not {self.eval_batches}"
            )
        if self.decay_gamma is not None and not self.decay_gamma > 0:
            raise ValueError(f"train.decay_gamma must be > 0 or null, not {self.decay_gamma}")
        if self.block_anchors < 1:
            raise ValueError(f"train.block_anchors must be >= 1, not {self.block_anchors}")
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"train.step_decay must be in (0, 1], not {self.step_decay}")
        if self.teacher not in TEACHERS:
            raise ValueError(f"train.teacher must be one of {TEACHERS}, not {self.teacher!r}")
        if not self.teacher_temperature > 0:
            raise ValueError(f"train.teacher_temperature must be > 0, not {self.teacher_temperature}")
        if not self.feature_weight >= 0:
            raise ValueError(f"train.feature_weight must be >= 0, not {self.feature_weight}")
        if self.loss not in LOSSES:
            raise ValueError(f"train.loss must be one of {LOSSES}, not {self.loss!r}")
        if self.loss_weight is not None:
            if self.loss != "lk_hybrid":
                raise ValueError(
                    f"train.loss_weight weighs lk_hybrid's KL part; train.loss={self.loss} has none (set it null)"
                )
            if not 0.0 <= self.loss_weight <= 1.0:
                raise ValueError(f"train.loss_weight must be in [0, 1] or null, not {self.loss_weight}")
            self.loss_weight = float(self.loss_weight)
        if not self.miss_weight >= 0:
            raise ValueError(f"train.miss_weight must be >= 0, not {self.miss_weight}")
        if self.oov_rule not in OOV_RULES:
            raise ValueError(f"train.oov_rule must be one of {OOV_RULES}, not {self.oov_rule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}, not {self.precision!r}")
        if self.best_metric not in BEST_METRICS:
            raise ValueError(f"train.best_metric must be one of {BEST_METRICS}, not {self.best_metric!r}")
        for name in ("eval_every", "save_every", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0")
        if self.keep_last < 1:
            raise ValueError(f"train.keep_last must be >= 1, not {self.keep_last}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"train.threads must be >= 1 or null, not {self.threads}")

    @property
    def step_weights(self) -> list[float]:
        if self.decay_gamma is not None:
            return [math.exp(-j / self.decay_gamma) for j in range(self.ttt_steps)]
        return [self.step_decay**j for j in range(self.ttt_steps)]

    def warmup_for(self, total_steps: int) -> int:
        if self.warmup_steps is not None:
            return min(self.warmup_steps, total_steps)
        return int(round(self.warmup_ratio * total_steps))

    def identity(self, optimizer: str | None = None) -> dict[str, Any]:
        """The fields a resumed run must share with its checkpoint (see the module docstring). optimizer: the
        optimizer ``train.optimizer`` resolved to for this launch (``train.optim.resolve_optimizer``), recorded
        in place of ``auto``."""
        d = asdict(self)
        d["optimizer"] = optimizer or self.optimizer
        for k in (
            "output_dir",
            "eval_every",
            "eval_batches",
            "eval_chain_length",
            "save_every",
            "keep_last",
            "resume",
            "log_every",
            "threads",
            "progress",
            "wandb",
            "best_metric",
        ):
            d.pop(k)
        d["betas"] = list(self.betas)
        if not d["freeze_lm_head"]:
            del d["freeze_lm_head"]  # runs from before the option keep their identity
        if not d["feature_weight"]:
            del d["feature_weight"]  # likewise
        if not d["miss_weight"]:
            del d["miss_weight"]  # likewise
        if d["loss"] == "fkl":
            del d["loss"]  # likewise
        if d["loss_weight"] is None:
            del d["loss_weight"]  # likewise
        if d["muon_lr"] is None or d["optimizer"] == "adamw":
            del d["muon_lr"]  # likewise; AdamW (auto under DeepSpeed) has no Muon part to apply it to
        if d["optimizer"] == "adamw":
            del d["optimizer"]  # runs from before the option (all AdamW) keep their identity
        if d["decay_gamma"] is None:
            del d["decay_gamma"]  # likewise
        if d["block_anchors"] == 128:
            del d["block_anchors"]  # likewise (only a DFlash drafter reads it)
        if d["schedule"] == "cosine":
            del d["schedule"], d["decay_ratio"]  # likewise
        if resolve_mixed_precision(self.precision) == "bf16" and not self.bf16_lm_head:
            # a bf16 run's lm_head runs under its autocast now; before this key the loss switched the autocast
            # off around it (fp32 logits), so a checkpoint of those numerics is not resumed into these
            d["lm_head_bf16"] = True
        return d


def diff_identity(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two identity dicts (``key: old -> new``)."""
    out: list[str] = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, "<absent>"), new.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_identity(a, b, f"{prefix}{k}.")
        elif json.dumps(a, default=str) != json.dumps(b, default=str):
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


@dataclass
class TrainJob:
    """What ``python -m eyas.train`` runs (:func:`train.setup.run`): the Hydra groups of the same names."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DraftModelConfig = field(default_factory=DraftModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
