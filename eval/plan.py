"""Memory plan for serving a target: KV bytes per token, weights, the KV pool and the largest context that fits.

``eyas plan plan.model=kimi_k2 plan.gpu_mem_gib=141 plan.num_gpus=8 plan.dp_attention=8 plan.kv_dtype=fp8
plan.context=131072`` (``python -m eyas.eval.plan``, ``conf/plan.yaml``)

Design decisions:
- Everything comes from the model config alone (a preset in ``conf/models/``, a ``config.json`` file or
  directory, a dict or a transformers config), so a plan for Kimi-K2 runs on a laptop in milliseconds.
- KV per token and layer: MHA/GQA caches ``2 × kv_heads × head_dim`` values; MLA (``kv_lora_rank`` present:
  DeepSeek-V3, Kimi-K2) caches the compressed latent plus the decoupled rope key, ``kv_lora_rank +
  qk_rope_head_dim`` values, as SGLang and vLLM do. Sliding-window layers (``layer_types`` or
  ``sliding_window_pattern``, Gemma 3) keep at most ``sliding_window`` tokens per sequence; a model-wide
  ``sliding_window`` without per-layer types is treated as full attention (an over-estimate).
- Parallelism follows SGLang's memory model. TP splits GQA kv heads: a rank keeps ``max(1, kv_heads //
  attn_tp)`` heads (replicated when TP exceeds the kv heads). MLA's latent has no head axis, so under plain TP
  every rank stores the whole latent of every token (replicated, no saving from TP). DP-attention
  (``dp_attention`` groups inside the TP group, attention TP = tp / dp_attention) gives each rank its own
  requests, so a token's KV lives on one rank and the group holds ``dp_attention`` times more tokens; that is
  where "Kimi-K2: 68.6 KiB per token, ~8.6 KiB per GPU over 8 GPUs" comes from. PP splits the layers evenly.
- Weights: parameters counted from the config, MoE experts included (MTP / nextn layers excluded, as servers
  load them only for MTP speculation). Attention weights shard over the attention-TP size, everything else over
  TP; PP splits evenly. ``weight_dtype=auto`` reads ``quantization_config`` (fp8 → 1 byte, 4-bit → 0.5) for the
  decoder's linear weights; embeddings, head and norms stay 16-bit.
- Memory per GPU for weights + KV is ``gpu_mem_gib × mem_fraction − reserve_gib`` (SGLang's
  ``mem_fraction_static`` semantics; ``reserve_gib`` stands in for activations and CUDA graphs).
- Supported context: ``max_position_embeddings``, or ``factor × original_max_position_embeddings`` for YaRN /
  linear rope scaling when larger (the YaRN convention vLLM also follows). A context beyond it is an error.
- The optional EAGLE-3 drafter follows :meth:`serving.models.drafter.DrafterConfig.from_target`: one layer whose kv
  heads are the target's (all attention heads for MLA targets, with ``head_dim = v_head_dim``), reading the
  target layers :func:`serving.models.target.default_aux_layers` picks (the rule training and serving use).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from eyas.command import Command

PRESET_DIR = Path(__file__).resolve().parent.parent / "conf" / "models"
KV_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
GIB = 2**30
KIB = 2**10


class PlanError(ValueError):
    """Settings that cannot work (the message says which limit they break)."""


class MissingConfigField(PlanError):
    """The model config lacks a field the plan needs."""

    def __init__(self, field_name: str, source: str, why: str):
        self.field = field_name
        super().__init__(f"model config {source} has no {field_name!r} ({why}); add it or use a preset")


class ContextTooLong(PlanError):
    """A requested context beyond what the model supports."""

    def __init__(self, context: int, limit: int, how: str):
        self.context, self.limit = context, limit
        super().__init__(f"context {context} exceeds the model's supported maximum of {limit} tokens ({how})")


# -- config ------------------------------------------------------------------------------------------------------
def load_model_config(source: Any) -> tuple[dict[str, Any], str]:
    """(text config as a dict, display name) from a preset name, a config.json path/dir, a dict or a config."""
    if isinstance(source, dict):
        cfg, name = dict(source), str(source.get("_name_or_path") or source.get("model_type") or "config")
    elif hasattr(source, "to_dict"):
        cfg, name = source.to_dict(), str(getattr(source, "_name_or_path", "") or source.model_type)
    else:
        s = str(source)
        p = Path(os.path.expanduser(s))
        if p.is_dir():
            p = p / "config.json"
        if p.suffix == ".json" and p.exists():
            try:
                cfg = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise PlanError(f"{p}: not valid JSON ({e})") from e
            name = str(p.parent.name)
        elif (PRESET_DIR / f"{s}.yaml").exists():
            cfg, name = _load_preset(PRESET_DIR / f"{s}.yaml")
        else:
            presets = sorted(x.stem for x in PRESET_DIR.glob("*.yaml"))
            raise PlanError(
                f"model {s!r} is neither a config.json (file or directory) nor a preset {presets}"
            )
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers: plan the language model
        cfg = {**cfg["text_config"], "quantization_config": cfg.get("quantization_config")}
    return cfg, name


def _load_preset(path: Path) -> tuple[dict[str, Any], str]:
    import yaml

    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise PlanError(f"{path}: a model preset needs a `config:` mapping (the model's config.json values)")
    return dict(data["config"]), str(data.get("name", path.stem))


def _need(cfg: dict, key: str, source: str, why: str):
    value = cfg.get(key)
    if value is None:
        raise MissingConfigField(key, source, why)
    return value


@dataclass(frozen=True)
class ModelShape:
    """The config fields the plan uses, resolved (defaults filled, MLA detected)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str
    """``mha``, ``gqa`` or ``mla``."""
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    sliding_window: int | None = None
    sliding_layers: int = 0
    max_position_embeddings: int = 0
    tie_word_embeddings: bool = False

    @property
    def full_layers(self) -> int:
        return self.num_layers - self.sliding_layers

    def kv_values_per_layer(self, kv_heads: int | None = None) -> int:
        """Cached values per token and layer (``kv_heads``: heads one rank keeps; MLA has none to split)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * (self.num_kv_heads if kv_heads is None else kv_heads) * self.head_dim


def model_shape(cfg: dict[str, Any], name: str = "config") -> ModelShape:
    layers = int(_need(cfg, "num_hidden_layers", name, "layer count"))
    hidden = int(_need(cfg, "hidden_size", name, "model width"))
    heads = int(_need(cfg, "num_attention_heads", name, "attention heads"))
    vocab = int(_need(cfg, "vocab_size", name, "embedding rows"))
    max_pos = int(_need(cfg, "max_position_embeddings", name, "the supported context"))
    mla = cfg.get("kv_lora_rank") is not None
    extra: dict[str, Any] = {}
    if mla:
        why = "MLA caches kv_lora_rank + qk_rope_head_dim values per layer"
        extra = dict(
            kv_lora_rank=int(_need(cfg, "kv_lora_rank", name, why)),
            qk_rope_head_dim=int(_need(cfg, "qk_rope_head_dim", name, why)),
            qk_nope_head_dim=int(_need(cfg, "qk_nope_head_dim", name, "MLA query/key width")),
            v_head_dim=int(_need(cfg, "v_head_dim", name, "MLA value width")),
            q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
        )
        kv_heads, head_dim, kind = heads, extra["v_head_dim"], "mla"
    else:
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kind = "mha" if kv_heads == heads else "gqa"
    window, n_sliding = _sliding(cfg, layers)
    return ModelShape(
        name=name,
        model_type=str(cfg.get("model_type", "unknown")),
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        attention=kind,
        sliding_window=window,
        sliding_layers=n_sliding,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **extra,
    )


def _sliding(cfg: dict, layers: int) -> tuple[int | None, int]:
    window = cfg.get("sliding_window")
    if not window:
        return None, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) >= layers:
        return int(window), sum(t == "sliding_attention" for t in types[:layers])
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if pattern:
        return int(window), sum((i + 1) % int(pattern) != 0 for i in range(layers))
    return None, 0  # model-wide window without per-layer types: counted as full attention


# -- parameters --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCount:
    """Parameters by where they live (for sharding) and how many one token uses."""

    embedding: int
    """Input embedding plus (untied) LM head."""
    attention: int
    mlp: int
    """Dense MLPs, routed experts (all of them), shared experts and routers."""
    norms: int
    active: int
    """Parameters one token computes with: routed experts ``num_experts_per_tok`` of them, the LM head, not the
    input embedding table (a lookup); DeepSeek-V3's published "36.6B activated" counts the same way."""

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms


