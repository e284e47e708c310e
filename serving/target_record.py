"""What a drafter remembers of the target it was trained against, and the check that a target is that one.

A training run writes ``target.json`` (:class:`TargetRecord`) into its output directory, and every checkpoint and
``best/`` carries a copy; an export carries it in ``eyas_export.json`` (``target_record``). ``eyas export`` and
``eyas eval`` take the target from there when the command line has no ``target=``, and refuse a target that does
not fit the drafter.

Design decisions:
- The record holds where the target comes from (``path``: ``embedded``, a hub id, an absolute local directory or
  a ``.gguf``; ``gguf_file``, ``revision``, ``trust_remote_code``), the aux layers the drafter reads, and what the
  drafter's weights depend on: hidden size, vocabulary, the tokenizer's fingerprint (plus layer count and model
  type, to say which model it was). How the target is run (dtype, device, attention) is not recorded: each
  command chooses that for itself.
- A target fits the drafter when hidden size, vocabulary and tokenizer fingerprint agree: a drafter's fc and
  embedding are sized by the first two, and its token ids mean words only under the third. The refusal names
  both targets and what differs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from eyas.common import ConfigError
from eyas.serving.models.target import EMBEDDED, TargetConfig, TargetInfo

log = logging.getLogger(__name__)

TARGET_FILE = "target.json"
EXPORT_SIDECAR = "eyas_export.json"
SIDECAR_KEY = "target_record"


class TargetMismatchError(ConfigError):
    """The target given does not fit the drafter (another hidden size, vocabulary or tokenizer)."""


@dataclass(frozen=True)
class TargetRecord:
    """A drafter's target: where to load it from and what the drafter depends on."""

    path: str
    """``TargetConfig.path``: ``embedded``, a hub id, an absolute local directory, or a ``.gguf`` file."""
    name: str
    """The display name (``TargetInfo.name``)."""
    hidden_size: int
    vocab_size: int
    tokenizer_hash: str
    aux_layers: list[int]
    """The layers the drafter reads (eyas/SGLang ids)."""
    num_layers: int
    model_type: str
    revision: str | None = None
    """Hub revision (branch, tag or commit) the target was loaded at."""
    gguf_file: str | None = None
    trust_remote_code: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of a newer eyas this one does not know (kept, not interpreted)."""

    @classmethod
    def of(cls, cfg: TargetConfig, info: TargetInfo) -> TargetRecord:
        """The record of a target loaded from ``cfg`` (``info``: its :attr:`Target.info`)."""
        path = cfg.path
        if path != EMBEDDED and Path(os.path.expanduser(path)).exists():
            path = str(Path(os.path.expanduser(path)).resolve())  # found again from any working directory
        return cls(
            path=path,
            name=info.name,
            hidden_size=int(info.hidden_size),
            vocab_size=int(info.vocab_size),
            tokenizer_hash=info.tokenizer_hash,
            aux_layers=[int(i) for i in info.aux_layers],
            num_layers=int(info.num_layers),
            model_type=info.model_type,
            revision=cfg.revision,
            gguf_file=cfg.gguf_file,
            trust_remote_code=cfg.trust_remote_code,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetRecord:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        rec = {k: v for k, v in d.items() if k in known}
        rec["aux_layers"] = [int(i) for i in rec.get("aux_layers", [])]
        return cls(**rec, extra={k: v for k, v in d.items() if k not in known and k != "extra"})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}

    def target_config(self, base: TargetConfig | None = None) -> TargetConfig:
        """``base`` (dtype, device, attention; default: the defaults) pointed at this target and its aux layers."""
        return replace(
            base or TargetConfig(),
            path=self.path,
            gguf_file=self.gguf_file,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
            aux_layers=list(self.aux_layers),
        )

    def describe(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return (
            f"{self.name}{rev} (hidden size {self.hidden_size}, vocabulary {self.vocab_size}, tokenizer "
            f"{self.tokenizer_hash})"
        )


def describe_info(info: TargetInfo) -> str:
    return (
        f"{info.name} (hidden size {info.hidden_size}, vocabulary {info.vocab_size}, tokenizer "
        f"{info.tokenizer_hash})"
    )


# -- where records live ------------------------------------------------------------------------------------------
def write_target_record(directory: str | os.PathLike, record: TargetRecord) -> Path:
    """``<directory>/target.json`` (atomically)."""
    from eyas.common import atomic_write_json

    path = Path(directory) / TARGET_FILE
    atomic_write_json(path, record.to_dict())
    return path


def find_target_record(drafter: str | os.PathLike) -> tuple[TargetRecord, Path] | None:
    """The record of the drafter at ``drafter`` and the file it was read from: an export's ``eyas_export.json``,
    a checkpoint's ``target.json``, or its run's (``<run>/best``, ``<run>/checkpoints/step_N``, ``<run>``); None
    when there is none (a drafter from before eyas recorded its target)."""
    d = Path(drafter)
    sidecar = d / EXPORT_SIDECAR
    if sidecar.is_file():
        try:
            rec = json.loads(sidecar.read_text()).get(SIDECAR_KEY)
        except (OSError, json.JSONDecodeError):
            rec = None
        return (TargetRecord.from_dict(rec), sidecar) if isinstance(rec, dict) else None
    run = d.parent if d.name == "best" else d.parent.parent if d.parent.name == "checkpoints" else None
    for where in (d, run):
        if where is None:
            continue
        path = where / TARGET_FILE
        if path.is_file():
            try:
                return TargetRecord.from_dict(json.loads(path.read_text())), path
            except (json.JSONDecodeError, TypeError) as e:
                raise ConfigError(
                    f"{path}: unreadable target record ({e}); delete it, and give target="
                ) from e
    return None


# -- the commands' side ------------------------------------------------------------------------------------------
@dataclass
class ChosenTarget:
    """The target a command loads for a drafter, and why."""

    config: TargetConfig
    record: TargetRecord | None
    """The drafter's record (None: it has none)."""
    source: str
    """Where the choice came from, for the log."""
    known: bool = True
    """False: ``config`` does not say where the target comes from (the caller loaded a target the drafter has no
    record of), so nothing should record it."""


