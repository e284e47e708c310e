"""Export an EAGLE-3 drafter in the formats SGLang and vLLM load unchanged (reading one back: :mod:`eyas.serving.load`).

Design decisions (what each consumer does was read from its own model-loading code, not from its documentation):
- Two formats. ``sglang``: ``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]`` and tensors named
  as :class:`serving.drafter.Eagle3Drafter` names them (``midlayer.*``); SGLang's ``LlamaForCausalLMEagle3`` and
  vLLM's ``Eagle3LlamaForCausalLM`` both load it. ``speculators``: the vLLM ``speculators`` library's Eagle-3
  format (``speculators_model_type: "eagle3"``, a ``transformer_layer_config``, ``layers.0.*`` tensor names),
  which vLLM detects and converts on load.
- Aux layer ids. SGLang id ``i`` is the output of decoder layer ``i``; vLLM/speculators id ``i`` is the *input*
  of layer ``i`` (vLLM captures ``hidden_states + residual`` before running layer ``i``), so speculators ids are
  SGLang's + 1. The SGLang config carries SGLang ids in ``eagle_config`` (the only place SGLang reads them) and,
  by default, vLLM-convention ids at the top level (the place vLLM reads first), so one directory serves both.
- ``norm_before_residual: false`` is written explicitly in the speculators config: vLLM defaults a missing key
  to ``True``, which would silently change the block (this drafter keeps the un-normed hidden as residual).
- EAGLE-3.1 (``DrafterConfig.fc_norm`` / ``norm_output`` / ``norm_before_fc``): written as the top-level config
  keys of those names, and the norms' weights as ``fc_norm.{i}.weight`` / ``input_norm.weight``, in both formats:
  what vLLM 0.32's ``llama_eagle3.py`` reads (its loader prefixes ``model.``, so they land on
  ``model.fc_norm.{i}`` / ``model.input_norm``), and what speculators' eagle3 config carries (vLLM's
  ``speculators/algos.py`` copies the three keys). A key is written only when on: vLLM reads a missing one as
  off, and a drafter without the options exports byte for byte as before them. SGLang versions whose
  ``LlamaForCausalLMEagle3`` predates them skip unknown weights silently, so export warns for that format.
- Parallel drafting (P-EAGLE, ``DrafterConfig.parallel_drafting``): the learned mask aux vector is the tensor
  ``mask_hidden`` (vLLM 0.32's ``Eagle3LlamaForCausalLM.load_weights`` copies it into its buffer of that name)
  and the mask token is the config's ``mask_token_id`` (what vLLM's proposer reads). vLLM drafts in parallel
  when its speculative config says ``parallel_drafting: true``, which the recorded vLLM command line carries; the
  speculators format says ``speculators_model_type: "peagle"`` instead, which vLLM turns into the same (its
  ``update_peagle`` carries ``norm_before_fc`` but not ``fc_norm`` / ``norm_output``, so those are refused
  there). SGLang has no parallel drafting: no SGLang command is recorded for such an export.
- The embedding. SGLang always replaces the drafter's embedding with the target's (``set_embed``); vLLM shares
  the target's when the checkpoint has none (or an identical one); the speculators library ignores a missing
  ``embed_tokens.weight`` on load and leaves it at its initial values, and its own converter adds the
  verifier's embedding. So: not exported for ``sglang`` (docs/DESIGN.md), exported for ``speculators`` (the
  directory is then complete for every speculators-format reader); :attr:`ExportConfig.include_embedding`
  overrides both.
- Rope: both the transformers-v5 ``rope_parameters`` and the classic ``rope_theta`` / ``rope_scaling`` keys are
  written, with the target's values and a ``max_position_embeddings`` no smaller than the target's. SGLang's and
  vLLM's ``yarn`` scale cos/sin by ``(0.1 ln factor + 1) × attn_factor`` and ignore ``mscale`` /
  ``mscale_all_dim``, while transformers (whose rope the drafter trains with) uses their ratio (1.0 for
  DeepSeek-V3 / Kimi-K2); so ``rope_scaling`` also carries the ``attn_factor`` that makes the two agree.
- A sliding-window drafter (``DrafterConfig.attention_window``) writes ``sliding_window`` and ``layer_types:
  ["sliding_attention"]``: vLLM 0.32 (``model_executor/models/llama.py``, ``LlamaAttention.__init__``) gives a
  layer ``per_layer_sliding_window = config.sliding_window`` when ``layer_types[layer_idx -
  config.target_layer_count]`` is ``sliding_attention``; ``llama_eagle3.py`` names the drafter's layer
  ``layers.{L}`` after an L-layer target and sets ``target_layer_count = L``, so a 1-layer drafter reads index 0.
  SGLang's ``LlamaForCausalLMEagle3`` reads neither field (it serves such a drafter with full attention).
- dtype: ``torch_dtype`` and ``dtype`` both written. Float tensors are cast to :attr:`ExportConfig.dtype`;
  ``d2t`` stays int64 and ``t2d`` bool.
- Every check runs before anything is written; the directory is written under a temporary name, every file and the
  directory fsynced, and swapped into place (``common.replace_dir``), so a failed export, a crash or a power loss
  never leaves a half-written checkpoint or destroys an earlier one. Where the filesystem cannot swap directories
  (NFS), the previous export is renamed aside to ``.<name>.old`` for a moment; a replace interrupted there is
  undone by the next export to that directory (the previous export restored), and a loader names it. ``overwrite``
  replaces only an earlier eyas export (its ``eyas_export.json`` and nothing but export files), never a directory
  holding anything else or a plain file. Files are written 0644 and the directory 0755, whatever the umask: the
  server reading them often runs as another user.
- A DFlash block drafter (``serving.models.dflash``) is written in vLLM's ``dflash`` format whatever ``fmt`` says,
  through the same checks, sidecar and atomic write as EAGLE-3's (:mod:`eyas.serving.export_dflash` supplies its
  tensors, config and mask embedding file); no SGLang command is recorded for it (SGLang's DFlash reading this
  export's mask embedding and ``d2t`` is unverified).
- ``eyas_export.json`` beside the checkpoint records what produced it (target name, tokenizer hash, SGLang aux
  ids, embed scale); no server reads it, and :func:`eyas.serving.load.load_exported` works without it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eyas.command import Command, command_line_sets
from eyas.common import (
    ConfigError,
    InputError,
    atomic_write_bytes,
    base_config,
    ensure_out_dir,
    fsync_tree,
    recover_dir,
    replace_dir,
)
from eyas.serving.export_dflash import (
    check_dflash_tensors,
    dflash_config_json,
    dflash_tensors,
    mask_embedding_bytes,
)
from eyas.serving.export_format import (
    CONFIG,
    EAGLE31_KEYS,
    EMBED,
    EXPORT_FILES,
    EYAS_SIDECAR,
    FORMATS,
    MASK_EMBEDDING,
    SPECULATORS_ARCH,
    WEIGHTS,
    ExportError,
    check_tensors,
    clean_rope,
    to_speculators_name,
)
from eyas.serving.load import (
    SGLANG_ARCH,
    describe_export,
    load_exported,
    read_export_json,
)
from eyas.serving.models.dflash import DFlashConfig, DFlashDrafter
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.models.layers import rope_parameters_of
from eyas.serving.models.target import TargetConfig, aux_layer_problem
from eyas.serving.target_record import (
    SIDECAR_KEY,
    TargetRecord,
    check_target,
    choose_target,
)

log = logging.getLogger(__name__)

FILE_MODE, DIR_MODE = 0o644, 0o755  # servers often run as another user than the one exporting
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ExportConfig:
    """How to write an exported drafter."""

    fmt: str = "sglang"
    """``sglang`` (``LlamaForCausalLMEagle3``; SGLang and vLLM load it) or ``speculators`` (vLLM's format)."""
    dtype: str = "bfloat16"
    """dtype of the floating-point tensors written: ``bfloat16``, ``float16`` or ``float32``."""
    include_embedding: bool | None = None
    """Write ``embed_tokens.weight`` (the target's). None: no for ``sglang``, yes for ``speculators``."""
    speculative_tokens: int = 3
    """The chain length to serve with: recorded in ``eyas_export.json`` (``serve``) with the vLLM and SGLang
    command lines, and, in the speculators format, the greedy proposal's length in its config. An evaluation
    replaces the recorded one with the K it measures fastest (:func:`record_serving`)."""
    vllm_aux_ids: bool = True
    """sglang format only: also write top-level ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention."""
    verifier: str | None = None
    """speculators format only: ``verifier.name_or_path``, the target as readers can load it (the speculators
    library loads its config and lm_head from there). Default: the target's hub id, else its local directory."""
    allow_embed_scale: bool = False
    """Allow a drafter that scales its embedding (Gemma). SGLang/vLLM's Llama EAGLE-3 never scale it, so such an
    export runs slightly differently there (``input_layernorm`` removes the scale up to its epsilon)."""
    overwrite: bool = False
    """Replace an earlier eyas export in the output directory (after the new one is completely written). A
    directory holding anything else than an export's files (``EXPORT_FILES``) is never replaced."""

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ExportError(f"export format must be one of {FORMATS}, not {self.fmt!r}")
        if self.dtype not in _DTYPES:
            raise ExportError(f"export dtype must be one of {tuple(_DTYPES)}, not {self.dtype!r}")
        if self.speculative_tokens < 1:
            raise ExportError("speculative_tokens must be at least 1")

    @property
    def embedding_included(self) -> bool:
        return self.fmt == "speculators" if self.include_embedding is None else bool(self.include_embedding)


@dataclass(frozen=True)
class TargetSpec:
    """What export needs to know about the target; build with :meth:`from_target` or :meth:`from_config`."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    """Rows of the target's input embedding (``config.vocab_size``)."""
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    """transformers-style rope settings of the target's full-attention layers."""
    architectures: tuple[str, ...] = ()
    model_type: str = "unknown"
    tokenizer_hash: str | None = None
    revision: str | None = None
    aux_layers: tuple[int, ...] | None = None
    """The aux layers the target runner captured (SGLang ids), when known; must match the drafter's."""
    embedding: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """The target's input embedding table, when available (written when the embedding is exported)."""
    source: str | None = None
    """Where the target was loaded from (hub id or local directory; transformers' ``_name_or_path``)."""

    @classmethod
    def from_config(
        cls,
        config,
        *,
        name: str | None = None,
        tokenizer_hash: str | None = None,
        revision: str | None = None,
        aux_layers=None,
        embedding: torch.Tensor | None = None,
    ):
        """From a transformers config of the target (any architecture; multimodal configs use the text part)."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        missing = [
            k
            for k in ("num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings")
            if getattr(c, k, None) is None
        ]
        if missing:
            raise ExportError(
                f"target config lacks {missing}; export needs them to write the drafter's config"
            )
        return cls(
            name=name or str(getattr(config, "_name_or_path", "") or getattr(c, "model_type", "target")),
            num_layers=int(c.num_hidden_layers),
            hidden_size=int(c.hidden_size),
            vocab_size=int(c.vocab_size),
            max_position_embeddings=int(c.max_position_embeddings),
            rope_parameters=rope_parameters_of(c),
            architectures=tuple(getattr(config, "architectures", None) or ()),
            model_type=str(getattr(c, "model_type", "unknown")),
            tokenizer_hash=tokenizer_hash,
            revision=revision,
            aux_layers=None if aux_layers is None else tuple(int(i) for i in aux_layers),
            embedding=embedding,
            source=str(getattr(config, "_name_or_path", "") or "") or None,
        )

    @classmethod
    def from_target(cls, target) -> TargetSpec:
        """From a loaded :class:`serving.target.Target` (carries its embedding and tokenizer hash)."""
        info = target.info
        return cls.from_config(
            target.model.config,
            name=info.name,
            tokenizer_hash=info.tokenizer_hash,
            revision=info.revision,
            aux_layers=info.aux_layers,
            embedding=target.model.get_input_embeddings().weight,
        )

    @classmethod
    def from_info(cls, info, config, embedding: torch.Tensor | None = None) -> TargetSpec:
        """From a :class:`serving.target.TargetInfo` (e.g. a feature-store manifest) plus the target's config."""
        return cls.from_config(
            config,
            name=info.name,
            tokenizer_hash=info.tokenizer_hash,
            revision=info.revision,
            aux_layers=info.aux_layers,
            embedding=embedding,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "revision": self.revision,
            "tokenizer_hash": self.tokenizer_hash,
            "num_layers": self.num_layers,
            "model_type": self.model_type,
            "architectures": list(self.architectures),
        }


@dataclass
class ExportResult:
    """What :func:`export` wrote."""

    out_dir: Path
    fmt: str
    config: dict[str, Any]
    tensor_names: list[str]
    num_bytes: int
    embedding_included: bool


def target_spec(target) -> TargetSpec:
    """Accept a :class:`TargetSpec`, a loaded Target, or a transformers config."""
    if isinstance(target, TargetSpec):
        return target
    if hasattr(target, "info") and hasattr(target, "model"):
        return TargetSpec.from_target(target)
    if hasattr(target, "num_hidden_layers") or hasattr(target, "get_text_config"):
        return TargetSpec.from_config(target)
    raise ExportError(
        f"cannot describe the target from a {type(target).__name__}; pass a loaded Target, a transformers "
        "config, or TargetSpec.from_info(info, config)"
    )


# -- expected tensors -------------------------------------------------------------------------------------------


def _eagle31_keys(c: DrafterConfig) -> dict[str, bool]:
    """The options that are on, for the config (off ones are left out: vLLM's default is off)."""
    return {k: True for k in EAGLE31_KEYS if getattr(c, k)}


def _parallel_keys(c: DrafterConfig) -> dict[str, Any]:
    """A parallel drafter's config keys (none for an autoregressive one)."""
    if not c.parallel_drafting:
        return {}
    return {"parallel_drafting": True, "mask_token_id": int(c.mask_token_id)}


def _norm_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """For comparisons: numbers as floats (4096 == 4096.0)."""
    return {
        k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
        for k, v in clean_rope(rope).items()
    }


def target_problems(c: DrafterConfig | DFlashConfig, spec: TargetSpec) -> list[str]:
    """Problems of either drafter family's config ``c`` with the target ``spec`` describes: layers, sizes, rope."""
    problems: list[str] = []
    aux_problem = aux_layer_problem(c.aux_layer_ids, spec.num_layers)
    if aux_problem:
        problems.append(aux_problem)
    if spec.aux_layers is not None and tuple(spec.aux_layers) != tuple(c.aux_layer_ids):
        problems.append(
            f"the drafter was built for aux layers {list(c.aux_layer_ids)} but the target runner "
            f"captures {list(spec.aux_layers)}"
        )
    if c.hidden_size != spec.hidden_size:
        problems.append(f"drafter hidden_size {c.hidden_size} != target's {spec.hidden_size}")
    if c.vocab_size != spec.vocab_size:
        problems.append(f"drafter vocab_size {c.vocab_size} != target's embedding rows {spec.vocab_size}")
    if c.max_position_embeddings < spec.max_position_embeddings:
        problems.append(
            f"drafter max_position_embeddings {c.max_position_embeddings} is smaller than the "
            f"target's {spec.max_position_embeddings}; long contexts would fall off its rope table"
        )
    if _norm_rope(c.rope_parameters) != _norm_rope(spec.rope_parameters):
        problems.append(
            f"drafter rope {_norm_rope(c.rope_parameters)} differs from the target's "
            f"{_norm_rope(spec.rope_parameters)}"
        )
    if str(c.rope_parameters.get("rope_type", "default")).startswith("dynamic"):
        problems.append("dynamic rope scaling cannot be exported")
    return problems


def check_compatibility(drafter: Eagle3Drafter, spec: TargetSpec, cfg: ExportConfig) -> list[str]:
    """Problems with exporting this EAGLE-3 drafter for this target in this format; [] if none."""
    c = drafter.config
    problems: list[str] = []
    n_aux = len(c.aux_layer_ids)
    if n_aux != 3:
        problems.append(f"the drafter fuses {n_aux} aux layers; SGLang and vLLM build fc for exactly 3")
    problems += target_problems(c, spec)
    if c.attention_bias:
        problems.append("attention_bias drafters cannot be exported (SGLang's EAGLE-3 qkv has no bias)")
    if c.hidden_act != "silu":
        problems.append(f"hidden_act {c.hidden_act!r}: only silu drafters are supported")
    if c.embed_scale != 1.0 and not cfg.allow_embed_scale:
        problems.append(
            f"the drafter scales its embedding by {c.embed_scale:g} ({spec.model_type}); SGLang/vLLM "
            "never do, so the served drafter would differ slightly (set allow_embed_scale=True to "
            "export anyway)"
        )
    if cfg.fmt == "speculators" and c.parallel_drafting and (c.fc_norm or c.norm_output):
        problems.append(
            "vLLM's peagle speculators config drops fc_norm and norm_output (update_peagle): export this "
            "parallel drafter in the sglang format, which vLLM also serves"
        )
    return problems


# -- config.json ------------------------------------------------------------------------------------------------
def _rope_keys(c: DrafterConfig) -> dict[str, Any]:
    rope = clean_rope(c.rope_parameters)
    theta = float(rope.get("rope_theta", 10000.0))
    scaling = None
    if rope["rope_type"] != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling["type"] = rope["rope_type"]  # pre-4.45 readers look for "type"
        attn_factor = _yarn_attn_factor(rope)
        if attn_factor is not None:
            scaling["attn_factor"] = attn_factor
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": rope}


def yarn_attention_factor(rope: dict[str, Any]) -> float:
    """The cos/sin scale transformers' YaRN applies (what the eyas drafter trains with)."""
    factor = float(rope["factor"])
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attn_factor(rope: dict[str, Any]) -> float | None:
    """``attn_factor`` making SGLang/vLLM's YaRN (cos/sin × ``(0.1 ln factor + 1) × attn_factor``, ignoring
    ``mscale``/``mscale_all_dim``) scale like transformers' does; None when they already agree."""
    if rope.get("rope_type") != "yarn" or not rope.get("factor"):
        return None
    ratio = yarn_attention_factor(rope) / _yarn_mscale(float(rope["factor"]))
    return None if abs(ratio - 1.0) < 1e-12 else ratio


def _llama_fields(c: DrafterConfig, dtype: str) -> dict[str, Any]:
    """The Llama-config part both formats share: sizes, rope, positions, dtype."""
    out = {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    out.update(_rope_keys(c))
    out.update(window_fields(c))
    return out


def window_fields(c: DrafterConfig) -> dict[str, Any]:
    """The sliding window as vLLM 0.32 reads it for a draft layer (module docstring); nothing for full attention.
    vllm/model_executor/models/llama.py: ``layer_types[layer_idx - config.target_layer_count] ==
    "sliding_attention"`` -> ``sliding_window = config.sliding_window``."""
    if c.attention_window is None:
        return {}
    return {"sliding_window": c.attention_window, "layer_types": ["sliding_attention"]}


def sglang_config(drafter: Eagle3Drafter, spec: TargetSpec, cfg: ExportConfig) -> dict[str, Any]:
    c = drafter.config
    out: dict[str, Any] = {"architectures": [SGLANG_ARCH], **_llama_fields(c, cfg.dtype)}
    out["draft_vocab_size"] = c.draft_vocab_size
    if c.target_hidden_size != c.hidden_size:  # SGLang tests hasattr(), so the key must be absent when equal
        out["target_hidden_size"] = c.target_hidden_size
    out["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "use_aux_hidden_state": True,
    }
    if cfg.vllm_aux_ids:
        out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in c.aux_layer_ids]
    out.update(_eagle31_keys(c))
    out.update(_parallel_keys(c))
    return out


def speculators_config(drafter: Eagle3Drafter, spec: TargetSpec, cfg: ExportConfig) -> dict[str, Any]:
    c = drafter.config
    layer = _llama_fields(c, cfg.dtype)
    out: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": False,
        "norm_before_fc": c.norm_before_fc,  # always written, as before the option (speculators reads it)
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.aux_layer_ids],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": _verifier_name(spec, cfg),
                "architectures": list(spec.architectures),
            },
        },
        "torch_dtype": cfg.dtype,
        "dtype": cfg.dtype,
    }
    if c.target_hidden_size != c.hidden_size:
        out["target_hidden_size"] = c.target_hidden_size
    out.update({k: v for k, v in _eagle31_keys(c).items() if k != "norm_before_fc"})
    if c.parallel_drafting:  # vLLM's update_peagle: architecture, parallel drafting and pard_token from these
        out["speculators_model_type"] = out["speculators_config"]["algorithm"] = "peagle"
        out["mask_token_id"] = int(c.mask_token_id)
    return out


