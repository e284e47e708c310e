"""Setup for a training run: the drafter for a target, its draft vocabulary, and the data sources.

``python -m eyas.train`` and the pipeline go setup -> :func:`train.trainer.fit`; tests call these pieces directly.

Design decisions:
- The drafter's sizes, rope and positions come from the target (``DrafterConfig.from_target``); its embedding
  is the target's (frozen); ``drafter.intermediate_size`` is the only size the user picks.
- The draft vocabulary is counted over the *training* split's loss-masked tokens (never the held-out one) and
  saved as ``<output_dir>/draft_vocab.json``; a resumed run reuses that file so the vocabulary cannot drift.
- The target is recorded as ``<output_dir>/target.json`` (:mod:`eyas.serving.target_record`) before training, and
  every checkpoint copies it: ``eyas export`` and ``eyas eval`` load that target when no ``target=`` is given.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from eyas.common import InputError, build_config, ensure_out_dir
from eyas.serving.models.dflash import DFlashConfig, DFlashDrafter
from eyas.serving.models.drafter import DrafterConfig, Eagle3Drafter
from eyas.serving.target_record import TargetRecord, write_target_record
from eyas.train.config import DraftModelConfig, TrainConfig, TrainJob
from eyas.train.sources import BatchSource, ListSource
from eyas.train.vocab import DraftVocab, build_draft_vocab, count_loss_tokens

log = logging.getLogger(__name__)


def build_drafter(
    target, cfg: DraftModelConfig, vocab: DraftVocab, seed: int = 0, block_size: int = 8
) -> Eagle3Drafter | DFlashDrafter:
    """A freshly initialised drafter for ``target`` with the draft vocabulary ``vocab`` (fp32, on the CPU);
    ``block_size``: a DFlash drafter's trained block (``train.ttt_steps + 1``)."""
    if vocab.target_vocab_size != target.vocab_size:
        raise ValueError(
            f"draft vocabulary built for a target vocabulary of {vocab.target_vocab_size}, the target has "
            f"{target.vocab_size}"
        )
    if cfg.family == "dflash":
        return build_dflash_drafter(target, cfg, vocab, seed, block_size)
    overrides: dict[str, Any] = {}
    if cfg.intermediate_size is not None:
        overrides["intermediate_size"] = cfg.intermediate_size
    # EAGLE-3.1's options and parallel drafting: absent from the drafter's config when off
    for option in ("fc_norm", "norm_output", "norm_before_fc"):
        if getattr(cfg, option):
            overrides[option] = True
    if cfg.parallel_drafting:
        overrides["parallel_drafting"] = True
        overrides["mask_token_id"] = target.vocab_size - 1 if cfg.mask_token_id is None else cfg.mask_token_id
    if cfg.attention_window is not None:
        overrides["attention_window"] = cfg.attention_window
    dcfg = DrafterConfig.from_target(target.model.config, list(target.aux_layers), vocab.size, **overrides)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_embedding(target.model.get_input_embeddings().weight.detach().float().cpu())
    drafter.set_vocab_map(vocab.draft_to_target)
    if cfg.init == "target":
        init_from_target(drafter, target, vocab, layer=cfg.init_layer)
    elif cfg.init_lm_head == "target":
        with torch.no_grad():
            drafter.lm_head.weight.copy_(target.head.weight.detach().float().cpu()[vocab.draft_to_target])
    return drafter


def build_dflash_drafter(
    target, cfg: DraftModelConfig, vocab: DraftVocab, seed: int, block_size: int
) -> DFlashDrafter:
    """A DFlash drafter (``serving.models.dflash``): random init (``drafter.init=random``) or the target's upper
    layers (:func:`init_dflash_from_target`); the embedding and the head's draft rows are the target's, frozen."""
    overrides: dict[str, Any] = {"num_hidden_layers": cfg.num_layers, "block_size": int(block_size)}
    if cfg.intermediate_size is not None:
        overrides["intermediate_size"] = cfg.intermediate_size
    if cfg.mask_token_id is not None:
        overrides["mask_token_id"] = cfg.mask_token_id
    dcfg = DFlashConfig.from_target(target.model.config, list(target.aux_layers), vocab.size, **overrides)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dcfg)
    drafter.set_embedding(target.model.get_input_embeddings().weight.detach().float().cpu())
    drafter.set_vocab_map(vocab.draft_to_target)
    drafter.set_head(target.head.weight)
    if cfg.init == "target":
        skipped = init_dflash_from_target(drafter, target)
        if skipped:
            log.warning("DFlash init from the target: left at random init: %s", ", ".join(skipped))
    return drafter