def _moe_layout(cfg: dict, layers: int) -> tuple[list[bool], int, int, int, int]:
    """(is_moe per layer, routed experts, expert width, shared width total, experts per token)."""
    if cfg.get("n_routed_experts"):  # DeepSeek-V2/V3, Kimi-K2
        n, width = int(cfg["n_routed_experts"]), int(cfg["moe_intermediate_size"])
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        moe = [i >= first and i % freq == 0 for i in range(layers)]
        shared = int(cfg.get("n_shared_experts") or 0) * width
    elif cfg.get("num_experts") or cfg.get("num_local_experts"):
        # Qwen2/3-MoE (``num_experts``; transformers v5 writes it as ``num_local_experts``) and Mixtral, whose
        # experts are ``intermediate_size`` wide
        n = int(cfg.get("num_experts") or cfg["num_local_experts"])
        width = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
        moe = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    else:
        return [False] * layers, 0, 0, 0, 0
    return moe, n, width, shared, int(cfg.get("num_experts_per_tok") or 1)


def count_parameters(cfg: dict[str, Any], shape: ModelShape | None = None) -> ParamCount:
    """Parameter count of a decoder-only LM from its config (Llama/Qwen/Gemma/DeepSeek/Kimi/Mixtral shapes)."""
    s = shape or model_shape(cfg)
    h, mt = s.hidden_size, s.model_type
    embedding = s.vocab_size * h * (1 if s.tie_word_embeddings else 2)
    if s.attention == "mla":
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank:
            q = h * s.q_lora_rank + s.q_lora_rank * s.num_heads * qk
            q_norm = s.q_lora_rank
        else:
            q, q_norm = h * s.num_heads * qk, 0
        attn = (
            q
            + h * (s.kv_lora_rank + s.qk_rope_head_dim)
            + s.kv_lora_rank * s.num_heads * (s.qk_nope_head_dim + s.v_head_dim)
            + s.num_heads * s.v_head_dim * h
        )
        attn_norms = q_norm + s.kv_lora_rank
    else:
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        attn = h * q + 2 * h * kv + q * h
        if mt.startswith("qwen2"):
            attn += q + 2 * kv  # qkv biases
        elif cfg.get("attention_bias"):
            attn += q + 2 * kv + h
        attn_norms = 2 * s.head_dim if (mt.startswith("qwen3") or mt.startswith("gemma3")) else 0
    layer_norms = (4 if mt.startswith(("gemma2", "gemma3")) else 2) * h + attn_norms

    moe, n_exp, width, shared, top_k = _moe_layout(cfg, s.num_layers)
    dense_width = int(cfg.get("intermediate_size") or 4 * h)
    mlp = active_mlp = 0
    for is_moe in moe:
        if is_moe:
            routed = n_exp * 3 * h * width
            router = n_exp * h + (n_exp if cfg.get("n_routed_experts") else 0)  # + DeepSeek's score bias
            if shared and cfg.get("shared_expert_intermediate_size"):
                router += h  # Qwen2-MoE's shared-expert gate
            mlp += routed + 3 * h * shared + router
            active_mlp += top_k * 3 * h * width + 3 * h * shared + router
        else:
            mlp += 3 * h * dense_width
            active_mlp += 3 * h * dense_width
    attention = s.num_layers * attn
    norms = s.num_layers * layer_norms + h
    active = s.vocab_size * h + attention + norms + active_mlp  # the head computes even when tied
    return ParamCount(embedding=embedding, attention=attention, mlp=mlp, norms=norms, active=active)


