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
(The distributed optimizer's DDP is built with ``overlap_grad_reduce`` on and switched off once built: Megatron
makes buckets of ``trainer.megatron.ddp_bucket_size`` parameters only then, and ``ParamSyncByBucket`` steps and
all-gathers the step's last update by those buckets. Megatron reads the flag at each backward and reduce.)

Checkpoints. Replicated: Megatron's own optimizer state dict in control/checkpoint.py's layout (``{"state": {index:
{name: tensor}}, "param_groups": [...]}``), written whole by trainer rank 0, as before. Distributed
(``DistributedShards``): sharded as FSDP's are, nothing gathered. Each rank's restore point copies its own shards
every step (12 bytes a parameter / data-parallel size: the float32 master weights and Adam's moments, views of
Megatron's own tensors: ``_get_main_param_and_optimizer_states``) and each rank writes its own file. A parameter is
stored flattened, and a rank holds the range of it that Megatron's buffer layout gives it
(``_get_model_param_range_map``), under ``<index>.<name>`` with ``index`` the parameter's position in the model
counted across the tensor-parallel ranks; the hyper-parameters (step counts included) go to state.json. A resumed
run reads back the ranges its own layout needs (``load_shards``), so it may have another data-parallel size; another
tensor-parallel size (the parameters' shapes differ), or the other optimizer, is refused with the key to set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rolloutpipe.control.checkpoint import Shard, ShardedState
from rolloutpipe.trainer.config import TrainerConfig
from rolloutpipe.trainer.megatron.cpu import cuda_calls_on_cpu
from rolloutpipe.trainer.torch_backend import MASTER, step_only

FORMAT = "megatron_distributed_optimizer"
"""Marks a checkpoint's optimizer state as written by ``DistributedShards``."""
STATE = ("param", "exp_avg", "exp_avg_sq")
"""What the distributed optimizer keeps per parameter range: float32 master weights, Adam's moments."""


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
    The distributed optimizer's DDP config asks for buckets: ``without_overlap`` once DDP is built (module docstring).

    fp32 Adam with decoupled weight decay (as the torch backend's AdamW), clipping by the global norm; gradients
    reduced in float32 unless the model is float64 (kept exact)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float64,
                                        use_distributed_optimizer=distributed,
                                        overlap_grad_reduce=distributed, overlap_param_gather=False,
                                        bucket_size=cfg.megatron.ddp_bucket_size)
    optimizer = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_eps=1e-8, clip_grad=cfg.max_grad_norm,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=distributed,
    )
    return ddp, optimizer


def without_overlap(ddp) -> None:
    """Megatron DDP, built with ``overlap_grad_reduce`` for its buckets: its gradients reduced in one go when the
    batch is complete (``finalize_model_grads``), as without the flag."""
    assert all(group.ddp_config is ddp.ddp_config for group in ddp.bucket_groups)
    ddp.ddp_config.overlap_grad_reduce = False


class ParamSyncByBucket:
    """The distributed optimizer's update applied one DDP bucket group at a time: this rank's shards of the group's
    parameters stepped (torch's Adam on their float32 masters, each once), copied into the parameter buffer, and the
    group's parameters all-gathered over the data-parallel ranks, which is what Megatron's ``step_with_ready_grads``
    and ``start_param_sync`` do for all at once. Every data-parallel rank defers and finishes the same groups in the
    same order (the all-gather is a collective): trainer.py finishes them as weight sync's buckets need them."""

    def __init__(self, optimizer, ddp) -> None:
        self.groups = list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)
        self.group_of = ddp.param_to_bucket_group
        self.masters = []
        """(DistributedOptimizer, {parameter: this rank's float32 master of its range})."""
        for sub in optimizer.chained_optimizers:
            pairs = zip(sub.model_float16_groups + sub.model_fp32_groups,
                        sub.shard_fp32_from_float16_groups + sub.shard_fp32_groups, strict=True)
            self.masters.append((sub, {p: master for params, masters in pairs
                                       for p, master in zip(params, masters, strict=True)}))
        self.left: list = []
        """The groups of a deferred update not yet stepped and gathered, in Megatron's order."""

    def steps_in_parts(self) -> bool:
        return all(_steps_in_parts(sub.optimizer) for sub, _ in self.masters)

    def defer(self) -> None:
        self.left = list(self.groups)

    def finish(self, params: list[torch.nn.Parameter] | None) -> None:
        """Step and gather the groups left that hold any of ``params`` (None: every group left), in the order of
        ``params``."""
        if not self.left:
            return
        wanted = self.left if params is None else list(dict.fromkeys(self.group_of[p] for p in params))
        for group in [g for g in wanted if g in self.left]:
            self.left.remove(group)
            with torch.no_grad():
                for sub, masters in self.masters:
                    held = [p for p in group.params if p in masters]
                    stepped = {id(t) for t in step_only(sub.optimizer, [masters[p] for p in held])}
                    for p in held:
                        if id(masters[p]) in stepped:
                            _param_buffer_range(sub, p).copy_(masters[p])
                group.start_param_sync(force_sync=True)


def _steps_in_parts(inner: torch.optim.Optimizer) -> bool:
    """Whether ``step_only`` on Megatron's inner optimizer gives Megatron's own step: torch's Adam, which keeps each
    parameter's step count in its state and skips a parameter without a gradient. Transformer Engine's or Apex's
    FusedAdam counts the steps per call, and would count one per part."""
    return type(inner) in (torch.optim.Adam, torch.optim.AdamW)


def _param_buffer_range(sub, param: torch.nn.Parameter) -> torch.Tensor:
    """Where this rank's range of ``param`` lies in the DDP parameter buffer that the all-gather reads (Megatron's
    ``_copy_main_params_to_model_params``)."""
    world = sub._get_model_param_range_map(param)["gbuf_world_in_bucket"]
    buffer, _, bucket = sub.model_param_gbuf_map[param]
    return sub.buffers[buffer].buckets[bucket].param_data.view(-1)[world.start:world.end]


class DistributedShards:
    """Megatron's (chained) DistributedOptimizer in the sharded checkpoint layout (module docstring): ``shards`` and
    ``load_shards`` on every rank; ``state_dict`` gives the hyper-parameters only (trainer rank 0's state.json)."""

    def __init__(self, optimizer, *, params: list[torch.nn.Parameter], tp_rank: int, data_parallel_size: int,
                 tensor_parallel_size: int) -> None:
        self.megatron = optimizer
        self.params = params
        """The model's parameters in a fixed order: ``<index>`` of the keys, after the tensor-parallel ranks before."""
        self.first_index = tp_rank * len(params)
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": [{
            "format": FORMAT, "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "optimizers": [_plain(sub.state_dict()) for sub in self.megatron.chained_optimizers],
        }]}

    def load_state_dict(self, state_dict: dict) -> None:
        """A checkpoint without per-rank files: the replicated optimizer's, or the layout gathered on trainer rank 0
        that earlier versions wrote for this one; each is refused with what to do."""
        check_format(state_dict, distributed=True, tensor_parallel_size=self.tensor_parallel_size)
        raise ValueError("the checkpoint's distributed optimizer state is the one file gathered on trainer rank 0 "
                         "(optimizer.safetensors) that earlier versions wrote; this version reads each rank's own "
                         "shards (optimizer/rank-<r>-of-<N>.safetensors). Resume it with the version that wrote it.")

    def shards(self) -> dict[str, Shard]:
        """This rank's ranges of the flattened parameters' master weights and moments, as views (nothing gathered)."""
        shards: dict[str, Shard] = {}
        for sub in self.megatron.chained_optimizers:
            for index, param, held in self._held(sub):
                tensors = sub._get_main_param_and_optimizer_states(param)
                for name in STATE:
                    shards[f"{index}.{name}"] = Shard(tensors[name].detach(), held.start, param.numel())
        return shards

    def load_shards(self, state: ShardedState, param_groups: list[dict]) -> None:
        """A sharded checkpoint of any data-parallel size into this rank's ranges."""
        check_format({"param_groups": param_groups}, distributed=True, tensor_parallel_size=self.tensor_parallel_size)
        (meta,) = param_groups
        # the shards are views of parameters that require grad (float32): the copies must not be recorded
        with cuda_calls_on_cpu(), torch.no_grad():
            for sub, hyper in zip(self.megatron.chained_optimizers, meta["optimizers"], strict=True):
                sub.load_state_dict(hyper)  # allocates the state; the step counts come from the hyper-parameters
                with _step_set_aside(sub.optimizer):
                    for index, param, held in self._held(sub):
                        sub._set_main_param_and_optimizer_states(
                            param, {name: state.rows(f"{index}.{name}", held.start, held.end) for name in STATE})

    def _held(self, sub) -> Iterator[tuple[int, torch.nn.Parameter, object]]:
        """(key index, parameter, the range of the flattened parameter this rank holds) for every parameter of
        ``sub`` (a DistributedOptimizer) this rank holds a part of."""
        for index, param in enumerate(self.params, start=self.first_index):
            if param in sub.model_param_gbuf_map:
                yield index, param, sub._get_model_param_range_map(param)["param"]


