"""The whole diagnosis: load the drafter, build the prompts, measure, analyse."""

from __future__ import annotations

import logging
from typing import Any

from eyas.eval.diagnose.analysis import DiagnoseResult, analyse
from eyas.eval.diagnose.config import DiagnoseConfig, DiagnoseJob
from eyas.eval.diagnose.context_prompts import ContextPrompts, build_prompts
from eyas.eval.diagnose.measure import check_contexts, measure
from eyas.eval.prompts import BUILTIN_PREDICTABLE, builtin_predictable, prompt_messages  # noqa: F401
from eyas.serving.load import LoadedDrafter, load_drafter, load_target_for_drafter
from eyas.serving.models.drafter import Eagle3Drafter
from eyas.serving.models.target import Target
from eyas.serving.proposers import Proposer

log = logging.getLogger(__name__)


# -- the whole run -----------------------------------------------------------------------------------------------
def target_facts(target: Target) -> dict[str, Any]:
    """The target's identity plus, from ``eval.plan``'s arithmetic, the KV bytes one token adds to every verify
    forward's reads (why verify time grows with context) and its supported context."""
    from eyas.eval.plan import PlanError, load_model_config, model_shape, supported_context

    facts = target.info.to_dict()
    try:
        cfg, name = load_model_config(target.config)
        shape = model_shape(cfg, name)
        facts["kv_bytes_per_token"] = shape.kv_values_per_layer() * shape.num_layers * target.dtype.itemsize
        facts["supported_context"] = supported_context(cfg, shape).tokens
    except PlanError as e:
        log.info("no memory facts for the target: %s", e)
    return facts


def diagnose(
    target: Target,
    cfg: DiagnoseConfig,
    drafter: LoadedDrafter | Eagle3Drafter | None = None,
    prompts: dict[str, ContextPrompts] | None = None,
    proposers: dict[str, Proposer] | None = None,
) -> DiagnoseResult:
    """Measure, decompose, check and recommend (prompts built from ``cfg`` unless given)."""
    if cfg.uses_drafter and drafter is None:
        drafter = load_drafter(cfg.drafter_spec, target, cfg.draft_vocab_size, cfg.seed, cfg.runs_dir)
    source = (
        drafter.source if isinstance(drafter, LoadedDrafter) else ("given" if drafter is not None else None)
    )
    module = drafter.drafter if isinstance(drafter, LoadedDrafter) else drafter
    check_contexts(cfg, target)
    if prompts is None:
        prompts = build_prompts(cfg, target.tokenizer)
    m = measure(target, cfg, prompts, module, proposers)
    result = analyse(cfg, m, target_facts(target), source)
    if isinstance(drafter, LoadedDrafter) and not drafter.trained:
        result.notes.append(
            "the EAGLE-3 drafter is UNTRAINED (random init): its τ is ~1 by construction; its "
            "step costs are those of a trained drafter of the same shape"
        )
    return result


def run(job: DiagnoseJob, command: str = "") -> int:
    """The command: load the target, diagnose, write the report; 1 when a cell is flagged (CI can gate on it)."""
    import torch

    from eyas.eval.diagnose.report import print_summary, write_report

    cfg = job.diagnose
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    # the drafter names the target layers it reads (serving.load.with_drafter_aux_layers)
    drafter = cfg.drafter_spec if cfg.uses_drafter else None
    result = diagnose(load_target_for_drafter(job.target, drafter, cfg.runs_dir), cfg)
    path = write_report(result, cfg.out_dir, command or None)
    print_summary(result, path)
    return 1 if result.flagged else 0
