"""A training batch's gradient summed exactly, so it is the same bits in any arrival order and on any number of ranks.

Why. Floating-point addition is not associative: a batch's gradient accumulated micro-batch by micro-batch in
arrival order (CGP), then all-reduced in float over the ranks, differs at rounding level from the same gradient
accumulated in another order (sync), and the runs drift apart step by step. Integer addition is associative.

How (``trainer.exact_accumulation``): a binned sum in the manner of Demmel and Nguyen's reproducible summation,
with integer bins. The bit positions from 2^-149 (float32's, bfloat16's and float16's smallest step) upwards are
cut into fixed bins of ``W = bin_bits(num_samples_per_batch)`` bits. Each gradient element keeps a window of
``NUM_BINS`` consecutive bins, each an int64, plus the index of its top bin (int8) and of the lowest bin any of its
values reached (int8). A micro-batch's value is cut, exactly, into its digits in the window's bins (a float32 value
spans at most two); a value above the window first moves the window up to its own top bin, dropping the bins that
fall out below. So the window ends at the top bin of the element's largest value whatever the order, and each bin
holds the exact integer sum of every value's digit in that bin: the same integers in any order. The ranks all-reduce
the top indices (max) and the lowest bins (min), move their windows to the common top, and all-reduce the bins as
integers (FSDP reduce-scatters them, fsdp_exact.py). The micro-batches themselves are defined by the batch's groups,
not by arrival (batching.BatchConsumer ``per_group``), and each micro-batch's backward is deterministic, so each
micro-batch's digits are the same in every mode, and so is the sum.

Range. Exact for any finite float32, bfloat16 or float16 values (float64: any at or above 2^-149) whose bits, within
one element, lie within ``NUM_BINS - 1`` bins below the largest's top bin: at least (NUM_BINS - 1) x W bits, 110 at
128 samples per batch, i.e. every value down to 2^-86 of the element's largest is summed exactly, from 2^-149 to
float32's largest. Beyond that (1e38 and 1e-40 in one element) the lower digits are dropped, the same ones in any
order; such elements are counted (``num_unrepresented``: train/exact_sum_unrepresented), never silent. Nothing
overflows: a bin adds at most ``num_samples_per_batch`` digits below 2^W, and W leaves that headroom below 2^62.
A value that is not finite is an error naming the micro-batch.

Back to floating point (``take``): the bins' carries are normalised and the integer turned into float64 with one
rounding (to nearest, ties to even), the same on every rank. The gradient is then that float64 times ``scale``
(1 / the batch's normaliser) in float64, rounded to the gradient's dtype: fl_dtype(fl64(fl64(S) x scale)), S the
exact sum of the micro-batch gradients (for counted elements, of their digits in the window).

Cost. 8 x NUM_BINS + 2 = 26 bytes per trainable parameter element (``BYTES_PER_ELEMENT``; the float path
accumulates in the gradient itself), a few dozen element-wise passes per micro-batch, and an all-reduce of 24 + 2
bytes an element. The memory plan counts it (launch/memory_plan.py); bench/exact_accumulation.py measures the time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

NUM_BINS = 3
"""Bins in each element's window: an element's values are exact down to (NUM_BINS - 1) bins below the largest."""
BYTES_PER_ELEMENT = 8 * NUM_BINS + 2
"""The accumulator's bytes per summed element: the int64 bins, the top bin's index, the lowest bin reached."""
LOWEST_BIT = -149
"""Bin 0 starts at 2^-149: every float32, bfloat16 and float16 value is an integer multiple of it."""
NO_BITS = 127
"""The lowest bin of an element no nonzero value reached."""
CHUNK_ELEMENTS = 1 << 22
"""``fold`` and ``take`` work on at most this many elements of a parameter at a time (temporaries of some 60 bytes
an element: 240 MiB)."""


def bin_bits(num_samples_per_batch: int) -> int:
    """W: each micro-batch has at least one sample, so a bin adds at most this many digits, each below 2^W, over
    every rank; their sum stays below 2^62, which leaves the carries of ``take`` room in an int64."""
    return 62 - math.ceil(math.log2(max(num_samples_per_batch, 2)))


class ExactGradientSum:
    """The binned integer sums of the micro-batch gradients of ``params`` (module docstring)."""

    def __init__(self, params: list[torch.Tensor], *, num_samples_per_batch: int) -> None:
        self.params = params
        self.bits = bin_bits(num_samples_per_batch)
        self._bins = [torch.zeros((NUM_BINS, *p.shape), dtype=torch.int64, device=p.device) for p in params]
        """Per element, the window's bins from the top one down: integers in units of each bin's lowest bit."""
        self._top = [torch.full(p.shape, NUM_BINS - 1, dtype=torch.int8, device=p.device) for p in params]
        """Per element, the window's top bin (at first the lowest window: bins NUM_BINS - 1 .. 0)."""
        self._low = [torch.full(p.shape, NO_BITS, dtype=torch.int8, device=p.device) for p in params]
        """Per element, the lowest bin holding a bit of any value added (NO_BITS: none)."""
        self.num_unrepresented = 0
        """Elements of the last batch ``take`` turned into gradients whose sum lost bits below its window."""
        self.num_micro_batches = 0
        """Micro-batches this rank added since the batch began (the one being added, while ``add`` runs)."""
        self.num_batches = 0
        """Batches taken since the trainer started (error messages name the batch and the micro-batch)."""

    def add(self) -> None:
        """Fold each parameter's ``.grad`` (one micro-batch's gradient) into the sums and clear it."""
        for i, p in enumerate(self.params):
            if p.grad is None:  # not reached by this micro-batch's loss: adds zero
                continue
            self.fold(i, p.grad)
            p.grad = None
        self.num_micro_batches += 1

    def fold(self, i: int, grad: torch.Tensor) -> None:
        """Add one micro-batch's gradient of parameter ``i`` to its sums, exactly (up to the counted drop), by flat
        chunks of CHUNK_ELEMENTS: the float64 and int64 temporaries stay bounded for the largest parameter."""
        values = self.checked(grad, f"parameter {i}").reshape(-1)
        bins, tops, lows = self._bins[i].view(NUM_BINS, -1), self._top[i].view(-1), self._low[i].view(-1)
        for start in range(0, values.numel(), CHUNK_ELEMENTS):
            part = slice(start, start + CHUNK_ELEMENTS)
            window, top = bins[:, part], tops[part]
            common = torch.maximum(self.top_bins(values[part]), top)  # (``merge``, cut in the common window at once)
            digits, low = self.digits(values[part], common)
            moved = shifted(window, common - top)
            if moved is not window:
                window.copy_(moved)
            window.add_(digits)
            top.copy_(common)
            torch.minimum(lows[part], low, out=lows[part])

    def checked(self, grad: torch.Tensor, what: str) -> torch.Tensor:
        """``grad``, or an error naming the micro-batch when a value is not finite."""
        grad = grad.detach()
        if not bool(torch.isfinite(grad).all()):
            raise FloatingPointError(
                f"trainer.exact_accumulation: micro-batch {self.num_micro_batches} of training batch "
                f"{self.num_batches} on this rank (counted from 0 since the trainer started) has a gradient that "
                f"is not finite: {int((~torch.isfinite(grad)).sum())} of the {grad.numel()} elements of {what} "
                f"(shape {tuple(grad.shape)}) are nan or inf; the loss diverged.")
        return grad

    def top_bins(self, values: torch.Tensor) -> torch.Tensor:
        """Per element, the bin of the value's highest bit, at least the lowest window's top (a zero adds nothing),
        as int8."""
        exponent = torch.frexp(values)[1]  # values = mantissa x 2^exponent, 0.5 <= |mantissa| < 1
        # floor((highest bit - LOWEST_BIT) / W) in float32: the + 0.5 keeps the quotient 0.5 / W off the integers
        top = (exponent - (1 + LOWEST_BIT) + 0.5).div_(self.bits).floor_()
        return torch.where(values == 0, 0.0, top).clamp_(min=NUM_BINS - 1).to(torch.int8)

    def digits(self, values: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` cut into their digits in the bins top .. top - NUM_BINS + 1 ([NUM_BINS, *shape] int64, each
        below 2^W in magnitude, with the value's sign; bits below the window are dropped), and the bin of each
        value's lowest bit (int8; top - NUM_BINS for one with bits below the window, NO_BITS for a zero)."""
        # in units of the window's lowest bit: a power of two, exact in float64; each step splits off exact bits
        rest = values.double().mul_(pow2(-(LOWEST_BIT + (top.long() - (NUM_BINS - 1)) * self.bits)))
        out = torch.empty((NUM_BINS, *values.shape), dtype=torch.int64, device=values.device)
        low = torch.full_like(top, NO_BITS)
        for j in range(NUM_BINS):
            unit = 2.0 ** ((NUM_BINS - 1 - j) * self.bits)
            digit = rest.mul(1.0 / unit).trunc_()
            rest.sub_(digit.mul_(unit))
            out[j] = digit.div_(unit)
            low = torch.where(digit != 0, top - j, low)
        return out, torch.where(rest != 0, top - NUM_BINS, low)

    def merge(self, i: int, top: torch.Tensor, low: torch.Tensor, bins: torch.Tensor) -> None:
        """Add a partial sum (its windows' tops, lowest bins and bins) into parameter ``i``'s, in the higher of the
        two windows of each element."""
        common = torch.maximum(top, self._top[i])
        self._bins[i] = shifted(self._bins[i], common - self._top[i]).add_(shifted(bins, common - top))
        self._top[i] = common
        torch.minimum(self._low[i], low, out=self._low[i])

    def reduce(self, all_reduce: Callable[..., object] | None) -> None:
        """Sum over the data-parallel ranks: the windows' tops (max) and lowest bins (min) in one flat int8
        all-reduce, then the bins, moved to the common windows, as integers in one flat int64 all-reduce."""
        if all_reduce is None:
            return
        reach = [torch.stack([top, -low]) for top, low in zip(self._top, self._low, strict=True)]
        all_reduce_flat(reach, all_reduce, op=dist.ReduceOp.MAX)
        for i, both in enumerate(reach):
            self._bins[i] = shifted(self._bins[i], both[0] - self._top[i])
            self._top[i], self._low[i] = both[0], both[1].neg_()
        all_reduce_flat(self._bins, all_reduce)

    def take(self, dtype: torch.dtype, *, scale: float) -> list[torch.Tensor]:
        """The summed gradients times ``scale`` (1 / the batch's normaliser) in ``dtype``: the exact sum rounded
        once to float64, scaled in float64, rounded to ``dtype``; the same on every rank. The sums restart at
        zero (``clear``)."""
        grads = []
        for bins, top in zip(self._bins, self._top, strict=True):
            grad = torch.empty(top.shape, dtype=dtype, device=top.device)
            flat, bins, top = grad.view(-1), bins.view(NUM_BINS, -1), top.view(-1)
            for start in range(0, flat.numel(), CHUNK_ELEMENTS):  # (bounded temporaries, as in ``fold``)
                part = slice(start, start + CHUNK_ELEMENTS)
                flat[part] = rounded(bins[:, part], top[part], self.bits).mul_(scale)
            grads.append(grad)
        self.clear()
        return grads

    def clear(self) -> None:
        """Restart the sums at zero without turning them into gradients (a rank that does not write them), after
        counting the batch's elements that lost bits below their window (``num_unrepresented``)."""
        self.num_unrepresented = sum(int((low < top - (NUM_BINS - 1)).sum())
                                     for top, low in zip(self._top, self._low, strict=True))
        self.num_batches += 1
        for bins, top, low in zip(self._bins, self._top, self._low, strict=True):
            bins.zero_()
            top.fill_(NUM_BINS - 1)
            low.fill_(NO_BITS)
        self.num_micro_batches = 0


def shifted(bins: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """``bins`` [NUM_BINS, *shape] of windows moved up by ``by`` (>= 0) bins per element: each bin goes ``by``
    places down the window, the ones falling out below are dropped, the new top ones are zero."""
    by = by.long()
    if not bool((by != 0).any()):  # the usual case after the first micro-batches: no window moved
        return bins
    out = torch.zeros_like(bins)
    for step in range(NUM_BINS):
        out[step:] = torch.where(by == step, bins[: NUM_BINS - step], out[step:])
    return out


def rounded(bins: torch.Tensor, top: torch.Tensor, bits: int) -> torch.Tensor:
    """The float64 nearest (ties to even) to the exact value of ``bins`` in the windows ending at ``top``.

    The carries are normalised (every bin but the top one into [0, 2^W)), the sign taken out, then the bins are
    gathered from the top into one int64 ``t`` < 2^63 times 2^``shift``, the bits shifted out kept as a sticky bit
    in ``t``'s lowest bit (``t`` then has 62 or 63 bits, so the rounding to 53 sees them): the hardware's int64 to
    float64 conversion rounds it once, and the power of two is exact."""
    bins = carried(bins.clone(), bits)
    negative = bins[0] < 0
    bins = carried(torch.where(negative, -bins, bins), bits)  # now every bin is >= 0
    t, shift = bins[0], torch.zeros_like(bins[0])
    sticky = torch.zeros_like(t)
    for digit in bins[1:]:
        up = shift + bits  # t's place in units of this digit's bin
        length = bit_length(t)
        out = (length + up - 63).clamp_(min=0)  # bits of the joined value that leave on the right
        dropped = out.clamp(max=63)
        t = torch.bitwise_left_shift(t, torch.minimum(up, 63 - length)) + (digit >> dropped)
        sticky |= (digit != ((digit >> dropped) << dropped)).long()
        shift = out
    value = (t | sticky).double() * pow2(shift + LOWEST_BIT + (top.long() - (NUM_BINS - 1)) * bits)
    return torch.where(negative, -value, value)


def carried(bins: torch.Tensor, bits: int) -> torch.Tensor:
    """``bins`` with each bin below the top one brought into [0, 2^W), its carry added to the bin above (the same
    value; arithmetic shifts: floor division)."""
    for j in range(NUM_BINS - 1, 0, -1):
        carry = bins[j] >> bits
        bins[j] -= carry << bits
        bins[j - 1] += carry
    return bins


def bit_length(t: torch.Tensor) -> torch.Tensor:
    """Bits of each int64 ``t`` >= 0 (0 for 0): from float64's exponent, one less where the conversion rounded up
    to the next power of two."""
    length = torch.frexp(t.double())[1].long().clamp_(max=63)
    return length - ((t >> (length - 1).clamp(min=0)) == 0).long() * (t > 0).long()


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as float64, built from its bits (exact; ``exponent`` int64 within float64's normal range)."""
    return ((exponent + 1023) << 52).view(torch.float64)


def all_reduce_flat(tensors: list[torch.Tensor], all_reduce: Callable[..., object] | None,
                    op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """Reduce ``tensors`` (one dtype) over the data-parallel ranks in place, as one flat tensor: one collective,
    not one per tensor. ``all_reduce`` None: alone, nothing to do."""
    if all_reduce is None:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, op=op)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
