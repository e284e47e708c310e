"""vLLM's hidden-states connector, made to run on vLLM's CPU build (imported by the vLLM server, not by eyas).

vLLM 0.32 writes a target's aux hidden states while it serves with ``--speculative-config
'{"method": "extract_hidden_states", ...}'`` and ``ExampleHiddenStatesConnector``. That connector's save path is
CUDA-only: ``_submit_async_write`` copies the cached states device-to-host on a CUDA stream into pinned memory
(``torch.empty_like(..., pin_memory=True)``), which on the CPU build fails with "pin_memory=True requires a CUDA or
other accelerator backend" after the first request, and the engine dies. On a CPU KV cache the states are already
in host memory, so this subclass gathers them and hands the write to the same thread pool, with no stream, event or
pinned buffer; on CUDA it defers to vLLM's own path. Use it with ``--kv-transfer-config '{"kv_connector":
"CPUHiddenStatesConnector", "kv_connector_module_path": "vllm_cpu_hidden_states", "kv_role": "kv_producer",
"kv_connector_extra_config": {"shared_storage_path": "<dir>"}}'`` and this file's folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the write thread waits on: a CPU copy is complete when it returns."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()  # [T, n_aux, H]
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
