"""The engine extraction backend: the target's features captured by a serving engine (vLLM), packed into eyas's store.

``python -m eyas.data.extract extract.samples=... extract.out_dir=... extract.backend=vllm``: eyas starts vLLM from
its own venv (``make vllm``) with the ``extract_hidden_states`` speculative method and a hidden-states connector,
sends every sample's token ids (one ``/v1/completions`` request each, ``max_tokens=1``, ``extract.concurrency`` in
flight), reads the safetensors file the engine writes per request (``hidden_states [T, n, H]``, ``token_ids [T]``;
its path in the response's ``kv_transfer_params.hidden_states_path``), deletes it, and hands the rows to the same
shard writer, manifest, checksums and resume logic as the transformers backend (:mod:`eyas.data.extract`).
``extract.server_url=<url>`` uses a server someone already runs (started with :func:`vllm_extract_command`'s
speculative and KV-transfer configs; its files must be readable here, e.g. on a shared filesystem, under the same
path: ``extract.server_states_dir``).

Design decisions:
- Layer ids. eyas aux id ``i`` is the output of decoder layer ``i``; vLLM collects the residual stream
  ``hidden + residual`` after layer ``idx`` under id ``idx + 1`` (``EagleModelMixin._maybe_add_hidden_state``), so
  eyas id i is vLLM id i + 1. vLLM sorts and deduplicates the ids (``tuple(sorted(set(layers)))``); eyas ids are
  strictly increasing and at most L-2, so the list below is already in vLLM's order.
- The teacher. eyas's ``distribution=hidden`` stores the *final normed* hidden state (``last_hidden_state``: what
  the LM head reads; ``topk`` is computed from it with the head). vLLM's model returns the normed state only to its
  sampler, never to the connector, but its aux loop also runs at ``idx + 1 = L`` after the last layer, so id ``L``
  is reachable: the last decoder layer's output *before* the final norm. eyas captures ``[i + 1 for i in aux] + [L]``
  and applies the target's own final norm module (its transformers class, built on the meta device; only the norm's
  weights, and the LM head's for ``topk``, are read from the checkpoint, not the whole target). Models whose norm
  or head cannot be read that way fall back to loading the whole target (logged).
- Prefix caching is off in the server eyas starts: every request is computed in full, so two samples sharing a
  prefix never share cached rows (correctness first; on a GPU it would save prefill time).
- A file is deleted as soon as its rows are in memory and checked (this sample's tokens, the layers asked for): a
  crash before the shard is written loses those requests, and the resumed job re-sends them (shard k depends only
  on its samples, so the store is the same). A file that fails to parse or to check is kept and named.
- A server reply is not trusted with paths: the file it names is read, and deleted, only when it lies inside the
  states directory (``.engine-states/`` of the store for a server eyas starts, ``extract.server_states_dir`` for
  one at ``extract.server_url``), symlinks resolved; anything else is refused before it is opened.
- CPU: vLLM's ``ExampleHiddenStatesConnector`` saves through CUDA streams and pinned memory and kills the CPU engine
  (serving/vllm_plugins/vllm_cpu_hidden_states.py explains); eyas puts that folder on ``PYTHONPATH`` and uses its
  ``CPUHiddenStatesConnector``. CUDA: vLLM's own connector.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from eyas.data.store import FeatureBlock, FeatureCodec
from eyas.data.types import Sample
from eyas.serving.engine_process import (
    REPO_ROOT,
    EngineError,
    EngineServerConfig,
    engine_env,
    engine_python,
    launch,
    post_json,
    served_model_name,
    vllm_server_command,
)
from eyas.serving.models.target import (
    TargetConfig,
    TargetHead,
    TargetInfo,
    aux_layer_problem,
    decoder_layers,
    default_aux_layers,
    model_source,
    resolve_dtype,
    tokenizer_hash,
)

log = logging.getLogger(__name__)

BACKENDS = ("transformers", "vllm")
ENGINE_STATES_DIR = ".engine-states"
"""Where a server eyas starts writes its per-request files (inside the store directory; emptied as it goes)."""
PLUGINS_DIR = REPO_ROOT / "serving" / "vllm_plugins"
SERVED_NAME = "eyas-extract"


class EngineFeatureError(EngineError):
    """An engine's per-request file does not hold what eyas asked for (other tokens, other layers)."""


def vllm_layer_ids(aux_layers: Sequence[int], num_layers: int) -> list[int]:
    """The ids vLLM captures for eyas aux ids ``aux_layers`` of an L-layer target: each aux id + 1, then L (the
    last layer's output before the final norm, from which eyas computes the teacher)."""
    return [int(i) + 1 for i in aux_layers] + [int(num_layers)]