# -- context limit -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContextLimit:
    tokens: int
    how: str


def supported_context(cfg: dict[str, Any], shape: ModelShape) -> ContextLimit:
    """The longest context the model is built for (see the module docstring for the rule)."""
    base = shape.max_position_embeddings
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    kind = rope.get("rope_type") or rope.get("type") or "default"
    factor = rope.get("factor")
    if kind in ("yarn", "linear") and factor:
        original = int(rope.get("original_max_position_embeddings") or base)
        scaled = int(float(factor) * original)
        if scaled > base:
            return ContextLimit(scaled, f"{kind} factor {float(factor):g} × original {original}")
    return ContextLimit(
        base, f"max_position_embeddings {base}" + (f" ({kind} rope)" if kind != "default" else "")
    )


# -- the plan ----------------------------------------------------------------------------------------------------
@dataclass
class PlanConfig:
    """Inputs of :func:`plan` (the ``plan`` key of ``eyas plan``: ``plan.model=kimi_k2``)."""

    model: str = "smollm2_135m"
    """Preset name in conf/models/, or a config.json file or model directory."""
    gpu_mem_gib: float = 80.0
    """Memory of one GPU in GiB (H100: 80, H200: 141)."""
    num_gpus: int = 1
    """GPUs in the deployment; replicas = num_gpus / (tp × pp)."""
    tp: int | None = None
    """Tensor-parallel size (default: num_gpus / pp)."""
    pp: int = 1
    """Pipeline-parallel size (splits the layers)."""
    dp_attention: int = 1
    """Data-parallel attention groups inside the TP group (SGLang --dp with --enable-dp-attention); 1 = off."""
    kv_dtype: str = "bf16"
    """KV cache element type: bf16, fp16, fp8, fp32."""
    weight_dtype: str = "auto"
    """Decoder linear weights: auto (from quantization_config / dtype), bf16, fp16, fp32, fp8, int8, int4."""
    mem_fraction: float = 0.9
    """Share of each GPU's memory for weights + KV cache (SGLang's mem_fraction_static)."""
    reserve_gib: float = 0.0
    """Further GiB per GPU kept for activations and CUDA graphs."""
    context: int | None = None
    """Check that sequences of this many tokens fit (and how many at once)."""
    concurrency: int = 1
    """Sequences of ``context`` tokens to hold at once."""
    with_drafter: bool = False
    """Add an EAGLE-3 drafter (weights and its own KV cache) as eyas exports it."""
    draft_vocab_size: int = 32000
    """Draft vocabulary of that drafter."""

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_BYTES:
            raise PlanError(f"kv_dtype must be one of {tuple(KV_BYTES)}, not {self.kv_dtype!r}")
        if self.weight_dtype != "auto" and self.weight_dtype not in WEIGHT_BYTES:
            raise PlanError(
                f"weight_dtype must be auto or one of {tuple(WEIGHT_BYTES)}, not {self.weight_dtype!r}"
            )
        for name in ("num_gpus", "pp", "dp_attention", "concurrency", "tp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1")
        if not 0 < self.mem_fraction <= 1:
            raise PlanError("mem_fraction must be in (0, 1]")
        if self.gpu_mem_gib <= 0:
            raise PlanError("gpu_mem_gib must be positive")


