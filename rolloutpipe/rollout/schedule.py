"""One step's rollout bookkeeping: which groups to admit and when, and which complete groups go out. Pure logic.

``RolloutSchedule`` strings together batch membership (``StepSlots``, slots.py) and admission (``Admission``,
admission.py). It has no threads, clock or I/O of its own: the rollout node (pipeline.py) drives it with real
engines, the simulator (rolloutpipe/sim) with simulated ones, so both run the same scheduling code. The
simulator runs this file compiled with mypyc (sim/compiled.py), so it is fully typed.

A complete group is dropped for zero variance under dynamic sampling (``rollout.filter_zero_variance``), or for
a reward that timed out under reward.on_timeout=drop_group; a dropped group is replaced by admitting one more
(slots.py says where the replacement lands), within ``rollout.max_groups_per_step``. A kept group goes out
once its training batch is certain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rolloutpipe.rollout.admission import Admission, Request
from rolloutpipe.rollout.slots import StepSlots
from rolloutpipe.types import CompleteGroup, DropReason, Prompt


@dataclass(kw_only=True, slots=True)
class Resolution:
    """What one complete group changed: why it is dropped (None: trainable), and the groups now placed."""

    dropped: DropReason | None
    placed: list[CompleteGroup]


class RolloutSchedule:
    """One step's rollout bookkeeping: which groups to admit and when, and which complete groups go out.

    ``draw(k)`` returns the next k prompts of the source; ``requests_for(group, prompt)`` makes a group's
    requests. ``start`` admits the step's groups (plus over-sampling when filtering); ``on_group`` resolves a
    complete group (drop or place, admit a replacement, refill engines); ``on_slot_freed`` refills engines; once
    ``full``, ``finish`` aborts the rest.
    """

    def __init__(self, *, rollout_batch_size: int, groups_per_batch: int, filter_zero_variance: bool,
                 drop_timed_out: bool, over_sampling_groups: int, max_groups: int, admission: Admission,
                 draw: Callable[[int], list[Prompt]], requests_for: Callable[[int, Prompt], Sequence[Request]]) -> None:
        self.slots = StepSlots(rollout_batch_size=rollout_batch_size, groups_per_batch=groups_per_batch)
        self.filter_zero_variance = filter_zero_variance
        self.drop_timed_out = drop_timed_out  # reward.on_timeout=drop_group
        self.max_groups = max_groups
        """The most groups the step may admit (dropped groups are replaced: without a bound, prompts that all get
        equal rewards, or a reward that always times out, would admit groups forever)."""
        self.num_initial_groups = rollout_batch_size + (over_sampling_groups if filter_zero_variance else 0)
        self.admission = admission
        self.draw = draw
        self.requests_for = requests_for
        self.prompts: list[Prompt] = []
        """The step's admitted prompts, by group."""
        self.complete: dict[int, CompleteGroup] = {}
        self.num_filtered = self.num_timeout_dropped = 0  # groups dropped for zero variance, for a reward timeout

    def start(self) -> None:
        self._admit(self.num_initial_groups)
        self.admission.pump(self.slots.frontier)

    def on_group(self, group: CompleteGroup) -> Resolution:
        self.complete[group.group] = group
        timed_out = self.drop_timed_out and any([s.reward_timed_out for s in group.samples])  # first: its 0s may be
        flat = self.filter_zero_variance and len({s.reward for s in group.samples}) == 1  # what made the rewards flat
        dropped = DropReason.reward_timeout if timed_out else DropReason.zero_variance if flat else None
        self.num_filtered += dropped is DropReason.zero_variance
        self.num_timeout_dropped += dropped is DropReason.reward_timeout
        placed = []
        for p in self.slots.resolve(group.group, trainable=dropped is None):
            self.complete[p.group].batch = p.batch
            placed.append(self.complete[p.group])
        self._admit(self.slots.num_to_admit())  # a dropped group's replacement, within max_groups
        self.admission.pump(self.slots.frontier)
        return Resolution(dropped=dropped, placed=placed)

    def on_slot_freed(self) -> None:
        self.admission.pump(self.slots.frontier)

    def full(self) -> bool:
        return self.slots.full()

    def finish(self) -> tuple[list[int], int]:
        """Abort the over-sampled groups past the last selected one; returns them and the requests aborted.

        Their prompts (``self.prompts[g]``) go back to the source.
        """
        unused = self.slots.unused()
        return unused, self.admission.abort_groups(unused)

    def selected(self) -> list[CompleteGroup]:
        return [self.complete[g] for g in self.slots.selected()]

    def _admit(self, num_groups: int) -> None:
        if len(self.prompts) + num_groups > self.max_groups:
            raise RuntimeError(self._too_many_groups())  # a plain one: mypyc compiles no builtin-exception subclass
        for prompt in self.draw(num_groups) if num_groups else []:
            group = self.slots.admit()
            self.prompts.append(prompt)
            self.admission.add_group(group, self.requests_for(group, prompt))

    def _too_many_groups(self) -> str:  # why the step cannot be filled within max_groups, and what to change
        resolved, filtered, timed_out = len(self.complete), self.num_filtered, self.num_timeout_dropped
        said = f"the step needs more than rollout.max_groups_per_step={self.max_groups} groups: "
        if not timed_out:
            return said + (f"{resolved - filtered} of the {resolved} complete ones are trainable and {filtered} "
                           f"({100 * filtered // max(resolved, 1)}%) had rewards all equal (zero variance), which "
                           "dynamic sampling drops. The prompts are too easy or too hard for the policy: use "
                           "prompts it solves sometimes, raise rollout.max_groups_per_step, or set "
                           "rollout.filter_zero_variance=false.")
        also = f" ({filtered} more had rewards all equal, which dynamic sampling drops)" if filtered else ""
        return said + (f"{resolved - filtered - timed_out} of the {resolved} complete ones are trainable and "
                       f"{timed_out} ({100 * timed_out // resolved}%) had a reward call that ran past "
                       f"reward.timeout_s, which reward.on_timeout=drop_group drops{also}. The reward function is "
                       "too slow for its timeout: make it faster, raise reward.timeout_s or "
                       "rollout.max_groups_per_step, or set reward.on_timeout=zero.")
