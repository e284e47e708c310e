"""The drafter's optimizer: AdamW, or Muon on the hidden weight matrices with AdamW on the rest.

``build_optimizer`` returns one ``torch.optim.Optimizer`` either way, so accelerate, the LR scheduler and the
checkpoint code see a single object. With ``train.optimizer=muon`` the 2-D weights of the decoder layer and
``fc`` take ``torch.optim.Muon`` (orthogonalised momentum, Moonshot's RMS matching so that ``train.lr`` means what
it means for AdamW); ``lm_head``, norms and biases keep AdamW, as Muon's authors recommend for embeddings, output
heads and vectors.
"""

from __future__ import annotations

import os
from typing import Any

import torch

OPTIMIZERS = ("auto", "adamw", "muon")


def deepspeed_launch() -> bool:
    """Whether this process was launched under DeepSpeed (``accelerate launch`` with a DeepSpeed config sets
    ``ACCELERATE_USE_DEEPSPEED``): what ``train.optimizer=auto`` resolves by, known before accelerate starts."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def resolve_optimizer(name: str, *, deepspeed: bool) -> str:
    """``auto``: Muon under plain data parallel, AdamW under DeepSpeed ZeRO, which hands a client optimizer flat
    partitions of the parameters, not the matrices Muon orthogonalises (DeepSpeed's own Muon is set in its JSON
    config, and eyas passes its optimizer itself). An explicit ``muon`` under DeepSpeed is refused."""
    if name == "auto":
        return "adamw" if deepspeed else "muon"
    if name == "muon" and deepspeed:
        raise ValueError(
            "train.optimizer=muon runs under plain data parallel only: DeepSpeed ZeRO hands the optimizer flat "
            "parameter partitions, not the weight matrices Muon orthogonalises; use train.optimizer=auto or adamw"
        )
    return name


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over some parameters and ``torch.optim.AdamW`` over the others, as one optimizer.

    The two inner optimizers share this object's ``param_groups`` dicts and ``state`` (their parameters are
    disjoint), so an LR scheduler's writes reach both and ``state_dict``/``load_state_dict`` are the base class's.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__(muon.param_groups + adamw.param_groups, {})
        self._n_muon = len(muon.param_groups)
        self._bind()

    def _bind(self) -> None:
        self.muon.param_groups = self.param_groups[: self._n_muon]
        self.adamw.param_groups = self.param_groups[self._n_muon :]
        self.muon.state = self.adamw.state = self.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_n_muon"):
            raise RuntimeError("MuonWithAdamW takes its parameter groups from its two inner optimizers")
        # called by the base __init__ only, with the groups the inner optimizers already built
        self.param_groups.append(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces self.param_groups and self.state
        self._bind()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices only."""
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


def build_optimizer(
    model: torch.nn.Module,
    kind: str,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    fused: bool,
    muon_lr: float | None = None,
    adamw_names: tuple[str, ...] = ("lm_head",),
) -> torch.optim.Optimizer:
    """The trainable parameters of ``model`` under ``kind`` (``adamw`` or ``muon``).

    With ``muon``, a 2-D parameter whose name contains one of ``adamw_names`` stays with AdamW, and the Muon part
    takes ``muon_lr`` (None: ``lr``); the LR schedule scales each group from its own starting value.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adamw_kw = dict(lr=lr, betas=betas, eps=eps, fused=fused)
    if kind == "adamw":
        return torch.optim.AdamW(param_groups([p for _, p in named], weight_decay), **adamw_kw)
    if kind != "muon":
        raise ValueError(f"build_optimizer: adamw or muon (resolve_optimizer first), not {kind!r}")
    on_muon = [p.ndim == 2 and not any(a in n for a in adamw_names) for n, p in named]
    hidden = [p for (_, p), m in zip(named, on_muon) if m]
    rest = [p for (_, p), m in zip(named, on_muon) if not m]
    if not hidden:
        raise ValueError("train.optimizer=muon: the model has no trainable 2-D weight outside lm_head")
    muon_lr = lr if muon_lr is None else muon_lr
    muon = torch.optim.Muon(hidden, lr=muon_lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    return MuonWithAdamW(muon, torch.optim.AdamW(param_groups(rest, weight_decay), **adamw_kw))