def _verifier_name(spec: TargetSpec, cfg: ExportConfig) -> str | None:
    """speculators 0.9's ``Eagle3DraftModel.from_pretrained`` loads the verifier's config (and lm_head) from
    this, so it must be loadable where the export is read: a hub id, else the local directory (with a warning)."""
    if cfg.verifier is not None:
        return cfg.verifier
    for name in (spec.name, spec.source):
        if name and re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not Path(name).exists():
            return name
    if spec.source and Path(spec.source).is_dir():
        log.warning(
            "speculators export: verifier.name_or_path is the local directory %s; set "
            "ExportConfig.verifier to a hub id for a checkpoint that is read on another machine",
            spec.source,
        )
        return spec.source
    log.warning(
        "speculators export: no loadable verifier for target %r; vLLM serves it, but the speculators "
        "library's from_pretrained needs ExportConfig.verifier set",
        spec.name,
    )
    return None


# -- export -----------------------------------------------------------------------------------------------------


def export(
    drafter: Eagle3Drafter,
    target,
    out_dir: str | os.PathLike,
    fmt: str | None = None,
    *,
    config: ExportConfig | None = None,
    embedding: torch.Tensor | None = None,
    record: TargetRecord | None = None,
) -> ExportResult:
    """Validate, then write ``drafter`` for ``target`` (Target, transformers config or :class:`TargetSpec`).

    ``fmt`` overrides ``config.fmt``. ``embedding``: the target's input embedding, written when the embedding
    is exported (default: the target's when ``target`` carries it, else the drafter's copy of it). ``record``:
    the target's :class:`~serving.target_record.TargetRecord`, kept in ``eyas_export.json`` (``eyas eval`` loads
    that target when no ``target=`` is given).
    Raises :class:`ExportError` listing every problem before anything is written.
    """
    cfg = config or ExportConfig()
    if fmt is not None and fmt != cfg.fmt:
        cfg = ExportConfig(**{**cfg.__dict__, "fmt": fmt})
    spec = target_spec(target)
    out = Path(out_dir)
    dflash = isinstance(drafter, DFlashDrafter)  # vLLM's dflash format, the only one that serves it
    include = cfg.embedding_included and not dflash  # DFlash shares the target's embedding
    dtype = _DTYPES[cfg.dtype]

    recover_export(out)  # an earlier replace of out cut short: the previous export back before out is judged
    if dflash:
        problems = target_problems(drafter.config, spec)
        written = dflash_tensors(drafter, dtype)
        problems += check_dflash_tensors(written, drafter.config, "drafter")
    else:
        problems = check_compatibility(drafter, spec, cfg)
        tensors = {k: v.detach().cpu() for k, v in drafter.trainable_state_dict().items()}
        if include:
            emb = embedding if embedding is not None else spec.embedding
            if emb is None:
                log.info(
                    "export: writing the drafter's copy of the target embedding (no target embedding given)"
                )
                emb = drafter.embed_tokens.weight
            tensors[EMBED] = emb.detach().cpu()
        problems += check_tensors(tensors, drafter.config, include)
    out_problem = output_dir_problem(out, cfg.overwrite)
    if out_problem:
        problems.append(out_problem)
    else:
        try:  # where the export will be renamed into place
            ensure_out_dir(out.parent, "export.out_dir", value=out)
        except InputError as e:
            problems.append(str(e))
    if problems:
        what = "the DFlash drafter" if dflash else "the drafter"
        raise ExportError(f"cannot export {what}:\n  - " + "\n  - ".join(problems))
    extra: dict[str, bytes] = {}
    if dflash:
        if drafter.config.num_hidden_layers > 1:
            log.warning(
                "export: a %d-layer DFlash drafter; vLLM 0.32's CPU build applies layer 0's k_norm to every "
                "layer's context keys (qwen3_dflash.py _normalize_context_k), so serve it on GPU",
                drafter.config.num_hidden_layers,
            )
        fmt = "dflash"
        cfg_json = {**dflash_config_json(drafter, cfg.dtype), **_rope_keys(drafter.config)}
        extra[MASK_EMBEDDING] = mask_embedding_bytes(drafter, dtype)
    else:
        if cfg.fmt == "sglang" and _eagle31_keys(drafter.config):
            log.warning(
                "export: the drafter uses %s; vLLM reads them from config.json, but SGLang versions whose "
                "LlamaForCausalLMEagle3 lacks them skip their weights and serve another drafter (check yours)",
                ", ".join(_eagle31_keys(drafter.config)),
            )
        fmt = cfg.fmt
        written = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
        if cfg.fmt == "speculators":
            written = {to_speculators_name(k): v for k, v in written.items()}
            cfg_json = speculators_config(drafter, spec, cfg)
        else:
            cfg_json = sglang_config(drafter, spec, cfg)
    sidecar = {
        "format": fmt,
        "target": spec.describe(),
        "aux_layers_sglang": list(drafter.config.aux_layer_ids),
        "embed_scale": 1.0 if dflash else drafter.config.embed_scale,
        "embedding_included": include,
        "drafter_config": drafter.config.to_dict(),
        "serve": serving_block(
            out,
            spec.source or spec.name,
            cfg.speculative_tokens,
            "export.speculative_tokens",
            parallel=not dflash and drafter.config.parallel_drafting,
            method="dflash" if dflash else "eagle3",
        ),
    }
    if record is not None:
        sidecar[SIDECAR_KEY] = record.to_dict()
    _write_atomically(out, cfg_json, written, sidecar, cfg.overwrite, extra=extra)
    num_bytes = sum(t.numel() * t.element_size() for t in written.values())
    log.info("exported drafter (%s, %s, %.1f MiB) to %s", fmt, cfg.dtype, num_bytes / 2**20, out)
    return ExportResult(
        out_dir=out,
        fmt=fmt,
        config=cfg_json,
        tensor_names=sorted(written),
        num_bytes=num_bytes,
        embedding_included=include,
    )


