"""The simulator's clock and engines.

``EventLoop`` is a plain discrete-event loop: callbacks ordered by (time, insertion). ``SimEngine`` has
the interface the real ``rollout.Admission`` uses (``name``, ``submit``, ``abort``, ``num_in_flight``)
and behaves like an SGLang server or the embedded engine: at most ``concurrency`` requests run, the
rest wait in submission order, a finished request leaves at once and a waiting one joins between
decode iterations. Time is advanced analytically, not iteration by iteration: between two changes of
the running batch every request gains one token per iteration, so the next finish is the smallest
remaining length and its time is a closed form of the cost model (models.EngineModel.decode_s).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable

from rolloutpipe.sim.models import EngineModel


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def at(self, time_s: float, callback: Callable, arg=None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time_s, self._seq, callback, arg))

    def runs_next(self, time_s: float) -> bool:
        """Whether an event at ``time_s`` would be the next one (lets a hot callback continue inline instead of
        pushing and popping itself). The run's ``done`` condition only changes in an event of its own, so a
        callback that goes on before the next event cannot miss it."""
        return not self._heap or time_s < self._heap[0][0]

    def run_until(self, done: Callable[[], bool]) -> None:
        heap = self._heap
        while heap and not done():
            self.now, _, callback, arg = heapq.heappop(heap)
            callback(arg)
        if not done():
            raise RuntimeError("simulation stalled: no event left before the step was full (a model bug)")

    def clear(self) -> None:
        self._heap.clear()


class SimRequest:
    """One sample to generate, with what the models decided about it up front (a plain class: the
    simulator makes millions, and a positional ``__init__`` is the cheapest)."""

    __slots__ = ("request_id", "group", "sample", "prompt_len", "response_len", "reward", "priority",
                 "submitted_s", "started_s", "joined_at")

    def __init__(self, request_id: int, group: int, sample: int, prompt_len: int, response_len: int,
                 reward: float) -> None:
        self.request_id = request_id
        self.group = group
        self.sample = sample
        self.prompt_len = prompt_len
        self.response_len = response_len
        self.reward = reward
        self.priority = 0
        self.submitted_s = 0.0
        self.started_s = 0.0
        self.joined_at = 0
        """The engine's iteration count when the request joined the running batch."""


OnSimResult = Callable[[str, list[SimRequest], bool, float], None]
"""(engine name, requests finished in the same iteration, aborted, finished_s)."""


class SimEngine:
    def __init__(self, *, name: str, concurrency: int, model: EngineModel, loop: EventLoop,
                 on_result: OnSimResult) -> None:
        self.name = name
        self.concurrency = concurrency
        self.model = model
        self.loop = loop
        self.on_result = on_result
        self._waiting: deque[SimRequest] = deque()
        self._running: list[tuple[int, int, SimRequest]] = []
        """Heap of (iteration at which it finishes, request id, request)."""
        self._iteration = 0
        self._time_s = 0.0
        """Time at which iteration ``_iteration`` starts."""
        self._context_offset = 0
        """Sum over running requests of (prompt_len - joined_at): their context is this + B * iteration."""
        self._version = 0
        self._join_pending = False
        self.busy_s = 0.0
        self.error: BaseException | None = None
        """Never set: simulated engines do not fail (the Engine protocol's health field)."""

    def num_in_flight(self) -> int:
        return len(self._waiting) + len(self._running)

    def submit(self, request: SimRequest) -> None:
        request.submitted_s = self.loop.now
        self._waiting.append(request)
        if len(self._running) < self.concurrency and not self._join_pending:
            self._join_pending = True  # requests submitted together join together, after the current event
            self.loop.at(self.loop.now, self._join)

    def _join(self, _=None) -> None:
        self._join_pending = False
        self._catch_up(self.loop.now)
        self._admit()
        self._schedule()

    def abort(self, request_id: int) -> None:
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                self.on_result(self.name, [request], True, self.loop.now)
                return
        for i, (_, rid, request) in enumerate(self._running):
            if rid == request_id:
                self._catch_up(self.loop.now)
                self._running[i] = self._running[-1]
                self._running.pop()
                heapq.heapify(self._running)
                self._context_offset -= request.prompt_len - request.joined_at
                self._schedule()
                self.on_result(self.name, [request], True, self.loop.now)
                return

    # -- time ---------------------------------------------------------------------------------------------
    def _context(self) -> int:
        return self._context_offset + len(self._running) * self._iteration

    def _catch_up(self, now: float) -> None:
        """Run the whole iterations that end by ``now``; a request joining now starts after them."""
        if not self._running:
            self._time_s = max(self._time_s, now)
            return
        k = self.model.iterations_within(now - self._time_s, len(self._running), self._context())
        if k:
            elapsed = self.model.decode_s(k, len(self._running), self._context())
            self._iteration += k
            self._time_s += elapsed
            self.busy_s += elapsed

    def _admit(self) -> None:
        num_prompt_tokens, iteration, waiting, running = 0, self._iteration, self._waiting, self._running
        while waiting and len(running) < self.concurrency:
            request = waiting.popleft()
            request.joined_at = iteration
            request.started_s = self._time_s
            heapq.heappush(running, (iteration + request.response_len, request.request_id, request))
            num_prompt_tokens += request.prompt_len
            self._context_offset += request.prompt_len - iteration
        if num_prompt_tokens:
            prefill = self.model.prefill_base_s + self.model.prefill_per_token_s * num_prompt_tokens
            self._time_s += prefill
            self.busy_s += prefill

    def _schedule(self) -> None:
        self._version += 1
        if self._running:
            k = self._running[0][0] - self._iteration
            finish_s = self._time_s + self.model.decode_s(k, len(self._running), self._context())
            self.loop.at(finish_s, self._on_finish, self._version)

    def _on_finish(self, version: int) -> None:
        """The hot path of the simulator, kept inline: finish the requests of the next finishing iteration;
        while this engine's next finish comes before every other event, go on without the event heap.
        (The time of the next finish is ``model.decode_s`` written out: a call per finish costs ~10%.)"""
        if version != self._version:  # the running batch changed since this was scheduled
            return
        loop, running, model, heappop = self.loop, self._running, self.model, heapq.heappop
        base, per_request, per_context = model.decode_base_s, model.decode_per_request_s, \
            model.decode_per_context_token_s
        per_finish = model.per_finish_s
        first = True
        while running:
            until, num_running = running[0][0], len(running)
            k = until - self._iteration
            finish_s = self._time_s + k * (base + per_request * num_running
                                           + per_context * (self._context_offset + num_running * self._iteration)) \
                + per_context * num_running * k * (k - 1) / 2
            if not first and (self._join_pending or not loop.runs_next(finish_s)):
                loop.at(finish_s, self._on_finish, self._version)
                return
            first = False
            self.busy_s += finish_s - self._time_s
            self._iteration = until
            done = []
            offset = self._context_offset
            while running and running[0][0] == until:
                request = heappop(running)[2]
                offset -= request.prompt_len - request.joined_at
                done.append(request)
            self._context_offset = offset
            if per_finish:
                finish_s += per_finish * len(done)
                self.busy_s += per_finish * len(done)
            self._time_s = loop.now = finish_s
            if self._waiting:
                self._admit()
            self._version += 1
            self.on_result(self.name, done, False, loop.now)
