"""The data-preparation stage: corpus mixture → optional regeneration by the target → chat-formatted samples.

``python -m eyas.data.prepare corpus=demo prepare.regenerate=true prepare.regen.max_new_tokens=256`` (Hydra app on
``conf/config.yaml``; ``target=`` picks the model whose tokenizer and chat template are used).
``prepare.regen.engine=server`` regenerates through a serving engine (:mod:`eyas.data.regenerate_server`).

Design decisions:
- The output directory is keyed by a hash of everything that shapes it (corpus config, the content of its local
  files, prepare settings, the tokenizer's fingerprint, and the target when regenerating), so a rerun with the
  same config and files reuses a finished directory and resumes an unfinished one (regeneration appends per batch
  and skips finished ids), while an edited or grown corpus file gets a new directory. A file is keyed by its
  sha256 up to ``HASH_LIMIT`` bytes (a fraction of a second), a larger one by its size and mtime.
- Layout, per split (``train``/``eval``): ``conversations.jsonl`` (docs/DESIGN.md records; the regenerated ones when
  regenerating) and ``samples.jsonl`` (``{"id", "source", "input_ids", "loss_mask"}``, mask as 0/1, the input
  of ``data.extract``); plus ``corpus.json`` (resolved config and per-source stats, ShareGPT recovery included)
  and ``summary.json`` (counts, skips, regeneration tokens/s), written last as the "done" marker. Files are
  written to a temporary name and renamed, so a crash never leaves a half file under a final name.
- The logic is :func:`prepare`; the Hydra ``main`` only converts the config and loads the target (the
  tokenizer alone when not regenerating).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.command import Command
from eyas.common import (
    InputError,
    atomic_write_json,
    atomic_write_jsonl,
    build_config,
    ensure_out_dir,
    json_hash,
    sha256_file,
)
from eyas.data.chat import FormatStats, format_conversations
from eyas.data.corpora.config import SPLITS, CorpusConfig, SourceConfig, corpus_config_from_dict
from eyas.data.corpora.mixtures import CorpusSplits, load_corpus
from eyas.data.corpora.readers import iter_jsonl
from eyas.data.regenerate import (
    SERVER_ONLY_FIELDS,
    RegenerateConfig,
    RegenerateResult,
    read_regenerated,
    regenerate,
)
from eyas.data.regenerate_server import (
    ServerSession,
    ServerTarget,
    load_server_target,
    regenerate_via_server,
)
from eyas.data.types import Conversation, Sample
from eyas.serving.models.target import TargetConfig

log = logging.getLogger(__name__)


@dataclass
class PrepareConfig:
    """The data-preparation stage (``conf/prepare``) together with the corpus it reads (``conf/corpus``)."""

    corpus: CorpusConfig
    """The corpus mixture."""
    out_dir: str | None = None
    """Output directory; None: ``<work_dir>/prepare/<config hash>``."""
    work_dir: str = "runs"
    """Root of stage outputs (used when ``out_dir`` is None)."""
    max_len: int = 2048
    """Tokens per sample; longer samples are truncated (the loss mask with them)."""
    regenerate: bool = False
    """Replace the assistant turns with the target's own answers before formatting."""
    regen: RegenerateConfig = field(default_factory=RegenerateConfig)
    """How to regenerate."""
    progress: bool = True
    """Show tqdm progress bars."""
    threads: int | None = None
    """CPU threads for torch (None: torch's default). On a CPU shared with other jobs, 1 thread avoids OpenMP
    spin-waits that made 2-thread decoding several times slower than 1 thread (measured on a 2-core machine)."""

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"prepare.threads must be >= 1 or null, not {self.threads}")
        if self.max_len < 2:
            raise ValueError(f"prepare.max_len must be >= 2, not {self.max_len}")
        if isinstance(self.regen, dict):
            self.regen = build_config(RegenerateConfig, self.regen, "prepare.regen")


@dataclass
class SplitResult:
    """What was written for one split."""

    conversations: int
    samples: int
    tokens: int
    loss_tokens: int
    format: FormatStats
    regen: RegenerateResult | None = None
    conversations_path: str = ""
    samples_path: str = ""


