"""Step-time profiles: the target's verify forward and the drafter's work against context length.

Design decisions:
- The verify forward is timed exactly as the loop runs it (:func:`serving.loop.tree_forward` over a chain of
  ``n`` tokens after a prefilled context of ``L`` tokens); the context is written once per length and every
  timed forward writes to the same slots without committing them, so repeats see identical work.
- Draft time for a chain of K is one drafter forward over the rows the target just accepted (τ rows on
  average) plus K - 1 single-row steps; both pieces are timed at each context length, so the throughput model
  can price any K and τ.
- :class:`StepProfiler` writes each context once and can then be sampled again and again, so a caller can
  interleave samples with other work (``eval.diagnose`` takes one between generations, so profile and
  generation see the same machine load); :func:`profile_steps` is one sample per context length.
- Each point summarises ``repeats`` runs after one warm-up: the median by default (``statistic`` may ask for
  the mean, which is what a sum of many steps sees on a machine shared with other jobs, or the minimum).
- Optional extras for the throughput model (``eval.throughput``): a drafter forward over ``m`` rows for each
  ``draft_rows`` entry (the context rows after a step that committed ``m`` tokens, or one tree expansion of ``m``
  parallel rows), and the loop's work between forwards (verification + cache keep of the verified path,
  ``bookkeeping``), so every term of a step is measured on its own.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from eyas.serving.loop import prefill, tree_forward
from eyas.serving.models.drafter import Eagle3Drafter
from eyas.serving.models.kv_cache import SlotCache
from eyas.serving.models.target import Target
from eyas.serving.tree import DraftTree, chain_tree
from eyas.serving.verify import SamplingConfig, verify

STATISTICS = ("median", "mean", "min")


@dataclass
class ProfileConfig:
    """What to time."""

    context_lengths: list[int] = field(default_factory=lambda: [16, 64, 256, 1024, 2048, 4096])
    """Context lengths L (committed tokens before the step)."""
    verify_tokens: list[int] = field(default_factory=lambda: [1, 7])
    """Tokens per verify forward (1 = plain decoding; K + 1 for a chain of K; a tree's size)."""
    accepted_rows: int = 4
    """Context rows the drafter re-encodes after a verify step (≈ τ)."""
    repeats: int = 5
    """Timed repetitions per point (summarised by ``statistic``)."""
    seed: int = 0
    statistic: str = "median"
    """How the repeats of a point are summarised: ``median``, ``mean`` or ``min``."""
    draft_rows: list[int] = field(default_factory=list)
    """Also time one drafter forward over ``m`` rows after the context, for each ``m`` listed (empty: skip)."""
    bookkeeping: bool = False
    """Also time verification + cache keep of each verify forward's output (the loop's work between forwards)."""
    temperature: float = 0.0
    """Verification timed by ``bookkeeping``: 0 = greedy, > 0 = the sampling rule at that temperature."""

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, not {self.statistic!r}")
        if self.draft_rows and min(self.draft_rows) < 1:
            raise ValueError("draft_rows must be positive")
        if not self.context_lengths or min(self.context_lengths) < 1:
            raise ValueError("context_lengths must be positive")
        if not self.verify_tokens or min(self.verify_tokens) < 1:
            raise ValueError("verify_tokens must be positive")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")


@dataclass
class StepProfile:
    """Median times in milliseconds, per context length."""

    context_lengths: list[int]
    verify_ms: dict[int, list[float]]
    """tokens per verify forward -> time at each context length."""
    draft_context_ms: list[float] = field(default_factory=list)
    """Drafter forward over ``accepted_rows`` new context rows."""
    draft_step_ms: list[float] = field(default_factory=list)
    """One single-row draft step."""
    accepted_rows: int = 4
    draft_rows_ms: dict[int, list[float]] = field(default_factory=dict)
    """Drafter forward over ``m`` rows -> time at each context length (``ProfileConfig.draft_rows``)."""
    bookkeeping_ms: dict[int, list[float]] = field(default_factory=dict)
    """Tokens per verify forward -> verification + cache keep time at each context length."""
    statistic: str = "median"
    machine: dict[str, Any] = field(default_factory=dict)
    """Where it was timed (:func:`machine_info`): a K chosen from this profile is this machine's."""
    plain_numerics: str = ""
    """When the one-token verify (``verify_ms[1]``, plain decoding's step) was timed on other numerics than the
    rest (the evaluation's baseline target): which."""

    def draft_ms(self, i: int, k: int) -> float:
        """Drafter time of one chain step of K drafts at context index ``i``."""
        if not self.draft_step_ms:
            return 0.0
        return self.draft_context_ms[i] + (k - 1) * self.draft_step_ms[i]

    def interp(self, series: list[float], length: float) -> float:
        """Piecewise-linear interpolation of a series over context length (clamped at the ends)."""
        xs = self.context_lengths
        if length <= xs[0]:
            return series[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, series), zip(xs[1:], series[1:])):
            if length <= x1:
                return y0 + (y1 - y0) * (length - x0) / (x1 - x0)
        return series[-1]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("verify_ms", "draft_rows_ms", "bookkeeping_ms"):
            d[key] = {str(k): v for k, v in getattr(self, key).items()}
        return d


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(device: torch.device) -> dict[str, Any]:
    """Where a profile is timed: CPU model, torch's CPU threads, torch's version, and the GPU on CUDA."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def time_ms(fn, repeats: int, device: torch.device, statistic: str = "median") -> float:
    """``fn()`` once to warm up, then ``repeats`` timed calls summarised by ``statistic`` (milliseconds)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    summary = {"median": statistics.median, "mean": statistics.fmean, "min": min}[statistic]
    return 1e3 * summary(times)


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    return time_ms(fn, repeats, device, "median")


