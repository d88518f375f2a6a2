"""Which groups form the step's training batches, and which request an engine gets next: pure logic.

``StepSlots`` (batch membership, below), ``GroupAssembler`` (rewarded samples -> complete groups and their
advantages), ``Admission`` (which engine gets which request, FIFO or FGD) and ``RolloutSchedule`` (one step's
bookkeeping over them) have no threads, clock or I/O of their own: the rollout node (pipeline.py) drives them
with real engines, the simulator (rolloutpipe/sim) with simulated ones. The simulator runs this file compiled
with mypyc (sim/compiled.py), so it is fully typed, and sees requests and engines only through the ``Request``
and ``EngineView`` protocols (a GenerationRequest's id is a string, a simulated one's an int).

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
yet filled. Frontier-group dispatch admits the frontier's requests first, all samples of a group
together, then the other pending groups in group order (the next batch's first).
"""

from __future__ import annotations

import bisect
import enum
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from rolloutpipe.types import CompleteGroup, DropReason, Prompt, Sample

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


class Request(Protocol):
    """What Admission reads of a request: a GenerationRequest (its id a string) or a simulated one (an int)."""

    @property
    def request_id(self) -> Hashable: ...


class EngineView(Protocol):
    """What Admission uses of an engine: engine.base.Engine has it, and so has the simulator's SimEngine."""

    @property
    def name(self) -> str: ...

    @property
    def error(self) -> BaseException | None: ...

    def submit(self, request: Any) -> None: ...

    def abort(self, request_id: Any) -> None: ...


class AdmissionPolicy(enum.Enum):
    fifo = "fifo"
    """Submit every request of the step at once in prompt order, a group to an engine, round robin (a cache-aware
    router's choice: one radix cache prefills the shared prompt), and let the engines interleave them: Slime's way."""
    fgd = "fgd"
    """Frontier-group dispatch: hold requests on the rollout node and fill free engine slots with the
    frontier groups first, all samples of a group together, on the engine with the most free slots."""


def group_advantages(rewards: list[float], *, normalize_std: bool) -> list[float]:
    """GRPO advantages of one group from its own rewards only (trainer/grpo.py); a group with one reward value gets zeros."""
    mean = math.fsum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if normalize_std and len(rewards) > 1:
        std = math.sqrt(math.fsum([c * c for c in centered]) / (len(rewards) - 1))  # unbiased, as torch.std
        centered = [c / (std + 1e-6) for c in centered]
    return centered


class GroupAssembler:
    """Collects rewarded samples; a group is complete when all ``n_samples`` are in. Thread-safe.

    ``prompts`` is the step's list of admitted prompts, indexed by group; it grows as groups are admitted.
    """

    def __init__(self, *, step: int, policy_version: int, prompts: list[Prompt], n_samples: int,
                 normalize_std: bool) -> None:
        self.step = step
        self.policy_version = policy_version
        self.prompts = prompts
        self.n_samples = n_samples
        self.normalize_std = normalize_std
        self._pending: dict[int, dict[int, Sample]] = {}
        self._lock = threading.Lock()

    def add(self, sample: Sample) -> CompleteGroup | None:
        with self._lock:
            samples = self._pending.get(sample.group)
            if samples is None:
                samples = self._pending[sample.group] = {}
            samples[sample.index] = sample
            if len(samples) < self.n_samples:
                return None
            del self._pending[sample.group]
            ordered = [samples[i] for i in range(self.n_samples)]
            prompt = self.prompts[sample.group]
            group = CompleteGroup(
                step=self.step,
                group=sample.group,
                policy_version=self.policy_version,
                prompt_index=prompt.index,
                prompt_ids=prompt.input_ids,
                samples=ordered,
                advantages=group_advantages([s.reward for s in ordered], normalize_std=self.normalize_std),
                completed_s=time.time(),
            )
            return group