def init_dflash_from_target(drafter: DFlashDrafter, target) -> list[str]:
    """Start each drafter layer i from target layer ``top + 1 + i`` (``top``: the top aux layer), ``fc`` as the
    identity on the top aux block, ``hidden_norm`` as the first such layer's input norm and ``norm`` as the target's
    final norm, so the context keys start as that layer's keys of the top aux state. q_norm / k_norm (which a
    Llama target lacks) start at ones, ``mask_embedding`` at zeros. Returns the names left at random init."""
    n, top = len(target.layers), int(target.aux_layers[-1])
    width = drafter.config.hidden_size
    skipped: list[str] = []

    def put(dst: torch.Tensor, module, path: str) -> None:
        src = module
        for p in path.split("."):
            src = getattr(src, p, None)
            if src is None:
                break
        w = getattr(src, "weight", None) if src is not None else None
        if w is None or tuple(w.shape) != tuple(dst.shape):
            skipped.append(path)
            return
        dst.copy_(w.detach().float().cpu())

    with torch.no_grad():
        fc = torch.zeros_like(drafter.fc.weight)
        fc[:, -width:] = torch.eye(width)
        drafter.fc.weight.copy_(fc)
        put(drafter.norm.weight, target.base, "norm")
        for i, layer in enumerate(drafter.layers):
            idx = min(top + 1 + i, n - 1)
            src = target.layers[idx]
            if i == 0:
                put(drafter.hidden_norm.weight, src, "input_layernorm")
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                put(getattr(layer.self_attn, name).weight, src, f"self_attn.{name}")
            for name in ("q_norm", "k_norm"):
                if getattr(src.self_attn, name, None) is not None:
                    put(getattr(layer.self_attn, name).weight, src, f"self_attn.{name}")
            put(layer.input_layernorm.weight, src, "input_layernorm")
            put(layer.post_attention_layernorm.weight, src, "post_attention_layernorm")
            mlp = {
                m: getattr(getattr(src.mlp, m, None), "weight", None)
                for m in ("gate_proj", "up_proj", "down_proj")
            }
            _put_mlp(layer.mlp, mlp, skipped)
    return skipped


