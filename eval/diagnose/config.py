"""Diagnose settings (:class:`DiagnoseConfig`, presets in ``conf/diagnose/``) and the methods they name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eyas.eval.acceptance import (
    MethodSpec,
    PromptSetSpec,
)
from eyas.eval.prompts import BUILTIN_PREDICTABLE, builtin_predictable, prompt_messages  # noqa: F401
from eyas.eval.throughput import (
    DrafterKind,
)
from eyas.serving.models.target import TargetConfig
from eyas.serving.tree import TreeConfig
from eyas.serving.verify import SamplingConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "diagnose"
METHODS = ("eagle3-chain", "eagle3-tree", "prompt-lookup", "none")
"""The drafting methods, named as in eval and the proposers; ``eagle3-tree`` measures every shape of ``trees``."""


class DiagnoseError(ValueError):
    """Settings or inputs diagnose cannot work with; the message says what to change."""


# -- config ------------------------------------------------------------------------------------------------------
def _default_sets() -> list[PromptSetSpec]:
    return [
        PromptSetSpec(
            "ood_reasoning",
            "ood_reasoning",
            n=2,
            label="hard reasoning (out of distribution)",
            max_new_tokens=32,
            half="report",
        ),
        PromptSetSpec("predictable", BUILTIN_PREDICTABLE, n=2, label="predictable", max_new_tokens=32),
    ]


@dataclass
class DiagnoseConfig:
    """What ``measure`` runs (the ``diagnose`` key of ``eyas diagnose``: ``diagnose.chain_length=6``)."""

    export_dir: str | None = None
    """The EAGLE-3 drafter of the ``eagle3`` methods: an exported drafter (``eyas export``'s directory; a trainer
    checkpoint or run directory also loads), or ``auto`` (the newest drafter under ``runs_dir``); None: an
    untrained drafter of the target's shape (τ ≈ 1, a trained one's step costs)."""
    draft_vocab_size: int = 32000
    """Draft vocabulary of the untrained drafter."""
    runs_dir: str = "runs"
    """Where ``export_dir=auto`` looks."""
    methods: list[str] = field(default_factory=lambda: ["eagle3-chain", "prompt-lookup"])
    """Any of ``eagle3-chain``, ``eagle3-tree`` (one method per entry of ``trees``), ``prompt-lookup``, ``none``."""
    chain_length: int = 4
    """K: drafts per step of the measured chains (prompt lookup's draft length too)."""
    trees: list[TreeConfig] = field(default_factory=list)
    """EAGLE-2 tree shapes measured by ``eagle3-tree`` (recommendation candidates; trees are never extrapolated)."""
    prompt_sets: list[PromptSetSpec] = field(default_factory=_default_sets)
    """Prompt sets (``source``: any ``data.corpora.load_prompt_set`` name, or ``builtin:predictable``)."""
    prompts_per_set: int | None = None
    """Overrides every set's ``n``."""
    max_new_tokens: int | None = None
    """Overrides every set's ``max_new_tokens``."""
    contexts: list[int] = field(default_factory=lambda: [128, 1024, 2048])
    """Context lengths L (tokens before generation starts) to measure at."""
    filler: str = "sharegpt"
    """Corpus (``conf/corpus`` name) whose conversations pad prompts to L tokens."""
    rounds: int = 2
    """Repeats of the whole measurement (every context, set, prompt and method)."""
    profile_repeats: int = 2
    """Timed repetitions per profile sample and point (one sample is taken after every generation)."""
    statistic: str = "mean"
    """How profile repeats are summarised (``mean`` matches a sum of steps on a shared machine; or median, min)."""
    tolerance: float = 0.10
    """|predicted / measured - 1| always accepted (costs the model leaves out, e.g. the loop's own Python)."""
    n_sigma: float = 3.0
    """Standard errors of the per-generation predicted/measured ratios beyond which a mismatch is flagged."""
    k_max: int | None = None
    """Longest chain the recommendation prices (default: ``chain_length``; longer needs ``extrapolate``)."""
    extrapolate: bool = False
    """Price chains longer than measured by repeating the last measured acceptance rates (marked)."""
    better_acceptance: list[float] = field(default_factory=lambda: [0.1, 0.2])
    """What-if drafters: per-position acceptance raised by each δ."""
    verify_cut: float = 0.25
    """What-if: verify forward this fraction cheaper."""
    draft_cut: float = 0.5
    """What-if: drafter this fraction cheaper."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples (lossless rejection sampling)."""
    top_p: float = 1.0
    """Nucleus sampling mass when sampling."""
    seed: int = 0
    """Seeds prompt choice, the random drafter, the profile's random contexts and sampling."""
    num_threads: int | None = None
    """torch CPU threads (the entry point sets them; 1 is steadiest on a shared machine)."""
    out_dir: str = "runs/diagnose"
    """Where report.md, results.json and the plots go."""
    tau_context: str | None = None
    """τ measured against context length (``context.json`` from ``eyas context``, or its directory): each of its
    (chain method, length) points is priced with this run's step costs, so tokens/s at long context uses the τ
    measured there instead of this run's τ held constant (which the report shows alongside)."""

    def __post_init__(self) -> None:
        if (
            self.export_dir == "random"
        ):  # load_drafter's name for it: refused, so a directory is never taken for it
            raise DiagnoseError(
                "diagnose.export_dir=random: leave diagnose.export_dir null for an untrained drafter"
            )
        if self.chain_length <= 0:
            raise DiagnoseError(f"diagnose.chain_length (K) must be >= 1, got {self.chain_length}")
        if self.k_max is not None and self.k_max <= 0:
            raise DiagnoseError(f"diagnose.k_max (K) must be >= 1, got {self.k_max}")
        if self.k_max is not None and self.k_max > self.chain_length and not self.extrapolate:
            raise DiagnoseError(
                f"diagnose.k_max={self.k_max} exceeds the measured diagnose.chain_length={self.chain_length}: "
                f"acceptance beyond position {self.chain_length} would not be measured. Raise chain_length, or set "
                "diagnose.extrapolate=true"
            )
        if not self.methods:
            raise DiagnoseError(f"diagnose.methods is empty; choose from {METHODS}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise DiagnoseError(f"diagnose.methods: unknown methods {unknown}; choose from {METHODS}")
        if "eagle3-tree" in self.methods and not self.trees:
            raise DiagnoseError(
                "method eagle3-tree needs tree shapes: diagnose.trees=[{topk: 4, depth: 5, total_tokens: 24}]"
            )
        self.trees = [TreeConfig(**t) if isinstance(t, dict) else t for t in self.trees]
        if not self.contexts or min(self.contexts) < 1:
            raise DiagnoseError(f"diagnose.contexts must be positive token counts, got {self.contexts}")
        self.contexts = sorted(set(int(c) for c in self.contexts))
        if not self.prompt_sets:
            raise DiagnoseError("diagnose.prompt_sets is empty: give at least one prompt set")
        self.prompt_sets = [PromptSetSpec(**s) if isinstance(s, dict) else s for s in self.prompt_sets]
        names = [s.name for s in self.prompt_sets]
        if len(set(names)) != len(names):
            raise DiagnoseError(f"diagnose.prompt_sets: names must be distinct, got {names}")
        for name in ("prompts_per_set", "max_new_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise DiagnoseError(f"diagnose.{name} must be >= 1")
        if self.prompts_per_set is not None or self.max_new_tokens is not None:
            self.prompt_sets = [
                PromptSetSpec(
                    s.name,
                    s.source,
                    self.prompts_per_set or s.n,
                    s.label,
                    self.max_new_tokens or s.max_new_tokens,
                )
                for s in self.prompt_sets
            ]
        if self.rounds < 1 or self.profile_repeats < 1:
            raise DiagnoseError("diagnose.rounds and diagnose.profile_repeats must be >= 1")
        if self.tolerance < 0 or self.n_sigma < 0:
            raise DiagnoseError("diagnose.tolerance and diagnose.n_sigma must be >= 0")
        if any(not 0 < d <= 1 for d in self.better_acceptance):
            raise DiagnoseError(
                f"diagnose.better_acceptance holds increments in (0, 1], got {self.better_acceptance}"
            )
        if self.statistic not in ("mean", "median", "min"):
            raise DiagnoseError(f"diagnose.statistic must be mean, median or min, not {self.statistic!r}")
        SamplingConfig(self.temperature, self.top_p, self.seed)  # validates
        if self.tau_context is not None and not Path(self.tau_context).exists():
            raise DiagnoseError(
                f"diagnose.tau_context={self.tau_context}: no such file (write it with `eyas context`)"
            )

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.seed)

    @property
    def recommend_k_max(self) -> int:
        return self.k_max or self.chain_length

    @property
    def uses_drafter(self) -> bool:
        return any(m.startswith("eagle3") for m in self.methods)

    @property
    def drafter_spec(self) -> str:
        """The drafter as :func:`serving.load.load_drafter` names it (``random`` for an untrained one)."""
        return self.export_dir or "random"


@dataclass
class DiagnoseJob:
    """What ``eyas diagnose`` runs (:func:`eval.diagnose.run.run`): the target and the diagnosis."""

    target: TargetConfig = field(default_factory=TargetConfig)
    """The target model (default: the embedded SmolLM2-135M-Instruct)."""
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)


def method_specs(cfg: DiagnoseConfig) -> list[MethodSpec]:
    """The measured methods, named as in the report."""
    out: list[MethodSpec] = []
    for m in cfg.methods:
        if m == "eagle3-chain":
            out.append(MethodSpec("eagle3-chain", "eagle3", "chain", cfg.chain_length))
        elif m == "eagle3-tree":
            out += [
                MethodSpec(
                    f"eagle3-tree-{t.topk}x{t.depth}/{t.total_tokens}", "eagle3", "tree", cfg.chain_length, t
                )
                for t in cfg.trees
            ]
        elif m == "prompt-lookup":
            out.append(MethodSpec("prompt-lookup", "prompt-lookup", "chain", cfg.chain_length))
        else:
            out.append(MethodSpec("none", "none", "chain", 1))
    return out


def drafter_kind(spec: MethodSpec) -> DrafterKind:
    return {"eagle3": "model", "prompt-lookup": "lookup", "none": "none"}[spec.kind]