@dataclass
class PrepareResult:
    """The stage's outcome (also in ``summary.json``)."""

    out_dir: Path
    splits: dict[str, SplitResult]
    corpus_stats: list[dict[str, Any]]
    reused: bool = False
    """True when a finished directory with the same config hash was found and nothing was recomputed."""

    @property
    def complete(self) -> bool:
        """False while a regeneration time budget has left conversations with their original answers."""
        return not any(s.regen is not None and s.regen.remaining for s in self.splits.values())

    def samples_path(self, split: str = "train") -> Path:
        return self.out_dir / split / "samples.jsonl"

    def to_dict(self) -> dict[str, Any]:
        splits = {}
        for name, s in self.splits.items():
            d = asdict(s)
            d["regen"] = s.regen.to_dict() if s.regen else None
            splits[name] = d
        return {"out_dir": str(self.out_dir), "splits": splits, "corpus_stats": self.corpus_stats}


# -- io ----------------------------------------------------------------------------------------------------------
def sample_record(s: Sample, tokenizer: str | None = None) -> dict[str, Any]:
    """A ``samples.jsonl`` line; ``tokenizer``: the fingerprint of the tokenizer that made the ids (extraction
    checks it against the target's)."""
    rec: dict[str, Any] = {
        "id": s.id,
        "source": s.source,
        "input_ids": s.input_ids,
        "loss_mask": [int(m) for m in s.loss_mask],
    }
    fp = tokenizer or s.tokenizer
    if fp:
        rec["tokenizer"] = fp
    return rec


def read_samples(path: str | os.PathLike) -> list[Sample]:
    """The samples of a ``samples.jsonl`` written by this stage."""
    return [
        Sample(
            id=str(r["id"]),
            input_ids=list(r["input_ids"]),
            loss_mask=[bool(m) for m in r["loss_mask"]],
            source=str(r.get("source", "")),
            tokenizer=r.get("tokenizer"),
        )
        for _, r in iter_jsonl(path)
    ]


def read_conversations(path: str | os.PathLike) -> list[Conversation]:
    return [Conversation.from_record(r) for _, r in iter_jsonl(path)]


# -- the stage ---------------------------------------------------------------------------------------------------
HASH_LIMIT = 64 << 20
"""Input files up to this many bytes are keyed by their sha256; larger ones by size and modification time."""


def _local_files(path: str) -> list[Path]:
    """The files a source path names (a file, every file under a directory, a glob's matches)."""
    p = Path(os.path.expanduser(path))
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file())
    return sorted(f for f in map(Path, glob.glob(str(p), recursive=True)) if f.is_file())


def _file_key(p: Path) -> list[Any]:
    st = p.stat()
    content = f"sha256:{sha256_file(p)}" if st.st_size <= HASH_LIMIT else f"mtime_ns:{st.st_mtime_ns}"
    return [str(p), st.st_size, content]


def source_inputs(src: SourceConfig) -> dict[str, Any]:
    """What a source reads besides its config: its local files' content (:func:`_file_key`), or for a packaged
    kind read from its wheel, the wheel's requirement."""
    from eyas.data.packaged import EVALS, HUMANEVAL, MT_BENCH, SHAREGPT

    packaged = {"sharegpt": SHAREGPT, "evals": EVALS, "mt_bench": MT_BENCH, "humaneval": HUMANEVAL}.get(
        src.kind
    )
    local = [src.path] if src.path else []
    if packaged is not None and not local and os.environ.get(packaged.env_var):
        local.append(os.environ[packaged.env_var])  # the local copy the packaged readers take instead
    local += list(src.data_files or [])
    if src.kind == "hf" and src.dataset and Path(src.dataset).expanduser().exists():
        local.append(src.dataset)
    out: dict[str, Any] = {"files": [_file_key(f) for x in local for f in _local_files(x)]}
    if packaged is not None and not src.path and not os.environ.get(packaged.env_var):
        out["requirement"] = src.requirement or packaged.requirement
    return out


