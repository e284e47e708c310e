"""Feature extraction: run the target over formatted samples and write the feature store.

``python -m eyas.data.extract extract.samples=samples.jsonl extract.out_dir=runs/store`` (Hydra; any ``target=``).
Data parallel, on one node or several: the same command under ``accelerate launch`` or ``torchrun``; rank r
extracts shards r, r + world, ... into the shared ``out_dir`` (:mod:`eyas.data.extract_ranks`), and the store
equals the single-process one byte for byte.

Design decisions:
- Shard k holds samples ``[k * shard_size, (k + 1) * shard_size)`` of the input order, and its micro-batches are
  planned from those samples alone. A shard's bytes are therefore a function of its samples and the settings,
  so a job killed at any point restarts from the first shard not in the manifest and writes a store identical
  to an uninterrupted run. Each listed shard records a fingerprint of its input samples; a resume whose input
  differs is refused instead of silently mixing two datasets.
- Within a shard, samples are sorted by length (longest first) into micro-batches whose *padded* size
  ``rows * longest`` stays within ``max_batch_tokens``, then written back in input order.
- Right padding with the plain causal mask: a real token never attends to a pad, so no attention mask is
  passed and the fast causal attention kernels apply. Outputs at pad positions are dropped, never stored.
- Only the storage option that needs logits computes them (top-k: through ``Target.head``, in row chunks, at
  real tokens only); the ``hidden`` option runs the base model without the vocabulary projection.
- A writer thread serializes, hashes and fsyncs shard k while the target computes shard k + 1 (at most one shard
  in flight, so memory stays at two shards).
- Listed shards that are missing or fail their size/header check on resume are re-extracted (same bytes).
- One driver: a single process is the data-parallel job with one rank (:func:`_write_store` runs on every rank,
  the same loop; :mod:`eyas.data.extract_ranks` holds what differs with the world size, and starts no process
  group for one rank). So any store a killed job left, whatever its world size, resumes under any other.
- Backends: ``extract.backend=transformers`` (eyas's own forward, above) or ``vllm`` (a serving engine computes
  the states and eyas packs its per-request files into the same shards; :mod:`eyas.data.extract_engine`). Both
  go through the same shard writer, manifest and resume logic; the manifest's ``run`` records the backend.
- Test hook: ``EYAS_TEST_KILL_AT_SHARD=k`` makes the job SIGKILL itself half-way through writing shard k's temp
  file, so the kill/resume test is deterministic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from itertools import chain, islice
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from eyas.command import Command
from eyas.common import (
    WRITE_PROBE_PREFIX,
    ConfigError,
    InputError,
    base_config,
    build_config,
    ensure_out_dir,
)
from eyas.data.corpora.readers import iter_jsonl
from eyas.data.extract_engine import ENGINE_STATES_DIR
from eyas.data.extract_ranks import (
    RankGroup,
    RankReport,
    Ranks,
    ShardLog,
    StoreTotals,
    finish_store,
    load_parts,
)
from eyas.data.store import (
    MANIFEST,
    BytesPerToken,
    FeatureBlock,
    FeatureCodec,
    Manifest,
    ShardEntry,
    StoreConfigError,
    StoreError,
    StoreMismatchError,
    StoreOptions,
    check_shard_file,
    check_target,
    fsync_dir,
    shard_metadata,
    shard_name,
    write_safetensors,
)
from eyas.data.types import Sample
from eyas.serving.engine_process import EngineServerConfig, check_server_url
from eyas.serving.models.target import TargetConfig

log = logging.getLogger(__name__)

KILL_HOOK_ENV = "EYAS_TEST_KILL_AT_SHARD"


@dataclass
class ExtractConfig:
    """Settings of an extraction job."""

    store: StoreOptions = field(default_factory=StoreOptions)
    """Storage layout: aux dtype and how the target distribution is stored."""
    shard_size: int = 1024
    """Samples per shard (part of the store's identity)."""
    max_batch_tokens: int = 16384
    """Padded tokens (rows x longest sample) per target forward; a longer sample runs alone."""
    max_batch_rows: int = 256
    """At most this many samples per forward."""
    writer_thread: bool = True
    """Serialize and hash shard k in a background thread while shard k + 1 is computed."""
    verify_resume: str = "header"
    """Check of the already-written shards on resume: ``header`` (presence, size, header) or ``full`` (sha256)."""
    progress: bool = True
    """Show a tqdm progress bar."""
    rank_timeout_s: float = 86400.0
    """Data-parallel runs: how long a rank waits for the others (at the end, for the slowest one)."""
    backend: str = "transformers"
    """Who runs the target: ``transformers`` (eyas's own forward) or ``vllm`` (a vLLM server's
    ``extract_hidden_states`` method; :mod:`eyas.data.extract_engine`)."""
    server_url: str | None = None
    """``backend=vllm``: a running server to use (None: eyas starts one from ``.venv-vllm`` and stops it)."""
    server_states_dir: str | None = None
    """``server_url``: the directory that server writes its hidden-states files to (its ``shared_storage_path``), as
    this machine sees it. Required with ``server_url``: eyas reads, and deletes, only files its replies name inside
    it."""
    server: EngineServerConfig = field(default_factory=EngineServerConfig)
    """``backend=vllm``: how eyas starts the server (``python``, ``dtype``, ``max_model_len``, ``args``...)."""
    concurrency: int = 4
    """``backend=vllm``: requests in flight (the started server's ``--max-num-seqs``)."""
    threads: int | None = None
    """``backend=vllm`` on CPU: the started server's ``OMP_NUM_THREADS`` (None: vLLM's default)."""

    def __post_init__(self) -> None:
        if isinstance(self.store, Mapping):
            self.store = build_config(StoreOptions, self.store, "extract.store")
        if isinstance(self.server, Mapping):
            self.server = build_config(EngineServerConfig, self.server, "extract.server")
        if self.backend not in ("transformers", "vllm"):
            raise ValueError(f"extract.backend must be 'transformers' or 'vllm', not {self.backend!r}")
        if self.server_url and self.backend == "transformers":
            raise ValueError("extract.server_url needs extract.backend=vllm")
        if self.server_url:
            check_server_url(self.server_url, "extract.server_url")
        if self.server_url and not self.server_states_dir:
            raise ValueError(
                "extract.server_url needs extract.server_states_dir=<the server's shared_storage_path, as this "
                "machine sees it>: eyas reads and deletes only the files a server reply names inside it"
            )
        if self.concurrency < 1:
            raise ValueError(f"extract.concurrency must be >= 1, not {self.concurrency}")
        if self.shard_size < 1:
            raise ValueError(f"extract.shard_size must be >= 1, not {self.shard_size}")
        if self.max_batch_tokens < 1 or self.max_batch_rows < 1:
            raise ValueError("extract.max_batch_tokens and extract.max_batch_rows must be >= 1")
        if self.rank_timeout_s <= 0:
            raise ValueError(f"extract.rank_timeout_s must be > 0, not {self.rank_timeout_s}")
        if self.verify_resume not in ("header", "full"):
            raise ValueError(f"extract.verify_resume must be 'header' or 'full', not {self.verify_resume!r}")


@dataclass
class ExtractResult:
    """What an extraction run did."""

    out_dir: Path
    num_shards: int
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    shards_written: int
    """Shards computed by this run (the rest were already in the store)."""
    shards_skipped: int
    bytes: int
    """Total size of the shards on disk."""
    bytes_per_token: BytesPerToken
    computed_tokens: int
    """Tokens run through the target by this run."""
    seconds: float
    """Wall time of this run."""

    @property
    def tokens_per_s(self) -> float:
        return self.computed_tokens / self.seconds if self.seconds > 0 else 0.0


# -- features of a list of samples (shared with the online mode) -------------------------------------------------
def plan_microbatches(lengths: Sequence[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Indices grouped longest-first so that ``rows * longest <= max_tokens`` (empty samples are left out)."""
    order = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and ((len(cur) + 1) * int(lengths[cur[0]]) > max_tokens or len(cur) >= max_rows):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _pad_id(target) -> int:
    tok = getattr(target, "tokenizer", None)
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tok, attr, None)
        if isinstance(v, int):
            return v
    return 0


@torch.inference_mode()
def compute_features(
    target,
    samples: Sequence[Sample],
    codec: FeatureCodec,
    *,
    max_batch_tokens: int = 16384,
    max_batch_rows: int = 256,
    on_progress: Callable[[int, int], None] | None = None,
    out_device: torch.device | str = "cpu",
) -> FeatureBlock:
    """Run ``target`` over ``samples`` (length-sorted, padding-aware micro-batches) and encode the features.

    Returns them in input order on ``out_device``. ``on_progress(samples, tokens)`` is called after each
    micro-batch.
    """
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    ids = (
        torch.from_numpy(np.concatenate([np.asarray(s.input_ids, dtype=np.int64) for s in samples]))
        if n
        else torch.zeros(0, dtype=torch.long)
    )
    mask = (
        torch.from_numpy(np.concatenate([np.asarray(s.loss_mask, dtype=np.uint8) for s in samples]))
        if n
        else torch.zeros(0, dtype=torch.uint8)
    )
    if n and (int(ids.min()) < 0 or int(ids.max()) >= codec.vocab_size):
        bad = next(
            s
            for s in samples
            if s.input_ids and (min(s.input_ids) < 0 or max(s.input_ids) >= codec.vocab_size)
        )
        raise ValueError(
            f"sample {bad.id!r} has token ids outside the target's vocabulary [0, {codec.vocab_size}): was it "
            "tokenized with another tokenizer?"
        )
    tensors: dict[str, torch.Tensor] = {
        "input_ids": ids.to(out_device, torch.int32),
        "loss_mask": (mask != 0).to(out_device, torch.uint8),
        "offsets": torch.from_numpy(offsets),
    }
    for name in codec.feature_names:
        spec = codec.specs[name]
        tensors[name] = torch.empty((n, *spec.row_shape), dtype=spec.dtype, device=out_device)
    pad = _pad_id(target)
    dev = target.device
    for mb in plan_microbatches(lengths, max_batch_tokens, max_batch_rows):
        lens = torch.from_numpy(lengths[mb])
        valid = torch.arange(int(lens[0]))[None, :] < lens[:, None]  # [B, T], rows longest first
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in mb])  # store rows, row-major
        batch = torch.full(valid.shape, pad, dtype=torch.long)
        batch[valid] = ids[rows]
        out = target.forward(batch.to(dev), logits="none")
        v = valid.to(dev)
        aux, hidden = out.aux[v], out.hidden[v]  # [n_mb, A*H], [n_mb, H]
        finite = torch.isfinite(aux).all(-1) & torch.isfinite(hidden).all(-1)  # [n_mb]
        if not bool(finite.all()):
            ends = np.cumsum(lengths[mb])
            bad = (~finite).nonzero()[:, 0].cpu().numpy()
            culprits = sorted({samples[mb[j]].id for j in np.searchsorted(ends, bad, side="right")})
            raise FloatingPointError(
                f"target produced non-finite hidden states for samples {culprits[:5]}; run the target in a wider "
                "dtype (target.dtype=bfloat16 or float32) or drop these samples"
            )
        enc = codec.encode(aux, hidden, head=target.head)
        dst = rows.to(out_device)
        for name, t in enc.items():
            tensors[name][dst] = t.to(out_device)
        if on_progress is not None:
            on_progress(len(mb), int(lens.sum()))
    return FeatureBlock(
        tensors=tensors, sample_ids=[s.id for s in samples], feature_names=codec.feature_names
    )


def features_of(
    target, samples: Sequence[Sample], codec: FeatureCodec, cfg: ExtractConfig, on_progress=None
) -> FeatureBlock:
    """Features of one shard's samples: an engine-backed target computes them itself
    (:class:`eyas.data.extract_engine.EngineTarget`), a transformers target through :func:`compute_features`."""
    if hasattr(target, "compute_features"):
        return target.compute_features(samples, codec, on_progress=on_progress)
    return compute_features(
        target,
        samples,
        codec,
        max_batch_tokens=cfg.max_batch_tokens,
        max_batch_rows=cfg.max_batch_rows,
        on_progress=on_progress,
    )


def inputs_fingerprint(samples: Iterable[Sample]) -> str:
    """sha256 over the samples' ids, token ids and loss masks (what a shard was made from)."""
    h = hashlib.sha256()
    for s in samples:
        sid = s.id.encode()
        h.update(len(sid).to_bytes(8, "little") + sid + len(s.input_ids).to_bytes(8, "little"))
        h.update(np.asarray(s.input_ids, dtype=np.int64).tobytes())
        h.update(np.asarray(s.loss_mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


def shard_fingerprint(chunk: list[Sample], k: int, target, old: ShardEntry | None, out_dir: Path) -> str:
    """The inputs fingerprint of shard ``k`` (:func:`inputs_fingerprint`), after checking every sample was tokenized
    by ``target``'s tokenizer and that ``old``, the shard entry a store already holds, was made from these samples."""
    for s in chunk:
        check_tokenizer(s, target.info.tokenizer_hash)
    sha = inputs_fingerprint(chunk)
    if old is not None and old.inputs_sha256 != sha:
        raise StoreConfigError(
            f"the input samples of shard {k} ({old.file}) differ from those it was extracted from (first sample "
            f"now {chunk[0].id!r}): the input changed since the store at {out_dir} was started. Use a new "
            "extract.out_dir for new data"
        )
    return sha


def codec_for(target, options: StoreOptions) -> FeatureCodec:
    info = target.info
    return FeatureCodec(
        options, hidden_size=info.hidden_size, num_aux=len(info.aux_layers), vocab_size=info.vocab_size
    )


# -- the job ------------------------------------------------------------------------------------------------------
class _ShardWriter:
    """Writes shards in order (optionally in one background thread) and hands each one's entry to ``record``
    (which rewrites the manifest, or this rank's part of it) once the file is in place."""

    def __init__(self, out_dir: Path, record: Callable[[int, ShardEntry], None], threaded: bool):
        self.out_dir = out_dir
        self.record = record
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") if threaded else None
        self.pending: Future | None = None
        kill = os.environ.get(KILL_HOOK_ENV)
        self.kill_at = int(kill) if kill else None
        self.written = 0

    def submit(self, index: int, block: FeatureBlock, inputs_sha: str) -> None:
        self.wait()  # at most one shard in flight
        if self.pool is None:
            self._write(index, block, inputs_sha)
        else:
            self.pending = self.pool.submit(self._write, index, block, inputs_sha)

    def keep(self, index: int, entry: ShardEntry) -> None:
        """Record shard ``index``, found finished in the store, after the shards before it."""
        self.wait()
        self.record(index, entry)

    def wait(self) -> None:
        if self.pending is not None:
            fut, self.pending = self.pending, None
            fut.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)

    def _write(self, index: int, block: FeatureBlock, inputs_sha: str) -> None:
        name = shard_name(index)
        tmp = self.out_dir / (name + ".tmp")
        written = write_safetensors(tmp, block.tensors, shard_metadata(index, block.sample_ids))
        if self.kill_at == index:
            os.truncate(tmp, written.bytes // 2)  # a half-written temp file, as a real crash would leave
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace(tmp, self.out_dir / name)
        fsync_dir(self.out_dir)
        entry = ShardEntry(
            file=name,
            sha256=written.sha256,
            bytes=written.bytes,
            num_samples=len(block.sample_ids),
            num_tokens=block.num_tokens,
            num_loss_tokens=int(block.tensors["loss_mask"].sum()),
            inputs_sha256=inputs_sha,
        )
        self.record(index, entry)
        self.written += 1
        log.debug(
            "wrote %s (%d samples, %d tokens, %d bytes)",
            name,
            entry.num_samples,
            entry.num_tokens,
            entry.bytes,
        )


class _Counted:
    """An iterable with a known length (for the progress bar) or none."""

    def __init__(self, it: Iterator[Sample], n: int | None):
        self.it, self.n = it, n

    def __iter__(self) -> Iterator[Sample]:
        return self.it

    def __len__(self) -> int:
        return self.n if self.n is not None else 0


def check_tokenizer(sample: Sample, expected: str) -> None:
    """Refuse a sample whose ids were made by another tokenizer than the target's (when the sample says)."""
    if sample.tokenizer is not None and sample.tokenizer != expected:
        raise StoreMismatchError(
            f"sample {sample.id!r} was tokenized by tokenizer {sample.tokenizer}, the target's tokenizer is "
            f"{expected}: its token ids mean other words to this target. Re-run `eyas prepare` with this "
            "target (target=...) and extract its samples.jsonl"
        )


def _chunks(samples: Iterable[Sample], size: int) -> Iterator[list[Sample]]:
    it = iter(samples)
    while chunk := list(islice(it, size)):
        yield chunk


def open_for_writing(out_dir: Path, fresh: Manifest) -> Manifest:
    """The manifest to continue: the existing one (checked against ``fresh``) or ``fresh`` (saved)."""
    if (out_dir / MANIFEST).exists():
        old = Manifest.load(out_dir)
        check_target(old.target, fresh.target, where=f"feature store {out_dir}")
        a, b = old.identity(), fresh.identity()
        diff = [k for k in a if a[k] != b[k]]
        if diff:
            parts = "; ".join(f"{k}: store {a[k]!r}, this run {b[k]!r}" for k in diff)
            raise StoreConfigError(
                f"{out_dir} holds a feature store made with different settings ({parts}). Nothing was "
                "changed: use another extract.out_dir, or rerun with the store's settings to resume it"
            )
        if old.run != fresh.run:
            log.warning(
                "resuming %s with run settings %s (store started with %s): new shards may differ in the last "
                "bits from an uninterrupted run",
                out_dir,
                fresh.run,
                old.run,
            )
        return old
    stray = [
        p.name
        for p in out_dir.iterdir()
        if not (
            p.name.endswith(".tmp")
            or p.name in (".lock", ENGINE_STATES_DIR)
            or p.name.startswith(WRITE_PROBE_PREFIX)
        )
    ]
    if stray:
        raise StoreConfigError(
            f"{out_dir} is not empty and holds no {MANIFEST} ({', '.join(sorted(stray)[:5])}...): refusing to "
            "write a feature store there; pick an empty or new extract.out_dir"
        )
    fresh.save(out_dir)
    return fresh


def extract(
    samples: Iterable[Sample],
    target,
    out_dir: str | os.PathLike,
    cfg: ExtractConfig | None = None,
    ranks: Ranks | None = None,
) -> ExtractResult:
    """Write (or resume) the feature store of ``samples`` under ``target`` at ``out_dir``; see the module doc.

    ``ranks``: this process's place among data-parallel extraction processes that share ``out_dir`` (each is
    given the same ``samples`` and extracts shards ``rank, rank + world, ...``; see
    :mod:`eyas.data.extract_ranks`); one process when None.
    """
    cfg = cfg or ExtractConfig()
    ranks = ranks or Ranks()
    total = len(samples) if hasattr(samples, "__len__") else None
    it = iter(samples)
    first = next(it, None)
    if first is None:  # refused before anything is written: an empty input never becomes a complete store
        raise InputError("no samples to extract: the input is empty (make samples with `eyas prepare`)")
    expected_tok = target.info.tokenizer_hash
    check_tokenizer(first, expected_tok)
    samples = _Counted(chain([first], it), total)
    out_dir = ensure_out_dir(out_dir, "extract.out_dir")
    codec = codec_for(target, cfg.store)
    run_settings = getattr(target, "run_settings", None) or {
        "max_batch_tokens": cfg.max_batch_tokens,
        "max_batch_rows": cfg.max_batch_rows,
    }
    fresh = Manifest(
        target=target.info.to_dict(),
        target_dtype=str(target.dtype).removeprefix("torch."),
        options=cfg.store.to_dict(),
        shard_size=cfg.shard_size,
        run=run_settings,
    )
    if ranks.world > 1 and hasattr(target, "compute_features"):
        raise ConfigError(
            "extract.backend=vllm runs as one eyas process: give the engine several GPUs with its own parallelism "
            "(extract.server.args='[--tensor-parallel-size,N]' or --data-parallel-size) instead of launching "
            "eyas on several ranks"
        )
    with RankGroup(ranks, cfg.rank_timeout_s) as group:
        return _write_store(samples, target, out_dir, cfg, codec, fresh, group)


def acquire_store_lock(out_dir: Path) -> FileLock:
    """The store's writer lock, held (released by the caller): one extraction writes into a directory at a time."""
    lock = FileLock(str(out_dir / ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout as e:
        raise StoreError(
            f"another extraction is writing to {out_dir} (lock {out_dir / '.lock'} is held)"
        ) from e
    return lock


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _open_store(out_dir: Path, fresh: Manifest, group: RankGroup) -> FileLock | None:
    """Rank 0 takes the store's lock and opens the store (:func:`open_for_writing`) before any rank writes into it;
    the lock on rank 0, None elsewhere. When rank 0 cannot, every rank raises (rank 0 its own error)."""
    lock: FileLock | None = None
    failure: Exception | None = None
    error = None
    if group.ranks.rank == 0:
        try:
            lock = acquire_store_lock(out_dir)
            for tmp in out_dir.glob("*.tmp"):
                tmp.unlink()  # a killed job's partial shard or manifest: never listed, never read
            open_for_writing(out_dir, fresh)
        except Exception as e:
            failure, error = e, _describe(e)
            if lock is not None:
                lock.release()
    error = group.broadcast(error)
    if failure is not None:
        raise failure
    if error is not None:
        raise StoreError(f"rank 0 could not open the feature store {out_dir}: {error}")
    return lock


def _write_store(
    samples: _Counted,
    target,
    out_dir: Path,
    cfg: ExtractConfig,
    codec: FeatureCodec,
    fresh: Manifest,
    group: RankGroup,
) -> ExtractResult:
    """The one driver, on every rank: open the store, extract this rank's shards, and let rank 0 finish the
    manifest; a failure on any rank is raised on every rank (its own error where it happened)."""
    t0 = time.perf_counter()
    lock = _open_store(out_dir, fresh, group)
    failure: Exception | None = None
    try:
        try:
            report = _extract_shards(samples, target, out_dir, cfg, codec, group)
        except Exception as e:
            failure, report = e, RankReport(error=_describe(e))
        reports = group.gather(report)
        totals = None
        if reports is not None:  # rank 0: fold every rank's shards into the manifest
            try:
                totals = finish_store(out_dir, reports)
            except Exception as e:
                totals = StoreTotals(error=_describe(e))
                failure = failure or e
    finally:
        if lock is not None:
            lock.release()
    totals = group.broadcast(totals)
    if failure is not None:
        raise failure
    if totals.error is not None:
        raise StoreError(f"data-parallel extraction into {out_dir} failed: {totals.error}")
    tot = totals.totals
    result = ExtractResult(
        out_dir=out_dir,
        num_shards=tot["num_shards"],
        num_samples=tot["num_samples"],
        num_tokens=tot["num_tokens"],
        num_loss_tokens=tot["num_loss_tokens"],
        shards_written=totals.written,
        shards_skipped=tot["num_shards"] - totals.written,
        bytes=tot["bytes"],
        bytes_per_token=codec.bytes_per_token(),
        computed_tokens=totals.computed_tokens,
        seconds=time.perf_counter() - t0,
    )
    if group.ranks.rank == 0:
        log.info(
            "feature store %s: %d samples, %d tokens in %d shards (%d written now by %d rank(s)), %.0f bytes/token "
            "(%.2fx the 4H bf16 anchor), %.0f tokens/s",
            out_dir,
            result.num_samples,
            result.num_tokens,
            result.num_shards,
            result.shards_written,
            group.ranks.world,
            result.bytes_per_token.total,
            result.bytes_per_token.ratio_to_anchor,
            result.tokens_per_s,
        )
    return result


def _extract_shards(
    samples: _Counted, target, out_dir: Path, cfg: ExtractConfig, codec: FeatureCodec, group: RankGroup
) -> RankReport:
    """This rank's shards into the open store: those found finished (in the manifest or a part file, and whose
    file passes ``cfg.verify_resume``) are kept, the others computed and written."""
    ranks = group.ranks
    manifest = Manifest.load(out_dir)
    known = dict(enumerate(manifest.shards)) | load_parts(out_dir)
    group.barrier()  # every rank has read the part files before any rewrites its own
    shard_log = ShardLog(out_dir, ranks, manifest)
    report = RankReport(entries=shard_log.done)
    skipped: list[int] = []
    t0 = time.perf_counter()
    bar = tqdm(
        total=(len(samples) or None) if ranks.world == 1 else None,
        unit="sample",
        desc=f"extract {cfg.store.label}" + (f" rank {ranks.rank}/{ranks.world}" if ranks.world > 1 else ""),
        disable=not cfg.progress,
        dynamic_ncols=True,
    )

    def progress(n_samples: int, n_tokens: int) -> None:
        report.computed_tokens += n_tokens
        bar.update(n_samples)
        bar.set_postfix(
            tok_s=f"{report.computed_tokens / max(time.perf_counter() - t0, 1e-9):.0f}", refresh=False
        )

    writer = _ShardWriter(out_dir, shard_log, cfg.writer_thread)
    try:
        for k, chunk in enumerate(_chunks(samples, cfg.shard_size)):
            report.num_chunks = k + 1
            if not ranks.owns(k):
                continue
            old = known.get(k)
            sha = shard_fingerprint(chunk, k, target, old, out_dir)
            if old is not None:
                problem = check_shard_file(out_dir, k, old, full=cfg.verify_resume == "full")
                if problem is None:
                    writer.keep(k, old)
                    skipped.append(k)
                    bar.update(len(chunk))
                    continue
                log.warning("re-extracting shard %d: %s", k, problem)
            block = features_of(target, chunk, codec, cfg, on_progress=progress)
            writer.submit(k, block, sha)
        writer.wait()
    finally:
        writer.close()
        bar.close()
    report.written = writer.written
    extracted = sorted(set(shard_log.done) - set(skipped))
    if ranks.world > 1:
        log.info(
            "rank %d/%d: extracted shards %s, found shards %s finished",
            ranks.rank,
            ranks.world,
            extracted,
            skipped,
        )
    elif skipped:
        log.info(
            "resumed %s: extracted %d shard(s), found %d finished", out_dir, len(extracted), len(skipped)
        )
    return report


# -- input: samples JSONL -------------------------------------------------------------------------------------------
def read_samples_jsonl(path: str | os.PathLike) -> Iterator[Sample]:
    """Samples from a JSONL file of ``{"id", "input_ids", "loss_mask", "source"?}`` records (streamed)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"samples file {path} does not exist (make it with the chat-formatting stage)"
        )
    # iter_jsonl names the line of a non-UTF-8 byte or malformed JSON
    for lineno, rec in iter_jsonl(path):
        try:
            sample = Sample(
                id=str(rec["id"]),
                input_ids=[int(x) for x in rec["input_ids"]],
                loss_mask=[bool(x) for x in rec["loss_mask"]],
                source=str(rec.get("source", "")),
                tokenizer=rec.get("tokenizer"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path}:{lineno}: malformed sample record ({type(e).__name__}: {e}); expected "
                '{"id": str, "input_ids": [int], "loss_mask": [bool]}'
            ) from e
        yield sample


# -- entry point ----------------------------------------------------------------------------------------------------
@dataclass
class ExtractStage(ExtractConfig):
    """The ``extract`` Hydra group: the job's inputs and outputs next to its :class:`ExtractConfig` settings."""

    samples: str | None = None
    """Formatted samples JSONL (``python -m eyas.data.prepare``'s ``<out_dir>/train/samples.jsonl``)."""
    out_dir: str | None = None
    """The feature store directory to write (or resume)."""

    def settings(self) -> ExtractConfig:
        return base_config(self, ExtractConfig)


@dataclass
class ExtractJob:
    """What ``python -m eyas.data.extract`` runs (:func:`run`): the Hydra groups of the same names."""

    target: TargetConfig = field(default_factory=TargetConfig)
    extract: ExtractStage = field(default_factory=ExtractStage)


def run(job: ExtractJob, target=None) -> ExtractResult:
    """Extract ``job.extract.samples`` into ``job.extract.out_dir`` with the target (loaded unless given)."""
    from eyas.serving.models.target import load_target

    for key in ("samples", "out_dir"):
        if not getattr(job.extract, key):
            raise ConfigError(
                f"extract.{key} is not set: extract.samples=<samples JSONL> extract.out_dir=<dir>"
            )
    ensure_out_dir(job.extract.out_dir, "extract.out_dir")  # bad inputs named before the target is loaded
    samples = read_samples_jsonl(job.extract.samples)
    first = next(samples, None)
    if first is None:
        raise InputError(
            f"extract.samples={job.extract.samples}: holds no samples (the file is empty); re-run `eyas prepare` "
            "or point extract.samples at a non-empty samples.jsonl"
        )
    ranks = Ranks.from_env()
    target_cfg = job.target
    if target is None and job.extract.backend == "vllm":
        from eyas.data.extract_engine import engine_target

        settings = job.extract.settings()
        with engine_target(target_cfg, settings, job.extract.out_dir) as engine:
            return extract(chain([first], samples), engine, job.extract.out_dir, settings, ranks)
    if ranks.world > 1 and target_cfg.device in ("auto", "cuda") and torch.cuda.is_available():
        target_cfg = replace(target_cfg, device=f"cuda:{ranks.local_rank}")  # one GPU per process
    target = target if target is not None else load_target(target_cfg)
    return extract(chain([first], samples), target, job.extract.out_dir, job.extract.settings(), ranks)


def extract_command(job: ExtractJob) -> None:
    res = run(job)
    if Ranks.from_env().rank != 0:
        return  # the same result on every rank: printed once
    print(json.dumps({k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(res).items()}, indent=1))


COMMAND = Command("extract", "eyas.data.extract", "config", ExtractJob, extract_command)
main = COMMAND.main


if __name__ == "__main__":
    main()
