"""train.optimizer=muon: the combined optimizer steps as Muon + AdamW do apart (with its own ``train.muon_lr``),
follows the LR schedule (cosine or WSD), round-trips its state, and a killed-and-resumed Muon run equals an
uninterrupted one."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from eyas.train.checkpoint import load_weights
from eyas.train.config import TrainConfig
from eyas.train.optim import MuonWithAdamW, build_optimizer, resolve_optimizer
from eyas.train.sources import ListSource
from eyas.train.trainer import cosine_with_warmup, fit, lr_schedule, wsd_with_warmup
from tests.train.test_trainer import tiny_cfg, tiny_setup


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = torch.nn.Linear(12, 8, bias=True)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)

    def forward(self, x):
        return self.lm_head(self.norm(self.fc(x)))


def _grads(net: Net, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    net.zero_grad()
    net(torch.randn(5, 12, generator=g)).square().mean().backward()


KW = dict(lr=2e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=False)


@pytest.mark.parametrize("muon_lr", [None, 7e-2])
def test_muon_with_adamw_steps_as_the_two_optimizers_apart(muon_lr):
    a, b = Net(), Net()
    opt = build_optimizer(a, "muon", muon_lr=muon_lr, **KW)
    assert isinstance(opt, MuonWithAdamW)
    muon = torch.optim.Muon(
        [b.fc.weight], lr=muon_lr or 2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW(
        [{"params": [b.lm_head.weight], "weight_decay": 0.1}, {"params": [b.fc.bias, *b.norm.parameters()]}],
        lr=2e-2,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    for step in range(3):
        _grads(a, step)
        _grads(b, step)
        opt.step()
        muon.step()
        adamw.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    assert not torch.equal(a.fc.weight, Net().fc.weight)


def test_the_lr_schedule_reaches_both_inner_optimizers_and_state_round_trips():
    a = Net()
    opt = build_optimizer(a, "muon", **KW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s + 1))
    for step in range(2):
        _grads(a, step)
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [2e-2 * 0.125] * 3

    b = copy.deepcopy(a)
    reloaded = build_optimizer(b, "muon", **KW)
    reloaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert reloaded.muon.param_groups[0] is reloaded.param_groups[0]
    assert reloaded.adamw.state is reloaded.state and len(reloaded.state) == 5
    for step in (7, 8):
        _grads(a, step)
        _grads(b, step)
        opt.step()
        reloaded.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_the_schedule_scales_each_part_from_its_own_lr():
    net = Net()
    opt = build_optimizer(net, "muon", muon_lr=8e-2, **KW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s + 1))
    _grads(net, 0)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [8e-2 * 0.25, 2e-2 * 0.25, 2e-2 * 0.25]


def test_wsd_warms_up_holds_then_decays_linearly_over_its_last_fraction():
    f = wsd_with_warmup(warmup=2, total=10, min_ratio=0.1, decay_ratio=0.4)
    got = [round(f(s), 6) for s in range(11)]
    # warm-up steps 0-1, lr held for steps 2-5, linear decay over the last 4 steps (6-9) towards 0.1 at step 10
    assert got == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1]
    assert wsd_with_warmup(0, 10, 0.0, 1.0)(0) == 1.0 and wsd_with_warmup(0, 10, 0.0, 1.0)(5) == 0.5
    # a decay longer than what the warm-up leaves starts after the warm-up
    assert wsd_with_warmup(8, 10, 0.0, 0.5)(8) == 1.0
    cfg = TrainConfig(schedule="wsd", decay_ratio=0.4, warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_schedule(cfg, 10)(s) for s in range(11)] == [f(s) for s in range(11)]
    cos = cosine_with_warmup(2, 10, 0.0)
    assert [lr_schedule(TrainConfig(warmup_steps=2), 10)(s) for s in range(11)] == [cos(s) for s in range(11)]


def test_muon_lr_and_schedule_are_checked_and_in_the_identity_only_when_they_act(tmp_path):
    with pytest.raises(ValueError, match="train.schedule must be one of"):
        TrainConfig(schedule="linear")
    with pytest.raises(ValueError, match="train.decay_ratio"):
        TrainConfig(schedule="wsd", decay_ratio=0.0)
    with pytest.raises(ValueError, match="train.muon_lr must be positive"):
        TrainConfig(muon_lr=0.0)
    with pytest.raises(ValueError, match="has no Muon part"):
        TrainConfig(optimizer="adamw", muon_lr=1e-3)
    base = TrainConfig().identity("muon")
    assert "muon_lr" not in base and "schedule" not in base and "decay_ratio" not in base  # hashes kept
    assert TrainConfig(muon_lr=4e-3).identity("muon")["muon_lr"] == 4e-3
    assert TrainConfig(muon_lr=4e-3).identity()["muon_lr"] == 4e-3  # auto, unresolved: kept
    assert "muon_lr" not in TrainConfig(muon_lr=4e-3).identity("adamw")  # auto under DeepSpeed: unused
    wsd = TrainConfig(schedule="wsd").identity("muon")
    assert (wsd["schedule"], wsd["decay_ratio"]) == ("wsd", 0.2)


def test_auto_is_muon_without_deepspeed_and_adamw_under_it_and_the_identity_records_which(tmp_path):
    with pytest.raises(ValueError, match="train.optimizer must be one of"):
        TrainConfig(output_dir=str(tmp_path), optimizer="sgd")
    assert resolve_optimizer("auto", deepspeed=False) == "muon"
    assert resolve_optimizer("auto", deepspeed=True) == "adamw"
    assert resolve_optimizer("adamw", deepspeed=False) == "adamw"
    with pytest.raises(ValueError, match="plain data parallel only"):
        resolve_optimizer("muon", deepspeed=True)
    assert TrainConfig().identity("muon")["optimizer"] == "muon"
    assert "optimizer" not in TrainConfig().identity("adamw")  # runs from before the option keep their hash
    assert "optimizer" not in TrainConfig(optimizer="adamw").identity()


@pytest.mark.parametrize("extra", [{}, {"muon_lr": 3e-2, "schedule": "wsd", "decay_ratio": 0.5}])
def test_a_resumed_muon_run_equals_an_uninterrupted_one(tmp_path, extra):
    def run(out):
        target, drafter, data = tiny_setup()
        return fit(
            tiny_cfg(out, optimizer="muon", keep_last=4, **extra),
            drafter,
            ListSource(data.train, shuffle=False),
            data.eval,
            head=target.head,
            target_info=target.info,
        )

    straight = run(tmp_path / "straight")
    # a run that stopped after step 4: the straight run's directory up to its step-4 checkpoint
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "straight", cut)
    for step in (6, 8):
        shutil.rmtree(cut / "checkpoints" / f"step_{step:08d}")
    resumed = run(cut)
    assert resumed.resumed_from is not None and resumed.steps_this_run == 4
    a, b = load_weights(resumed.last_checkpoint), load_weights(straight.last_checkpoint)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    first = load_weights(tmp_path / "straight" / "checkpoints" / "step_00000002")
    assert not torch.equal(first["fc.weight"], b["fc.weight"])
