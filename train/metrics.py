"""Training metrics: simulated acceptance length, the metrics JSONL and wandb.

Design decisions:
- Simulated acceptance (the training metric that picks ``best/``), from :class:`train.losses.ChainCounts`
  summed over the held-out split. With K draft steps and chain drafting, the expected number of tokens per
  verify step is ``tau = 1 + sum_{k=1..K} P(drafts 1..k all accepted)``.
  ``tau_indep`` plugs in the per-step teacher-forced accuracies ``acc_j`` (``P = prod_{j<k} acc_j``), which
  assumes acceptance at different depths is independent; ``tau_chain`` uses per-row conditional acceptance
  ``a_j = hits_j / reach_j`` measured on the same rows, so ``P = prod_{j<k} a_j`` is exact by the chain rule
  for greedy chain decoding over the positions where the data follows the target's argmax (self-distilled
  data). Neither models tree drafting (which accepts more).
- ``tau_served`` takes the same conditional acceptances over only the rows where served greedy chains of length
  K start (:func:`train.losses.served_chains` walks each row as the decoding loop would). Chains start right
  after a miss far more often than at a random row, and acceptance there is lower, so ``tau_chain`` overstates
  served τ (BENCH.md, "Where served chains start"); ``tau_served`` is the estimate to compare with the loop's.
- The metrics file is plain JSONL, one object per line with ``step`` and ``kind`` (train | eval); on resume,
  lines past the resumed step (work that the killed run lost) are dropped so the file matches the weights.
- wandb is imported only when enabled; mode comes from the config, else ``$WANDB_MODE``, else ``offline``, so a
  run never needs the network unless asked to.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.common import atomic_write_bytes
from eyas.train.config import WandbConfig
from eyas.train.losses import ChainCounts

log = logging.getLogger(__name__)


@dataclass
class AcceptanceEstimate:
    """Simulated acceptance over a held-out split (see the module docstring)."""

    acc: list[float]
    """Per-step teacher-forced accuracy, out-of-vocabulary teacher tokens counted as misses."""
    cond_acc: list[float]
    """Per-step conditional acceptance given the chain reached the step."""
    tau_indep: float
    tau_chain: float
    rows: int
    """Rows scored at step 0."""
    served_cond_acc: list[float] = field(default_factory=list)
    """Per-step conditional acceptance over the rows served chains start from."""
    tau_served: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tau(rates: list[float]) -> float:
    tau, run = 1.0, 1.0
    for r in rates:
        run *= r
        tau += run
    return tau


def simulated_acceptance(chain: ChainCounts) -> AcceptanceEstimate:
    counted = chain.counted.tolist()
    correct = chain.correct.tolist()
    reach = chain.reach.tolist()
    hits = chain.hits.tolist()

    def rates(num: list[float], den: list[float]) -> list[float]:
        return [x / n if n else 0.0 for x, n in zip(num, den)]

    acc = rates(correct, counted)
    cond = rates(hits, reach)
    served = []
    if chain.served_reach is not None and chain.served_hits is not None:
        served = rates(chain.served_hits.tolist(), chain.served_reach.tolist())
    return AcceptanceEstimate(
        acc=acc,
        cond_acc=cond,
        tau_indep=_tau(acc),
        tau_chain=_tau(cond),
        served_cond_acc=served,
        tau_served=_tau(served),
        rows=int(counted[0]) if counted else 0,
    )


def wandb_mode(cfg: WandbConfig) -> str:
    return cfg.mode or os.environ.get("WANDB_MODE") or "offline"


class MetricsLogger:
    """metrics.jsonl + wandb on the main process; a no-op elsewhere."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        enabled: bool,
        wandb_cfg: WandbConfig,
        run_config: dict[str, Any],
        resume_step: int | None,
        wandb_id: str | None,
    ):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.wandb_id = wandb_id
        self._run = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        mode = wandb_mode(wandb_cfg)
        if mode != "disabled":
            import wandb

            if os.environ.get("WANDB_MODE") == "":
                del os.environ["WANDB_MODE"]  # wandb itself rejects an empty mode

            self.wandb_id = self.wandb_id or uuid.uuid4().hex[:12]
            self._run = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name,
                mode=mode,
                dir=str(self.path.parent),
                config=run_config,
                id=self.wandb_id,
                resume="allow",
            )

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut by the kill
        atomic_write_bytes(self.path, "".join(x + "\n" for x in kept).encode())

    def log(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, "kind": kind, **{k: _jsonable(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._run is not None:
            flat = {f"{kind}/{k}": v for k, v in _flatten(values).items()}
            self._run.log(flat, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _flatten(values: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in values.items():
        if isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                if isinstance(x, (int, float)):
                    out[f"{k}/{i}"] = x
        elif isinstance(v, (int, float)):
            out[k] = v
    return out