@contextlib.contextmanager
def _step_set_aside(inner: torch.optim.Optimizer) -> Iterator[None]:
    """Torch's Adam (what Megatron wraps without Apex or Transformer Engine) keeps the step count in each
    parameter's state, where ``sub.load_state_dict`` put it from the hyper-parameters; Megatron's
    ``_set_main_param_and_optimizer_states`` copies every state key of a parameter from what it is given (param,
    exp_avg, exp_avg_sq) and has no step to copy. FusedAdam keeps the step in its parameter groups, and this does
    nothing."""
    steps = {param: state.pop("step") for param, state in inner.state.items() if "step" in state}
    try:
        yield
    finally:
        for param, step in steps.items():  # one tensor each: Megatron gave them all one, which Adam adds 1 to per
            inner.state[param]["step"] = step.clone()  # parameter (the step count would run N times too fast)


def check_format(state_dict: dict, *, distributed: bool, tensor_parallel_size: int = 0) -> None:
    """Refuse optimizer state this optimizer would misread, naming the key to set."""
    groups = state_dict["param_groups"]
    written = len(groups) == 1 and groups[0].get("format") == FORMAT
    if written != distributed:
        was, now = ("true", "false") if written else ("false", "true")
        raise ValueError(f"the checkpoint's optimizer state was written with trainer.megatron.distributed_optimizer"
                         f"={was}, and this run resolves it to {now}: set trainer.megatron.distributed_optimizer="
                         f"{was} to resume from it.")
    if distributed and groups[0]["tensor_parallel_size"] != tensor_parallel_size:
        raise ValueError(f"the checkpoint's distributed optimizer state was written at tensor-parallel size "
                         f"{groups[0]['tensor_parallel_size']}; this run has {tensor_parallel_size}. Resume with the "
                         f"same trainer.megatron.tensor_parallel_size (its shards are of the parameters' "
                         "tensor-parallel pieces; the data-parallel size may change).")


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

    def steps_in_parts(self) -> bool:
        return _steps_in_parts(self._sub.optimizer)

    def step_only(self, params: list[torch.nn.Parameter] | None) -> None:
        """Megatron's ``step_with_ready_grads`` on those of the model's ``params`` (None: all) still holding a
        gradient, and their gradients dropped: torch's Adam on the tensors it steps for them (the parameters, or
        their float32 masters, which are then copied into them as Megatron copies them). Stepped in parts, each once,
        the parameters get what Megatron's step of all gives, to the bit (torch_backend.step_only)."""
        if not hasattr(self._sub, "fp32_from_float16_groups"):
            step_only(self._sub.optimizer, params)
            return
        masters = {id(p): (p, master) for group, masters in zip(self._sub.float16_groups,
                                                                  self._sub.fp32_from_float16_groups, strict=True)
                   for p, master in zip(group, masters, strict=True)}
        masters |= {id(p): (p, p) for group in self._sub.fp32_from_fp32_groups for p in group}
        pairs = list(masters.values()) if params is None else [masters[id(p)] for p in params]
        stepped = {id(t) for t in step_only(self._sub.optimizer, [master for _, master in pairs])}
        with torch.no_grad():
            for p, master in pairs:
                if id(master) in stepped and master is not p:
                    p.copy_(master)

    def load_state_dict(self, state_dict: dict) -> None:
        check_format(state_dict, distributed=False)
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

