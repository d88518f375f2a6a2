"""Megatron-core without CUDA: the one module that redirects its CUDA-only calls to the CPU.

Megatron-core 0.16 runs GPTModel, its DDP (gloo) and its optimizers on the CPU except for a few calls
that assume a GPU. ``cuda_calls_on_cpu`` redirects them for the duration of a Megatron call, and only
when ``torch.cuda.is_available()`` is False; on a GPU machine it does nothing, so the GPU path is
Megatron's own code, untouched:

    torch.cuda.current_device()          -> the CPU device (buffers, rotary frequencies, grad buffers)
    factories with device="cuda"         -> device="cpu" (optimizer loss scale, causal mask, norm buffers)
    get_cuda_rng_tracker()               -> named streams of the CPU generator (``seed_rng_tracker``)
    the CUDA RNG state that activation      -> nothing (there is no CUDA generator; the CPU one and the
    recomputation saves and restores           tracker's streams are still saved and restored)
    gradient norm and clipping           -> plain torch in the gradients' dtype (Megatron's asserts
                                            torch.cuda.FloatTensor and reduces the norm in float32)
    tensor.type() of a CPU tensor        -> its torch.cuda.* name (the bf16 and the distributed optimizers
                                            accept torch.cuda.{Float,BFloat16,Half}Tensor parameters only)

So the bf16 optimizer and the DistributedOptimizer (its gathers and scatters go over gloo groups) run
here too: what the tests run a GPU run's optimizer code with. Only Transformer Engine's spec needs a GPU.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.overrides import TorchFunctionMode

from rolloutpipe.trainer.torch_backend import sum_of_squares


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites an explicit ``device="cuda"`` argument of any torch function to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _current_device() -> torch.device:
    return torch.device("cpu")


def _grad_norm(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """Megatron's get_grad_norm_fp32 for the 2-norm: sum of squares over the model-parallel group, added in float64."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    assert float(norm_type) == 2.0, "the CPU path computes the 2-norm only (Megatron's default)"
    total = torch.zeros((), dtype=torch.float64)  # per-tensor sums in float32, added in float64 (see
    for grad in grads_for_norm:                  # torch_backend.clip_grad_norm)
        total += sum_of_squares(grad)
    torch.distributed.all_reduce(total, group=grad_stats_parallel_group)
    return math.sqrt(float(total))


def _clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """Megatron's clip_grad_by_total_norm_fp32 (same 1e-6 as torch.nn.utils.clip_grad_norm_)."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for param in parameters:
            grad = param.decoupled_grad if use_decoupled_grad else param.grad
            if grad is not None:
                grad.mul_(clip_coeff)


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """Run Megatron calls inside this block on the CPU; a no-op when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    import megatron.core.optimizer.optimizer as megatron_optimizer
    import megatron.core.tensor_parallel.random as megatron_random

    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(torch.cuda, "current_device", _current_device))
        stack.enter_context(_swapped(megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: None))
        stack.enter_context(_swapped(megatron_random, "_set_cuda_rng_state", lambda *args, **kwargs: None))
        stack.enter_context(_swapped(megatron_optimizer, "get_grad_norm_fp32", _grad_norm))
        stack.enter_context(_swapped(megatron_optimizer, "clip_grad_by_total_norm_fp32", _clip_by_total_norm))
        stack.enter_context(_CudaFactoriesOnCpu())
        yield


class CpuRngStatesTracker:
    """Megatron's CudaRNGStatesTracker over the CPU generator: named streams, swapped in by ``fork``.

    Megatron forks the tensor-parallel stream around dropout; with dropout at 0 (this backend's
    models) the streams are never drawn from, but the fork must find them.
    """

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states[name] = torch.get_rng_state()

    @contextlib.contextmanager
    def fork(self, name: str | None = None):
        from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

        name = name or _MODEL_PARALLEL_RNG_TRACKER_NAME
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def seed_rng_tracker(seed: int, *, tp_rank: int) -> None:
    """Megatron's model_parallel_cuda_manual_seed with the CPU tracker (same stream names and seeds)."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = CpuRngStatesTracker()
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
