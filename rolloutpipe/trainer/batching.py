"""The trainer's consume loop as pure logic: handles in publish order -> micro-batches and optimizer steps.

Handles of one step arrive in publish order, each tagged with its training batch. Batch b is trained
only after batch b - 1's optimizer step (its gradients are taken at the weights that step produced),
so handles of later batches wait in ``arrived`` until their turn. Within the batch being trained, the
groups are dealt round-robin over the data-parallel ranks in arrival order (group i of the batch goes
to rank i % world_size); a rank cuts its samples into micro-batches of ``micro_batch_size`` as they
come and runs the remainder when the batch's last group is in, then every rank takes the optimizer
step. Which rank trained which group changes only the order of floating-point additions (torch_backend.py).

``pipeline.train_step`` runs this with real handles and the real trainer; the
simulator (rolloutpipe/sim) runs it with simulated groups on a virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    batch: int
    samples: list[Any]
    rank: int = 0
    """The data-parallel rank that trains it."""


@dataclass(kw_only=True, slots=True)
class OptimizerStep:
    batch: int
    groups: list[int]
    """The batch's groups, in arrival order."""


@dataclass(kw_only=True, slots=True)
class BatchConsumer:
    """One rank's share of one step's training batches (see module docstring); with ``rank=None`` every
    rank's (the simulator's trainer node group: one consumer, micro-batches tagged with their rank)."""

    num_batches: int
    groups_per_batch: int
    micro_batch_size: int
    rank: int | None = 0
    world_size: int = 1
    current: int = 0
    """The training batch being trained."""
    _arrived: list[list[Any]] = field(default_factory=list)
    _next_in_batch: int = 0
    _local: list[list[Any]] = field(default_factory=list)
    """Per rank: samples not cut into a micro-batch yet."""

    def __post_init__(self) -> None:
        self._arrived = [[] for _ in range(self.num_batches)]
        self._local = [[] for _ in range(self.world_size)]

    def arrive(self, handle: Any, load: Callable[[Any], list[Any]]) -> list[MicroBatch | OptimizerStep]:
        """The work ``handle`` makes possible, in order; ``load`` turns a handle into samples (called only
        for the consumer's own groups)."""
        arrived = self._arrived
        arrived[handle.batch].append(handle)
        if handle.batch != self.current:  # it waits for its batch's turn (every handle before it is taken)
            return []
        work: list[MicroBatch | OptimizerStep] = []
        current, taken, size = self.current, self._next_in_batch, self.micro_batch_size
        while current < self.num_batches and taken < len(arrived[current]):
            batch = arrived[current]
            owner = taken % self.world_size
            if self.rank is None or owner == self.rank:
                local = self._local[owner]
                local.extend(load(batch[taken]))
                while len(local) >= size:
                    work.append(MicroBatch(batch=current, samples=local[:size], rank=owner))
                    del local[:size]
            taken += 1
            if taken == self.groups_per_batch:  # the training batch is complete: remainders, then the step
                for rank, local in enumerate(self._local):
                    if local:
                        work.append(MicroBatch(batch=current, samples=local, rank=rank))
                        self._local[rank] = []
                work.append(OptimizerStep(batch=current, groups=[h.group for h in batch]))
                current, taken = current + 1, 0
        self.current, self._next_in_batch = current, taken
        return work

    def done(self) -> bool:
        return self.current == self.num_batches
