"""The restore point: the last finished step's training state, kept in host memory, so that a stop loses at most the
step in progress.

A step is finished when its metrics record is written (trainer/node.py ``end_step``). Right then trainer rank 0
copies what a checkpoint of that step holds (the policy under HF names, the optimizer's state, the prompt source's
state) into host buffers it reuses every step, and every checkpoint is written from that copy: the periodic ones
(``run.checkpoint_every``) and the *stop checkpoint*. Whatever stops the run afterwards (Slurm's time-limit warning,
SIGTERM from a preemption, ``scontrol requeue`` or ``scancel``, a peer that failed, a lost store) finds the last
finished step's state intact in the copy, even in the middle of the next step's optimizer steps, and writes it
before the process exits (``write``: a no-op when that step is on disk already). The resumed run continues after it
and keeps its metrics. Only a process that gets no chance to run (SIGKILL, OOM, a lost node) falls back to the
newest checkpoint on disk.

A sharded backend (FSDP, Megatron's distributed optimizer) keeps no rank's state whole: every rank copies its own
shards (``capture_shards``) and writes its own file of them (control/checkpoint.py ``write_shard``) wherever rank 0
writes the checkpoint (a due checkpoint, which every rank learns of at the step's end; any stop, on every rank);
rank 0 copies the policy and the prompt source's state, and completes the checkpoint once every rank's file is
there. The ranks copy step k one after the other around the step's last collective: a stop that finds rank 0 still
at step k - 1 and a peer at k cannot assemble either, and the resume starts from the newest checkpoint on disk.

Cost: one copy of the rank's training state per step, taken while the trainer waits for the next step's first
group, and that much host memory (bench/restore_point.py measures both; launch/host_memory.py plans it); the copy is
made with stop signals held back (control/lifetime.py ``stop_deferred``), so a stop never finds it half-written.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from rolloutpipe.control.checkpoint import Shard, missing_shards, save_checkpoint, shard_dir, write_shard
from rolloutpipe.control.lifetime import stop_deferred


class RestorePoint:
    """Trainer rank 0's copy of the last finished step; ``write`` may run on another thread than ``capture``."""

    def __init__(self, *, run_dir: Path, tokenizer, config_yaml: str, keep_last: int, on_disk: int, rank: int = 0,
                 world_size: int = 1, attempt: int = 0) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        """The job's restart count: the directory this attempt's ranks write their shards into."""
        self.tokenizer = tokenizer
        self.config_yaml = config_yaml
        self.keep_last = keep_last
        self.step: int | None = None
        """The step the copy holds (None: nothing finished since this process started)."""
        self.on_disk = on_disk
        """The newest step with a complete checkpoint (-1: none)."""
        self._model: torch.nn.Module | None = None
        self._model_state: dict[str, torch.Tensor] = {}
        self._optimizer_state: dict = {}
        self._source_state: dict = {}
        self._shards: dict[str, Shard] | None = None
        """This rank's copy of its shards of the training state (a sharded backend), else None."""
        self._shards_step: int | None = None
        self._shards_written: int | None = None
        self._lock = threading.Lock()

    def capture(self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                source_state: dict) -> None:
        """Rank 0: copy step ``step``'s state (the live model and optimizer, right after the step's metrics record;
        a sharded backend's optimizer gives only its param groups: its state is in ``capture_shards``)."""
        with stop_deferred(), self._lock, torch.no_grad():
            self.step = None  # until the copy is whole
            self._model = model
            self._model_state = _copy_into(self._model_state, model.state_dict())
            state = optimizer.state_dict()
            self._optimizer_state = {"state": _copy_into(self._optimizer_state.get("state", {}), state["state"]),
                                     "param_groups": _plain_copy(state["param_groups"])}
            self._source_state = _plain_copy(source_state)
            self.step = step

    def capture_shards(self, step: int, shards: dict[str, Shard]) -> None:
        """Every rank of a sharded backend: copy its shards of step ``step``'s training state."""
        with stop_deferred(), self._lock, torch.no_grad():
            self._shards_step = None
            old = self._shards or {}
            tensors = _copy_into({k: s.tensor for k, s in old.items()}, {k: s.tensor for k, s in shards.items()})
            self._shards = {k: Shard(tensors[k], s.offset, s.rows) for k, s in shards.items()}
            self._shards_step = step

    def write(self, *, span: Callable[[int], object] | None = None, wait_s: float = 0.0) -> int | None:
        """Write the copy as ``checkpoints/step=<k>`` unless that step is on disk already; returns the step written.
        With shards, every rank writes its file first; rank 0 then waits up to ``wait_s`` for the others' and
        writes nothing (None) if one is still missing: a later ``write`` may complete the step."""
        with self._lock:
            if self._shards is not None and self._shards_step is not None and self._shards_written != self._shards_step:
                write_shard(shard_dir(self.run_dir, self._shards_step, self.attempt), rank=self.rank,
                            world_size=self.world_size, shards=self._shards)
                self._shards_written = self._shards_step
            if self.rank != 0 or self.step is None or self.step <= self.on_disk:
                return None
            shards = None
            if self._shards is not None:
                shards = shard_dir(self.run_dir, self.step, self.attempt)
                if missing := missing_shards(shards, self.world_size, wait_s=wait_s):
                    if wait_s > 0:
                        print(f"[trainer rank 0] step {self.step}'s checkpoint is incomplete: trainer ranks {missing} "
                              f"wrote no shard within {wait_s:g}s", file=sys.stderr, flush=True)
                    return None
            with span(self.step) if span is not None else contextlib.nullcontext():
                save_checkpoint(run_dir=self.run_dir, step=self.step, model=self._model,
                                model_state=dict(self._model_state),  # save_pretrained empties the dict it gets
                                tokenizer=self.tokenizer, optimizer_state=self._optimizer_state,
                                source_state=self._source_state, config_yaml=self.config_yaml,
                                keep_last=self.keep_last, shards=shards)
            self.on_disk = self.step
            return self.step


def _copy_into(buffers: dict, source: dict) -> dict:
    """``source`` (a tree of dicts and tensors) copied into CPU ``buffers`` of the same shapes, reused from the last
    copy where they fit. Tensors that share storage in ``source`` (tied embeddings) share their copy too, as
    ``save_pretrained`` expects."""
    copies: dict[tuple, torch.Tensor] = {}

    def copy(old: object, value: object) -> object:
        if isinstance(value, dict):
            return {k: copy(old.get(k) if isinstance(old, dict) else None, v) for k, v in value.items()}
        if not isinstance(value, torch.Tensor):
            return value
        alias = (value.data_ptr(), value.shape, value.stride(), value.dtype)
        if alias in copies:
            return copies[alias]
        fits = (isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype
                and old.device.type == "cpu")
        copies[alias] = old.copy_(value) if fits else value.detach().to("cpu", copy=True)
        return copies[alias]

    return copy(buffers, source)


def _plain_copy(value: object) -> object:
    """A deep copy of JSON-like data (lists, dicts, numbers, strings)."""
    if isinstance(value, dict):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain_copy(v) for v in value)
    return value