def choose_target(
    given: TargetConfig | None, drafter: str | os.PathLike | None, command: str, caller_loaded: bool = False
) -> ChosenTarget:
    """``given`` (``target=`` on the command line) or, when absent, the target the drafter at ``drafter``
    recorded (else the default target); logs which. ``caller_loaded``: the caller passes a target it loaded
    itself (the pipeline), which is used whatever this returns."""
    found = find_target_record(drafter) if drafter else None
    record, where = found if found else (None, None)
    if given is not None:
        chosen = ChosenTarget(given, record, "target= on the command line")
    elif record is not None:
        chosen = ChosenTarget(record.target_config(), record, f"recorded in {where}")
    elif caller_loaded:
        return ChosenTarget(TargetConfig(), None, "the target the caller loaded", known=False)
    else:
        chosen = ChosenTarget(TargetConfig(), None, "the default target: the drafter records none")
        if drafter:
            log.warning(
                "%s: %s records no target (trained before eyas recorded it); using the default target %r; give "
                "target=... if it was trained on another",
                command,
                drafter,
                TargetConfig().path,
            )
    log.info("%s: target %s (%s)", command, chosen.config.path, chosen.source)
    return chosen


def check_target(record: TargetRecord | None, info: TargetInfo, drafter: str | os.PathLike | None) -> None:
    """Refuse (:class:`TargetMismatchError`) a target whose hidden size, vocabulary or tokenizer is not those of
    the target the drafter was trained against, naming both."""
    if record is None:
        return
    diffs = [
        f"{what} {a} vs {b}"
        for what, a, b in (
            ("hidden size", record.hidden_size, info.hidden_size),
            ("vocabulary", record.vocab_size, info.vocab_size),
            ("tokenizer", record.tokenizer_hash, info.tokenizer_hash),
        )
        if a != b
    ]
    if diffs:
        raise TargetMismatchError(
            f"the drafter at {drafter} was trained against {record.describe()}, not {describe_info(info)} "
            f"({'; '.join(diffs)}): leave target= out to use the target it was trained against, or give that "
            "target"
        )


def check_tokenizer(record: TargetRecord | None, tokenizer_hash: str, name: str, drafter) -> None:
    """:func:`check_target` for a command that loads only the tokenizer (an engine-only evaluation)."""
    if record is not None and record.tokenizer_hash != tokenizer_hash:
        raise TargetMismatchError(
            f"the drafter at {drafter} was trained against {record.describe()}, not {name} (tokenizer "
            f"{record.tokenizer_hash} vs {tokenizer_hash}): leave target= out to use the target it was trained "
            "against, or give that target"
        )
