"""Nothing a checkpoint holds can run code on resume: every ``.pt`` file is read with ``weights_only=True``, so a
pickled object put in any of them is refused unread, naming the checkpoint and the file; the RNG state is stored as
tensors and numbers and still restores every generator exactly."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eyas.train.checkpoint import (
    DamagedCheckpointError,
    TrainerState,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from eyas.train.losses import DistillationModel

from .test_trainer import tiny_setup


class MarkerPayload:
    """Unpickling it creates ``path`` (what a real payload would do with a shell command)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mknod, (self.path,))


def _stub_run():
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
    return dict(accelerator=acc, model=model, optimizer=opt, scheduler=sched)


def _save(tmp_path, kw):
    state = TrainerState(step=2, config_hash="h", identity={}, world_size=1)
    return save_checkpoint(
        tmp_path / "checkpoints", state, data_state={"pos": 1}, drafter_config={}, keep_last=3, **kw
    )


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_rank0.pt", "data_rank0.pt"])
def test_a_pickled_payload_in_a_checkpoint_file_is_refused_unread(tmp_path, name):
    kw = _stub_run()
    path = _save(tmp_path, kw)
    assert load_checkpoint(path, config_hash="h", identity={}, **kw).data_state == {"pos": 1}
    marker = tmp_path / "payload-ran"
    torch.save({"state": MarkerPayload(str(marker))}, path / name)
    with pytest.raises(DamagedCheckpointError) as e:
        load_checkpoint(path, config_hash="h", identity={}, **kw)
    assert not marker.exists(), "loading the checkpoint ran the pickled payload"
    msg = str(e.value)
    assert str(path) in msg and name in msg and "pickled object" in msg and "mknod" in msg
    assert "train.resume=never" in msg and "weights_only=False" not in msg


def test_the_rng_state_survives_a_weights_only_file_exactly(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # numpy holds a cached gaussian
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == want


def test_an_rng_file_written_before_the_tensor_format_still_resumes(tmp_path):
    """Checkpoints written by earlier eyas hold numpy's state as an ndarray tuple: the numpy array constructors
    alone are allowed for that file, so those runs resume."""
    kw = _stub_run()
    path = _save(tmp_path, kw)
    np.random.seed(5)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, path / "rng_rank0.pt")
    want = np.random.standard_normal(2).tolist()
    np.random.seed(0)
    load_checkpoint(path, config_hash="h", identity={}, **kw)
    assert np.random.standard_normal(2).tolist() == want


def _deepspeed_run(tmp_path, optim_state):
    """A checkpoint whose ``ds/`` holds ``optim_state`` as DeepSpeed's optimizer file, and a run under DeepSpeed whose
    engine (which unpickles ds/ with weights_only=False) records in ``kw["asked"]`` that it was asked to load it."""
    from accelerate.utils import DistributedType

    kw = _stub_run()
    path = _save(tmp_path, kw)
    (path / "optimizer.pt").unlink()
    ds = path / "ds" / "ds"
    ds.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}}, ds / "mp_rank_00_model_states.pt")
    torch.save(optim_state, ds / "zero_pp_rank_0_mp_rank_00_optim_states.pt")

    asked: list[str] = []

    def load_checkpoint(ds_dir, **k):
        asked.append(ds_dir)
        return None, None  # "nothing loaded": the run stops there, named

    kw["accelerator"].distributed_type = DistributedType.DEEPSPEED
    kw["model"].load_checkpoint = load_checkpoint
    return path, kw, asked


def test_a_pickled_payload_in_a_deepspeed_file_is_refused_before_deepspeed_reads_it(tmp_path):
    marker = tmp_path / "payload-ran"
    path, kw, asked = _deepspeed_run(tmp_path, {"optimizer_state_dict": {"x": MarkerPayload(str(marker))}})
    with pytest.raises(DamagedCheckpointError) as e:
        load_checkpoint(path, config_hash="h", identity={}, **kw)
    assert not asked and not marker.exists()
    msg = str(e.value)
    assert "ds/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt" in msg and "mknod" in msg and str(path) in msg


def test_deepspeeds_own_state_classes_pass_the_scan(tmp_path):
    """What a ZeRO-2 optimizer file pickles (its stage enum, loss scaler and fragment addresses) goes to DeepSpeed."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(1.0),
            "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [{"w": fragment_address(numel=2, start=0)}],
        }
    }
    path, kw, asked = _deepspeed_run(tmp_path, state)
    with pytest.raises(DamagedCheckpointError, match="could not be loaded by DeepSpeed"):
        load_checkpoint(path, config_hash="h", identity={}, **kw)
    assert asked == [str(path / "ds")]