@torch.inference_mode()
def profile_steps(
    target: Target, drafter: Eagle3Drafter | None, cfg: ProfileConfig | None = None
) -> StepProfile:
    """Time the verify forward (and the drafter, if given) at each context length."""
    cfg = cfg or ProfileConfig()
    lengths = sorted(cfg.context_lengths)
    profiler = StepProfiler(target, drafter, cfg)
    too_long = [n for n in lengths if n + max(cfg.verify_tokens) > profiler.limit]
    if too_long:
        raise ValueError(
            f"context lengths {too_long} exceed the target's max_position_embeddings={profiler.limit}"
        )
    parts = []
    for length in tqdm(lengths, desc="profile", unit="ctx"):
        profiler.prepare(length)
        parts.append(profiler.sample(length))
        profiler.release(length)
    prof = merge_profiles(parts)
    prof.machine = machine_info(target.device)
    return prof


def merge_profiles(parts: list[StepProfile]) -> StepProfile:
    """Profiles of distinct context lengths (same settings) -> one profile over all of them, in order."""
    if not parts:
        raise ValueError("no profiles to merge")

    def table(name: str) -> dict[int, list[float]]:
        return {k: [x for p in parts for x in getattr(p, name)[k]] for k in getattr(parts[0], name)}

    return StepProfile(
        context_lengths=[c for p in parts for c in p.context_lengths],
        verify_ms=table("verify_ms"),
        draft_context_ms=[x for p in parts for x in p.draft_context_ms],
        draft_step_ms=[x for p in parts for x in p.draft_step_ms],
        accepted_rows=parts[0].accepted_rows,
        draft_rows_ms=table("draft_rows_ms"),
        bookkeeping_ms=table("bookkeeping_ms"),
        statistic=parts[0].statistic,
        machine=parts[0].machine,
        plain_numerics=parts[0].plain_numerics,
    )


@dataclass
class _Prepared:
    """A context of ``length`` tokens written once into the target's (and the drafter's) cache."""

    cache: SlotCache
    trees: dict[int, DraftTree]  # verify width n -> the chain tree timed
    logits: dict[int, torch.Tensor]  # n -> the verify forward's logits [n, V] (for bookkeeping)
    drafter: _DrafterBench | None


class StepProfiler:
    """Times the pieces of a step at contexts written once by :meth:`prepare`, so that :meth:`sample` can be
    called again and again between other work (``eval.diagnose`` interleaves samples with generations, so both
    see the same machine load). :func:`profile_steps` is one sample per context length."""

    def __init__(self, target: Target, drafter: Eagle3Drafter | None, cfg: ProfileConfig):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.limit = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        self.sampling = SamplingConfig(temperature=cfg.temperature, seed=cfg.seed)
        self._prepared: dict[int, _Prepared] = {}

    @torch.inference_mode()
    def prepare(self, length: int) -> None:
        """Write a random context of ``length`` tokens (idempotent)."""
        cfg, target = self.cfg, self.target
        if length in self._prepared:
            return
        if length + max(cfg.verify_tokens) > self.limit:
            raise ValueError(
                f"context length {length} exceeds the target's max_position_embeddings={self.limit}"
            )
        dev = target.device
        g = torch.Generator().manual_seed(cfg.seed)
        top = length + max([*cfg.verify_tokens, *cfg.draft_rows, cfg.accepted_rows]) + 1
        ids = torch.randint(3, target.vocab_size, (top,), generator=g).to(dev)
        cache = target.new_cache(length + max(cfg.verify_tokens) + 1)
        out = prefill(target, cache, ids[:length])
        trees = {
            n: chain_tree(ids[length : length + 1], ids[length + 1 : length + n]) for n in cfg.verify_tokens
        }
        logits = {}
        if cfg.bookkeeping:
            logits = {n: tree_forward(target, cache, t).logits[0] for n, t in trees.items()}  # [n, V]
        bench = None if self.drafter is None else _DrafterBench(self.drafter, out.aux[0], ids, length, cfg)
        self._prepared[length] = _Prepared(cache, trees, logits, bench)

    def release(self, length: int) -> None:
        self._prepared.pop(length, None)

    @torch.inference_mode()
    def sample(self, length: int) -> StepProfile:
        """One profile point at a prepared ``length`` (each time: one warm-up, then ``repeats`` timed runs)."""
        if length not in self._prepared:
            self.prepare(length)
        cfg, target, dev = self.cfg, self.target, self.target.device
        state = self._prepared[length]
        prof = StepProfile(
            [length],
            {n: [] for n in cfg.verify_tokens},
            accepted_rows=cfg.accepted_rows,
            statistic=cfg.statistic,
        )
        cache = state.cache
        for n, tree in state.trees.items():

            def verify_once(tree=tree):
                tree_forward(target, cache, tree)

            prof.verify_ms[n].append(time_ms(verify_once, cfg.repeats, dev, cfg.statistic))
            if cfg.bookkeeping:
                gen = torch.Generator(device=dev).manual_seed(cfg.seed)

                def bookkeeping_once(tree=tree, logits=state.logits[n], gen=gen):
                    res = verify(logits, tree, None, self.sampling, gen, chain=True)
                    cache.keep(cache.length + res.path, cache.length)  # what commit does, length left as is

                prof.bookkeeping_ms.setdefault(n, []).append(
                    time_ms(bookkeeping_once, cfg.repeats, dev, cfg.statistic)
                )
        if state.drafter is not None:
            times = state.drafter.time(cfg)
            prof.draft_context_ms.append(times.context_ms)
            prof.draft_step_ms.append(times.step_ms)
            prof.draft_rows_ms = {m: [ms] for m, ms in times.rows_ms.items()}
        return prof