def vllm_speculative_config(
    export_dir: str | os.PathLike, k: int, parallel: bool = False, method: str = "eagle3"
) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for the export at ``export_dir`` drafting ``k`` tokens a step (a parallel
    drafter's K in one forward: ``parallel_drafting``; ``method``: ``eagle3``, or ``dflash`` for a DFlash export)."""
    spec: dict[str, Any] = {"method": method, "model": str(export_dir), "num_speculative_tokens": int(k)}
    if parallel:
        spec["parallel_drafting"] = True
    return spec


def export_is_parallel(export_dir: str | os.PathLike) -> bool:
    """Whether the export at ``export_dir`` holds a parallel-drafting (P-EAGLE) drafter (False where it holds no
    config: the server that is handed it says what is missing)."""
    path = Path(export_dir) / CONFIG
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    return bool(config.get("parallel_drafting")) or config.get("speculators_model_type") == "peagle"


def serving_commands(
    export_dir: str | os.PathLike, target_ref: str, k: int, parallel: bool = False, method: str = "eagle3"
) -> dict[str, str]:
    """The vLLM and SGLang command lines that serve ``target_ref`` with the export at ``export_dir`` as its
    drafter, drafting a chain of ``k`` tokens per step (vLLM's only for a parallel or a DFlash drafter)."""
    d = str(Path(export_dir).resolve())
    spec = json.dumps(vllm_speculative_config(d, k, parallel, method), separators=(",", ":"))
    commands = {"vllm": f"vllm serve {shlex.quote(target_ref)} --speculative-config {shlex.quote(spec)}"}
    if not parallel and method == "eagle3":
        commands["sglang"] = (
            f"python -m sglang.launch_server --model-path {shlex.quote(target_ref)} "
            f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {shlex.quote(d)} "
            f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
        )
    return commands


def serving_block(
    export_dir: str | os.PathLike,
    target_ref: str,
    k: int,
    source: str,
    parallel: bool = False,
    provenance: dict[str, Any] | None = None,
    method: str = "eagle3",
) -> dict[str, Any]:
    """``eyas_export.json``'s ``serve`` entry: the chain length, where it came from (``provenance``: the prompts
    it was chosen on and the hardware it was profiled on, when an evaluation chose it), and the command lines
    (none when ``k`` is 0, i.e. when plain decoding was predicted faster than any chain)."""
    block: dict[str, Any] = {"num_speculative_tokens": k, "source": source, "target": target_ref}
    if provenance:
        block.update(provenance)
    if k > 0:
        block["commands"] = serving_commands(export_dir, target_ref, k, parallel, method)
    else:
        block["note"] = "plain decoding was predicted faster than any chain length on the evaluated prompts"
    return block


def record_serving(
    export_dir: str | os.PathLike,
    k: int,
    source: str,
    *,
    profiled_on: dict[str, Any] | None = None,
    chosen_on: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Record chain length ``k`` (from ``source``, e.g. an evaluation report) in an export's ``eyas_export.json``
    and, in the speculators format, as its ``config.json``'s greedy proposal length (what vLLM serves by
    default); both rewritten atomically. ``profiled_on``: the hardware whose step times chose ``k`` (CPU model,
    threads, torch version); ``chosen_on``: the prompts it was chosen on. Returns the new ``serve`` entry."""
    d = Path(export_dir)
    sidecar = read_export_json(d / EYAS_SIDECAR, EYAS_SIDECAR)
    target_ref = (sidecar.get("serve") or {}).get("target") or sidecar.get("target", {}).get(
        "name", "<target>"
    )
    parallel = bool((sidecar.get("drafter_config") or {}).get("parallel_drafting"))
    provenance = {
        **({"profiled_on": profiled_on} if profiled_on else {}),
        **({"chosen_on": chosen_on} if chosen_on else {}),
    }
    method = "dflash" if sidecar.get("format") == "dflash" else "eagle3"
    sidecar["serve"] = serving_block(
        d, target_ref, k, source, parallel=parallel, provenance=provenance, method=method
    )
    config = read_export_json(d / CONFIG, CONFIG)
    if k > 0 and _set_speculative_tokens(config, k):
        _rewrite_json(d / CONFIG, config)
    _rewrite_json(d / EYAS_SIDECAR, sidecar)
    return sidecar["serve"]


def _set_speculative_tokens(config: dict[str, Any], k: int) -> bool:
    """Set every proposal method's ``speculative_tokens`` of a speculators-format config to ``k``; False when
    the config has none (the SGLang format: the engine's command line carries K)."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or []
    for m in methods:
        m["speculative_tokens"] = int(k)
    return bool(methods)


def _rewrite_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode())
    os.chmod(path, 0o644)  # as export wrote it, whatever the umask


def print_serving(serve: dict[str, Any] | None) -> None:
    """Print an export's ``serve`` entry as the command lines to run."""
    if not serve:
        return
    if not serve.get("commands"):
        print(f"serve: {serve.get('note', 'no chain length recorded')} ({serve.get('source')})")
        return
    print(f"serve with K={serve['num_speculative_tokens']} (from {serve['source']}):")
    hw = serve.get("profiled_on")
    if hw:  # a K chosen from step times is that machine's
        print(
            "  chosen for "
            + ", ".join(f"{k} {v}" for k, v in hw.items())
            + "; on other hardware, evaluate there"
        )
    for engine, cmd in serve["commands"].items():
        print(f"  {engine}: {cmd}")


def export_sglang(drafter: Eagle3Drafter, target, out_dir, **kw: Any) -> ExportResult:
    """:func:`export` in SGLang's ``LlamaForCausalLMEagle3`` format; ``kw`` are :class:`ExportConfig` fields."""
    embedding = kw.pop("embedding", None)
    return export(drafter, target, out_dir, config=ExportConfig(fmt="sglang", **kw), embedding=embedding)


def export_speculators(drafter: Eagle3Drafter, target, out_dir, **kw: Any) -> ExportResult:
    """:func:`export` in vLLM's speculators format; ``kw`` are :class:`ExportConfig` fields."""
    embedding = kw.pop("embedding", None)
    return export(drafter, target, out_dir, config=ExportConfig(fmt="speculators", **kw), embedding=embedding)


def output_dir_problem(out: Path, overwrite: bool) -> str | None:
    """Why ``out`` may not receive an export, else None: it may be absent, an empty directory or, with
    ``overwrite``, an earlier eyas export (its ``eyas_export.json`` and nothing outside ``EXPORT_FILES``)."""
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} is a file, not a directory; choose another export.out_dir (overwrite never replaces a file)"
    names = {p.name for p in out.iterdir()}
    if not names:
        return None
    if not overwrite:
        return f"{out} exists and is not empty (set export.overwrite=true to replace an earlier export there)"
    others = sorted(names - EXPORT_FILES)
    if others or EYAS_SIDECAR not in names:
        held = f"holds {others}" if others else f"has no {EYAS_SIDECAR}"
        return (
            f"{out} {held}: it is not an earlier eyas export, and overwrite replaces only those "
            f"({', '.join(sorted(EXPORT_FILES))}); choose another export.out_dir or empty this one yourself"
        )
    return None


