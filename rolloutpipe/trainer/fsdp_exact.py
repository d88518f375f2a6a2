"""trainer.exact_accumulation on FSDP2: the batch's gradient summed as integers, shard by shard.

The torch backend cuts each micro-batch's gradient into the integer bins of exact_sum.py and adds them to its
sums. FSDP2 cannot do that after the fact: every backward reduce-scatters the ranks' gradients in floating point
(each rank's is another micro-batch's), and the shards accumulate in floating point over the batch. So the cut goes
in before the reduction:

- The reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, one per sharded module): each rank's flat
  unsharded gradient, its own micro-batch's, is cut into bins in bounded chunks: the ranks all-reduce each
  element's top bin (max, int8), cut their values into the common window, all-reduce the lowest bin reached (min,
  int8) and reduce-scatter the int64 bins. The float output FSDP receives is zeros; the integer shard waits in
  ``_shard``.
- Each parameter's post-accumulate-grad hook, which FSDP2 calls in the order of its flat layout: the parameter's
  rows of that integer shard go into its sums, and its float gradient is dropped. On one rank FSDP2 reduces
  nothing (no reduce-scatter call): the hook cuts the gradient itself.
- ``take_into_grads``: the sums, rounded once to float64, scaled, rounded to the dtype, become the shards'
  gradients.
- ``clip_gathered_grad_norm``: the clip norm from each parameter's whole gradient, gathered one parameter at a
  time, as the torch backend computes it; the partial sums of shards would change with the number of ranks.

Every rank cuts the same micro-batch into the same integers on any number of ranks, integer addition has no order,
and everything after the sum is element-wise or computed on whole tensors: the update is the same bits in sync, cgp
and cgp with FGD, on 1 or N ranks. The flat layout FSDP2 uses (each parameter's dim-0 chunk, padded to
ceil(rows / N) rows, in its order) is checked as it is read: a reduce-scatter output that the hooks do not consume
exactly is an error, not a silent mix-up.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rolloutpipe.trainer.exact_sum import NUM_BINS, ExactGradientSum
from rolloutpipe.trainer.torch_backend import sum_of_squares

CHUNK_ELEMENTS = 1 << 22
"""The integer reduce-scatter runs on at most this many input elements at a time (NUM_BINS x 32 MiB of int64)."""


class ShardedExactSum(ExactGradientSum):
    """The int64 sums of this rank's shards of ``params`` (the FSDP2 modules' sharded parameters), fed by the
    modules' reduce-scatters and the parameters' hooks (module docstring)."""

    def __init__(self, params: list[torch.Tensor], modules: list, *, num_samples_per_batch: int,
                 world_size: int) -> None:
        for p in params:
            if not isinstance(p, DTensor) or p.dim() == 0:
                raise ValueError(f"trainer.exact_accumulation on FSDP2 needs sharded parameters of at least one "
                                 f"dimension; got {type(p).__name__} of shape {tuple(p.shape)}.")
        super().__init__([p.to_local() for p in params], num_samples_per_batch=num_samples_per_batch)
        self.sharded = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._world = world_size
        self._shard: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """The last reduce-scatter's output (each element's top bin, lowest bin, [NUM_BINS, n] bins), until the
        hooks have taken all of it."""
        self._taken = 0
        """How much of ``_shard`` the hooks took so far."""
        if world_size > 1:
            for module in modules:
                module.set_custom_reduce_scatter(_IntegerReduceScatter(self))
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def add(self) -> None:
        """Nothing left to do after a backward: the hooks folded the gradients in during it."""
        self.num_micro_batches += 1

    def _on_grad(self, param: torch.Tensor) -> None:
        """FSDP2 has set ``param``'s gradient shard (zeros with more than one rank): fold the integers in."""
        i = self._index[id(param)]
        local = param.grad.to_local()
        if self._world == 1:  # nothing was reduced: the gradient is this rank's micro-batch's, whole
            self.fold(i, local)
        else:
            rows = -(-param.shape[0] // self._world)  # its padded chunk of dim 0; this rank's rows come first
            size = rows * math.prod(param.shape[1:])
            if self._shard is None or self._taken + size > self._shard[0].numel():
                raise RuntimeError("trainer.exact_accumulation: FSDP2 set a gradient beyond what the integer "
                                   "reduce-scatter made; its layout is not the one fsdp_exact.py reads.")
            top, low, bins = (t[..., self._taken : self._taken + size] for t in self._shard)
            n, shape = local.shape[0], (rows, *param.shape[1:])
            self.merge(i, top.view(shape)[:n], low.view(shape)[:n], bins.reshape(NUM_BINS, *shape)[:, :n])
            self._taken += size
            if self._taken == self._shard[0].numel():
                self._shard = None
        param.grad = None

    def reduce_scatter(self, input_tensor: torch.Tensor, group: dist.ProcessGroup, numel_out: int) -> None:
        """This rank's flat unsharded gradient, cut into bins and reduce-scattered as integers, by chunks of columns
        of the [ranks, numel_out] layout (row r: rank r's shard); the shard is queued for the hooks."""
        if self._shard is not None:
            raise RuntimeError("trainer.exact_accumulation: a reduce-scatter's shard was not taken by the "
                               "parameters' hooks; FSDP2's layout is not the one fsdp_exact.py reads.")
        rows, rank = input_tensor.view(self._world, numel_out), dist.get_rank(group)
        device = input_tensor.device
        top = torch.empty(numel_out, dtype=torch.int8, device=device)
        low = torch.empty(numel_out, dtype=torch.int8, device=device)
        bins = torch.empty((NUM_BINS, numel_out), dtype=torch.int64, device=device)
        step = max(1, CHUNK_ELEMENTS // self._world)
        for start in range(0, numel_out, step):
            values = self.checked(rows[:, start : start + step], "a module's flat gradient")
            common = self.top_bins(values)  # [ranks, columns]
            dist.all_reduce(common, op=dist.ReduceOp.MAX, group=group)
            digits, lowest = self.digits(values, common)  # [NUM_BINS, ranks, columns], in the common windows
            dist.all_reduce(lowest.neg_(), op=dist.ReduceOp.MAX, group=group)  # the lowest bins' min, as a max
            shard = torch.empty(NUM_BINS * values.shape[1], dtype=torch.int64, device=device)  # (flat: gloo's)
            dist.reduce_scatter_tensor(shard, digits.transpose(0, 1).contiguous().view(-1), group=group)
            top[start : start + step], low[start : start + step] = common[rank], lowest[rank].neg()
            bins[:, start : start + step] = shard.view(NUM_BINS, -1)
        self._shard, self._taken = (top, low, bins), 0

    def take_into_grads(self, dtype: torch.dtype, *, scale: float) -> None:
        """Every shard's gradient from the sums (``take``), as a DTensor like its parameter."""
        if self._shard is not None:
            raise RuntimeError("trainer.exact_accumulation: a reduce-scatter's shard was left over at the "
                               "optimizer step; FSDP2's layout is not the one fsdp_exact.py reads.")
        for p, grad in zip(self.sharded, self.take(dtype, scale=scale), strict=True):
            p.grad = DTensor.from_local(grad, device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())


class _IntegerReduceScatter:
    """FSDP2's ReduceScatter interface (``allocate``, ``__call__``) over ``ShardedExactSum.reduce_scatter``."""

    def __init__(self, sums: ShardedExactSum) -> None:
        self.sums = sums

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        self.sums.reduce_scatter(input_tensor, group, output_tensor.numel())
        output_tensor.zero_()  # the float shards FSDP2 accumulates stay zero: the sum is the integers'


def clip_gathered_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """torch_backend.clip_grad_norm over FSDP2's gradient shards, computed from each parameter's whole gradient
    (gathered one at a time, on every rank) so that it is the same bits on any number of ranks."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        whole = p.grad.full_tensor()
        total += sum_of_squares(whole).to("cpu", torch.float64)
        del whole
    norm = float(total.sqrt())
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for p in params:
            p.grad.to_local().mul_(coefficient)
    return norm