@dataclass
class _DrafterTimes:
    context_ms: float  # ``accepted_rows`` context rows
    step_ms: float  # one single-row draft step (forward + argmax)
    rows_ms: dict[int, float]  # m rows after the whole context, for each ``draft_rows`` entry


class _DrafterBench:
    """The drafter's cache with ``length`` rows written (all but ``accepted_rows`` of them at construction)."""

    def __init__(
        self, drafter: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, length: int, cfg: ProfileConfig
    ):
        dev = drafter.fc.weight.device
        self.drafter, self.ids, self.length = drafter, ids, length
        extra = max([cfg.accepted_rows, *cfg.draft_rows])
        self.cache = cache = drafter.new_cache(length + extra + 2)
        m = length - cfg.accepted_rows if length > cfg.accepted_rows else length
        self.aux = aux = aux.to(dev)
        pos = torch.arange(m, device=dev)
        cache.prepare(pos, m)
        causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()[None, None]
        out = drafter(ids[1 : m + 1][None], aux[:m][None], pos[None], cache, causal, hidden_is_aux=True)
        cache.commit(m)
        self.m = m
        self.hidden = out.hidden[:, -1:]

    def time(self, cfg: ProfileConfig) -> _DrafterTimes:
        drafter, ids, length, cache = self.drafter, self.ids, self.length, self.cache
        aux, m = self.aux, self.m
        dev = drafter.fc.weight.device
        r = length - m
        if r > 0:
            rpos = torch.arange(m, m + r, device=dev)
            rmask = torch.ones(r, m + r, dtype=torch.bool, device=dev).tril(diagonal=m)[None, None]

            def ctx_rows():
                cache.prepare(rpos, m + r)
                drafter(
                    ids[m + 1 : m + r + 1][None],
                    aux[m : m + r][None],
                    rpos[None],
                    cache,
                    rmask,
                    hidden_is_aux=True,
                )

            ctx_ms = time_ms(ctx_rows, cfg.repeats, dev, cfg.statistic)
        else:
            ctx_ms = 0.0
        hidden = self.hidden
        slot = torch.tensor([length], device=dev)
        smask = torch.ones(1, 1, 1, length + 1, dtype=torch.bool, device=dev)

        def draft_row():
            cache.prepare(slot, length + 1)
            o = drafter(ids[length : length + 1][None], hidden, slot[None], cache, smask, hidden_is_aux=False)
            o.logits.argmax(-1)

        step_ms = time_ms(draft_row, cfg.repeats, dev, cfg.statistic)
        rows_ms = {}
        for rows in cfg.draft_rows:  # m rows at positions length .. length + m - 1, reading the whole context
            mpos = torch.arange(length, length + rows, device=dev)
            mmask = torch.ones(rows, length + rows, dtype=torch.bool, device=dev).tril(diagonal=length)
            mmask = mmask[None, None]  # [1, 1, rows, length + rows]
            maux = aux[:rows] if aux.shape[0] >= rows else aux[:1].expand(rows, -1)  # [rows, n_aux * H]

            def rows_once(mpos=mpos, mmask=mmask, maux=maux, rows=rows):
                cache.prepare(mpos, length + rows)
                drafter(ids[1 : rows + 1][None], maux[None], mpos[None], cache, mmask, hidden_is_aux=True)

            rows_ms[rows] = time_ms(rows_once, cfg.repeats, dev, cfg.statistic)
        return _DrafterTimes(ctx_ms, step_ms, rows_ms)