def aside_dir(out: Path) -> Path:
    """Where :func:`common.replace_dir` keeps the previous export while it swaps in a new one without
    ``RENAME_EXCHANGE``: present with ``out`` missing only when that replace was cut between its two renames."""
    return out.with_name(f".{out.name}.old")


def recover_export(out: Path) -> None:
    """Undo a replace of ``out`` interrupted between its two renames: the previous export back in place."""
    old = aside_dir(out)
    if out.exists() or not old.is_dir():
        return
    try:
        recover_dir(out)
    except OSError as e:
        raise ExportError(
            f"{out} is missing: an export replacing it was interrupted, and the previous export at {old} cannot be "
            f"moved back ({e.strerror or e}); move it back yourself (mv {old} {out})"
        ) from None
    log.warning("%s: restored the previous export from %s (an export replacing it was interrupted)", out, old)


def _write_atomically(
    out: Path,
    cfg_json: dict,
    tensors: dict[str, torch.Tensor],
    sidecar: dict,
    overwrite: bool,
    extra: dict[str, bytes] | None = None,
) -> None:
    """The export's files (``extra``: further files by name, e.g. a DFlash export's mask embedding) written
    under a temporary name and swapped into place (module docstring)."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        try:
            tmp.mkdir()
            save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
            (tmp / CONFIG).write_text(json.dumps(cfg_json, indent=2) + "\n")
            (tmp / EYAS_SIDECAR).write_text(json.dumps(sidecar, indent=2, default=str) + "\n")
            for name, data in (extra or {}).items():
                (tmp / name).write_bytes(data)
            for name in EXPORT_FILES:  # safetensors writes 0600; servers may run as another user
                if (tmp / name).exists():
                    (tmp / name).chmod(FILE_MODE)
            tmp.chmod(DIR_MODE)
            fsync_tree(tmp)  # every byte on the disk before the directory takes the final name
        except OSError as e:  # a full disk, a quota, an I/O error: the earlier export is untouched
            raise ExportError(
                f"cannot write the export to {tmp} (export.out_dir={out}): {e.strerror or e}; free space there or "
                "choose another export.out_dir" + (f" ({out} is unchanged)" if out.exists() else "")
            ) from None
        if out.exists():
            problem = output_dir_problem(out, overwrite)
            if problem:
                raise ExportError(f"{out} changed while exporting; not replacing it: {problem}")
        replace_dir(tmp, out)  # a swap where the filesystem can; else out aside, tmp in, out removed
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# -- round trip -------------------------------------------------------------------------------------------------
@torch.no_grad()
def round_trip_error(
    drafter: Eagle3Drafter, export_dir: str | os.PathLike, embedding=None, steps: int = 2
) -> float:
    """Max |Δ logit| between ``drafter`` (its parameters rounded to the export's dtype) and the drafter loaded back
    from ``export_dir``, over a TTT unroll on random inputs. 0 up to fp32 reduction order means the export holds
    exactly this drafter."""
    d = Path(export_dir)
    config = read_export_json(d / CONFIG, CONFIG)
    dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "float32"))
    if isinstance(drafter, DFlashDrafter):
        return _dflash_round_trip_error(drafter, d, embedding, dtype)
    loaded = load_exported(
        d, embedding=embedding if embedding is not None else drafter.embed_tokens.weight, dtype=torch.float32
    )
    ref = copy.deepcopy(drafter).float().cpu()
    for p in ref.parameters():  # parameters only: the rope table stays fp32, as load_exported keeps it
        p.copy_(p.to(dtype).float())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ref.config.vocab_size, (1, 16), generator=g)
    aux = torch.randn(1, 16, ref.config.fc_in_features, generator=g)
    a = [ref.logits(h) for h in ref.forward_ttt(ids, aux, steps).hidden]
    b = [loaded.logits(h) for h in loaded.forward_ttt(ids, aux, steps).hidden]
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _dflash_round_trip_error(drafter: DFlashDrafter, d: Path, embedding, dtype: torch.dtype) -> float:
    """:func:`round_trip_error` of a DFlash drafter: its blocks at a few anchors of a random sequence."""
    loaded = load_exported(
        d, embedding=embedding if embedding is not None else drafter.embed_tokens.weight, dtype=torch.float32
    )
    ref = copy.deepcopy(drafter).float().cpu()
    for name, p in ref.named_parameters():  # what the export holds, rounded (the embedding is the target's)
        if not name.startswith("embed_tokens."):
            p.copy_(p.to(dtype).float())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ref.config.vocab_size, (1, 16), generator=g)
    ids[0, 5] = ref.config.mask_token_id  # the mask token as a real input too
    aux = torch.randn(1, 16, ref.config.fc_in_features, generator=g)
    anchors = torch.tensor([[1, 6, 11]])
    k = ref.config.block_size - 1

    def by_target_id(m: DFlashDrafter) -> torch.Tensor:  # a whole-vocabulary head is exported in target order
        z = m.logits(m.forward_blocks(ids, aux, anchors, k).hidden)
        out = z.new_zeros(*z.shape[:-1], m.config.vocab_size)
        out[..., m.draft_to_target] = z
        return out

    return float((by_target_id(ref) - by_target_id(loaded)).abs().max())


# -- entry point -------------------------------------------------------------------------------------------------
@dataclass
class ExportStage(ExportConfig):
    """The ``export`` Hydra group: which trainer checkpoint, where to, and the :class:`ExportConfig` settings."""

    checkpoint: str | None = None
    """A trainer checkpoint directory (``drafter.safetensors`` + ``drafter_config.json``), e.g. ``<run>/best``."""
    out_dir: str | None = None
    attention_window: int | None = None
    """The sliding window the export declares to the engines (``sliding_window`` / ``layer_types``): null the
    drafter's own (as trained), n > 0 a window of n tokens, 0 full attention. The weights are the checkpoint's
    either way; this is how ``eyas context`` measures a window (``context.windows``) is served (EAGLE-3 only)."""

    def settings(self) -> ExportConfig:
        return base_config(self, ExportConfig)


@dataclass
class ExportJob:
    """What ``python -m eyas.serving.export`` runs (:func:`run`): the Hydra groups of the same names."""

    target: TargetConfig | None = None
    """None (no ``target=`` on the command line): the target the checkpoint records, else the default one."""
    export: ExportStage = field(default_factory=ExportStage)


def run(job: ExportJob, target=None) -> dict[str, Any]:
    """Export ``job.export.checkpoint`` for SGLang / vLLM, load it back and check it reproduces the checkpoint's
    logits; returns :func:`describe_export` plus the round-trip error. The target (loaded unless given) is
    ``job.target``, else the one the checkpoint records; one that does not fit the drafter is refused."""
    from eyas.serving.models.drafter import load_trained_drafter
    from eyas.serving.models.target import load_target

    e = job.export
    for key in ("checkpoint", "out_dir"):
        if not getattr(e, key):
            raise ConfigError(
                f"export.{key} is not set: python -m eyas.serving.export export.{key}=<dir> ..."
            )
    chosen = choose_target(job.target, e.checkpoint, "export", caller_loaded=target is not None)
    target = target if target is not None else load_target(chosen.config)
    check_target(chosen.record, target.info, e.checkpoint)
    emb = target.model.get_input_embeddings().weight
    try:
        drafter = load_trained_drafter(e.checkpoint, emb)
    except ValueError as err:
        raise ExportError(f"export.checkpoint={e.checkpoint} (target {target.info.name}): {err}") from None
    if e.attention_window is not None:
        drafter = with_window(drafter, e.attention_window)
    record = TargetRecord.of(chosen.config, target.info) if chosen.known else None
    export(drafter, target, e.out_dir, config=e.settings(), record=record)
    err = round_trip_error(drafter, e.out_dir, emb)
    if err > 1e-4:
        raise ExportError(f"export round trip changed the logits by {err:.3g}: {e.out_dir}")
    return {**describe_export(e.out_dir), "round_trip_max_abs_logit_diff": err}


def with_window(drafter, window: int):
    """``drafter`` declaring a sliding window of ``window`` tokens (0: full attention), its weights untouched
    (:attr:`ExportStage.attention_window`)."""
    if isinstance(drafter, DFlashDrafter):
        raise ExportError(
            "export.attention_window applies to EAGLE-3 drafters; a DFlash drafter has no window"
        )
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ExportError(
            f"export.attention_window must be null (the drafter's own), 0 (full attention) or a positive token "
            f"count, not {window!r}"
        )
    drafter.config = replace(drafter.config, attention_window=window or None)
    return drafter


def export_command(job: ExportJob) -> None:
    """``python -m eyas.serving.export export.checkpoint=<dir> export.out_dir=<dir> [export.fmt=speculators] target=...``:
    export a trainer checkpoint for SGLang / vLLM, then load it back and check it reproduces the checkpoint. Without
    ``target=`` on the command line, the target is the one the checkpoint records."""
    if not command_line_sets("target"):
        job = replace(job, target=None)
    res = run(job)
    print(json.dumps(res, indent=1, default=str))
    print_serving(res.get("serve"))


COMMAND = Command("export", "eyas.serving.export", "config", ExportJob, export_command)
main = COMMAND.main


if __name__ == "__main__":
    main()
