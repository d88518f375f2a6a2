"""The trainer's consume loop as pure logic: handles in publish order -> micro-batches and optimizer steps.

Handles of one step arrive in publish order, each tagged with its training batch. Batch b is trained
only after batch b - 1's optimizer step (its gradients are taken at the weights that step produced),
so handles of later batches wait in ``arrived`` until their turn. Within the batch being trained, the
groups are dealt round-robin over the data-parallel ranks in arrival order (group i of the batch goes
to rank i % world_size); a rank cuts its samples into micro-batches of ``micro_batch_size`` as they
come and runs the remainder when the batch's last group is in, then every rank takes the optimizer
step. Which rank trained which group changes only the order of floating-point additions (trainer.py).

``TrainerNode.train_step`` (pipeline.py) runs this with real handles and the real trainer; the
simulator (rolloutpipe/sim) runs it with simulated groups on a virtual clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    batch: int
    samples: list[Any]


@dataclass(kw_only=True, slots=True)
class OptimizerStep:
    batch: int
    groups: list[int]
    """The batch's groups, in arrival order."""


@dataclass(kw_only=True, slots=True)
class BatchConsumer:
    """One rank's share of one step's training batches (see module docstring)."""

    num_batches: int
    groups_per_batch: int
    micro_batch_size: int
    rank: int = 0
    world_size: int = 1
    current: int = 0
    """The training batch being trained."""
    _arrived: list[list[Any]] = field(default_factory=list)
    _next_in_batch: int = 0
    _local: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._arrived = [[] for _ in range(self.num_batches)]

    def arrive(self, handle: Any, load: Callable[[Any], list[Any]]) -> list[MicroBatch | OptimizerStep]:
        """The work ``handle`` makes possible on this rank, in order; ``load`` turns a handle into samples
        (called only for this rank's groups)."""
        self._arrived[handle.batch].append(handle)
        work: list[MicroBatch | OptimizerStep] = []
        while self.current < self.num_batches and self._next_in_batch < len(self._arrived[self.current]):
            batch = self._arrived[self.current]
            if self._next_in_batch % self.world_size == self.rank:
                self._local.extend(load(batch[self._next_in_batch]))
                while len(self._local) >= self.micro_batch_size:
                    work.append(MicroBatch(batch=self.current, samples=self._local[: self.micro_batch_size]))
                    self._local = self._local[self.micro_batch_size :]
            self._next_in_batch += 1
            if self._next_in_batch == self.groups_per_batch:  # the training batch is complete
                if self._local:
                    work.append(MicroBatch(batch=self.current, samples=self._local))
                    self._local = []
                work.append(OptimizerStep(batch=self.current, groups=[h.group for h in batch]))
                self.current, self._next_in_batch = self.current + 1, 0
        return work

    def done(self) -> bool:
        return self.current == self.num_batches
