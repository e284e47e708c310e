"""Exports are durable: every file and the directory are fsynced before the rename into place; a replace cut between
its two renames (where the filesystem cannot swap directories) is undone by the next export, and named by a loader
meanwhile; a full disk is named with the path, the earlier export untouched."""

from __future__ import annotations

import errno
import os

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file

import eyas.common
from eyas.serving.export import ExportConfig, export
from eyas.serving.export_format import WEIGHTS, ExportError
from eyas.serving.load import DrafterLoadError, load_drafter, random_drafter

from ..conftest import make_tiny_target


def _drafter(target, seed: int):
    torch.manual_seed(seed)
    return random_drafter(target, draft_vocab_size=64, seed=seed)


def _fc(d) -> torch.Tensor:
    return load_file(str(d / WEIGHTS))["fc.weight"]


def test_every_export_file_and_the_directory_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    target = make_tiny_target()
    out = tmp_path / "export"
    export(_drafter(target, 0), target, out)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    export(_drafter(target, 1), target, out, config=ExportConfig(overwrite=True))
    tmp = tmp_path / f".export.tmp-{os.getpid()}"
    names = sorted(p.name for p in out.iterdir())
    unsynced = [n for n in names if str(tmp / n) not in synced]
    assert not unsynced, f"written without fsync: {unsynced}"
    assert str(tmp) in synced, "the export directory itself is fsynced before its rename"
    assert synced[-1] == str(tmp_path), "the parent is fsynced after the rename"


def _crash_second_rename(monkeypatch, out):
    """Make the rename of the new export onto ``out`` fail, on a filesystem that cannot swap directories."""

    class Crash(RuntimeError):
        pass

    monkeypatch.setattr(eyas.common, "_exchange", lambda a, b: False, raising=False)
    for name in ("replace", "rename"):
        real = getattr(os, name)

        def wrapped(src, dst, *a, _real=real, **kw):
            if str(dst) == str(out) and ".tmp" in str(src):
                raise Crash(f"killed between the two renames ({src} -> {dst})")
            return _real(src, dst, *a, **kw)

        monkeypatch.setattr(os, name, wrapped)
    return Crash


def test_a_replace_cut_between_its_renames_is_named_then_restored(tmp_path, monkeypatch):
    target = make_tiny_target()
    out = tmp_path / "export"
    export(_drafter(target, 0), target, out)
    first = _fc(out)
    with monkeypatch.context() as m:
        crash = _crash_second_rename(m, out)
        with pytest.raises(crash):
            export(_drafter(target, 1), target, out, config=ExportConfig(overwrite=True))
    assert not out.exists()  # the state a kill at that moment leaves
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".export.old")]
    assert len(aside) == 1
    with pytest.raises(DrafterLoadError) as e:
        load_drafter(str(out), target)
    assert str(aside[0]) in str(e.value) and "interrupted" in str(e.value)
    # the next export to that directory puts the previous one back first (here it then refuses to overwrite it)
    with pytest.raises(ExportError, match="exists and is not empty"):
        export(_drafter(target, 2), target, out)
    assert torch.equal(_fc(out), first) and not aside[0].exists()
    export(_drafter(target, 2), target, out, config=ExportConfig(overwrite=True))
    assert not torch.equal(_fc(out), first)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_a_full_disk_is_named_with_the_path_and_the_earlier_export_kept(tmp_path, monkeypatch):
    target = make_tiny_target()
    out = tmp_path / "export"
    export(_drafter(target, 0), target, out)
    first = _fc(out)

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ExportError) as e:
        export(_drafter(target, 1), target, out, config=ExportConfig(overwrite=True))
    msg = str(e.value)
    assert f"export.out_dir={out}" in msg and "No space left on device" in msg and "\n" not in msg
    assert torch.equal(_fc(out), first)
    assert [p.name for p in tmp_path.iterdir()] == ["export"], "no temporary directory left behind"