class Admission:
    """Hands the step's requests to the engines under FIFO or FGD (see AdmissionPolicy).

    Called from the rollout loop only (``finished`` also from engine threads, hence the lock): ``add_group`` when
    a group is admitted, ``pump`` whenever an engine may have a free slot (a request finished) or the frontier
    moved, ``abort_groups`` when the step is full. ``assigned`` remembers which engine holds each request, and
    Admission counts what each engine holds itself (a crashed engine cannot be asked).

    Engine failure (the EngineSupervisor decides when): ``take_out`` puts a failed engine's unfinished requests
    back in line, unchanged (same id, same seed), and they go to the engines in service as new ones would:
    under FIFO at once, round robin one by one; under FGD by ``pump``, frontier groups first. ``put_back`` puts its
    replacement (``engines`` is the supervisor's list, replaced in place) into service. A result counts only
    if it comes from the engine the request is assigned to now (``finished``), so a late result of the failed
    engine is ignored and no sample is counted twice.
    """

    def __init__(self, *, policy: AdmissionPolicy, engines: Sequence[EngineView], concurrency: int) -> None:
        self.policy = policy
        self.engines = engines
        self.concurrency = concurrency
        self.assigned: dict[Hashable, EngineView] = {}
        """The engine holding each unfinished request."""
        self._num_held: dict[str, int] = {}
        """Unfinished requests per engine name (names are unique: a restarted engine gets a new one)."""
        self._total_held = 0
        """Their sum: while it is at least every engine's concurrency, no engine has a free slot (pump is hot)."""
        self._waiting: dict[int, list[Request]] = {}
        """FGD's held groups (and requests to retry), in group order."""
        self._orphans: list[tuple[int, Request]] = []
        """FIFO's requests to retry while no engine is in service."""
        self._out_of_service: list[EngineView] = []
        self._serving = list(engines)
        """``engines`` minus those out of service (recomputed on take_out / put_back only: pump is hot)."""
        self._capacity = concurrency * len(engines)
        """Slots of the engines in service."""
        self._submitted: dict[int, dict[Hashable, Request]] = {}
        self._aborted: set[Hashable] = set()
        self._next_engine = 0
        self._lock = threading.Lock()

    def add_group(self, group: int, requests: Sequence[Request]) -> None:
        if self.policy is AdmissionPolicy.fifo:
            self._submit_round_robin(group, requests)
        else:
            self._waiting[group] = list(requests)

    def pump(self, frontier: Callable[[], list[int]]) -> None:
        """FGD: fill free engine slots, frontier groups first, a whole group at a time.

        ``frontier`` is called only when a slot is free (it scans the step's groups).
        """
        if not self._waiting or self._total_held >= self._capacity or (engine := self._most_free()) is None:
            return  # (the capacity test is _most_free's first, here without a call: pump runs after every finish)
        held = (g for g in frontier() if g in self._waiting)  # lazily: usually one group goes out
        while self._waiting:
            group = next(held, None)
            if group is None:
                group = next(iter(self._waiting))
            self._submit(group, self._waiting.pop(group), engine)
            if (engine := self._most_free()) is None:
                return

    def finished(self, request_id: Hashable, engine_name: str) -> bool:
        """An engine handed the request back (any finish reason); returns whether the result counts.

        It does not when the request is no longer assigned to that engine (a late result of a failed engine) or
        was already handed back, or belongs to another step.
        """
        with self._lock:
            engine = self.assigned.pop(request_id, None)
            if engine is None:
                return False
            if engine.name != engine_name:
                self.assigned[request_id] = engine
                return False
            self._num_held[engine_name] -= 1
            self._total_held -= 1
            return True

    def abort_groups(self, groups: list[int]) -> int:
        """Drop waiting requests and abort submitted ones of ``groups``; returns how many were aborted."""
        num_aborted = 0
        dropped = set(groups)
        num_orphans = len(self._orphans)
        self._orphans = [(g, r) for g, r in self._orphans if g not in dropped]
        num_aborted += num_orphans - len(self._orphans)
        for group in groups:
            num_aborted += len(self._waiting.pop(group, []))
            for request_id in self._submitted.get(group, {}):
                with self._lock:
                    engine = self.assigned.get(request_id)
                    self._aborted.add(request_id)
                if engine is not None:
                    engine.abort(request_id)
                    num_aborted += 1
        return num_aborted

    def num_in_flight(self) -> int:
        """Requests submitted and not handed back yet (on any engine)."""
        with self._lock:
            return len(self.assigned)

    def num_held(self, engine: EngineView) -> int:
        with self._lock:
            return self._num_held.get(engine.name, 0)

    def take_out(self, engine: EngineView) -> int:
        """Take a failed engine out of service and put its unfinished requests back in line; returns how many.

        Requests already aborted (unused over-sampled groups) are dropped instead: nobody waits for them.
        """
        with self._lock:
            held = {r for r, e in self.assigned.items() if e is engine}
            for r in held:
                del self.assigned[r]
            self._total_held -= self._num_held.get(engine.name, 0)
            self._num_held[engine.name] = 0
        self._out_of_service.append(engine)
        self._serving = self._in_service()
        self._capacity = self.concurrency * len(self._serving)
        retry = [(group, request) for group, requests in self._submitted.items() for request in requests.values()
                 if request.request_id in held and request.request_id not in self._aborted]  # submission order
        for group, request in retry:
            if self.policy is AdmissionPolicy.fifo:
                self._submit_round_robin(group, [request])
            else:
                self._waiting.setdefault(group, []).append(request)
        self._waiting = dict(sorted(self._waiting.items()))
        return len(retry)

    def put_back(self, failed: EngineView, replacement: EngineView) -> None:
        """``replacement`` (in ``engines`` now) serves; FIFO hands it the requests that waited."""
        if failed in self._out_of_service:  # else it failed in an earlier step, and restarted on another node
            self._out_of_service.remove(failed)
        self._serving = self._in_service()
        self._capacity = self.concurrency * len(self._serving)
        orphans, self._orphans = self._orphans, []
        for group, request in orphans:
            self._submit_round_robin(group, [request])

    def _in_service(self) -> list[EngineView]:
        return [e for e in self.engines if e not in self._out_of_service]

    def _most_free(self) -> EngineView | None:
        """The engine in service with the most free slots, if it has one (a lock-free read of the counts)."""
        if self._total_held >= self._capacity:
            return None
        held, best, fewest = self._num_held, None, self.concurrency
        for engine in self._serving:
            num = held.get(engine.name, 0)
            if num < fewest:
                best, fewest = engine, num
        return best

    def _submit_round_robin(self, group: int, requests: Sequence[Request]) -> None:
        """FIFO: ``requests`` (a group's, or one to retry) to the next engine in service, in turn."""
        engines = self._serving
        if not engines:
            self._orphans.extend((group, request) for request in requests)
            return
        self._submit(group, requests, engines[self._next_engine % len(engines)])
        self._next_engine += 1

    def _submit(self, group: int, requests: Sequence[Request], engine: EngineView) -> None:
        with self._lock:
            for request in requests:
                self.assigned[request.request_id] = engine
            self._num_held[engine.name] = self._num_held.get(engine.name, 0) + len(requests)
            self._total_held += len(requests)
        submitted = self._submitted.setdefault(group, {})
        for request in requests:
            submitted[request.request_id] = request
            try:
                engine.submit(request)
            except Exception:
                if engine.error is None:
                    raise
                # it failed since the supervisor last looked: the request stays assigned to it until the
                # supervisor takes the engine out and puts its requests back in line


@dataclass(kw_only=True, slots=True)
class Resolution:
    """What one complete group changed: why it is dropped (None: trainable), and the groups now placed."""

    dropped: DropReason | None
    placed: list[CompleteGroup]


class RolloutSchedule:
    """One step's rollout bookkeeping: which groups to admit and when, and which complete groups go out.

    Pure (no threads, clock or I/O): the rollout node (pipeline.py) and the simulator (rolloutpipe/sim) run
    the same scheduling code, with real engines and simulated ones. ``draw(k)`` returns the next k prompts of
    the source; ``requests_for(group, prompt)`` makes a group's requests. ``start`` admits the step's groups
    (plus over-sampling when filtering); ``on_group`` resolves a complete group (drop or place, admit a
    replacement, refill engines); ``on_slot_freed`` refills engines; once ``full``, ``finish`` aborts the rest.
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
