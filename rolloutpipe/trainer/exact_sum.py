"""A training batch's gradient summed exactly, so it is the same bits in any arrival order and on any number of ranks.

Why. Floating-point addition is not associative: a batch's gradient accumulated micro-batch by micro-batch in
arrival order (CGP), then all-reduced in float over the ranks, differs at rounding level from the same gradient
accumulated in another order (sync), and the runs drift apart step by step. Integer addition is associative.

How (``trainer.exact_accumulation``). Each micro-batch's gradient is rounded once to a fixed-point grid of
2^-``fraction_bits`` (round half to even, in float64, where every float32/bfloat16/float16 value and its scaling
by a power of two are exact) and added to an int64 accumulator; the ranks all-reduce the accumulators as integers;
the sum is turned back into floating point once, in the same way on every rank. The micro-batches themselves are
defined by the batch's groups, not by arrival (batching.BatchConsumer ``per_group``: a micro-batch never spans two
groups, and a group's samples are in sample order), and each micro-batch's forward and backward is deterministic,
so each micro-batch's rounded gradient is the same in every mode, and so is the sum.

Range and resolution. The grid is chosen once per run from the batch's size alone (``fraction_bits``): one
micro-batch's gradient element may reach +-2^``RANGE_BITS`` (a loss *sum*'s gradient, before the batch's
normaliser), and the sum of every micro-batch of the batch still fits int64. For 128 samples per batch that is a
grid of 2^-31 = 4.7e-10 on the un-normalised gradient, i.e. below 1e-12 once divided by a batch's token count: far
below float32's rounding of the values it sums. A micro-batch whose gradient is out of range, or not finite, is an
error that names itself, not a silent wrap-around.

Cost. An int64 accumulator per trainable parameter element (8 bytes; the float path accumulates in the gradient
itself), one rounding pass per micro-batch, an int64 all-reduce (twice a float32 one's bytes). The memory plan
counts it (launch/memory_plan.py); bench/exact_accumulation.py measures the time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

RANGE_BITS = 24
"""|one micro-batch's gradient element| < 2^RANGE_BITS before the normaliser (a loss sum's gradient)."""


def fraction_bits(num_samples_per_batch: int) -> int:
    """The grid 2^-bits for a batch of this many samples: each micro-batch has at least one sample, so at most this
    many rounded gradients are summed, each below 2^(RANGE_BITS + bits), and the sum stays below 2^62."""
    return 62 - RANGE_BITS - math.ceil(math.log2(max(num_samples_per_batch, 1)))


class ExactGradientSum:
    """The int64 sum of the micro-batch gradients of ``params`` (module docstring)."""

    def __init__(self, params: list[torch.Tensor], *, num_samples_per_batch: int) -> None:
        self.params = params
        self.bits = fraction_bits(num_samples_per_batch)
        self._scale = float(2 ** self.bits)
        self._limit = float(2 ** (RANGE_BITS + self.bits))
        self._sums = [torch.zeros(p.shape, dtype=torch.int64, device=p.device) for p in params]

    def add(self) -> None:
        """Fold each parameter's ``.grad`` (one micro-batch's gradient) into the sums and clear it."""
        for p, total in zip(self.params, self._sums, strict=True):
            if p.grad is None:  # not reached by this micro-batch's loss: adds zero
                continue
            total.add_(self.to_grid(p.grad))
            p.grad = None

    def to_grid(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (one micro-batch's) rounded once to the grid, as int64 multiples of 2^-bits."""
        scaled = grad.double().mul_(self._scale)  # exact: a power of two
        largest = float(scaled.abs().max()) if scaled.numel() else 0.0
        if not largest < self._limit:  # also catches nan and inf
            raise FloatingPointError(
                f"trainer.exact_accumulation: a micro-batch's gradient reaches {largest / self._scale:.3g} (or is "
                f"not finite), beyond the +-2^{RANGE_BITS} the exact sum holds; the loss diverged, or set "
                "trainer.exact_accumulation=false to sum gradients in floating point.")
        return scaled.round_().long()

    def reduce(self, all_reduce: Callable[[torch.Tensor], object] | None) -> None:
        """Sum over the data-parallel ranks, as integers, in one flat tensor."""
        all_reduce_flat(self._sums, all_reduce)

    def take(self, dtype: torch.dtype, *, scale: float) -> list[torch.Tensor]:
        """The summed gradients times ``scale`` (1 / the batch's normaliser) in ``dtype``: computed in float64 and
        rounded once, the same on every rank. The sums restart at zero."""
        grads = [s.double().mul_(scale / self._scale).to(dtype) for s in self._sums]
        self.clear()
        return grads

    def clear(self) -> None:
        """Restart the sums at zero without turning them into gradients (a rank that does not write them)."""
        for s in self._sums:
            s.zero_()


def all_reduce_flat(tensors: list[torch.Tensor], all_reduce: Callable[[torch.Tensor], object] | None) -> None:
    """Sum ``tensors`` (one dtype) over the data-parallel ranks in place, as one flat tensor: one collective, not one
    per tensor. ``all_reduce`` None: alone, nothing to do."""
    if all_reduce is None:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
