"""Megatron's optimizer for the trainer: replicated, or its DistributedOptimizer
(``trainer.megatron.distributed_optimizer``).

Replicated (the CPU path, and ``distributed_optimizer=false``): every data-parallel rank keeps the whole optimizer
state; DDP all-reduces the gradients. Distributed: Megatron's DistributedOptimizer keeps each rank's 1/N of the
float32 master weights and of Adam's moments; DDP reduce-scatters the gradients into the shards and, after the step,
all-gathers the updated parameters. The update is the same: only the order of the gradients' additions differs.
Megatron's distributed optimizer wraps CUDA half/bfloat16/float32 tensors only: it refuses float64, and on the CPU it
runs under cpu.py's redirection (gloo), which is how the tests run it.

No overlap. ``overlap_grad_reduce`` / ``overlap_param_gather`` stay off: Megatron starts a bucket's reduce when its
last gradient of the *last* micro-batch is ready, and CGP does not know which micro-batch is last before its backward
(a training batch is complete only when its last group arrives); the batch's one reduce runs in finalize_model_grads.

Checkpoints (control/checkpoint.py keeps ``{"state": {index: {name: tensor}}, "param_groups": [...]}``). Replicated:
Megatron's own optimizer state dict, as before. Distributed: ``DistributedParameterState`` speaks the same layout,
one entry per gradient buffer, each holding the buffer's master weights and moments, gathered whole on trainer rank 0
(Megatron's ``get_parameter_state_dp_zero``: a gather over the data-parallel group, which the other ranks join inside
``writer_reads``), and the hyper-parameters with the data-parallel size they were written at. A resumed run scatters
them back to the shards (``load_parameter_state_from_dp_zero``). Resuming on another data-parallel size, or with the
other optimizer, is refused with the key to set: the buffers' padding depends on the layout, so nothing would check
that a shard landed where it belongs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from rolloutpipe.trainer.config import TrainerConfig
from rolloutpipe.trainer.megatron.cpu import cuda_calls_on_cpu
from rolloutpipe.trainer.torch_backend import MASTER

FORMAT = "megatron_distributed_optimizer"
"""Marks a checkpoint's optimizer state as written by ``DistributedParameterState``."""


def resolve_distributed_optimizer(requested: bool | None, *, cuda: bool, dtype: str) -> bool:
    """``trainer.megatron.distributed_optimizer``: null means on a GPU (float64 excepted, which Megatron refuses);
    an explicit true runs on the CPU too (cpu.py redirects its CUDA calls: what CI tests it with), and with float64
    raises with the key to set. ``dtype`` is model.dtype's name (``"bfloat16"``)."""
    if requested is None:
        return cuda and dtype != "float64"
    if requested and dtype == "float64":
        raise ValueError("trainer.megatron.distributed_optimizer=true takes float16, bfloat16 or float32 parameters "
                         "(Megatron refuses float64 ones); set model.dtype=float32, or "
                         "trainer.megatron.distributed_optimizer=false.")
    return requested


def megatron_optimizer_configs(cfg: TrainerConfig, *, dtype: torch.dtype, distributed: bool):
    """Megatron's DDP config and optimizer config for this trainer: (DistributedDataParallelConfig, OptimizerConfig).

    fp32 Adam with decoupled weight decay (as the torch backend's AdamW), clipping by the global norm; gradients
    reduced in float32 unless the model is float64 (kept exact)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float64,
                                        use_distributed_optimizer=distributed,
                                        overlap_grad_reduce=False, overlap_param_gather=False)
    optimizer = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_eps=1e-8, clip_grad=cfg.max_grad_norm,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=distributed,
    )
    return ddp, optimizer


class DistributedParameterState:
    """Megatron's (chained) DistributedOptimizer with ``state_dict`` / ``load_state_dict`` in the checkpoint layout
    (module docstring). ``state_dict`` is trainer rank 0's, inside ``writer_reads`` while the other ranks run
    ``gather``; ``load_state_dict`` runs on every rank."""

    def __init__(self, optimizer, *, data_parallel_size: int, tensor_parallel_size: int,
                 announce: Callable[[], None] = lambda: None) -> None:
        self.megatron = optimizer
        self.announce = announce
        """Called first by ``state_dict``: asks the other ranks to join the gather."""
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size

    def gather(self) -> list[dict | None]:
        """Every rank: each sub-optimizer's parameter state, whole on data-parallel rank 0 (None elsewhere)."""
        return [sub.get_parameter_state_dp_zero() for sub in self.megatron.chained_optimizers]

    def state_dict(self) -> dict:
        self.announce()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for gathered in self.gather():
            for key, buffers in gathered.items():
                if key == "buckets_coalesced":
                    continue
                (world,) = buffers.values()  # Megatron keeps one dtype per gradient buffer
                state[len(state)] = {name: world[name] for name in ("param", "exp_avg", "exp_avg_sq")}
        return {"state": state, "param_groups": [{
            "format": FORMAT, "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "optimizers": [_plain(sub.state_dict()) for sub in self.megatron.chained_optimizers],
        }]}

    def load_state_dict(self, state_dict: dict) -> None:
        check_format(state_dict, distributed=True, data_parallel_size=self.data_parallel_size,
                     tensor_parallel_size=self.tensor_parallel_size)
        (meta,) = state_dict["param_groups"]
        tensors = state_dict["state"]
        index = 0
        # the shards are views of parameters that require grad: Megatron's copies into them must not be recorded
        with cuda_calls_on_cpu(), torch.no_grad():
            for sub, hyper in zip(self.megatron.chained_optimizers, meta["optimizers"], strict=True):
                sub.load_state_dict(hyper)
                parameter_state: dict = {"buckets_coalesced": True}
                for buffer_index, ranges in enumerate(sub.gbuf_ranges):
                    (dtype_key,) = ranges.keys()
                    world = {name: tensors[index][name].float() for name in ("param", "exp_avg", "exp_avg_sq")}
                    parameter_state[buffer_index] = {dtype_key: {**world, "numel_unpadded": world["param"].numel()}}
                    index += 1
                with _step_set_aside(sub.optimizer):
                    sub.load_parameter_state_from_dp_zero(parameter_state)
        if index != len(tensors):
            raise ValueError(f"the checkpoint's optimizer state has {len(tensors)} gradient buffers, this model "
                             f"{index}: it was written for another model.")


