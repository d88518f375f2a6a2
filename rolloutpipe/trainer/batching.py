"""The trainer's consume loop as pure logic: handles in publish order -> micro-batches and optimizer steps.

Handles of one step arrive in publish order, each tagged with its training batch. Batch b is trained
only after batch b - 1's optimizer step (its gradients are taken at the weights that step produced),
so handles of later batches wait in ``arrived`` until their turn. Within the batch being trained, the
groups are dealt round-robin over the data-parallel ranks in arrival order (group i of the batch goes
to rank i % world_size); a rank packs its samples into micro-batches as they come, runs what is left
when the batch's last group is in, then every rank takes the optimizer step. Which rank trained which
group, and how its samples were packed, changes only the order of floating-point additions: the loss
normaliser is the batch's total (torch_backend.py).

Packing (``per_group``: within each group only, so that micro-batches do not depend on arrival). With
``max_tokens_per_micro_batch`` = 0 a micro-batch is ``micro_batch_size`` samples in
arrival order. With a budget B, the rank packs first fit by tokens (Slime's dynamic batch size):
grpo_trainer.pack right-pads every row to the micro-batch's longest sequence (prompt + response), so
memory scales with rows x longest, and that *padded* size is what B bounds. A sample goes into the
first open micro-batch it fits in, (rows + 1) x max(longest, its length) <= B, else opens a new one.
A micro-batch is emitted as soon as no sample of any length can join it, (rows + 1) x longest > B
(a newcomer pads to at least ``longest``), so training starts while groups still arrive; the open
ones are emitted when the batch's last group is in. A sample longer than B alone gets its own
micro-batch (nothing can join it; lengths are unknown until the rollout, so this warns once, and
trains).

``pipeline.train_step`` runs this with real handles and the real trainer (samples are TrainSamples);
the simulator (rolloutpipe/sim) runs it with simulated groups on a virtual clock (samples are their
token counts). ``length`` gives a sample's prompt + response tokens for either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
_warned_oversized = False
"""Whether this process has said that a sample exceeded the token budget (once is enough)."""


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    batch: int
    samples: list[Any]
    rank: int = 0
    """The data-parallel rank that trains it."""
    num_padded_tokens: int = 0
    """Its token slots once right-padded: len(samples) x its longest sequence (what the token budget bounds)."""
    num_padding_tokens: int = 0
    """The slots of ``num_padded_tokens`` that hold no token of a sample."""


@dataclass(kw_only=True, slots=True)
class OptimizerStep:
    batch: int
    groups: list[int]
    """The batch's groups, in arrival order."""


@dataclass(kw_only=True, slots=True)
class _Open:
    """A micro-batch being filled."""

    samples: list[Any] = field(default_factory=list)
    longest: int = 0
    num_tokens: int = 0

    def padded_with(self, length: int) -> int:
        return (len(self.samples) + 1) * max(self.longest, length)

    def add(self, sample: Any, length: int) -> None:
        self.samples.append(sample)
        self.longest = max(self.longest, length)
        self.num_tokens += length

    def close(self, batch: int, rank: int) -> MicroBatch:
        padded = len(self.samples) * self.longest
        return MicroBatch(batch=batch, samples=self.samples, rank=rank, num_padded_tokens=padded,
                          num_padding_tokens=padded - self.num_tokens)


@dataclass(kw_only=True, slots=True)
class BatchConsumer:
    """One rank's share of one step's training batches (see module docstring); with ``rank=None`` every
    rank's (the simulator's trainer node group: one consumer, micro-batches tagged with their rank)."""

    num_batches: int
    groups_per_batch: int
    micro_batch_size: int
    length: Callable[[Any], int]
    """A sample's prompt + response tokens: its row's length before padding."""
    max_tokens_per_micro_batch: int = 0
    """0: ``micro_batch_size`` samples per micro-batch; else a budget of padded tokens (module docstring)."""
    per_group: bool = False
    """Micro-batches never span two groups (a group's open ones close with its last sample): each is then defined
    by the batch's content, not by arrival (trainer.exact_accumulation, exact_sum.py)."""
    rank: int | None = 0
    world_size: int = 1
    current: int = 0
    """The training batch being trained."""
    _arrived: list[list[Any]] = field(default_factory=list)
    _next_in_batch: int = 0
    _open: list[list[_Open]] = field(default_factory=list)
    """Per rank: its micro-batches being filled, oldest first (at most one with a fixed micro_batch_size)."""

    def __post_init__(self) -> None:
        self._arrived = [[] for _ in range(self.num_batches)]
        self._open = [[] for _ in range(self.world_size)]

    def arrive(self, handle: Any, load: Callable[[Any], list[Any]]) -> list[MicroBatch | OptimizerStep]:
        """The work ``handle`` makes possible, in order; ``load`` turns a handle into samples (called only
        for the consumer's own groups)."""
        arrived = self._arrived
        arrived[handle.batch].append(handle)
        if handle.batch != self.current:  # it waits for its batch's turn (every handle before it is taken)
            return []
        work: list[MicroBatch | OptimizerStep] = []
        current, taken = self.current, self._next_in_batch
        while current < self.num_batches and taken < len(arrived[current]):
            batch = arrived[current]
            owner = taken % self.world_size
            if self.rank is None or owner == self.rank:
                for sample in load(batch[taken]):
                    closed = self._place(self._open[owner], sample)
                    if closed is not None:
                        work.append(closed.close(current, owner))
                if self.per_group:
                    work.extend(m.close(current, owner) for m in self._open[owner])
                    self._open[owner] = []
            taken += 1
            if taken == self.groups_per_batch:  # the training batch is complete: what is open, then the step
                for rank, open_ in enumerate(self._open):
                    work.extend(m.close(current, rank) for m in open_)
                    self._open[rank] = []
                work.append(OptimizerStep(batch=current, groups=[h.group for h in batch]))
                current, taken = current + 1, 0
        self.current, self._next_in_batch = current, taken
        return work

    def _place(self, open_: list[_Open], sample: Any) -> _Open | None:
        """Put ``sample`` into one of a rank's ``open_`` micro-batches; returns that one if it is now full."""
        length, budget = self.length(sample), self.max_tokens_per_micro_batch
        i = 0
        if budget > 0:  # first fit; with no budget, the one open micro-batch
            while i < len(open_) and open_[i].padded_with(length) > budget:
                i += 1
            if length > budget:
                _warn_oversized(length, budget)
        if i == len(open_):
            open_.append(_Open())
        target = open_[i]
        target.add(sample, length)
        if budget == 0:
            full = len(target.samples) >= self.micro_batch_size
        else:  # no newcomer fits: it would pad to at least ``longest``
            full = (len(target.samples) + 1) * target.longest > budget
        if full:
            del open_[i]
            return target
        return None

    def done(self) -> bool:
        return self.current == self.num_batches


def _warn_oversized(length: int, budget: int) -> None:
    global _warned_oversized
    if not _warned_oversized:
        _warned_oversized = True
        log.warning("a sample of %d tokens (prompt + response) exceeds max_tokens_per_micro_batch=%d; it is "
                    "trained in a micro-batch of its own (said once; raise the budget if memory allows).",
                    length, budget)