def corpus_inputs(corpus: CorpusConfig) -> dict[str, Any]:
    """:func:`source_inputs` of every source, by name."""
    return {src.name: source_inputs(src) for src in corpus.sources}


def config_hash(
    cfg: PrepareConfig,
    tokenizer_fingerprint: str,
    target_name: str | None,
    inputs: dict[str, Any] | None = None,
) -> str:
    """What the output depends on: corpus, formatting and regeneration settings, tokenizer (and target), and
    ``inputs``, the content of the corpus's files (:func:`corpus_inputs`)."""
    key = {
        "corpus": asdict(cfg.corpus),
        "inputs": inputs,
        "max_len": cfg.max_len,
        # threads/progress and the stopping points do not change what a finished output holds
        "regenerate": _regen_key(cfg.regen) if cfg.regenerate else None,
        "tokenizer": tokenizer_fingerprint,
        "target": target_name if cfg.regenerate else None,
    }
    return json_hash(key)


def _regen_key(regen: RegenerateConfig) -> dict[str, Any]:
    """The regeneration settings that shape the output: not the stopping points, nor (``engine=server``) where
    and how fast the servers are asked; the in-process engines' key is what it was before servers existed."""
    skip = {"time_budget_s", "max_batches"}
    if regen.engine == "server":
        skip |= set(SERVER_ONLY_FIELDS) - {"request_mode"}
    else:
        skip |= set(SERVER_ONLY_FIELDS)
    return {k: v for k, v in asdict(regen).items() if k not in skip}


def _target_name(target) -> str | None:
    if target is None:
        return None
    return target.name if isinstance(target, ServerTarget) else target.info.name


def _changed_inputs(before: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """The files (or wheels) whose content differs between two :func:`corpus_inputs`."""
    if before is None:
        return []
    old = {f[0]: f for src in before.values() for f in src.get("files", [])}
    new = {f[0]: f for src in now.values() for f in src.get("files", [])}
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)) + [
        f"{name} ({src.get('requirement')})"
        for name, src in now.items()
        if src.get("requirement") != (before.get(name) or {}).get("requirement")
    ]


def prepare(cfg: PrepareConfig, target=None, *, tokenizer=None) -> PrepareResult:
    """Run the stage. ``target`` (a :class:`serving.models.target.Target`; with ``regen.engine=server`` a
    :class:`data.regenerate_server.ServerTarget`) is needed to regenerate; otherwise its tokenizer, or
    ``tokenizer`` alone, is enough."""
    from eyas.serving.models.target import tokenizer_hash

    if cfg.regenerate and target is None:
        raise ValueError("prepare.regenerate=true needs the target model (pass target=load_target(...))")
    if cfg.regenerate and (cfg.regen.engine == "server") != isinstance(target, ServerTarget):
        raise ValueError(
            "prepare.regen.engine=server regenerates through a ServerTarget (load_server_target), the other "
            "engines through a loaded Target"
        )
    tok = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
    if tok is None:
        raise ValueError("prepare needs the target's tokenizer: pass target= or tokenizer=")
    name = _target_name(target)
    tok_fp = tokenizer_hash(tok)
    inputs = corpus_inputs(cfg.corpus)
    key = config_hash(cfg, tok_fp, name, inputs)
    out = Path(cfg.out_dir) if cfg.out_dir else Path(cfg.work_dir) / "prepare" / key
    if cfg.out_dir:
        ensure_out_dir(out, "prepare.out_dir")
    else:
        ensure_out_dir(out, "work_dir", value=cfg.work_dir)
    summary_path = out / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        made_by = summary.get("config_hash")
        if made_by is not None and made_by != key:  # only a fixed out_dir can hold another config's output
            changed = _changed_inputs(summary.get("inputs"), inputs)
            why = (
                f"the corpus files changed since: {', '.join(changed[:5])}"
                if changed
                else "corpus, its files, max_len, regeneration settings or tokenizer differ"
            )
            raise InputError(
                f"prepare.out_dir={out} holds data prepared with other settings or inputs (config hash {made_by}, "
                f"now {key}: {why}). Use another prepare.out_dir, or leave it unset so every configuration gets "
                "its own directory"
            )
        if summary.get("complete", True) or not cfg.regenerate:
            log.info("prepare: reusing the finished output in %s", out)
            return _result_from_summary(out, summary)
        if _done_up_to_max_batches(summary, cfg.regen.max_batches):
            log.info(
                "prepare: reusing %s: its first %d batches are regenerated (max_batches; a larger value continues)",
                out,
                cfg.regen.max_batches,
            )
            return _result_from_summary(out, summary)
        log.info("prepare: %s holds a partly regenerated corpus; continuing the regeneration", out)

    corpus: CorpusSplits = load_corpus(cfg.corpus)
    _refuse_empty_sources(cfg.corpus, corpus)
    corpus_stats = [s.to_dict() for s in corpus.stats]
    atomic_write_json(out / "corpus.json", {"config": asdict(cfg.corpus), "stats": corpus_stats})
    splits: dict[str, SplitResult] = {}
    session = _server_session(cfg, target, out)
    try:
        for split in SPLITS:
            convs = corpus.train if split == "train" else corpus.eval
            splits[split] = _prepare_split(
                cfg, split, convs, out / split, target, tok, tok_fp, session, corpus
            )
    finally:
        if session is not None:
            session.close()
    result = PrepareResult(out_dir=out, splits=splits, corpus_stats=corpus_stats)
    summary = {
        **result.to_dict(),
        "complete": result.complete,
        "config_hash": key,
        "inputs": inputs,
        "regen_max_batches": cfg.regen.max_batches if cfg.regenerate else None,
    }
    atomic_write_json(summary_path, summary)
    return result


