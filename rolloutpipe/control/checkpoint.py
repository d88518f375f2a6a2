"""Step-atomic checkpoints: what a run needs to continue after step k exactly as if it had never stopped.

    checkpoints/step=<k>/
        model.safetensors, config.json, tokenizer files   policy_version k + 1, HF layout
        optimizer.safetensors                              AdamW moments and step counts, by parameter index
        optimizer/rank-<r>-of-<N>.safetensors              or, from a sharded backend (FSDP, Megatron's distributed
                                                           optimizer), each rank's rows of its training state
                                                           instead: float32 master weights, AdamW moments and
                                                           step counts ("<index>.<name>")
        state.json                                         step, policy_version, the prompt source's cursor
                                                           and returned prompts, optimizer hyper-parameters,
                                                           the config it was written with

Trainer rank 0 writes everything into ``step=<k>.tmp/``, fsyncs, and renames it to ``step=<k>/``: a
directory without the ``.tmp`` suffix is complete, whatever happened during the write. Resuming from
step k redoes step k + 1 from its start; because every sample is seeded by its id, the redone step
generates the same samples, so a resumed run ends with the weights of an uninterrupted one. Nothing
here is read from the network, and no pickle is used.

Sharded training state. No rank holds the whole of it: each writes its own file (``write_shard``) into
``step=<k>.shards-<attempt>/``, on its own, from its own restore point (no collective, so a stop can write it
while a peer is mid-step), and rank 0 moves the directory into ``step=<k>.tmp/optimizer`` once all N files are
there (``missing_shards``), before the rename. A stop that cannot collect them all (a rank died) leaves the step
unwritten: the resume starts from the newest complete checkpoint. Each file names the rows of dimension 0 it holds
of each tensor it holds a part of (FSDP2's ``Shard(0)``; Megatron's distributed optimizer: a range of the flattened
parameter, and nothing of some), so ``ShardedState`` reads back any rows: a resume onto another number of ranks, or
onto an unsharded backend, takes the rows its own layout needs. (torch.distributed.checkpoint plans a save as a
collective of every rank, which a stop with a rank gone cannot make.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

_COMPLETE = re.compile(r"^step=(\d+)$")


@dataclass(kw_only=True, slots=True)
class Checkpoint:
    directory: Path
    step: int
    """The last step whose update is in the checkpoint; a resumed run starts at step + 1."""
    source_state: dict

    @property
    def policy_version(self) -> int:
        return self.step + 1

    @property
    def weights_path(self) -> Path:
        return self.directory / "model.safetensors"

    @property
    def sharded(self) -> bool:
        """Whether its training state is in per-rank files (``optimizer/``)."""
        return (self.directory / "optimizer").is_dir()


@dataclass(frozen=True, slots=True)
class Shard:
    """A rank's part of one tensor of the training state: rows [offset, offset + len) of a tensor of ``rows`` rows
    (sharded on dimension 0), or the whole tensor (``offset`` None: a step count every rank holds)."""

    tensor: torch.Tensor
    offset: int | None = None
    rows: int | None = None


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    steps = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("step=*") if (m := _COMPLETE.match(p.name))]
    if not steps:
        return None
    directory = run_dir / "checkpoints" / f"step={max(steps)}"
    state = json.loads((directory / "state.json").read_text())
    return Checkpoint(directory=directory, step=state["step"], source_state=state["source"])


def save_checkpoint(*, run_dir: Path, step: int, model: torch.nn.Module, model_state: dict[str, torch.Tensor],
                    tokenizer, optimizer_state: dict, source_state: dict, config_yaml: str, keep_last: int,
                    shards: Path | None = None) -> Path:
    """Write step ``step``'s checkpoint from ``model_state`` (HF names; ``model`` gives the config and the layout) and
    ``optimizer_state`` (an optimizer's ``state_dict``): trainer/restore.py's copy, so the live model may move on.
    ``shards``: the complete directory of every rank's ``write_shard`` file, moved in as ``optimizer/`` (then
    ``optimizer_state`` holds only the param groups)."""
    from rolloutpipe.model import save_hf_checkpoint

    final = run_dir / "checkpoints" / f"step={step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(model, tokenizer, tmp, state_dict=model_state)
    if shards is None:
        save_file({f"{index}.{name}": value.contiguous() for index, moments in optimizer_state["state"].items()
                   for name, value in moments.items()}, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({
        "step": step, "policy_version": step + 1, "source": source_state,
        "optimizer_param_groups": optimizer_state["param_groups"], "config": config_yaml,
    }))
    for path in tmp.iterdir():
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    if shards is not None:  # (each file was fsynced by its writer)
        shards.rename(tmp / "optimizer")
        _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(final.parent)
    for old in sorted(int(m.group(1)) for p in final.parent.glob("step=*")
                       if (m := _COMPLETE.match(p.name)))[:-keep_last]:
        shutil.rmtree(final.parent / f"step={old}", ignore_errors=True)
    for stale in final.parent.glob("step=*.shards-*"):  # shards of a step no stop could complete
        if int(stale.name.split("=")[1].split(".")[0]) <= step:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def shard_dir(run_dir: Path, step: int, attempt: int) -> Path:
    """Where the ranks of attempt ``attempt`` write their files of step ``step`` (one attempt never mixes with
    another's)."""
    return run_dir / "checkpoints" / f"step={step}.shards-{attempt}"


def save_final(model: torch.nn.Module, tokenizer, run_dir: Path) -> Path:
    """The final policy as ``checkpoints/final``, HF layout, written as a checkpoint is: into ``final.tmp/``, synced,
    renamed when complete. (The last step's own checkpoint is on disk before it: trainer/node.py, ``finish``.)"""
    from rolloutpipe.model import save_hf_checkpoint

    final = run_dir / "checkpoints" / "final"
    tmp = final.with_name("final.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(model, tokenizer, tmp)
    for path in tmp.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(final.parent)
    return final


def shard_file(rank: int, world_size: int) -> str:
    return f"rank-{rank}-of-{world_size}.safetensors"


def write_shard(directory: Path, *, rank: int, world_size: int, shards: dict[str, Shard]) -> None:
    """This rank's file of the sharded training state, written atomically (a tmp file, fsync, rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_file(rank, world_size)
    tmp = path.with_suffix(".tmp")
    rows = {k: [s.offset, s.rows] for k, s in shards.items()}
    save_file({k: s.tensor.contiguous() for k, s in shards.items()}, str(tmp), metadata={"rows": json.dumps(rows)})
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    tmp.rename(path)
    _fsync_dir(directory)


def missing_shards(directory: Path, world_size: int, *, wait_s: float) -> list[int]:
    """The ranks whose file is not in ``directory`` after waiting up to ``wait_s`` seconds for them."""
    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r in range(world_size) if not (directory / shard_file(r, world_size)).exists()]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.1)


class ShardedState:
    """A checkpoint's ``optimizer/`` files read back by rows, whichever files hold them; a context manager."""

    def __init__(self, directory: Path) -> None:
        paths = sorted(directory.glob("rank-*-of-*.safetensors"))
        sizes = {int(p.name.split("-of-")[1].split(".")[0]) for p in paths}
        if len(sizes) != 1 or len(paths) != sizes.pop():
            raise ValueError(f"{directory}: a sharded checkpoint needs rank-<r>-of-<N>.safetensors for every r < N; "
                             f"found {[p.name for p in paths]}")
        self._stack = contextlib.ExitStack()
        self._files = [self._stack.enter_context(safe_open(str(p), "pt")) for p in paths]
        self._rows = [json.loads(f.metadata()["rows"]) for f in self._files]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        """Every tensor some file holds rows of (a rank may hold none of one: Megatron's distributed optimizer)."""
        return list(dict.fromkeys(key for rows in self._rows for key in rows))

    def whole(self, key: str) -> bool:
        """Whether every rank holds all of ``key`` (a step count) rather than rows of it."""
        return self._holding(key)[1][key][0] is None

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of tensor ``key`` (all of them by default; a whole tensor ignores the range)."""
        first, meta = self._holding(key)
        offset, total = meta[key]
        if offset is None:
            return first.get_tensor(key)
        start, stop = start or 0, total if stop is None else stop
        parts = []
        for f, rows in zip(self._files, self._rows):
            if key not in rows:
                continue
            offset = rows[key][0]
            piece = f.get_slice(key)
            lo, hi = max(start, offset), min(stop, offset + piece.get_shape()[0])
            if lo < hi:
                parts.append(piece[lo - offset:hi - offset])
        result = torch.cat(parts) if parts else first.get_slice(key)[0:0]
        if result.shape[0] != stop - start:
            raise ValueError(f"sharded checkpoint: rows {start}..{stop} of {key} are not all in its files")
        return result

    def _holding(self, key: str) -> tuple:
        """The first file that holds rows of ``key``, and its rows metadata."""
        return next((f, rows) for f, rows in zip(self._files, self._rows) if key in rows)


def optimizer_groups(checkpoint: Checkpoint) -> list[dict]:
    return json.loads((checkpoint.directory / "state.json").read_text())["optimizer_param_groups"]


def load_optimizer(optimizer: torch.optim.Optimizer, checkpoint: Checkpoint) -> None:
    """The checkpoint's whole AdamW state into ``optimizer`` (a sharded checkpoint's rows assembled; its master
    weights are not optimizer state: ``load_model`` took the weights from model.safetensors)."""
    if checkpoint.sharded:
        with ShardedState(checkpoint.directory / "optimizer") as shards:
            tensors = {k: shards.rows(k) for k in shards.names() if not k.endswith(".param")}
    else:
        tensors = load_file(str(checkpoint.directory / "optimizer.safetensors"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer_groups(checkpoint)})


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
