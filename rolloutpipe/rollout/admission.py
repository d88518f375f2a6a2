"""Which engine gets which request: ``Admission`` and its policies (FIFO, FGD). Pure logic.

``Admission`` keeps what every policy needs: which engine holds each unfinished request, how many each engine
holds (engines hold at most ``concurrency``), which engines are in service, aborts, and engine failure. A
policy decides what differs: whether a new group's requests go to the engines at once or wait, what ``pump``
submits when a slot frees, and where requests taken off a failed engine go. A policy is an object behind the
``Policy`` protocol; ``POLICIES`` maps the config value (``rollout.admission``, an ``AdmissionPolicy``) to its
class, and is the one place that does: a new policy is one class and one line there.

No threads, clock or I/O of its own: the rollout node (pipeline.py, rollout/node.py) drives it with real
engines, the simulator (rolloutpipe/sim) with simulated ones, through the same ``POLICIES``. The simulator
runs this file compiled with mypyc (sim/compiled.py), so it is fully typed, and sees requests and engines only
through the ``Request`` and ``EngineView`` protocols (a GenerationRequest's id is a string, a simulated one's
an int). FGD's frontier (the groups the next incomplete training batch still needs) comes from slots.py.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final, Protocol


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
    """``rollout.admission``: the policy's name in the config; ``POLICIES`` maps it to the class."""

    fifo = "fifo"
    """FifoPolicy: every request of the step at once, in prompt order (Slime's way)."""
    fgd = "fgd"
    """FgdPolicy: frontier-group dispatch, frontier groups first, all samples of a group together."""


class Policy(Protocol):
    """What differs between admission policies. Admission calls it and passes itself in (a policy keeps no
    reference to it: the simulator runs with the cyclic collector off, and a cycle would stay every step)."""

    def add_group(self, admission: Admission, group: int, requests: Sequence[Request]) -> None:
        """A group was admitted: submit its requests (``admission.submit``) or hold them."""
        ...

    def pump(self, admission: Admission, frontier: Callable[[], list[int]]) -> None:
        """An engine may have a free slot (a request finished) or the frontier moved: submit held requests.

        ``frontier`` scans the step's groups: call it only when a slot is free.
        """
        ...

    def retry(self, admission: Admission, requests: list[tuple[int, Request]]) -> None:
        """(group, request) pairs taken off a failed engine, unchanged, in submission order: back in line."""
        ...

    def engine_back(self, admission: Admission) -> None:
        """An engine (a failed one's replacement) is in service again."""
        ...

    def add_turn(self, admission: Admission, group: int, request: Request, engine: EngineView | None) -> None:
        """An episode's next model turn; ``engine`` served its previous turn (its cache holds the conversation) if
        it is still in service."""
        ...

    def drop(self, groups: list[int]) -> int:
        """The step is full: forget the held requests of ``groups``; returns how many."""
        ...


class FifoPolicy:
    """Submit every request of the step at once in prompt order, a group to an engine, round robin (a cache-aware
    router's choice: one radix cache prefills the shared prompt), and let the engines interleave them: Slime's way.
    Requests taken off a failed engine go to the engines in service at once, round robin one by one; while no
    engine is in service they wait for one."""

    def __init__(self) -> None:
        self._next_engine = 0
        self._orphans: list[tuple[int, Request]] = []
        """Requests to retry while no engine is in service."""

    def add_group(self, admission: Admission, group: int, requests: Sequence[Request]) -> None:
        self._submit_round_robin(admission, group, requests)

    def pump(self, admission: Admission, frontier: Callable[[], list[int]]) -> None:
        pass  # nothing is held while an engine is in service

    def retry(self, admission: Admission, requests: list[tuple[int, Request]]) -> None:
        for group, request in requests:
            self._submit_round_robin(admission, group, [request])

    def engine_back(self, admission: Admission) -> None:
        orphans, self._orphans = self._orphans, []
        for group, request in orphans:
            self._submit_round_robin(admission, group, [request])

    def add_turn(self, admission: Admission, group: int, request: Request, engine: EngineView | None) -> None:
        if engine is None:  # (its engine is out of service: in turn, as a retry)
            self._submit_round_robin(admission, group, [request])
        else:  # where the conversation's prefix is cached, as a group's first turns all go to one engine
            admission.submit(group, [request], engine)

    def drop(self, groups: list[int]) -> int:
        dropped = set(groups)
        num_orphans = len(self._orphans)
        self._orphans = [(g, r) for g, r in self._orphans if g not in dropped]
        return num_orphans - len(self._orphans)

    def _submit_round_robin(self, admission: Admission, group: int, requests: Sequence[Request]) -> None:
        """``requests`` (a group's, or one to retry) to the next engine in service, in turn."""
        engines = admission.serving
        if not engines:
            self._orphans.extend((group, request) for request in requests)
            return
        admission.submit(group, requests, engines[self._next_engine % len(engines)])
        self._next_engine += 1


