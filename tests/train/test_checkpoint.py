"""Checkpoints on disk: every file fsynced before the directory gets its final name, a complete checkpoint (and a
complete ``best/``) at every moment of a save, whatever step a crash interrupts; damaged checkpoints named with
the way out; ``tokens_seen`` counted and carried across a resume."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

import eyas.common
from eyas.train.checkpoint import (
    TrainerState,
    load_checkpoint,
    load_weights,
    save_best,
    save_checkpoint,
)
from eyas.train.losses import DistillationModel
from eyas.train.sources import ListSource
from eyas.train.trainer import fit
from tests.train.test_trainer import tiny_cfg, tiny_setup


class Crash(RuntimeError):
    pass


def _crash_at(monkeypatch, n: int) -> list[str]:
    """Make the ``n``-th file-system step of a save (rename, swap, tree removal) raise :class:`Crash`."""
    calls: list[str] = []

    def wrap(name, fn):
        def inner(*a, **kw):
            calls.append(name)
            if len(calls) == n:
                raise Crash(f"crash at step {n} ({name})")
            return fn(*a, **kw)

        return inner

    monkeypatch.setattr(os, "replace", wrap("replace", os.replace))
    monkeypatch.setattr(os, "rename", wrap("rename", os.rename))
    monkeypatch.setattr(shutil, "rmtree", wrap("rmtree", shutil.rmtree))
    exchange = getattr(eyas.common, "_exchange", None)
    monkeypatch.setattr(eyas.common, "_exchange", wrap("exchange", exchange), raising=False)
    return calls


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"fc.weight": torch.full((4, 12), value), "norm.weight": torch.full((4,), value)}


def test_save_best_leaves_a_complete_best_dir_whatever_step_crashes(tmp_path, monkeypatch):
    best = tmp_path / "best"
    save_best(best, _weights(1.0), {"h": 4}, {"step": 1})
    n = 1
    while True:
        with monkeypatch.context() as m:
            calls = _crash_at(m, n)
            try:
                save_best(best, _weights(2.0), {"h": 4}, {"step": 2})
                done = True
            except Crash:
                done = False
        got = load_weights(best)["fc.weight"][0, 0].item()  # best/ exists and is whole: old or new
        assert got in (1.0, 2.0), f"crash at step {n} of {calls}"
        assert (best / "metrics.json").exists() and (best / "drafter_config.json").exists()
        if done:
            assert got == 2.0
            break
        n += 1
        save_best(best, _weights(1.0), {"h": 4}, {"step": 1})
    assert n > 1  # the save has steps a crash can interrupt


def _stub_run(tmp_path):
    _target, drafter, _data = tiny_setup(num_samples=2)
    model = DistillationModel(drafter, [1.0])
    acc = SimpleNamespace(
        process_index=0,
        num_processes=1,
        is_main_process=True,
        distributed_type="NO",
        wait_for_everyone=lambda: None,
        unwrap_model=lambda m: m,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return drafter, model, acc, opt, sched


def _state(step: int, tokens: int = 0) -> TrainerState:
    return TrainerState(step=step, config_hash="h", identity={}, world_size=1, tokens_seen=tokens)


def test_resaving_a_step_keeps_a_complete_checkpoint_whatever_step_crashes(tmp_path, monkeypatch):
    drafter, model, acc, opt, sched = _stub_run(tmp_path)
    root = tmp_path / "checkpoints"
    kw = dict(accelerator=acc, model=model, optimizer=opt, scheduler=sched, drafter_config={}, keep_last=3)
    save_checkpoint(root, _state(2, tokens=10), data_state={"pos": 1}, **kw)
    n = 1
    while True:
        with monkeypatch.context() as m:
            _crash_at(m, n)
            try:
                save_checkpoint(root, _state(2, tokens=20), data_state={"pos": 1}, **kw)
                done = True
            except Crash:
                done = False
        step = root / "step_00000002"
        assert TrainerState.read(step).tokens_seen in (10, 20), f"crash at step {n}"
        assert load_weights(step) and (step / "optimizer.pt").exists() and (step / "data_rank0.pt").exists()
        if done:
            assert TrainerState.read(step).tokens_seen == 20
            break
        n += 1
    assert n > 1


def test_every_checkpoint_and_best_file_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    synced: set[str] = set()
    real_fsync = os.fsync

    def fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target, drafter, data = tiny_setup(num_samples=4)
    fit(
        tiny_cfg(tmp_path, max_steps=2, save_every=2),
        drafter,
        ListSource(data.train, shuffle=False),
        data.eval,
        head=target.head,
        target_info=target.info,
    )
    for final, tmp in (
        (tmp_path / "checkpoints" / "step_00000002", tmp_path / "checkpoints" / ".step_00000002.tmp"),
        (tmp_path / "best", tmp_path / ".best.tmp"),
    ):
        names = sorted(p.name for p in final.iterdir())
        assert "drafter.safetensors" in names
        unsynced = [x for x in names if str(tmp / x) not in synced]
        assert not unsynced, f"{final.name}: written without fsync: {unsynced}"
        assert str(tmp) in synced  # the directory itself, before its rename
    assert str(tmp_path / "checkpoints") in synced


def test_tokens_seen_counts_every_token_and_survives_resume(tmp_path):
    target, drafter, data = tiny_setup(num_samples=4)
    per_batch = [int(b.num_tokens) for b in data.train]
    res = fit(
        tiny_cfg(tmp_path, max_steps=3, save_every=1),
        drafter,
        ListSource(data.train, shuffle=False),
        None,
        head=target.head,
        target_info=target.info,
    )
    states = [TrainerState.read(tmp_path / "checkpoints" / f"step_{s:08d}") for s in (2, 3)]
    n = len(per_batch)
    assert states[0].tokens_seen == sum(per_batch[i % n] for i in range(2))
    assert states[1].tokens_seen == sum(per_batch[i % n] for i in range(3)) == res.tokens
    # resumed from step 2: the count continues from the checkpoint's
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000003")
    target, drafter, data = tiny_setup(num_samples=4)
    again = fit(
        tiny_cfg(tmp_path, max_steps=3, save_every=1),
        drafter,
        ListSource(data.train, shuffle=False),
        None,
        head=target.head,
        target_info=target.info,
    )
    assert again.resumed_from is not None and again.steps_this_run == 1
    assert TrainerState.read(tmp_path / "checkpoints" / "step_00000003").tokens_seen == states[1].tokens_seen


@pytest.mark.parametrize("damaged", ["drafter.safetensors", "optimizer.pt", "scheduler.pt", "data_rank0.pt"])
def test_a_truncated_checkpoint_file_is_named_with_the_way_out(tmp_path, damaged):
    drafter, model, acc, opt, sched = _stub_run(tmp_path)
    root = tmp_path / "checkpoints"
    kw = dict(accelerator=acc, model=model, optimizer=opt, scheduler=sched)
    path = save_checkpoint(root, _state(2), data_state={"pos": 1}, drafter_config={}, keep_last=3, **kw)
    f = path / damaged
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(Exception) as e:
        load_checkpoint(path, config_hash="h", identity={}, **kw)
    msg = str(e.value)
    assert str(path) in msg and damaged in msg
    assert "train.resume=never" in msg and "train.resume=" in msg


def test_without_directory_swaps_an_interrupted_resave_is_recovered(tmp_path, monkeypatch):
    """On filesystems without RENAME_EXCHANGE (NFS) a re-save renames the old step aside first; a crash between
    the two renames is undone when the checkpoints are next listed."""
    from eyas.train.checkpoint import latest_checkpoint

    drafter, model, acc, opt, sched = _stub_run(tmp_path)
    root = tmp_path / "checkpoints"
    kw = dict(accelerator=acc, model=model, optimizer=opt, scheduler=sched, drafter_config={}, keep_last=3)
    save_checkpoint(root, _state(2, tokens=10), data_state={"pos": 1}, **kw)
    monkeypatch.setattr(eyas.common, "_exchange", lambda a, b: False)
    with monkeypatch.context() as m:
        # steps: trainer_state.json's rename, the swap (refused), the old step aside, the new one in place
        calls = _crash_at(m, 4)
        with pytest.raises(Crash):
            save_checkpoint(root, _state(2, tokens=20), data_state={"pos": 1}, **kw)
    assert calls == ["replace", "exchange", "replace", "replace"]
    assert not (root / "step_00000002").exists()
    assert latest_checkpoint(root) == root / "step_00000002"
    assert TrainerState.read(root / "step_00000002").tokens_seen == 10
    save_checkpoint(root, _state(2, tokens=20), data_state={"pos": 1}, **kw)
    assert TrainerState.read(root / "step_00000002").tokens_seen == 20


def test_a_resume_under_another_best_metric_starts_a_new_best(tmp_path):
    """best_value is a value of one metric: compared with another metric's it would keep best/ for no reason (a
    loss of ~4 is never below a tau_chain of ~1)."""
    target, drafter, data = tiny_setup(num_samples=4)
    kw = dict(max_steps=4, save_every=2, eval_every=2, best_metric="tau_chain")
    fit(tiny_cfg(tmp_path, **kw), drafter, ListSource(data.train), data.train, head=target.head)
    state = TrainerState.read(tmp_path / "checkpoints" / "step_00000002")
    assert state.best_metric == "tau_chain" and state.best_step == 2
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")
    target, drafter, data = tiny_setup(num_samples=4)
    kw["best_metric"] = "loss"
    again = fit(tiny_cfg(tmp_path, **kw), drafter, ListSource(data.train), data.train, head=target.head)
    assert again.resumed_from is not None and again.best_step == 4
    state = TrainerState.read(tmp_path / "checkpoints" / "step_00000004")
    assert state.best_metric == "loss" and state.best_value == pytest.approx(again.final_eval["loss"])