def _prepare_split(
    cfg: PrepareConfig,
    split: str,
    convs: list[Conversation],
    d: Path,
    target,
    tok,
    tok_fp: str,
    session: ServerSession | None,
    corpus: CorpusSplits,
) -> SplitResult:
    """One split: (regenerated) conversations, then the formatted samples, into ``d``."""
    d.mkdir(exist_ok=True)
    conv_path = d / "conversations.jsonl"
    regen_path = d / "regenerate.json"
    regen_res = None
    partial = d / "conversations.partial.jsonl"
    if conv_path.exists() and not partial.exists():  # an earlier run of this config finished this step
        convs = read_conversations(conv_path)
        if regen_path.exists():
            regen_res = _regen_result(json.loads(regen_path.read_text()))
    elif cfg.regenerate and convs:
        # appended per batch under a working name: a restart resumes it; removed once complete
        regen_res = _regenerate(convs, target, cfg, partial, session)
        by_id = {c.id: c for c in read_regenerated(partial)}
        if regen_res.remaining and cfg.regen.unfinished == "keep":  # time budget: original answers for now
            convs = [by_id.get(c.id, c) for c in convs]
        else:  # corpus order, not generation order
            convs = [by_id[c.id] for c in convs if c.id in by_id]
        atomic_write_json(regen_path, regen_res.to_dict())
        atomic_write_jsonl(conv_path, (c.to_record() for c in convs))
        if not regen_res.remaining:
            partial.unlink()
    else:
        atomic_write_jsonl(conv_path, (c.to_record() for c in convs))
    fmt = format_conversations(convs, tok, cfg.max_len, progress=cfg.progress)
    samples_path = d / "samples.jsonl"
    if split == "train" and not fmt.samples:
        raise InputError(_no_samples_message(cfg, corpus, convs, fmt.stats))
    atomic_write_jsonl(samples_path, (sample_record(s, tok_fp) for s in fmt.samples))
    return SplitResult(
        conversations=len(convs),
        samples=len(fmt.samples),
        tokens=fmt.stats.tokens,
        loss_tokens=fmt.stats.loss_tokens,
        format=fmt.stats,
        regen=regen_res,
        conversations_path=str(conv_path),
        samples_path=str(samples_path),
    )


def _server_session(cfg: PrepareConfig, target, out: Path) -> ServerSession | None:
    """The regeneration servers of this run (``engine=server``), started when a split first needs them."""
    if not (cfg.regenerate and cfg.regen.engine == "server"):
        return None
    return ServerSession(target, cfg.regen, out / "regen_server.log", cfg.threads)


