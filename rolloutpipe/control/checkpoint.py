"""Step-atomic checkpoints: what a run needs to continue after step k exactly as if it had never stopped.

    checkpoints/step=<k>/
        model.safetensors, config.json, tokenizer files   policy_version k + 1, HF layout
        optimizer.safetensors                              AdamW moments and step counts, by parameter index
        state.json                                         step, policy_version, the prompt source's cursor
                                                           and returned prompts, optimizer hyper-parameters,
                                                           the config it was written with

Trainer rank 0 writes everything into ``step=<k>.tmp/``, fsyncs, and renames it to ``step=<k>/``: a
directory without the ``.tmp`` suffix is complete, whatever happened during the write. Resuming from
step k redoes step k + 1 from its start; because every sample is seeded by its id, the redone step
generates the same samples, so a resumed run ends with the weights of an uninterrupted one. Nothing
here is read from the network, and no pickle is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
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


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    steps = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("step=*") if (m := _COMPLETE.match(p.name))]
    if not steps:
        return None
    directory = run_dir / "checkpoints" / f"step={max(steps)}"
    state = json.loads((directory / "state.json").read_text())
    return Checkpoint(directory=directory, step=state["step"], source_state=state["source"])


def save_checkpoint(*, run_dir: Path, step: int, model: torch.nn.Module, model_state: dict[str, torch.Tensor],
                    tokenizer, optimizer_state: dict, source_state: dict, config_yaml: str, keep_last: int) -> Path:
    """Write step ``step``'s checkpoint from ``model_state`` (HF names; ``model`` gives the config and the layout) and
    ``optimizer_state`` (an optimizer's ``state_dict``): trainer/restore.py's copy, so the live model may move on."""
    from rolloutpipe.model import save_hf_checkpoint

    final = run_dir / "checkpoints" / f"step={step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(model, tokenizer, tmp, state_dict=model_state)
    save_file({f"{index}.{name}": value.contiguous() for index, moments in optimizer_state["state"].items()
               for name, value in moments.items()}, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({
        "step": step, "policy_version": step + 1, "source": source_state,
        "optimizer_param_groups": optimizer_state["param_groups"], "config": config_yaml,
    }))
    for path in tmp.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(final.parent)
    for old in sorted((int(m.group(1)) for p in final.parent.glob("step=*")
                       if (m := _COMPLETE.match(p.name))))[:-keep_last]:
        shutil.rmtree(final.parent / f"step={old}", ignore_errors=True)
    return final


def load_optimizer(optimizer: torch.optim.Optimizer, checkpoint: Checkpoint) -> None:
    tensors = load_file(str(checkpoint.directory / "optimizer.safetensors"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    groups = json.loads((checkpoint.directory / "state.json").read_text())["optimizer_param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