def vllm_extract_configs(layer_ids: Sequence[int], states_dir: str, cuda: bool) -> tuple[dict, dict]:
    """(``--speculative-config``, ``--kv-transfer-config``) of a vLLM server that writes these layers' states."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in layer_ids]}
        },
    }
    kv: dict[str, Any] = {
        "kv_connector": "ExampleHiddenStatesConnector" if cuda else "CPUHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(states_dir)},
    }
    if not cuda:
        kv["kv_connector_module_path"] = "vllm_cpu_hidden_states"
    return spec, kv


def vllm_extract_command(
    python: str,
    target_dir: str,
    layer_ids: Sequence[int],
    states_dir: str,
    port: int,
    cfg: EngineServerConfig,
    max_num_seqs: int,
    cuda: bool,
) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` writing the states of ``layer_ids`` to ``states_dir``."""
    import json

    spec, kv = vllm_extract_configs(layer_ids, states_dir, cuda)
    return vllm_server_command(
        python,
        target_dir,
        port,
        cfg,
        "--no-enable-prefix-caching",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
        served_name=SERVED_NAME,
        max_num_seqs=max_num_seqs,
    )


# -- reading the engine's files ------------------------------------------------------------------------------------
def read_states_file(path: str | os.PathLike, timeout_s: float = 300.0, poll_s: float = 0.01) -> dict:
    """The tensors of one per-request file, once the engine has finished writing it.

    The connector creates ``<path>.lock`` holding an exclusive flock before the response leaves and releases it
    after the write: a shared flock waits for that. Without a lock file (``use_synchronization_lock=false``) the
    file is polled until it parses."""
    from safetensors.torch import load_file

    path = str(path)
    lock = path + ".lock"
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        if os.path.exists(lock):
            with open(lock) as lf:
                while True:
                    try:
                        fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise EngineError(
                                f"the engine did not finish writing {path} within {timeout_s:.0f} s"
                            ) from None
                        time.sleep(poll_s)
                try:
                    return load_file(path, device="cpu")
                finally:
                    fcntl.flock(lf, fcntl.LOCK_UN)
        if os.path.exists(path):
            try:
                return load_file(path, device="cpu")
            except Exception as e:  # still being written
                last_error = e
        if time.monotonic() > deadline:
            if last_error is not None and os.path.exists(path):
                raise EngineError(
                    f"the engine's hidden-states file {path} is not a readable safetensors file after "
                    f"{timeout_s:.0f} s ({type(last_error).__name__}: {last_error}); it is kept for inspection"
                )
            raise EngineError(
                f"the engine's hidden-states file {path} did not appear within {timeout_s:.0f} s: is the "
                "server's shared_storage_path readable from this machine?"
            )
        time.sleep(poll_s)


def states_path(reply_path: str, states_dir: str | os.PathLike, url: str) -> str:
    """``reply_path``, the file a server reply names, when it lies inside ``states_dir`` (symlinks resolved);
    :class:`EngineError` otherwise: eyas opens and deletes nothing outside the directory it was given."""
    root = os.path.realpath(states_dir)
    real = os.path.realpath(reply_path)
    if os.path.commonpath([root, real]) != root or real == root:
        raise EngineError(
            f"{url} named {reply_path!r} as its hidden-states file, which is not inside the states directory "
            f"{root}; refused (eyas reads and deletes only files inside it). Point extract.server_states_dir at "
            "the server's shared_storage_path, as this machine sees it"
        )
    return reply_path