def init_from_target(
    drafter: Eagle3Drafter, target, vocab: DraftVocab, layer: int | None = None
) -> list[str]:
    """Start ``drafter`` from the target's own upper layer: at step 0 it then computes target layer ``layer`` on the
    top aux state and reads it out through the target's final norm and head (the logit lens at that layer).

    What that is, and is not: row ``t`` of step 0 carries ``fc(aux_t)`` (the target's state after ``x_0..x_t``) and
    the embedding of ``x_{t+1}``, and is trained to predict ``x_{t+2}``. With the default ``layer`` the init
    reproduces the target's distribution of ``x_{t+1}``, the row's own input token, and ignores that token (its
    half of q/k/v is zero): it agrees with the objective only where the target predicts one token twice in a row.
    It starts the drafter from the target's features and output space, not from a solution of its objective; no
    weights of this block reproduce the target's prediction of ``x_{t+2}``, which needs the whole target run on
    ``x_{t+1}`` (``tests/serving/test_drafter_init.py`` pins both properties).

    - ``fc`` [H, n_aux*H]: the identity on the top aux block, zeros elsewhere;
    - ``midlayer``: q/k/v take ``[input_layernorm(embedding) ; hidden_norm(hidden)]`` (2H wide): the hidden half
      copies the target layer's q/k/v, the embedding half starts at zero; o_proj, the MLP and
      ``post_attention_layernorm`` are the layer's; ``hidden_norm`` and ``input_layernorm`` its input norm;
    - ``norm`` is the target's final norm, ``lm_head`` the target head's draft rows.

    ``layer`` defaults to the layer after the top aux layer, the one that reads exactly the state ``fc`` passes
    through. A drafter MLP wider than the layer's takes the layer's units first; its extra units keep their
    random gate/up rows and get *zero* down_proj columns, so at step 0 it still computes the layer exactly and
    the extra width comes into play as it trains. Weights whose shapes do not fit (an MLA attention, a drafter
    MLP narrower than the layer's) and parts the drafter has no place for (attention biases, q/k norms) are
    left as they are; their names are returned."""
    n = len(target.layers)
    top = int(target.aux_layers[-1])
    idx = top + 1 if layer is None else int(layer)
    if not 0 <= idx < n:
        raise ValueError(f"drafter.init_layer={idx}: the target has layers 0..{n - 1}")
    src = target.layers[idx]
    h = drafter.config.hidden_size
    skipped: list[str] = []

    def put(dst: torch.Tensor, value: torch.Tensor | None, name: str) -> None:
        if value is None or tuple(value.shape) != tuple(dst.shape):
            skipped.append(name)
            return
        dst.copy_(value.detach().float().cpu())

    def weight(module, *path: str) -> torch.Tensor | None:
        for p in path:
            module = getattr(module, p, None)
            if module is None:
                return None
        return getattr(module, "weight", None)

    d = drafter.midlayer
    with torch.no_grad():
        fc = torch.zeros_like(drafter.fc.weight)  # [H, n_aux*H]
        fc[:, -h:] = torch.eye(h)
        drafter.fc.weight.copy_(fc)
        for name in ("q_proj", "k_proj", "v_proj"):
            dst = getattr(d.self_attn, name).weight  # [out, 2H]: embedding half, hidden half
            dst[:, :h].zero_()
            put(dst[:, h:], weight(src, "self_attn", name), f"self_attn.{name}")
            if getattr(getattr(src.self_attn, name, None), "bias", None) is not None:
                skipped.append(f"self_attn.{name}.bias")
        put(d.self_attn.o_proj.weight, weight(src, "self_attn", "o_proj"), "self_attn.o_proj")
        _put_mlp(d.mlp, {n: weight(src, "mlp", n) for n in _MLP}, skipped)
        put(d.hidden_norm.weight, weight(src, "input_layernorm"), "input_layernorm")
        put(d.input_layernorm.weight, weight(src, "input_layernorm"), "input_layernorm")
        put(
            d.post_attention_layernorm.weight,
            weight(src, "post_attention_layernorm"),
            "post_attention_layernorm",
        )
        put(drafter.norm.weight, weight(target.base, "norm"), "norm")
        drafter.lm_head.weight.copy_(target.head.weight.detach().float().cpu()[vocab.draft_to_target])
    for extra in ("q_norm", "k_norm"):
        if getattr(src.self_attn, extra, None) is not None:
            skipped.append(f"self_attn.{extra}")
    if skipped:
        log.warning("drafter init from target layer %d: left at random init: %s", idx, ", ".join(skipped))
    else:
        log.info("drafter initialised from target layer %d (fc = identity on aux layer %d)", idx, top)
    return skipped


_MLP = ("gate_proj", "up_proj", "down_proj")


def _put_mlp(dst_mlp, src: dict[str, torch.Tensor | None], skipped: list[str]) -> None:
    """Copy the target layer's gated MLP weights (``src``: gate_proj/up_proj/down_proj, None where the layer has
    none) into the drafter's MLP, which may be wider (see :func:`init_from_target`)."""
    gate, up, down = (getattr(dst_mlp, n).weight for n in _MLP)
    h, width = down.shape
    m = None if src["down_proj"] is None else src["down_proj"].shape[1]  # the layer's MLP width
    if (
        m is None
        or m > width
        or any(
            src[n] is None or tuple(src[n].shape) != shape
            for n, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m)))
        )
    ):
        skipped.extend(f"mlp.{n}" for n in _MLP)
        return
    gate[:m].copy_(src["gate_proj"].detach().float().cpu())
    up[:m].copy_(src["up_proj"].detach().float().cpu())
    down.zero_()
    down[:, :m].copy_(src["down_proj"].detach().float().cpu())