@contextlib.contextmanager
def _step_set_aside(inner: torch.optim.Optimizer) -> Iterator[None]:
    """Torch's Adam (what Megatron wraps without Apex or Transformer Engine) keeps the step count in each
    parameter's state, where ``sub.load_state_dict`` put it from the hyper-parameters; Megatron's scatter copies every
    state key of a parameter from what it received (param, exp_avg, exp_avg_sq) and has no step to copy. FusedAdam
    keeps the step in its parameter groups, and this does nothing."""
    steps = {param: state.pop("step") for param, state in inner.state.items() if "step" in state}
    try:
        yield
    finally:
        for param, step in steps.items():  # one tensor each: Megatron gave them all one, which Adam adds 1 to per
            inner.state[param]["step"] = step.clone()  # parameter (the step count would run N times too fast)


def check_format(state_dict: dict, *, distributed: bool, data_parallel_size: int, tensor_parallel_size: int) -> None:
    """Refuse optimizer state this optimizer would misread, naming the key to set."""
    groups = state_dict["param_groups"]
    written = len(groups) == 1 and groups[0].get("format") == FORMAT
    if written != distributed:
        was, now = ("true", "false") if written else ("false", "true")
        raise ValueError(f"the checkpoint's optimizer state was written with trainer.megatron.distributed_optimizer"
                         f"={was}, and this run resolves it to {now}: set trainer.megatron.distributed_optimizer="
                         f"{was} to resume from it.")
    if not distributed:
        return
    sizes = (groups[0]["data_parallel_size"], groups[0]["tensor_parallel_size"])
    if sizes != (data_parallel_size, tensor_parallel_size):
        raise ValueError(f"the checkpoint's distributed optimizer state was written at data-parallel size {sizes[0]}"
                         f" and tensor-parallel size {sizes[1]}; this run has {data_parallel_size} and "
                         f"{tensor_parallel_size}. Resume with the same trainer.num_ranks and "
                         "trainer.megatron.tensor_parallel_size (its shards are laid out for them).")


class ReplicatedState:
    """Megatron's replicated optimizer in the checkpoint layout, refusing a distributed optimizer's checkpoint.

    float32 (FP32Optimizer): Megatron's state dict is torch's, unchanged. bfloat16 (Float16OptimizerWithFloat16Params):
    Megatron keeps the float32 master weights beside torch's state (``fp32_from_fp16_params``); here each goes under
    ``MASTER`` in its parameter's state, as the torch backend keeps them, and back where Megatron wants it on load."""

    def __init__(self, optimizer) -> None:
        self.megatron = optimizer
        (self._sub,) = optimizer.chained_optimizers  # one model chunk, no experts: one optimizer

    def state_dict(self) -> dict:
        megatron = self._sub.state_dict()
        if "fp32_from_fp16_params" not in megatron:
            return megatron
        state = megatron["optimizer"]
        for group, masters in zip(state["param_groups"], megatron["fp32_from_fp16_params"], strict=True):
            for index, master in zip(group["params"], masters, strict=True):  # (a new dict: torch's state_dict
                state["state"][index] = {**state["state"][index], MASTER: master}  # hands out the live ones)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        check_format(state_dict, distributed=False, data_parallel_size=0, tensor_parallel_size=0)
        if not hasattr(self._sub, "fp32_from_float16_groups"):
            self._sub.load_state_dict(state_dict)
            return
        state = {index: dict(tensors) for index, tensors in state_dict["state"].items()}
        masters = [[state[index].pop(MASTER) for index in group["params"]] for group in state_dict["param_groups"]]
        with cuda_calls_on_cpu():
            self._sub.load_state_dict({"optimizer": {"state": state, "param_groups": state_dict["param_groups"]},
                                       "fp32_from_fp16_params": masters})


def _plain(value):
    """Megatron's hyper-parameter dict as JSON data (state.json): tuples as lists, scalar tensors as numbers."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value