class FgdPolicy:
    """Frontier-group dispatch: hold requests on the rollout node and fill free engine slots with the frontier
    groups first, all samples of a group together, on the engine with the most free slots; then the other held
    groups in group order. Requests taken off a failed engine wait with the others, in group order. Episodes' next
    turns wait with their group too, and go back to the engine of their previous turns while it has a free slot."""

    def __init__(self) -> None:
        self._waiting: dict[int, list[Request]] = {}
        """Held groups (and requests to retry), in group order."""
        self._turn_engine: dict[int, EngineView] = {}
        """A group whose episodes' next turns wait: the engine that served their previous turns (a group's requests
        go to one engine together), preferred while it has a free slot: its prefix cache holds the conversations."""

    def add_group(self, admission: Admission, group: int, requests: Sequence[Request]) -> None:
        self._waiting[group] = list(requests)

    def pump(self, admission: Admission, frontier: Callable[[], list[int]]) -> None:
        if not self._waiting or (engine := admission.most_free()) is None:
            return
        held = (g for g in frontier() if g in self._waiting)  # lazily: usually one group goes out
        while self._waiting:
            group = next(held, None)
            if group is None:
                group = next(iter(self._waiting))
            cached = self._turn_engine.pop(group, None)
            if cached is not None and cached in admission.serving and admission.has_free_slot(cached):
                engine = cached
            admission.submit(group, self._waiting.pop(group), engine)
            if (engine := admission.most_free()) is None:
                return

    def retry(self, admission: Admission, requests: list[tuple[int, Request]]) -> None:
        new_group = False
        for group, request in requests:
            new_group |= group not in self._waiting
            self._waiting.setdefault(group, []).append(request)
        if new_group:  # (a turn of a group already in line keeps its place: no sort on every turn)
            self._waiting = dict(sorted(self._waiting.items()))

    def engine_back(self, admission: Admission) -> None:
        pass  # the next pump fills it

    def add_turn(self, admission: Admission, group: int, request: Request, engine: EngineView | None) -> None:
        self.retry(admission, [(group, request)])  # in line by its group: the frontier's turns go first
        if engine is not None:
            self._turn_engine[group] = engine

    def drop(self, groups: list[int]) -> int:
        for group in groups:
            self._turn_engine.pop(group, None)
        return sum([len(self._waiting.pop(group, [])) for group in groups])


POLICIES: Final[dict[AdmissionPolicy, Callable[[], Policy]]] = {
    AdmissionPolicy.fifo: FifoPolicy,
    AdmissionPolicy.fgd: FgdPolicy,
}
"""The one place a config value becomes a policy: Admission makes its policy here, on the node and in the simulator."""