def remove_states_file(path: str | os.PathLike) -> None:
    """Delete an engine file and its ``.lock`` (the caller checked that ``path`` lies in the states directory)."""
    for p in (str(path), str(path) + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


def check_states(sample: Sample, states: dict, num_aux: int, hidden_size: int) -> torch.Tensor:
    """The ``[T, num_aux + 1, H]`` states of ``sample`` from an engine file, after checking that the file is this
    sample's (same token ids) with the layers eyas asked for; :class:`EngineFeatureError` otherwise."""
    ids = states.get("token_ids")
    hs = states.get("hidden_states")
    if ids is None or hs is None:
        raise EngineFeatureError(
            f"sample {sample.id!r}: the engine's file holds {sorted(states)}, not hidden_states and token_ids"
        )
    want = list(map(int, sample.input_ids))
    got = ids.reshape(-1).tolist()
    if got != want:
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise EngineFeatureError(
            f"sample {sample.id!r}: the engine's file holds other tokens than the sample ({len(got)} vs {len(want)} "
            f"tokens, first difference at position {first}): a stale file, or a server that rewrote the prompt"
        )
    shape = (len(want), num_aux + 1, hidden_size)
    if tuple(hs.shape) != shape:
        raise EngineFeatureError(
            f"sample {sample.id!r}: the engine's hidden_states have shape {tuple(hs.shape)}, eyas expects {shape} "
            f"(tokens, {num_aux} aux layers + the last layer's output, hidden size): the server captures other "
            "layers than this store's target.aux_layers (see vllm_layer_ids)"
        )
    if not bool(torch.isfinite(hs).all()):
        raise FloatingPointError(f"sample {sample.id!r}: the engine produced non-finite hidden states")
    return hs


@torch.inference_mode()
def pack_states(
    samples: Sequence[Sample],
    states: Sequence[dict | None],
    codec: FeatureCodec,
    final_norm: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor] | None,
    dtype: torch.dtype,
):
    """A :class:`~eyas.data.store.FeatureBlock` of ``samples`` from their engine files' tensors (None for an
    empty sample): aux states as they are, the teacher as ``final_norm`` of the last layer's output."""
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    a, h = codec.num_aux, codec.hidden_size
    tensors: dict[str, torch.Tensor] = {
        "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32).reshape(n),
        "loss_mask": torch.tensor([bool(m) for s in samples for m in s.loss_mask], dtype=torch.uint8).reshape(
            n
        ),
        "offsets": torch.from_numpy(offsets),
    }
    for name in codec.feature_names:
        spec = codec.specs[name]
        tensors[name] = torch.empty((n, *spec.row_shape), dtype=spec.dtype)
    for i, (s, st) in enumerate(zip(samples, states)):
        if s.num_tokens == 0:
            continue
        if st is None:
            raise EngineFeatureError(f"sample {s.id!r}: no engine file")
        hs = check_states(s, st, a, h)
        aux = hs[:, :a].reshape(s.num_tokens, a * h)
        hidden = final_norm(hs[:, a].to(dtype))
        b, e = int(offsets[i]), int(offsets[i + 1])
        for name, t in codec.encode(aux, hidden, head=head).items():
            tensors[name][b:e] = t
    return FeatureBlock(
        tensors=tensors, sample_ids=[s.id for s in samples], feature_names=codec.feature_names
    )


# -- the target, without its weights -------------------------------------------------------------------------------
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")


def _checkpoint_tensors(path: str, revision: str | None) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a model directory or hub id (empty if none)."""
    from safetensors import safe_open

    d = Path(path)
    if not d.is_dir():
        from huggingface_hub import snapshot_download

        d = Path(snapshot_download(path, revision=revision, allow_patterns=["*.safetensors", "*.json"]))
    where: dict[str, Path] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                where[k] = f
    return where


def _load(where: dict[str, Path], names: Sequence[str]) -> torch.Tensor | None:
    from safetensors import safe_open

    for name in names:
        if name in where:
            with safe_open(str(where[name]), "pt") as st:
                return st.get_tensor(name)
    return None


class EngineTarget:
    """What the extraction job needs of the target when an engine runs it: identity (``info``, ``dtype``, the
    tokenizer), the final norm, the LM head (``distribution=topk``), and :meth:`compute_features` through the
    engine's HTTP API."""

    def __init__(
        self,
        info: TargetInfo,
        dtype: torch.dtype,
        final_norm: nn.Module,
        head: TargetHead | None,
        tokenizer=None,
    ):
        self.info = info
        self.dtype = dtype
        self.final_norm = final_norm
        self.head = head
        self.tokenizer = tokenizer
        self.device = torch.device("cpu")
        self.client: HiddenStatesClient | None = None

    @property
    def layer_ids(self) -> list[int]:
        return vllm_layer_ids(self.info.aux_layers, self.info.num_layers)

    @property
    def run_settings(self) -> dict[str, Any]:
        """What the manifest records under ``run`` (may change between resumes, with a warning)."""
        return {"backend": "vllm"}

    def compute_features(self, samples: Sequence[Sample], codec: FeatureCodec, on_progress=None):
        if self.client is None:
            raise EngineError("EngineTarget has no server: attach a HiddenStatesClient (client=...)")
        for s in samples:
            if s.input_ids and (min(s.input_ids) < 0 or max(s.input_ids) >= codec.vocab_size):
                raise ValueError(
                    f"sample {s.id!r} has token ids outside the target's vocabulary [0, {codec.vocab_size}): was "
                    "it tokenized with another tokenizer?"
                )
        states = self.client.fetch_all(
            samples, on_progress, check=lambda s, st: check_states(s, st, codec.num_aux, codec.hidden_size)
        )
        return pack_states(samples, states, codec, self.final_norm, self.head, self.dtype)


