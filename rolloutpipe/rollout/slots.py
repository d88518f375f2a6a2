"""Batch membership: which groups form the step's training batches, and the frontier FGD admits first. Pure logic.

Batch membership (``StepSlots``). A step admits groups in order, group 0, 1, 2, ... (group g carries the g-th
prompt the step drew from the source, and its samples are seeded by their ids, so a group's content never
depends on timing). Without filtering every group is trainable and group g belongs to training batch
g // groups_per_batch. With dynamic sampling, a group whose rewards have zero variance is dropped (so is one
whose reward timed out, under reward.on_timeout=drop_group), and the rule becomes: *the j-th trainable group in
group order fills slot j; slot j belongs to batch j // groups_per_batch; the step is full when slot
rollout_batch_size - 1 is filled.* A dropped group is replaced by admitting one more group, and every later
group moves up one slot: the replacement lands in the last batch, while the frontier (below) moves on to the
next group in line. This rule makes membership a function of the samples alone, so ``sync`` and ``cgp`` (and
two runs with the same seed) train the same groups in the same batches.

A trainable group can be published before every group below it is resolved, as soon as its batch
is certain: with t trainable and p pending groups below it, its slot lies in [t, t + p], so it is in
the step when t + p < rollout_batch_size and its batch is known when t and t + p fall in one batch.

Frontier (FGD). The frontier is the set of unresolved groups the next incomplete training batch still
needs: the first ``k`` pending groups in group order, where k is the number of that batch's slots not
yet filled. Frontier-group dispatch (admission.py) admits the frontier's requests first, all samples of a
group together, then the other pending groups in group order (the next batch's first).

The simulator runs this file compiled with mypyc (sim/compiled.py), so it is fully typed.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import Final

# Final: the compiled simulator (sim/compiled.py) calls them directly instead of looking them up in bisect each time
_bisect_left: Final = bisect.bisect_left
_insort: Final = bisect.insort


class GroupState(enum.Enum):
    PENDING = "pending"
    """Admitted, not all samples rewarded yet."""
    TRAINABLE = "trainable"
    FILTERED = "filtered"
    """Dropped, never trained, and replaced (``DropReason`` says why)."""


@dataclass(kw_only=True, slots=True)
class Placement:
    group: int
    batch: int


class StepSlots:
    """Batch membership of one step's groups (see module docstring). Not thread-safe; one owner.

    Kept as sorted lists of pending, filtered and not-yet-placed trainable groups, so that every group
    below g is one of trainable / pending / filtered and g's slot range is computed with two bisections.
    A call scans only the unplaced trainable groups, and stops once ``groups_per_batch`` pending groups
    lie below (no later group can be certain of its batch). The simulator calls this ~1,000 times a step.
    """

    def __init__(self, *, rollout_batch_size: int, groups_per_batch: int) -> None:
        self.rollout_batch_size = rollout_batch_size
        self.groups_per_batch = groups_per_batch
        self.states: list[GroupState] = []
        self.placed: dict[int, int] = {}
        """group -> batch, for groups whose batch is known."""
        self._pending: list[int] = []
        self._filtered: list[int] = []
        self._unplaced: list[int] = []
        """Trainable groups whose batch is not known yet."""

    def admit(self) -> int:
        self.states.append(GroupState.PENDING)
        self._pending.append(len(self.states) - 1)
        return len(self.states) - 1

    def resolve(self, group: int, *, trainable: bool) -> list[Placement]:
        """Record a complete group; returns the groups whose batch became known (this one or later ones)."""
        self.states[group] = GroupState.TRAINABLE if trainable else GroupState.FILTERED
        del self._pending[_bisect_left(self._pending, group)]
        _insort(self._unplaced if trainable else self._filtered, group)
        return self._place_new(group)

    def _place_new(self, resolved: int) -> list[Placement]:
        """Only groups from ``resolved`` up can be placed now: the counts below a lower group did not change."""
        new, size, per_batch, pending, filtered = [], self.rollout_batch_size, self.groups_per_batch, \
            self._pending, self._filtered
        first = _bisect_left(self._unplaced, resolved)
        for g in self._unplaced[first:]:
            pending_below = _bisect_left(pending, g)
            trainable_below = g - pending_below - (_bisect_left(filtered, g) if filtered else 0)
            if pending_below >= per_batch or trainable_below >= size:
                break  # later groups have at least as many below them
            lo, hi = trainable_below, trainable_below + pending_below
            if hi < size and lo // per_batch == hi // per_batch:
                self.placed[g] = lo // per_batch
                new.append(Placement(group=g, batch=self.placed[g]))
        if new:
            self._unplaced[first:] = [g for g in self._unplaced[first:] if g not in self.placed]
        return new

    def num_to_admit(self) -> int:
        """Groups to admit now so that trainable + pending groups can still fill the step (replacements)."""
        return max(self.rollout_batch_size - (len(self.states) - len(self._filtered)), 0)

    def full(self) -> bool:
        return len(self.placed) == self.rollout_batch_size

    def selected(self) -> list[int]:
        return sorted(self.placed)

    def unused(self) -> list[int]:
        """Once full: every group after the last selected one (to abort, and whose prompts go back)."""
        last = max(self.placed)
        return list(range(last + 1, len(self.states)))

    def frontier(self) -> list[int]:
        """Pending groups the next incomplete training batch still needs, in group order."""
        start = self._pending[0] if self._pending else len(self.states)  # every group below is resolved
        filled = start - _bisect_left(self._filtered, start)  # slots filled for certain
        if filled >= self.rollout_batch_size:
            return []
        budget = self.groups_per_batch - filled % self.groups_per_batch  # slots left in that batch
        # A pending group is needed if fewer than `budget` live (not filtered) groups lie from start to it, that
        # is if it lies below `end`, the budget-th live group from start: each filtered group pushes end by one.
        end = start + budget
        for f in self._filtered[_bisect_left(self._filtered, start):]:
            if f >= end:
                break
            end += 1
        return self._pending[:_bisect_left(self._pending, end)]