def _regenerate(
    convs, target, cfg: PrepareConfig, partial: Path, session: ServerSession | None
) -> RegenerateResult:
    if session is None:
        return regenerate(convs, target, cfg.regen, partial, progress=cfg.progress)
    return regenerate_via_server(convs, target, cfg.regen, partial, session.servers(), progress=cfg.progress)


def _source_where(src) -> str:
    return src.path or src.dataset or src.requirement or f"the packaged {src.kind} corpus"


def _refuse_empty_sources(corpus_cfg: CorpusConfig, corpus: CorpusSplits) -> None:
    """A source that yields no record at all (an empty file, an empty dataset split) is a mistake, not data."""
    read = {st.name: st.read for st in corpus.stats}
    for src in corpus_cfg.sources:
        if read.get(src.name, 1) == 0:
            raise InputError(
                f"corpus source {src.name!r} ({_source_where(src)}) holds no records: the file is empty or "
                "nothing in it could be read; fix the file or remove the source from the corpus"
            )


def _no_samples_message(cfg: PrepareConfig, corpus: CorpusSplits, convs, stats: FormatStats) -> str:
    where = ", ".join(_source_where(s) for s in cfg.corpus.sources)
    skipped = {k: v for k, v in asdict(stats).items() if k.startswith("skipped") and v}
    return (
        f"corpus {cfg.corpus.name!r} ({where}) yields no training samples: {len(convs)} conversations selected, "
        f"none usable after formatting (skipped: {skipped or 'none'}; per source: "
        f"{[(st.name, st.read, st.skipped) for st in corpus.stats]}). Check the files hold conversations with an "
        "assistant turn, or raise the corpus budget"
    )


def _result_from_summary(out: Path, d: dict[str, Any]) -> PrepareResult:
    splits = {}
    for name, s in d["splits"].items():
        regen = _regen_result(s["regen"]) if s.get("regen") else None
        splits[name] = SplitResult(**{**s, "format": FormatStats(**s["format"]), "regen": regen})
    return PrepareResult(out_dir=out, splits=splits, corpus_stats=d["corpus_stats"], reused=True)


def _done_up_to_max_batches(summary: dict[str, Any], max_batches: int | None) -> bool:
    """Whether an unfinished regeneration left only conversations past ``max_batches`` (its own limit was at least
    this one), so that a rerun would start the engine to find nothing to do."""
    made_with = summary.get("regen_max_batches")
    if max_batches is None or made_with is None or max_batches > made_with:
        return False
    regens = [s.get("regen") for s in summary.get("splits", {}).values() if s.get("regen")]
    return all(r.get("remaining", 0) == r.get("past_max_batches", 0) for r in regens)


def _regen_result(d: dict[str, Any]) -> RegenerateResult:
    r = {k: v for k, v in d.items() if k != "tokens_per_s"}
    return RegenerateResult(**{**r, "path": Path(r["path"])})


def format_summary(res: PrepareResult) -> str:
    """A human-readable summary of the stage's result."""
    lines = [f"prepare: {res.out_dir}{' (reused)' if res.reused else ''}"]
    for st in res.corpus_stats:
        skipped = sum(st["skipped"].values())
        lines.append(
            f"  source {st['name']}: read {st['read']}, train {st['kept']['train']}, eval "
            f"{st['kept']['eval']}, skipped {skipped}, duplicates {st['duplicates']}"
        )
        for ja in st.get("json_array", []):
            if ja["truncated"] or ja["damaged_at_bytes"]:
                lines.append(
                    f"    recovered {ja['records']} records from {Path(ja['path']).name}: truncated at byte "
                    f"{ja['truncated_at_byte']:,}, last complete record ends at byte "
                    f"{ja['last_record_end_byte']:,}"
                )
    for name, s in res.splits.items():
        f = s.format
        skips = (
            f.skipped_empty
            + f.skipped_no_assistant
            + f.skipped_template_error
            + f.skipped_unmaskable
            + f.skipped_truncated_no_loss
        )
        lines.append(
            f"  {name}: {s.samples} samples from {s.conversations} conversations, {s.tokens:,} tokens, "
            f"{s.loss_tokens:,} loss-masked ({s.loss_tokens / max(1, s.tokens):.0%}); skipped {skips} "
            f"(empty {f.skipped_empty}, no assistant {f.skipped_no_assistant}, template "
            f"{f.skipped_template_error}, unmaskable {f.skipped_unmaskable}, all-truncated "
            f"{f.skipped_truncated_no_loss}); truncated {f.truncated}"
        )
        if s.regen:
            r = s.regen
            lines.append(
                f"    regenerated {r.written} conversations ({r.already_done} already done), {r.turns} "
                f"turns, {r.generated_tokens:,} tokens at {r.tokens_per_s:.1f} tok/s; finish {r.finish}"
                + (f"; {r.remaining} not regenerated yet (time budget or max_batches)" if r.remaining else "")
            )
    return "\n".join(lines)