@dataclass
class PlanResult:
    """A memory plan; :meth:`table` prints it."""

    model: str
    attention: str
    params: ParamCount
    weight_bytes: float
    weight_bytes_per_gpu: float
    kv_bytes_per_token: int
    """Whole model, one copy of each token's KV (all layers)."""
    kv_bytes_per_token_per_gpu: float
    """What one GPU stores for a token it holds (its layers, its kv heads)."""
    kv_bytes_per_token_avg_gpu: float
    """Bytes per token summed over the parallel group, divided by its GPUs (replication counts in full)."""
    kv_bytes_per_gpu: float
    """Memory per GPU left for the KV cache."""
    pool_tokens_per_rank: int
    """Tokens one rank's KV pool holds (at the per-token cost of all layers)."""
    pool_tokens_total: int
    """Tokens the whole deployment holds at once (ranks with their own requests × replicas)."""
    largest_context: int
    """Longest single sequence that fits on one rank, capped at the supported context."""
    largest_context_memory: int
    """Longest single sequence the memory alone would allow."""
    supported_context: ContextLimit
    parallel: dict[str, int]
    drafter_kv_bytes_per_token_per_gpu: float = 0.0
    drafter_weight_bytes_per_gpu: float = 0.0
    drafter_aux_layers: list[int] | None = None
    """The target layers the drafter reads (``with_drafter``)."""
    context: int | None = None
    max_concurrency: int | None = None
    """Sequences of ``context`` tokens the deployment holds at once."""
    fits: bool = True
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        p = self.params
        rows = [
            ("model", f"{self.model} ({self.attention.upper()})"),
            ("parallelism", ", ".join(f"{k}={v}" for k, v in self.parallel.items())),
            ("parameters", f"{p.total / 1e9:,.2f} B total, {p.active / 1e9:,.2f} B active per token"),
            (
                "weights",
                f"{self.weight_bytes / GIB:,.1f} GiB total, {self.weight_bytes_per_gpu / GIB:,.2f} GiB per GPU",
            ),
            ("KV per token (model)", f"{self.kv_bytes_per_token / KIB:,.2f} KiB"),
            ("KV per token, stored per GPU", f"{self.kv_bytes_per_token_per_gpu / KIB:,.2f} KiB"),
            ("KV per token, averaged per GPU", f"{self.kv_bytes_per_token_avg_gpu / KIB:,.2f} KiB"),
        ]
        if self.drafter_weight_bytes_per_gpu:
            rows.append(
                (
                    "EAGLE-3 drafter per GPU",
                    f"{self.drafter_weight_bytes_per_gpu / GIB:,.2f} GiB weights, "
                    f"{self.drafter_kv_bytes_per_token_per_gpu / KIB:,.2f} KiB KV per token, reads target "
                    f"layers {self.drafter_aux_layers}",
                )
            )
        rows += [
            ("KV memory per GPU", f"{self.kv_bytes_per_gpu / GIB:,.2f} GiB"),
            (
                "KV pool",
                f"{self.pool_tokens_per_rank:,} tokens per rank, {self.pool_tokens_total:,} in total",
            ),
            ("supported context", f"{self.supported_context.tokens:,} ({self.supported_context.how})"),
            (
                "largest context that fits",
                f"{self.largest_context:,} tokens"
                + (
                    ""
                    if self.largest_context == self.largest_context_memory
                    else f" (memory alone: {self.largest_context_memory:,})"
                ),
            ),
        ]
        if self.context is not None:
            rows.append(
                (
                    f"sequences of {self.context:,} tokens",
                    f"{self.max_concurrency:,} at once"
                    + ("" if self.fits else "  << does not fit the requested concurrency"),
                )
            )
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _weight_bytes_per_param(cfg: dict, weight_dtype: str) -> tuple[float, float]:
    """(bytes per decoder linear weight, bytes per embedding/norm value)."""
    if weight_dtype != "auto":
        linear = WEIGHT_BYTES[weight_dtype]
        return linear, 4.0 if weight_dtype == "fp32" else 2.0
    dense = 4.0 if str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16") == "float32" else 2.0
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", ""))
    if method == "fp8" or "fp8" in str(q.get("fmt", "")):
        return 1.0, 2.0
    bits = None
    for group in (q.get("config_groups") or {}).values():
        bits = (group.get("weights") or {}).get("num_bits", bits)
    bits = bits or q.get("bits") or q.get("num_bits")
    if bits:
        return int(bits) / 8, 2.0
    return dense, dense