class Admission:
    """Hands the step's requests to the engines under a policy (``POLICIES[policy]``).

    Called from the rollout loop only (``finished`` also from engine threads, hence the lock): ``add_group`` when
    a group is admitted, ``pump`` whenever an engine may have a free slot (a request finished) or the frontier
    moved, ``abort_groups`` when the step is full. ``assigned`` remembers which engine holds each request, and
    Admission counts what each engine holds itself (a crashed engine cannot be asked).

    Engine failure (the EngineSupervisor decides when): ``take_out`` puts a failed engine's unfinished requests
    back in line, unchanged (same id, same seed), and they go to the engines in service as the policy sends
    new ones (``Policy.retry``). ``put_back`` puts its replacement (``engines`` is the supervisor's list,
    replaced in place) into service. A result counts only if it comes from the engine the request is assigned
    to now (``finished``), so a late result of the failed engine is ignored and no sample is counted twice.
    """

    def __init__(self, *, policy: AdmissionPolicy, engines: Sequence[EngineView], concurrency: int) -> None:
        self.policy: Policy = POLICIES[policy]()
        self.engines = engines
        self.concurrency = concurrency
        self.assigned: dict[Hashable, EngineView] = {}
        """The engine holding each unfinished request."""
        self._num_held: dict[str, int] = {}
        """Unfinished requests per engine name (names are unique: a restarted engine gets a new one)."""
        self._total_held = 0
        """Their sum: while it is at least every engine's concurrency, no engine has a free slot (pump is hot)."""
        self._out_of_service: list[EngineView] = []
        self.serving = list(engines)
        """``engines`` minus those out of service (recomputed on take_out / put_back only: pump is hot)."""
        self._capacity = concurrency * len(engines)
        """Slots of the engines in service."""
        self._submitted: dict[int, dict[Hashable, Request]] = {}
        self._aborted: set[Hashable] = set()
        self._aborted_groups: set[int] = set()
        self._lock = threading.Lock()

    def add_group(self, group: int, requests: Sequence[Request]) -> None:
        self.policy.add_group(self, group, requests)

    def add_turn(self, group: int, request: Request, engine_name: str = "") -> bool:
        """An episode of ``group`` asks for its next model turn (multi-turn environments); ``engine_name`` served
        its previous turn. FIFO sends it there at once (its cache holds the conversation so far); FGD puts it in line
        by its group, so the frontier's turns go first (``Policy.add_turn``). Returns False when the group was
        aborted (the step no longer needs it): the episode ends there."""
        if group in self._aborted_groups:
            return False
        engine = next((e for e in self.serving if e.name == engine_name), None)
        self.policy.add_turn(self, group, request, engine)
        return True

    def pump(self, frontier: Callable[[], list[int]]) -> None:
        """Fill free engine slots with held requests (FGD: frontier groups first, a whole group at a time).

        ``frontier`` is called only when a slot is free (it scans the step's groups).
        """
        self.policy.pump(self, frontier)

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
        """Drop held requests and abort submitted ones of ``groups``; returns how many were aborted."""
        num_aborted = self.policy.drop(groups)
        self._aborted_groups.update(groups)
        for group in groups:
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
        self.serving = self._in_service()
        self._capacity = self.concurrency * len(self.serving)
        retry = [(group, request) for group, requests in self._submitted.items() for request in requests.values()
                 if request.request_id in held and request.request_id not in self._aborted]  # submission order
        self.policy.retry(self, retry)
        return len(retry)

    def put_back(self, failed: EngineView, replacement: EngineView) -> None:
        """``replacement`` (in ``engines`` now) serves; FIFO hands it the requests that waited."""
        if failed in self._out_of_service:  # else it failed in an earlier step, and restarted on another node
            self._out_of_service.remove(failed)
        self.serving = self._in_service()
        self._capacity = self.concurrency * len(self.serving)
        self.policy.engine_back(self)

    def has_free_slot(self, engine: EngineView) -> bool:
        return self._num_held.get(engine.name, 0) < self.concurrency

    def most_free(self) -> EngineView | None:
        """The engine in service with the most free slots, if it has one (a lock-free read of the counts)."""
        if self._total_held >= self._capacity:
            return None
        held, best, fewest = self._num_held, None, self.concurrency
        for engine in self.serving:
            num = held.get(engine.name, 0)
            if num < fewest:
                best, fewest = engine, num
        return best

    def submit(self, group: int, requests: Sequence[Request], engine: EngineView) -> None:
        """Hand ``requests`` of ``group`` to ``engine`` (policies call it) and count them as its own."""
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

    def _in_service(self) -> list[EngineView]:
        return [e for e in self.engines if e not in self._out_of_service]