# -- entry point -------------------------------------------------------------------------------------------------
def prepare_config_from_hydra(cfg) -> PrepareConfig:
    """``cfg.prepare`` + ``cfg.corpus`` (+ ``cfg.work_dir``) of the Hydra config as a :class:`PrepareConfig`."""
    from omegaconf import OmegaConf

    corpus = corpus_config_from_dict(OmegaConf.to_container(cfg.corpus, resolve=True))
    p = {**OmegaConf.to_container(cfg.prepare, resolve=True), "corpus": corpus}
    return build_config(PrepareConfig, {**p, "work_dir": str(cfg.get("work_dir", "runs"))}, "prepare")


@dataclass
class PrepareJob:
    """What ``python -m eyas.data.prepare`` runs (:func:`run`)."""

    target: TargetConfig
    prepare: PrepareConfig


def prepare_job(cfg) -> PrepareJob:
    """The typed config of ``python -m eyas.data.prepare`` (groups ``target``, ``prepare``, ``corpus``)."""
    return PrepareJob(build_config(TargetConfig, cfg.target, "target"), prepare_config_from_hydra(cfg))


def run(job: PrepareJob, target=None) -> PrepareResult:
    """The stage: the target is loaded (unless given) only to regenerate; formatting needs its tokenizer."""
    from eyas.serving.models.target import load_target

    pcfg = job.prepare
    if pcfg.threads:
        import torch

        torch.set_num_threads(pcfg.threads)
    if (
        pcfg.regenerate and pcfg.regen.engine == "server"
    ):  # the engine holds the weights; eyas reads the tokenizer
        if not isinstance(target, ServerTarget):
            target = load_server_target(job.target)
        return prepare(pcfg, target, tokenizer=target.tokenizer)
    if pcfg.regenerate:
        target = target if target is not None else load_target(job.target)
        return prepare(pcfg, target, tokenizer=target.tokenizer)
    tok = target.tokenizer if target is not None else load_tokenizer(job.target)
    return prepare(pcfg, tokenizer=tok)


def load_tokenizer(tcfg):
    """The tokenizer of the target described by ``tcfg`` (a ``TargetConfig``), without loading the model."""
    from transformers import AutoTokenizer

    from eyas.serving.models.embedded import convert_gguf
    from eyas.serving.models.target import resolve_source

    path, gguf_file, _ = resolve_source(tcfg)
    if gguf_file is not None:
        path = str(convert_gguf(Path(path), gguf_file))
    kwargs: dict[str, Any] = {"trust_remote_code": tcfg.trust_remote_code}
    if tcfg.revision and not Path(path).exists():
        kwargs["revision"] = tcfg.revision
    return AutoTokenizer.from_pretrained(path, **kwargs)


def prepare_command(job: PrepareJob) -> None:
    print(format_summary(run(job)))


COMMAND = Command(
    "prepare",
    "eyas.data.prepare",
    "config",
    PrepareJob,
    prepare_command,
    load=prepare_job,
    reads=("corpus", "work_dir"),
)
main = COMMAND.main


if __name__ == "__main__":
    main()