def plan(config: Any, gpu_mem_gib: float, num_gpus: int = 1, **settings: Any) -> PlanResult:
    """Plan ``config`` (preset name, config.json path, dict or transformers config) on ``num_gpus`` GPUs of
    ``gpu_mem_gib`` GiB; ``settings`` are the other :class:`PlanConfig` fields."""
    pc = PlanConfig(
        model=str(config) if isinstance(config, (str, Path)) else "config",
        gpu_mem_gib=gpu_mem_gib,
        num_gpus=num_gpus,
        **settings,
    )
    cfg, name = load_model_config(config)
    return plan_from(pc, cfg, name)


def plan_from(pc: PlanConfig, cfg: dict[str, Any], name: str) -> PlanResult:
    s = model_shape(cfg, name)
    tp = pc.tp or max(1, pc.num_gpus // pc.pp)
    if pc.num_gpus % (tp * pc.pp):
        raise PlanError(f"tp={tp} × pp={pc.pp} does not divide num_gpus={pc.num_gpus}")
    if tp % pc.dp_attention:
        raise PlanError(
            f"dp_attention={pc.dp_attention} must divide tp={tp} (attention TP = tp / dp_attention)"
        )
    attn_tp = tp // pc.dp_attention
    if s.num_heads % attn_tp:
        raise PlanError(f"{s.num_heads} attention heads do not split over attention TP {attn_tp}")
    if s.attention != "mla" and s.num_kv_heads % attn_tp and attn_tp % s.num_kv_heads:
        raise PlanError(
            f"{s.num_kv_heads} kv heads neither split over nor replicate evenly across attention TP {attn_tp}"
        )
    if s.num_layers % pc.pp:
        raise PlanError(f"{s.num_layers} layers do not split into pp={pc.pp} equal stages")
    replicas = pc.num_gpus // (tp * pc.pp)
    notes: list[str] = []

    # weights
    params = count_parameters(cfg, s)
    linear_b, dense_b = _weight_bytes_per_param(cfg, pc.weight_dtype)
    attn_b = params.attention * linear_b
    mlp_b = params.mlp * linear_b
    other_b = (params.embedding + params.norms) * dense_b
    weight_bytes = attn_b + mlp_b + other_b
    per_gpu_w = (attn_b / attn_tp + (mlp_b + other_b) / tp) / pc.pp

    # KV per token
    kv_b = KV_BYTES[pc.kv_dtype]
    per_layer = s.kv_values_per_layer() * kv_b
    kv_per_token = per_layer * s.num_layers
    rank_heads = max(1, s.num_kv_heads // attn_tp)
    rank_layer = s.kv_values_per_layer(rank_heads) * kv_b  # one rank, one layer
    stage_full, stage_swa = s.full_layers / pc.pp, s.sliding_layers / pc.pp
    stored_full, stored_swa = rank_layer * stage_full, rank_layer * stage_swa  # bytes per token on one GPU
    stored = stored_full + stored_swa
    avg_gpu = stored / pc.dp_attention  # each token lives on one rank of its dp group
    if s.attention == "mla" and attn_tp > 1:
        notes.append(
            f"MLA latent is replicated on each of the {attn_tp} attention-TP ranks (no head axis to "
            "split); DP-attention (dp_attention=tp) gives each rank its own requests instead"
        )
    elif s.attention != "mla" and attn_tp > s.num_kv_heads:
        notes.append(
            f"{s.num_kv_heads} kv heads over attention TP {attn_tp}: each head is replicated "
            f"{attn_tp // s.num_kv_heads}×"
        )

    # optional EAGLE-3 drafter: its own weights and one layer of KV with the target's kv heads
    d = _drafter_costs(cfg, s, pc, attn_tp, tp, kv_b) if pc.with_drafter else None
    if d is not None:
        per_gpu_w += d.weight_bytes_per_gpu
        stored += d.kv_bytes_per_token_per_gpu
        stored_full += d.kv_bytes_per_token_per_gpu
        avg_gpu = stored / pc.dp_attention

    budget = pc.gpu_mem_gib * GIB * pc.mem_fraction - pc.reserve_gib * GIB
    kv_mem = budget - per_gpu_w
    if kv_mem <= 0:
        raise PlanError(
            f"weights need {per_gpu_w / GIB:.1f} GiB per GPU but only {budget / GIB:.1f} GiB is "
            f"available (gpu_mem_gib={pc.gpu_mem_gib} × mem_fraction={pc.mem_fraction} − reserve); "
            "use more GPUs, a larger tp/pp or narrower weights"
        )
    pool_rank = int(kv_mem // stored)
    pool_total = pool_rank * pc.dp_attention * replicas
    limit = supported_context(cfg, s)
    longest_mem = _longest_sequence(kv_mem, stored_full, stored_swa, s.sliding_window)
    result = PlanResult(
        model=name,
        attention=s.attention,
        params=params,
        weight_bytes=weight_bytes,
        weight_bytes_per_gpu=per_gpu_w,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_token_per_gpu=stored,
        kv_bytes_per_token_avg_gpu=avg_gpu,
        kv_bytes_per_gpu=kv_mem,
        pool_tokens_per_rank=pool_rank,
        pool_tokens_total=pool_total,
        largest_context=min(longest_mem, limit.tokens),
        largest_context_memory=longest_mem,
        supported_context=limit,
        parallel={
            "gpus": pc.num_gpus,
            "tp": tp,
            "pp": pc.pp,
            "dp_attention": pc.dp_attention,
            "replicas": replicas,
        },
        drafter_kv_bytes_per_token_per_gpu=d.kv_bytes_per_token_per_gpu if d else 0.0,
        drafter_weight_bytes_per_gpu=d.weight_bytes_per_gpu if d else 0.0,
        drafter_aux_layers=d.aux_layers if d else None,
        notes=notes,
    )
    if s.sliding_layers:
        notes.append(
            f"{s.sliding_layers} of {s.num_layers} layers use a {s.sliding_window}-token sliding window: "
            "they cost at most that many tokens per sequence"
        )
    if pc.context is not None:
        if pc.context > limit.tokens:
            raise ContextTooLong(pc.context, limit.tokens, limit.how)
        per_seq = pc.context * stored_full + min(pc.context, s.sliding_window or pc.context) * stored_swa
        per_rank = int(kv_mem // per_seq)
        result.context = pc.context
        result.max_concurrency = per_rank * pc.dp_attention * replicas
        result.fits = result.max_concurrency >= pc.concurrency
    return result


def _longest_sequence(kv_mem: float, full: float, swa: float, window: int | None) -> int:
    """Largest n with n·full + min(n, window)·swa ≤ kv_mem."""
    if not swa or not window:
        return int(kv_mem // full) if full else 0
    if window * (full + swa) >= kv_mem:
        return int(kv_mem // (full + swa))
    return int((kv_mem - window * swa) // full) if full else sys.maxsize


@dataclass
class DrafterCosts:
    """What an EAGLE-3 drafter for the target costs, as eyas exports it."""

    aux_layers: list[int]
    """The target layers it reads (:func:`serving.models.target.default_aux_layers`)."""
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float


def _drafter_costs(
    cfg: dict, s: ModelShape, pc: PlanConfig, attn_tp: int, tp: int, kv_b: int
) -> DrafterCosts:
    """An EAGLE-3 drafter for this target: the layers it reads, its weights and its KV per GPU."""
    from types import SimpleNamespace

    from eyas.serving.models.drafter import DrafterConfig
    from eyas.serving.models.target import default_aux_layers

    aux = default_aux_layers(s.num_layers)  # the one rule: what a drafter trained and served for it reads
    d = DrafterConfig.from_target(SimpleNamespace(**cfg), aux, min(pc.draft_vocab_size, s.vocab_size))
    h, q, kv = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    n = d.fc_in_features * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * d.intermediate_size
    n += d.draft_vocab_size * h + 4 * h
    w = n * 2.0 / tp  # bf16; SGLang shards the drafter over the same TP group
    kv_heads = max(1, d.num_key_value_heads // attn_tp)
    return DrafterCosts(aux, w, float(2 * kv_heads * d.head_dim * kv_b))


# -- entry point -------------------------------------------------------------------------------------------------
def run(pc: PlanConfig) -> int:
    """The command: print the plan table; 0 when the requested context and concurrency fit, 1 when not."""
    cfg, name = load_model_config(pc.model)
    result = plan_from(pc, cfg, name)
    print(result.table())
    return 0 if result.fits else 1


# plan's settings were top-level keys
COMMAND = Command(
    "plan",
    "eyas.eval.plan",
    "plan",
    PlanConfig,
    run,
    key="plan",
    renamed={f.name: f"plan.{f.name}" for f in fields(PlanConfig)} | {"drafter": "plan.with_drafter"},
)
main = COMMAND.main


if __name__ == "__main__":
    main()
