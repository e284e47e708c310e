"""The feature store: the target's aux hidden states and next-token distribution, per token, on disk.

A store is a directory::

    manifest.json               format version, target identity, options, tensor layout, bytes per token,
                                shard list (file, sha256, bytes, samples, tokens), totals, complete flag
    shard-00000.safetensors     many samples concatenated along the token axis, with an offsets index
    shard-00001.safetensors
    ...

Shard tensors (N tokens, S samples): ``input_ids [N] int32``, ``loss_mask [N] uint8``, ``offsets [S+1] int64``,
the aux states as ``aux [N, A*H] bf16`` | ``aux_fp8 [N, A*H] f8_e4m3 + aux_scale [N, A] bf16`` |
``aux_int4 [N, A*H/2] uint8 + aux_scale [N, A*H/g] bf16``, and the target distribution as ``hidden [N, H] bf16``
| ``topk_logprobs [N, k] fp32 + topk_ids [N, k] int32``. Sample ids and the shard index
are the shard's metadata.

Design decisions:
- Shards are plain safetensors files (the official library reads them) written by our own small writer: the
  byte layout is then a pure function of the tensors (tensors ordered by element size then name, one metadata
  key holding canonical JSON), which is what lets a resumed extraction be bit-identical to an uninterrupted one.
  Tensors are ordered by decreasing element size, so every tensor is aligned and readable in place.
- Reads are zero-copy: one copy-on-write ``numpy.memmap`` per shard, tensors are views into it.
- Every file write is atomic: temp file, fsync, rename, fsync of the directory. The manifest is rewritten the
  same way after each shard, so it only ever lists whole shards.
- Opening checks what is cheap (every shard present, file size, header parses and names the expected shard).
  A shard's sha256 is checked the first time a sample of it is read (``checksum_on_read``, on by default; the
  trainer's ``train.data.verify_checksums=false`` turns it off), so a flipped byte stops training with the
  shard named instead of being trained on, and a job that reads part of a store hashes only that part. Hashing
  reads each shard once more, once per process: on a demo-sized store (68k tokens, 300 MiB at SmolLM2's 4613
  bytes/token, warm page cache, 2-core CPU) 0.24 s in all (~1.25 GiB/s), against 0.11 s to read every
  sample without it, far less than a training epoch over it takes.
  ``verify="full"`` (:func:`verify_store`) checks every shard up front.
- No tail mass is stored with the top-k: it is ``1 - sum(exp(topk_logprobs))``, a function of what is stored,
  and the top-k teacher cannot use it (the share of the tail inside the draft vocabulary is unknown, so it cannot
  be placed on tokens or renormalised against; train/losses.py). Stores written with a ``tail_mass`` tensor
  still open: it is never read.
- Bytes per token is a headline number: :func:`bytes_per_token` computes it from the options, the manifest
  records it, and the file sizes confirm it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.common import atomic_write_bytes, fsync_dir, sha256_file  # noqa: F401 (re-exported)
from eyas.data.quant import dequantize_fp8, dequantize_int4, quantize_fp8, quantize_int4

log = logging.getLogger(__name__)

FORMAT_NAME = "eyas-feature-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
AUX_DTYPES = ("bfloat16", "float8_e4m3", "int4")
DISTRIBUTIONS = ("hidden", "topk")
VERIFY_MODES = ("header", "full")


# -- errors -------------------------------------------------------------------------------------------------------
class StoreError(RuntimeError):
    """Base class of feature-store errors."""


class StoreMismatchError(StoreError):
    """The store was written for another target or tokenizer than the one configured."""


class StoreConfigError(StoreError):
    """An extraction would resume into a store made with different settings."""


class MissingShardError(StoreError, FileNotFoundError):
    """Shard files listed in the manifest are missing."""


class CorruptShardError(StoreError):
    """Shard files fail their size, header or checksum check. ``shards`` names them."""

    def __init__(self, message: str, shards: list[str]):
        super().__init__(message)
        self.shards = shards


class IncompleteStoreError(StoreError):
    """The extraction that writes this store has not finished."""


# -- options and sizes --------------------------------------------------------------------------------------------
@dataclass
class StoreOptions:
    """How the features are stored (part of the store's identity: a resumed extraction must use the same)."""

    aux_dtype: str = "bfloat16"
    """Aux hidden states: ``bfloat16``, ``float8_e4m3`` (per token, per aux layer scale) or ``int4`` (group-wise
    scales, two codes per byte)."""
    int4_group_size: int = 64
    """Values sharing one scale with ``aux_dtype=int4``; even, and dividing the hidden size."""
    distribution: str = "hidden"
    """Target next-token distribution: ``hidden`` (final normed hidden state, bf16; the trainer applies the
    frozen head) or ``topk`` (top-k log-probabilities over the full vocabulary, fp32, + their ids, int32)."""
    topk: int = 32
    """k for ``distribution=topk``."""

    def __post_init__(self) -> None:
        if self.aux_dtype not in AUX_DTYPES:
            raise ValueError(f"store aux_dtype must be one of {AUX_DTYPES}, not {self.aux_dtype!r}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"store distribution must be one of {DISTRIBUTIONS}, not {self.distribution!r}")
        if self.topk < 1:
            raise ValueError(f"store topk must be >= 1, not {self.topk}")
        if self.int4_group_size < 2 or self.int4_group_size % 2:
            raise ValueError(f"store int4_group_size must be even and >= 2, not {self.int4_group_size}")

    def to_dict(self) -> dict[str, Any]:
        """Only the settings that matter for this choice (so unrelated defaults never block a resume)."""
        d: dict[str, Any] = {"aux_dtype": self.aux_dtype, "distribution": self.distribution}
        if self.aux_dtype == "int4":
            d["int4_group_size"] = self.int4_group_size
        if self.distribution == "topk":
            d["topk"] = self.topk
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StoreOptions:
        return cls(**dict(d))

    @property
    def label(self) -> str:
        aux = {"bfloat16": "bf16", "float8_e4m3": "fp8", "int4": f"int4g{self.int4_group_size}"}[
            self.aux_dtype
        ]
        dist = "hidden" if self.distribution == "hidden" else f"top{self.topk}"
        return f"{aux}+{dist}"


@dataclass(frozen=True)
class BytesPerToken:
    """Store bytes per token, by part (the per-sample offsets add 8 bytes per sample on top)."""

    aux: int
    distribution: int
    tokens: int
    """input_ids (int32) + loss_mask (uint8)."""
    total: int
    anchor: int
    """The reference layout: 4H bf16 values per token (3 aux states + the final hidden state)."""

    @property
    def ratio_to_anchor(self) -> float:
        return self.total / self.anchor

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio_to_anchor"] = round(self.ratio_to_anchor, 4)
        return d


_TORCH_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}
_ST_TO_TORCH = {v: k for k, v in _TORCH_TO_ST.items()}


@dataclass(frozen=True)
class TensorSpec:
    """A per-token shard tensor: its trailing shape and dtype (the leading dimension is the token axis)."""

    row_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


class FeatureCodec:
    """Turns the target's per-token outputs into the stored tensors and back; one per store layout."""

    def __init__(self, options: StoreOptions, *, hidden_size: int, num_aux: int, vocab_size: int):
        self.options = options
        self.hidden_size = int(hidden_size)
        self.num_aux = int(num_aux)
        self.vocab_size = int(vocab_size)
        width = self.num_aux * self.hidden_size
        if options.aux_dtype == "int4" and self.hidden_size % options.int4_group_size:
            raise ValueError(
                f"int4_group_size={options.int4_group_size} does not divide the hidden size {self.hidden_size}; "
                "pick a divisor (e.g. 32 or 64)"
            )
        if options.distribution == "topk" and options.topk > self.vocab_size:
            raise ValueError(f"topk={options.topk} exceeds the vocabulary size {self.vocab_size}")
        specs: dict[str, TensorSpec] = {
            "input_ids": TensorSpec((), torch.int32),
            "loss_mask": TensorSpec((), torch.uint8),
        }
        if options.aux_dtype == "bfloat16":
            specs["aux"] = TensorSpec((width,), torch.bfloat16)
        elif options.aux_dtype == "float8_e4m3":
            specs["aux_fp8"] = TensorSpec((width,), torch.float8_e4m3fn)
            specs["aux_scale"] = TensorSpec((self.num_aux,), torch.bfloat16)
        else:
            specs["aux_int4"] = TensorSpec((width // 2,), torch.uint8)
            specs["aux_scale"] = TensorSpec((width // options.int4_group_size,), torch.bfloat16)
        if options.distribution == "hidden":
            specs["hidden"] = TensorSpec((self.hidden_size,), torch.bfloat16)
        else:
            specs["topk_logprobs"] = TensorSpec((options.topk,), torch.float32)
            specs["topk_ids"] = TensorSpec((options.topk,), torch.int32)
        self.specs = specs

    @property
    def feature_names(self) -> list[str]:
        """The per-token tensors other than input_ids / loss_mask."""
        return [n for n in self.specs if n not in ("input_ids", "loss_mask")]

    def bytes_per_token(self) -> BytesPerToken:
        aux = sum(s.row_bytes for n, s in self.specs.items() if n.startswith("aux"))
        dist = sum(s.row_bytes for n, s in self.specs.items() if n in ("hidden", "topk_logprobs", "topk_ids"))
        tok = self.specs["input_ids"].row_bytes + self.specs["loss_mask"].row_bytes
        return BytesPerToken(
            aux=aux, distribution=dist, tokens=tok, total=aux + dist + tok, anchor=8 * self.hidden_size
        )

    # -- encode -------------------------------------------------------------------------------------------------
    def encode(
        self,
        aux: torch.Tensor,
        hidden: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """aux [n, A*H], hidden [n, H] (final normed) -> stored feature tensors (on the input's device).

        ``head`` maps hidden rows to fp32 logits over the full vocabulary; needed for ``distribution=topk``.
        """
        o = self.options
        out: dict[str, torch.Tensor] = {}
        if o.aux_dtype == "bfloat16":
            out["aux"] = aux.to(torch.bfloat16)
        elif o.aux_dtype == "float8_e4m3":
            out["aux_fp8"], out["aux_scale"] = quantize_fp8(aux, self.num_aux)
        else:
            out["aux_int4"], out["aux_scale"] = quantize_int4(aux, o.int4_group_size)
        if o.distribution == "hidden":
            out["hidden"] = hidden.to(torch.bfloat16)
        else:
            if head is None:
                raise ValueError("distribution=topk needs the target head to compute logits")
            out.update(self.encode_topk(hidden, head))
        return out

    def encode_topk(
        self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Top-k log-probabilities over the full vocabulary and their ids."""
        k = self.options.topk
        n = hidden.shape[0]
        lp = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
        ids = torch.empty(n, k, dtype=torch.int32, device=hidden.device)
        # rows per chunk: 16 MiB of fp32 logits. Small enough for the allocator to reuse the same memory chunk after
        # chunk (measured on a 2-core CPU: 128-row chunks of a 49k vocabulary cost 0.65x the time of 1,365-row ones,
        # which paid a page fault per fresh 256 MiB buffer)
        chunk = max(1, (1 << 22) // self.vocab_size)
        for s in range(0, n, chunk):
            logits = head(hidden[s : s + chunk]).float()  # [c, V]
            # top-k of the logits minus their logsumexp: log_softmax's values without writing a [c, V] copy
            top = torch.topk(logits, k, dim=-1)
            lp[s : s + chunk] = top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
            ids[s : s + chunk] = top.indices.to(torch.int32)
        return {"topk_logprobs": lp, "topk_ids": ids}

    # -- decode -------------------------------------------------------------------------------------------------
    def decode_aux(
        self, rows: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Stored aux rows -> [n, A*H] in ``dtype``."""
        o = self.options
        if o.aux_dtype == "bfloat16":
            return rows["aux"].to(dtype)
        if o.aux_dtype == "float8_e4m3":
            return dequantize_fp8(rows["aux_fp8"], rows["aux_scale"], dtype)
        return dequantize_int4(rows["aux_int4"], rows["aux_scale"], dtype)


def bytes_per_token(
    hidden_size: int, num_aux: int, options: StoreOptions, vocab_size: int = 1 << 20
) -> BytesPerToken:
    """Store bytes per token for a target of ``hidden_size`` with ``num_aux`` aux layers under ``options``."""
    return FeatureCodec(
        options, hidden_size=hidden_size, num_aux=num_aux, vocab_size=vocab_size
    ).bytes_per_token()


NAMED_OPTIONS: dict[str, StoreOptions] = {
    "bf16+hidden": StoreOptions(),
    "bf16+top32": StoreOptions(distribution="topk", topk=32),
    "fp8+hidden": StoreOptions(aux_dtype="float8_e4m3"),
    "fp8+top32": StoreOptions(aux_dtype="float8_e4m3", distribution="topk", topk=32),
    "int4+top32": StoreOptions(aux_dtype="int4", int4_group_size=64, distribution="topk", topk=32),
}
"""The storage layouts compared by name (the pipeline's bytes-per-token line, the extraction benchmark's rows)."""


# -- shard files (safetensors) ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WrittenFile:
    """What :func:`write_safetensors` wrote."""

    sha256: str
    bytes: int


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> WrittenFile:
    """Write a safetensors file whose bytes depend only on the tensors and metadata; fsync it; hash it."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    start = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _TORCH_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [start, start + nbytes],
        }
        start += nbytes
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    head += b" " * (-(8 + len(head)) % 8)  # data starts 8-byte aligned
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            h.update(chunk)
        for name in order:
            buf = _raw_bytes(tensors[name])
            f.write(memoryview(buf))
            h.update(memoryview(buf))
        f.flush()
        os.fsync(f.fileno())
    return WrittenFile(sha256=h.hexdigest(), bytes=8 + len(head) + start)


class ShardFile:
    """A safetensors file opened memory-mapped; :meth:`tensor` returns zero-copy views."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"header length {n} exceeds the file size {size}")
                header = json.loads(f.read(n))
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise CorruptShardError(
                f"shard {self.path.name}: unreadable safetensors header ({e})", [self.path.name]
            ) from e
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict[str, Any]] = header
        self.data_start = 8 + n
        self.data_bytes = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self.data_start + self.data_bytes != size:
            raise CorruptShardError(
                f"shard {self.path.name}: {size} bytes on disk but its header describes "
                f"{self.data_start + self.data_bytes}",
                [self.path.name],
            )
        self._mm: np.memmap | None = None

    def _map(self) -> np.memmap:
        if self._mm is None:
            # copy-on-write: writable views for torch without ever touching the file
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="c")
        return self._mm

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = _ST_TO_TORCH[info["dtype"]]
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        if e == b:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_numpy(self._map()[self.data_start + b : self.data_start + e])
        return raw.view(dtype).view(shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: self.tensor(n) for n in self.header}


# -- manifest -----------------------------------------------------------------------------------------------------
@dataclass
class ShardEntry:
    """One committed shard, as listed in the manifest."""

    file: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    inputs_sha256: str
    """Fingerprint of the samples it was made from (ids, tokens, masks): a resume checks its inputs against it."""


@dataclass
class Manifest:
    """``manifest.json``: everything a reader needs to trust and decode the shards."""

    target: dict[str, Any]
    """TargetInfo of the model that produced the features (name, revision, tokenizer hash, aux layers, sizes)."""
    target_dtype: str
    """Dtype the target ran in (bf16 and fp32 runs differ in the last bits)."""
    options: dict[str, Any]
    """StoreOptions.to_dict()."""
    shard_size: int
    """Samples per shard (the last one may hold fewer): shard k holds samples [k * shard_size, (k+1) * shard_size)."""
    shards: list[ShardEntry] = field(default_factory=list)
    complete: bool = False
    """True once the extraction has consumed all its input."""
    run: dict[str, Any] = field(default_factory=dict)
    """Settings that may change between resumes without changing the layout (micro-batch budget...)."""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def identity(self) -> dict[str, Any]:
        """What must be equal for two extraction runs to write the same store."""
        return {
            "format_version": self.format_version,
            "target": self.target,
            "target_dtype": self.target_dtype,
            "options": self.options,
            "shard_size": self.shard_size,
        }

    def data_identity(self) -> dict[str, Any]:
        """What names the data a training run reads: the layout (:meth:`identity`, which names only the target
        and settings) and the shards' sha256. Two stores of one target with other samples differ here."""
        return {"store": self.identity(), "shards": [sh.sha256 for sh in self.shards]}

    @property
    def store_options(self) -> StoreOptions:
        return StoreOptions.from_dict(self.options)

    def codec(self) -> FeatureCodec:
        t = self.target
        return FeatureCodec(
            self.store_options,
            hidden_size=t["hidden_size"],
            num_aux=len(t["aux_layers"]),
            vocab_size=t["vocab_size"],
        )

    def to_dict(self) -> dict[str, Any]:
        codec = self.codec()
        n_tok = sum(s.num_tokens for s in self.shards)
        n_bytes = sum(s.bytes for s in self.shards)
        return {
            "format": self.format,
            "format_version": self.format_version,
            "target": self.target,
            "target_dtype": self.target_dtype,
            "aux_layers": self.target["aux_layers"],
            "hidden_size": self.target["hidden_size"],
            "vocab_size": self.target["vocab_size"],
            "options": self.options,
            "tensors": {
                n: {"dtype": _TORCH_TO_ST[s.dtype], "shape": ["N", *s.row_shape]}
                for n, s in codec.specs.items()
            },
            "bytes_per_token": codec.bytes_per_token().to_dict(),
            "shard_size": self.shard_size,
            "shards": [asdict(s) for s in self.shards],
            "totals": {
                "num_shards": len(self.shards),
                "num_samples": sum(s.num_samples for s in self.shards),
                "num_tokens": n_tok,
                "num_loss_tokens": sum(s.num_loss_tokens for s in self.shards),
                "bytes": n_bytes,
                "bytes_per_token_on_disk": round(n_bytes / n_tok, 3) if n_tok else None,
            },
            "complete": self.complete,
            "run": self.run,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "manifest") -> Manifest:
        if d.get("format") != FORMAT_NAME:
            raise StoreError(f"{where}: not an eyas feature store manifest (format={d.get('format')!r})")
        if d.get("format_version") != FORMAT_VERSION:
            raise StoreError(
                f"{where}: store format version {d.get('format_version')} is not the supported {FORMAT_VERSION}; "
                "re-extract with this eyas version"
            )
        shards = [ShardEntry(**s) for s in d["shards"]]
        for k, entry in enumerate(shards):  # the only names eyas writes: a path elsewhere is never opened
            if entry.file != shard_name(k):
                raise StoreError(
                    f"{where}: shard {k} is listed as {entry.file!r}, not {shard_name(k)!r} inside the store "
                    "directory: the manifest was edited or damaged; restore it, or extract into a new directory"
                )
        return cls(
            target=dict(d["target"]),
            target_dtype=str(d["target_dtype"]),
            options=dict(d["options"]),
            shard_size=int(d["shard_size"]),
            shards=shards,
            complete=bool(d["complete"]),
            run=dict(d.get("run") or {}),
        )

    def save(self, directory: Path) -> None:
        atomic_write_bytes(
            Path(directory) / MANIFEST, (json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n").encode()
        )

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise StoreError(f"{path}: manifest is not valid JSON ({e})") from e
        return cls.from_dict(d, where=str(path))


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def shard_metadata(index: int, sample_ids: Sequence[str]) -> dict[str, str]:
    return {"eyas": json.dumps({"shard": index, "sample_ids": list(sample_ids)}, separators=(",", ":"))}


_IDENTITY_FIELDS = ("name", "revision", "tokenizer_hash", "aux_layers", "hidden_size", "vocab_size")


def check_target(stored: Mapping[str, Any], expected: Mapping[str, Any], where: str) -> None:
    """Raise :class:`StoreMismatchError` when ``stored`` (a manifest's target) is not the ``expected`` target."""
    if stored.get("tokenizer_hash") != expected.get("tokenizer_hash"):
        raise StoreMismatchError(
            f"{where} was written with tokenizer {stored.get('tokenizer_hash')} (target {stored.get('name')!r}), "
            f"but the configured target {expected.get('name')!r} has tokenizer {expected.get('tokenizer_hash')}: "
            "token ids would not mean the same; extract a new store for this target"
        )
    diff = [k for k in _IDENTITY_FIELDS if _norm(stored.get(k)) != _norm(expected.get(k))]
    if diff:
        parts = ", ".join(f"{k}: store {stored.get(k)!r} vs configured {expected.get(k)!r}" for k in diff)
        raise StoreMismatchError(
            f"{where} was written by target {stored.get('name')!r} (revision {stored.get('revision')!r}), but the "
            f"configured target is {expected.get('name')!r} (revision {expected.get('revision')!r}) [{parts}]; "
            "point at the store of this target or re-extract"
        )


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


# -- reading ------------------------------------------------------------------------------------------------------
@dataclass
class SampleRows:
    """One stored sample: zero-copy views of its rows in every shard tensor."""

    id: str
    input_ids: torch.Tensor  # [n] int32
    loss_mask: torch.Tensor  # [n] uint8
    features: dict[str, torch.Tensor]  # name -> [n, ...] stored dtype

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def rows_of(
    tensors: Mapping[str, torch.Tensor], offsets: torch.Tensor, i: int, sample_id: str, names: Sequence[str]
) -> SampleRows:
    """Sample ``i`` of a block of concatenated samples (a shard, or features computed in memory)."""
    b, e = int(offsets[i]), int(offsets[i + 1])
    return SampleRows(
        id=sample_id,
        input_ids=tensors["input_ids"][b:e],
        loss_mask=tensors["loss_mask"][b:e],
        features={n: tensors[n][b:e] for n in names},
    )


@dataclass
class FeatureBlock:
    """Encoded features of consecutive samples, concatenated along the token axis: a shard's tensors before they are
    written (extraction computes them, :func:`write_safetensors` writes them) or features computed in memory."""

    tensors: dict[str, torch.Tensor]
    """input_ids [N] int32, loss_mask [N] uint8, offsets [S+1] int64 and the codec's feature tensors [N, ...]."""
    sample_ids: list[str]
    feature_names: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    def rows(self, i: int) -> SampleRows:
        return rows_of(self.tensors, self.tensors["offsets"], i, self.sample_ids[i], self.feature_names)


@dataclass(frozen=True)
class VerifyReport:
    """Result of :func:`verify_store`."""

    checked: int
    missing: list[str]
    corrupt: list[str]

    @property
    def ok(self) -> bool:
        return not self.missing and not self.corrupt


class FeatureStore:
    """A feature store opened for reading (memory-mapped)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        expect_target: Any = None,
        verify: str = "header",
        allow_incomplete: bool = False,
        checksum_on_read: bool = True,
    ):
        """Open the store at ``path``.

        expect_target: the configured target's ``TargetInfo`` (or its dict); a store from another target or
        tokenizer is refused. verify: ``header`` (presence, size, header) or ``full`` (also sha256 of every
        byte, now). allow_incomplete: read the shards of an extraction still running or killed.
        checksum_on_read: check a shard's sha256 against the manifest the first time a sample of it is read
        (:class:`CorruptShardError` naming it otherwise); a store opened with ``verify="full"`` is already checked.
        """
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
        self.path = Path(path)
        if not (self.path / MANIFEST).exists():
            raise FileNotFoundError(
                f"{self.path} is not a feature store: no {MANIFEST} (run `python -m eyas.data.extract` first)"
            )
        self.manifest = Manifest.load(self.path)
        if expect_target is not None:
            exp = expect_target.to_dict() if hasattr(expect_target, "to_dict") else dict(expect_target)
            check_target(self.manifest.target, exp, where=f"feature store {self.path}")
        if not self.manifest.complete and not allow_incomplete:
            raise IncompleteStoreError(
                f"feature store {self.path} is incomplete ({len(self.manifest.shards)} shards written, extraction "
                "not finished): rerun the extraction to resume it, or open with allow_incomplete=True"
            )
        verify_store(self.path, full=verify == "full", raise_errors=True, manifest=self.manifest)
        # shards whose sha256 is still to be checked on first read
        self._unchecked = (
            set() if verify == "full" or not checksum_on_read else set(range(len(self.manifest.shards)))
        )
        self.codec = self.manifest.codec()
        self._files = [ShardFile(self.path / s.file) for s in self.manifest.shards]
        self._offsets = [f.tensor("offsets") for f in self._files]
        self._ids: list[list[str]] = []
        for f, entry in zip(self._files, self.manifest.shards):
            ids = json.loads(f.metadata["eyas"])["sample_ids"]
            if len(ids) != entry.num_samples:
                raise CorruptShardError(
                    f"shard {entry.file}: metadata lists {len(ids)} samples, manifest {entry.num_samples}",
                    [entry.file],
                )
            self._ids.append(ids)
        counts = np.array([s.num_samples for s in self.manifest.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self.lengths = (
            np.concatenate([np.diff(o.numpy()) for o in self._offsets])
            if self._offsets
            else np.zeros(0, np.int64)
        )
        self.sample_ids: list[str] = [i for ids in self._ids for i in ids]
        self._loss_counts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def options(self) -> StoreOptions:
        return self.manifest.store_options

    def loss_counts(self) -> np.ndarray:
        """Loss-masked tokens per sample (reads every loss mask once, then cached)."""
        if self._loss_counts is None:
            parts = []
            for f, off in zip(self._files, self._offsets):
                cs = np.concatenate([[0], np.cumsum(f.tensor("loss_mask").numpy(), dtype=np.int64)])
                o = off.numpy()
                parts.append(cs[o[1:]] - cs[o[:-1]])
            self._loss_counts = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._loss_counts

    def rows(self, index: int) -> SampleRows:
        """Sample ``index`` (0..num_samples-1, in extraction order) as zero-copy views."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for a store of {self.num_samples} samples")
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        if k in self._unchecked:
            self.check_shard(k)
        local = index - int(self._starts[k])
        f = self._files[k]
        names = ["input_ids", "loss_mask", *self.codec.feature_names]
        tensors = {n: f.tensor(n) for n in names}
        return rows_of(tensors, self._offsets[k], local, self._ids[k][local], self.codec.feature_names)

    def fetch(self, indices: Sequence[int]) -> list[SampleRows]:
        return [self.rows(int(i)) for i in indices]

    def check_shard(self, k: int) -> None:
        """Compare shard ``k``'s sha256 with the manifest's (once); a mismatch raises :class:`CorruptShardError`
        naming the shard and the fix."""
        entry = self.manifest.shards[k]
        digest = sha256_file(self.path / entry.file)
        if digest != entry.sha256:
            raise CorruptShardError(
                f"feature store {self.path}: shard {entry.file} fails its checksum (sha256 {digest[:16]}…, the "
                f"manifest says {entry.sha256[:16]}…): its bytes changed after extraction (disk or copy error). "
                f"Re-extract it: rerun the extraction into this store with extract.verify_resume=full (it redoes "
                "only the shards that fail), or delete the store and extract it again",
                [entry.file],
            )
        self._unchecked.discard(k)


def check_shard_file(path: Path, k: int, entry: ShardEntry, *, full: bool) -> str | None:
    """Why shard file ``entry`` (position ``k``) of the store at ``path`` cannot be trusted: ``"missing"``, a
    reason naming the file, or None when it is present with the listed size and header (and ``full``: sha256)."""
    p = path / entry.file
    if not p.exists():
        return "missing"
    size = p.stat().st_size
    if size != entry.bytes:
        return f"{entry.file}: {size} bytes, manifest says {entry.bytes}"
    try:
        meta = json.loads(ShardFile(p).metadata.get("eyas", "{}"))
    except (CorruptShardError, json.JSONDecodeError) as e:
        return f"{entry.file}: {e}"
    if meta.get("shard") != k:
        return f"{entry.file}: header says shard {meta.get('shard')}, manifest position {k}"
    if full:
        digest = sha256_file(p)
        if digest != entry.sha256:
            return f"{entry.file}: sha256 {digest[:16]}… != manifest {entry.sha256[:16]}…"
    return None


def verify_store(
    path: str | os.PathLike, *, full: bool = True, raise_errors: bool = True, manifest: Manifest | None = None
) -> VerifyReport:
    """Check every shard of the store at ``path``: present, size, header and (``full``) sha256.

    Raises :class:`MissingShardError` / :class:`CorruptShardError` naming the shards (``raise_errors``), or
    returns the report.
    """
    path = Path(path)
    manifest = manifest or Manifest.load(path)
    missing: list[str] = []
    corrupt: list[str] = []
    reasons: list[str] = []
    for k, entry in enumerate(manifest.shards):
        problem = check_shard_file(path, k, entry, full=full)
        if problem == "missing":
            missing.append(entry.file)
        elif problem is not None:
            corrupt.append(entry.file)
            reasons.append(problem)
    report = VerifyReport(checked=len(manifest.shards), missing=missing, corrupt=corrupt)
    if raise_errors and missing:
        raise MissingShardError(
            f"feature store {path}: {len(missing)} shard file(s) listed in the manifest are missing: "
            f"{', '.join(missing)}. Restore them, or re-extract into a new directory"
        )
    if raise_errors and corrupt:
        raise CorruptShardError(
            f"feature store {path}: {len(corrupt)} shard(s) failed verification: {'; '.join(reasons)}. Delete the "
            "store and re-extract (a bad shard is never read)",
            corrupt,
        )
    return report