def draft_vocab_for(data: Any, cfg: DraftModelConfig, vocab_size: int, output_dir: str | Path) -> DraftVocab:
    """Load ``cfg.vocab_file`` or ``<output_dir>/draft_vocab.json``, else count ``data`` and save the result."""
    path = Path(cfg.vocab_file) if cfg.vocab_file else Path(output_dir) / "draft_vocab.json"
    if path.exists():
        vocab = DraftVocab.load(path, target_vocab_size=vocab_size)
        if vocab.size != cfg.draft_vocab_size:
            raise ValueError(
                f"{path} holds a draft vocabulary of {vocab.size} tokens, drafter.draft_vocab_size is "
                f"{cfg.draft_vocab_size}; delete the file or use another train.output_dir"
            )
        log.info("draft vocabulary: %s (%d tokens, coverage %.4f)", path, vocab.size, vocab.coverage)
        return vocab
    counts = data if isinstance(data, torch.Tensor) else count_loss_tokens(data, vocab_size)
    vocab = build_draft_vocab(counts, cfg.draft_vocab_size)
    vocab.save(path)
    log.info(
        "draft vocabulary built: %d tokens cover %.4f of %d loss tokens -> %s",
        vocab.size,
        vocab.coverage,
        vocab.loss_tokens,
        path,
    )
    return vocab


@dataclass
class RunData:
    """This process's training source and held-out batches, plus what identifies them."""

    train: BatchSource
    eval: list[Any]
    vocab_counts: Any
    """What :func:`draft_vocab_for` counts (an iterable of items with input_ids/loss_mask, or [V] counts)."""
    identity: dict[str, Any]


def run_data(target, cfg: TrainConfig, rank: int, world: int) -> RunData:
    """This process's data for ``cfg.data.source``."""
    src = cfg.data.source
    if src == "synthetic":
        return synthetic_run_data(target, cfg, rank, world)
    from eyas.data.loader import FeatureLoader, LoaderConfig, resolve_max_tokens

    ef = cfg.data.eval_fraction
    text = target.model.config.get_text_config()
    lc = resolve_max_tokens(dict(cfg.data.loader), int(text.max_position_embeddings))
    if src == "store":
        from eyas.data.store import FeatureStore

        if not cfg.data.store_dir:
            raise ValueError(
                "train.data.source=store needs train.data.store_dir (a store from `python -m eyas.data.extract`)"
            )
        store = FeatureStore(
            cfg.data.store_dir, expect_target=target.info, checksum_on_read=cfg.data.verify_checksums
        )

        def make(split: str, **over: Any) -> FeatureLoader:
            return FeatureLoader(
                store,
                build_config(
                    LoaderConfig, {**lc, **over, "split": split, "eval_fraction": ef}, "train.data.loader"
                ),
                rank=rank,
                world_size=world,
            )

        identity = {"source": "store", **store.manifest.data_identity()}
    else:
        from eyas.data.extract import check_tokenizer, inputs_fingerprint, read_samples_jsonl
        from eyas.data.online import online_loader
        from eyas.data.store import StoreOptions

        if not cfg.data.samples:
            raise ValueError(
                "train.data.source=online needs train.data.samples (the formatted samples JSONL)"
            )
        samples = list(read_samples_jsonl(cfg.data.samples))
        if not samples:
            raise InputError(f"train.data.samples={cfg.data.samples}: holds no samples (the file is empty)")
        for s in samples:  # ids made by another tokenizer mean other words to this target
            check_tokenizer(s, target.info.tokenizer_hash)
        opts = build_config(StoreOptions, cfg.data.online, "train.data.online")

        def make(split: str, **over: Any) -> FeatureLoader:
            return online_loader(
                samples,
                target,
                build_config(
                    LoaderConfig, {**lc, **over, "split": split, "eval_fraction": ef}, "train.data.loader"
                ),
                opts,
                rank=rank,
                world_size=world,
            )

        identity = {"source": "online", "samples": inputs_fingerprint(samples), "online": opts.to_dict()}
    try:
        train = make("train")
    except ValueError as e:
        raise ValueError(f"train.data: no training loader: {e}") from e
    evals: list[Any] = []
    if ef > 0:
        try:
            # τ_sim: the assistant's tokens, each held-out sample whole in rows up to the longest training row
            held_out = make("eval", shuffle=False, loss_on="assistant", **held_out_rows(lc))
        except ValueError as e:
            log.warning("no held-out batches (%s): simulated acceptance will not be measured", e)
        else:
            # decoded here and kept for the whole run: only the batches an evaluation uses
            evals = list(islice(held_out, cfg.eval_batches) if cfg.eval_batches else held_out)
    source = train.source
    counts = count_loss_tokens(_token_rows(source, train.candidates), target.vocab_size)
    identity.update(loader=lc, eval_fraction=ef)
    return RunData(train=train, eval=evals, vocab_counts=counts, identity={"data": identity})