def load_engine_target(cfg: TargetConfig, dtype: str, need_head: bool) -> EngineTarget:
    """The target's identity, final norm and (``need_head``) LM head, without loading its decoder layers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, name = model_source(cfg)
    kwargs: dict[str, Any] = dict(trust_remote_code=cfg.trust_remote_code)
    if cfg.revision and not Path(path).exists():
        kwargs["revision"] = cfg.revision
    tdtype = resolve_dtype(dtype, torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    config = AutoConfig.from_pretrained(path, **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=tdtype, **kwargs)
    n = len(decoder_layers(model))
    chosen = cfg.chosen_aux_layers()
    aux = tuple(default_aux_layers(n) if chosen is None else chosen)
    problem = aux_layer_problem(aux, n)
    if problem:
        raise ValueError(problem)
    base = model.get_decoder()
    out_emb = model.get_output_embeddings()
    info = TargetInfo(
        name=name,
        revision=cfg.revision,
        tokenizer_hash=tokenizer_hash(tokenizer),
        num_layers=n,
        hidden_size=int(getattr(config.get_text_config(), "hidden_size", 0) or out_emb.weight.shape[1]),
        vocab_size=int(out_emb.weight.shape[0]),
        aux_layers=aux,
        model_type=str(getattr(config.get_text_config(), "model_type", "unknown")),
    )
    module_names = {id(m): k for k, m in model.named_modules()}
    norm = next(
        (getattr(base, a) for a in _NORM_NAMES if isinstance(getattr(base, a, None), nn.Module)), None
    )
    norm_ok = norm is not None and not list(norm.buffers())
    where = _checkpoint_tensors(path, cfg.revision) if norm_ok else {}
    state: dict[str, torch.Tensor] = {}
    if norm_ok:
        prefix = module_names[id(norm)]
        for k, p in norm.named_parameters():
            t = _load(where, [f"{prefix}.{k}"])
            if t is None or tuple(t.shape) != tuple(p.shape):
                norm_ok = False
                break
            state[k] = t
    head = None
    if norm_ok and need_head:
        hname = module_names[id(out_emb)]
        candidates = [f"{hname}.weight"]
        if getattr(config.get_text_config(), "tie_word_embeddings", False) or getattr(
            config, "tie_word_embeddings", False
        ):
            candidates.append(f"{module_names[id(model.get_input_embeddings())]}.weight")
        w = _load(where, candidates)
        bias = None
        if getattr(out_emb, "bias", None) is not None:
            bias = _load(where, [f"{hname}.bias"])
        if w is None or (getattr(out_emb, "bias", None) is not None and bias is None):
            norm_ok = False
        else:
            head = TargetHead.from_config(
                config, w.to(tdtype), None if bias is None else bias.to(tdtype)
            ).requires_grad_(False)
    if norm_ok:
        norm = norm.to_empty(device="cpu")
        norm.load_state_dict(state)
        norm = norm.to(tdtype).eval().requires_grad_(False)
        log.info(
            "target %s: final norm%s read from its checkpoint", name, " and LM head" if need_head else ""
        )
        return EngineTarget(info, tdtype, norm, head, tokenizer)
    from eyas.serving.models.target import load_target

    log.warning(
        "target %s: could not read its final norm%s from the checkpoint alone; loading the whole target for them",
        name,
        " and LM head" if need_head else "",
    )
    t = load_target(TargetConfig(**{**cfg.__dict__, "dtype": dtype, "device": "cpu"}))
    return EngineTarget(t.info, t.dtype, t.base.norm, t.head if need_head else None, t.tokenizer)


# -- the client ----------------------------------------------------------------------------------------------------
@dataclass
class HiddenStatesClient:
    """Sends samples to a server running ``extract_hidden_states`` and reads back its files."""

    url: str
    states_dir: str | os.PathLike
    """Where the server writes its files, as this machine sees it: a reply naming a file elsewhere is refused."""
    model: str | None = None
    concurrency: int = 4
    timeout_s: float = 600.0
    max_len: int | None = None
    """The server's ``--max-model-len``: a sample of more than ``max_len - 1`` tokens is refused up front."""
    keep_files: bool = False

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if self.concurrency < 1:
            raise ValueError(f"extract.concurrency must be >= 1, not {self.concurrency}")

    def served_model(self) -> str:
        if self.model is None:
            self.model = served_model_name(self.url)
        return self.model

    def request(self, sample: Sample) -> str:
        """One sample through the engine; the path of the file it writes."""
        body = {
            "model": self.served_model(),
            "prompt": list(map(int, sample.input_ids)),
            "max_tokens": 1,
            "temperature": 0.0,
        }
        ans = post_json(self.url + "/v1/completions", body, self.timeout_s)
        path = (ans.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise EngineError(
                f"{self.url}/v1/completions answered without kv_transfer_params.hidden_states_path: the server does "
                "not run the extract_hidden_states method with a hidden-states connector (see vllm_extract_command)"
            )
        return str(path)

    def fetch(self, sample: Sample, check: Callable[[Sample, dict], Any] | None = None) -> dict | None:
        """The tensors of ``sample``'s file; it is deleted once read and ``check(sample, tensors)`` passed, and kept
        (named in the error) when either fails."""
        if sample.num_tokens == 0:
            return None
        if self.max_len is not None and sample.num_tokens > self.max_len - 1:
            raise EngineError(
                f"sample {sample.id!r} has {sample.num_tokens} tokens; the server takes at most {self.max_len - 1} "
                f"(--max-model-len {self.max_len} holds the prompt and one generated token): raise "
                "extract.server.max_model_len"
            )
        path = states_path(self.request(sample), self.states_dir, self.url)
        states = read_states_file(path, self.timeout_s)
        if check is not None:
            try:
                check(sample, states)
            except EngineFeatureError as e:
                raise EngineFeatureError(f"{e} (the file is kept: {path})") from None
        if not self.keep_files:
            remove_states_file(path)
        return states

    def fetch_all(
        self, samples: Sequence[Sample], on_progress=None, check: Callable[[Sample, dict], Any] | None = None
    ) -> list[dict | None]:
        """Every sample's tensors, in input order, ``concurrency`` requests in flight (``check``: see
        :meth:`fetch`)."""
        self.served_model()
        out: list[dict | None] = []

        def one(s: Sample) -> dict | None:
            return self.fetch(s, check)

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="engine-extract") as pool:
            for s, st in zip(samples, pool.map(one, samples)):
                out.append(st)
                if on_progress is not None:
                    on_progress(1, s.num_tokens)
        return out