def held_out_rows(loader: dict[str, Any]) -> dict[str, Any]:
    """Loader settings of the held-out split over the training ``loader``'s: a ``length_mix`` (a share of the
    training tokens per row length) becomes plain rows of its longest length. The mix's shares are a training
    choice; a held-out split of a few samples need not hold a sample of every length (it often holds no long one),
    and each of its samples is measured whole."""
    mix = loader.get("length_mix")
    if not mix:
        return {}
    return {"length_mix": None, "max_tokens": max(int(k) for k in mix)}


def _token_rows(source: Any, indices: Any):
    """(input_ids, loss_mask) of each selected sample, without computing features (online: from the samples)."""
    if hasattr(source, "samples"):
        for i in indices:
            s = source.samples[int(i)]
            yield (s.input_ids, s.loss_mask)
    else:
        for i in indices:
            r = source.rows(int(i))
            yield (r.input_ids, r.loss_mask)


def synthetic_run_data(target, cfg: TrainConfig, rank: int, world: int) -> RunData:
    from eyas.train.synthetic import synthetic_data

    s = cfg.data.synthetic
    d = synthetic_data(target, s, rank=rank, world=world)
    return RunData(
        train=ListSource(d.train, shuffle=s.shuffle, seed=cfg.seed),
        eval=d.eval[: cfg.eval_batches] if cfg.eval_batches else d.eval,
        vocab_counts=d.vocab_counts,
        identity={"data": {"source": "synthetic", **asdict(s)}},
    )


@contextmanager
def _without_zero3_init(accelerator):
    """Load the (frozen, replicated) target as a plain model even under ZeRO-3: accelerate registers its DeepSpeed
    config with transformers, which would otherwise partition every model built meanwhile."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def run(job: TrainJob, target=None):
    """Load the target (unless given, as the pipeline does), build the data, the draft vocabulary and the drafter,
    and train (every process). The stage's one entry point: ``python -m eyas.train`` and the pipeline call it.
    The output directory is locked first (``train.guards``): a second trainer into it stops before loading."""
    from eyas.train.guards import OutputDirLock
    from eyas.train.trainer import make_accelerator

    cfg = job.train
    out_dir = ensure_out_dir(cfg.output_dir, "train.output_dir")  # before minutes of loading, not after
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    acc = make_accelerator(cfg)
    lock = OutputDirLock(out_dir, acc)
    try:
        return _run_locked(job, acc, target)
    finally:
        lock.release()


def _run_locked(job: TrainJob, acc, target):
    from dataclasses import replace

    from eyas.serving.models.target import load_target
    from eyas.train.trainer import fit

    target_cfg, drafter_cfg, cfg = job.target, job.drafter, job.train
    if target is None:
        if target_cfg.device == "auto":
            target_cfg = replace(target_cfg, device=str(acc.device))
        with _without_zero3_init(acc):
            target = load_target(target_cfg)
    if acc.is_main_process:  # every checkpoint carries a copy (train/checkpoint.py): export and eval read it
        write_target_record(cfg.output_dir, TargetRecord.of(target_cfg, target.info))
    data = run_data(target, cfg, acc.process_index, acc.num_processes)
    vocab_path = (
        Path(drafter_cfg.vocab_file) if drafter_cfg.vocab_file else Path(cfg.output_dir) / "draft_vocab.json"
    )
    if acc.is_main_process:
        vocab = draft_vocab_for(data.vocab_counts, drafter_cfg, target.vocab_size, cfg.output_dir)
    acc.wait_for_everyone()
    if not acc.is_main_process:
        vocab = DraftVocab.load(vocab_path, target_vocab_size=target.vocab_size)
    drafter = build_drafter(target, drafter_cfg, vocab, seed=cfg.seed, block_size=cfg.ttt_steps + 1)
    head, info = target.head, target.info
    if cfg.data.source != "online":
        del target  # only the head is needed from here on (the embedding was copied into the drafter)
    return fit(
        cfg,
        drafter,
        data.train,
        data.eval,
        head=head,
        target_info=info,
        accelerator=acc,
        extra_identity=data.identity,
    )