@contextlib.contextmanager
def engine_target(
    target_cfg: TargetConfig,
    extract_cfg,
    out_dir: str | os.PathLike,
    log_path: Path | None = None,
) -> Iterator[EngineTarget]:
    """An :class:`EngineTarget` attached to a vLLM server: the one at ``extract.server_url``, or one eyas starts
    (from ``.venv-vllm``) and stops on every exit path."""
    server_cfg: EngineServerConfig = extract_cfg.server
    need_head = extract_cfg.store.distribution == "topk"
    # the engine's interpreter first: a missing venv is named before anything is loaded or created
    python = None if extract_cfg.server_url else engine_python("vllm", server_cfg, key="extract.server")
    target = load_engine_target(target_cfg, server_cfg.dtype, need_head)
    if extract_cfg.server_url:
        target.client = HiddenStatesClient(
            extract_cfg.server_url,
            extract_cfg.server_states_dir,
            concurrency=extract_cfg.concurrency,
            timeout_s=server_cfg.request_timeout_s,
        )
        log.info(
            "extracting through the server at %s: it must run --speculative-config '%s' (eyas aux ids + 1, then L)",
            extract_cfg.server_url,
            vllm_extract_configs(target.layer_ids, "<dir>", False)[0],
        )
        yield target
        return
    cuda = torch.cuda.is_available()
    states_dir = Path(out_dir) / ENGINE_STATES_DIR
    shutil.rmtree(states_dir, ignore_errors=True)  # a killed job's files: their shards are redone anyway
    states_dir.mkdir(parents=True, exist_ok=True)
    target_dir, _ = model_source(target_cfg)
    env = engine_env("vllm", server_cfg, cuda, extract_cfg.threads)
    if not cuda:
        pp = [str(PLUGINS_DIR), env.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in pp if p)
    server = launch(
        lambda port: vllm_extract_command(
            python,
            target_dir,
            target.layer_ids,
            str(states_dir.resolve()),
            port,
            server_cfg,
            extract_cfg.concurrency,
            cuda,
        ),
        server_cfg,
        log_path or Path(out_dir) / ENGINE_STATES_DIR / "server.log",
        env=env,
        model=SERVED_NAME,
    )
    with server:
        target.client = HiddenStatesClient(
            server.url,
            states_dir,
            model=SERVED_NAME,
            concurrency=extract_cfg.concurrency,
            timeout_s=server_cfg.request_timeout_s,
            max_len=server_cfg.max_model_len,
        )
        try:
            yield target
        finally:
            target.client = None
    for p in states_dir.glob("*.safetensors*"):  # requests cut short by an error
        p.unlink()
