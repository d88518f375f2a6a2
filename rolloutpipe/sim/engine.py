"""The simulator's clock and engines.

``EventLoop`` is a plain discrete-event loop: callbacks ordered by (time, insertion). ``SimEngine`` has
the interface the real ``admission.Admission`` uses (``name``, ``submit``, ``abort``, ``num_in_flight``)
and behaves like an SGLang server or the embedded engine: at most ``concurrency`` requests run, the
rest wait in submission order, a finished request leaves at once and a waiting one joins between
decode iterations. Time is advanced analytically, not iteration by iteration: between two changes of
the running batch every request gains one token per iteration, so the next finish is the smallest
remaining length and its time is a closed form of the cost model (models.EngineModel.decode_s).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Final

from rolloutpipe.sim.models import EngineModel
from rolloutpipe.types import EpisodeEnd, FinishReason, Sample

# Final: the compiled simulator (sim/compiled.py) calls them directly instead of looking them up in heapq each time
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop
_heapify: Final = heapq.heapify


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self._stopped = False

    def at(self, time_s: float, callback: Callable, arg=None) -> None:
        self._seq += 1
        _heappush(self._heap, (time_s, self._seq, callback, arg))

    def runs_next_or_at(self, time_s: float, callback: Callable, arg=None) -> bool:
        """True if an event at ``time_s`` would be the next one: the caller goes on inline instead of pushing
        and popping itself (a hot callback); otherwise the event is scheduled (``at``) and this returns False."""
        heap = self._heap
        if not self._stopped and (not heap or time_s < heap[0][0]):
            return True
        self._seq += 1
        _heappush(heap, (time_s, self._seq, callback, arg))
        return False

    def run(self) -> None:
        """Run events in order until one calls ``stop``; the events left stay (``clear`` drops them)."""
        heap, pop = self._heap, _heappop
        self._stopped = False
        while heap:
            self.now, _, callback, arg = pop(heap)
            callback(arg)
            if self._stopped:
                return
        raise RuntimeError("simulation stalled: no event left before the run was stopped (a model bug)")

    def stop(self) -> None:
        self._stopped = True

    def clear(self) -> None:
        self._heap.clear()


class SimRequest(Sample):
    """One sample to generate, with what the models decided about it up front. It is also the ``Sample`` it
    becomes (the real GroupAssembler takes it as it is), so a finish creates no object; a plain positional
    ``__init__``, because the simulator makes millions. In an episode (sim.episodes) it is one model turn, and the
    last turn's request becomes the episode's sample (sim/run.py ``_StepDraws.next_turn``)."""

    request_id: int
    prompt_len: int
    response_len: int
    submitted_s: float
    """Set by the engine: when it received the request, when the request joined the running batch, and the
    engine's iteration count then."""
    started_s: float
    joined_at: int
    drafted_tokens: int
    """Speculative rollout (sim/speculative.py): tokens of this request's draft, which its first prefill verifies,
    and how many of them policy k+1 reproduces (kept: the request starts with them generated)."""
    kept_tokens: int
    turn: int
    """An episode's model turn (sim.episodes): 0, 1, ...; a single response is turn 0 of a one-turn episode."""
    episode_tokens: int
    """Tokens of the episode before this turn, after the group's prompt (earlier turns and environment replies,
    all in ``prompt_len``): ``prompt_len - episode_tokens`` is the prompt the group's samples share, and what is
    left of the episode's budget is ``rollout_max_response_len - episode_tokens``. 0 on turn 0."""

    def __init__(self, request_id: int, group: int, index: int, prompt_len: int, response_len: int,
                 reward: float, policy_version: int, truncated: bool = False) -> None:
        self.request_id = request_id
        self.group = group
        self.index = index
        self.prompt_len = prompt_len
        self.response_len = response_len
        self.response_ids = range(response_len)
        self.logprobs = _NO_LOGPROBS
        self.response_text = ""
        self.finish_reason = FinishReason.LENGTH if truncated else FinishReason.STOP
        self.reward = reward
        self.policy_version = policy_version
        self.reward_error = None
        self.reward_timed_out = False
        self.response_mask = None  # (Sample's fields with defaults: a slots dataclass keeps no class default)
        self.num_turns = 1
        self.episode_end = EpisodeEnd.done
        self.drafted_tokens = 0
        self.kept_tokens = 0
        self.turn = 0
        self.episode_tokens = 0


_NO_LOGPROBS: list[float] = []
"""Every simulated sample's (shared, never written: the simulator has no trainer that reads them)."""


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
        self._waiting: list[SimRequest] = []
        self._head = 0
        """The requests waiting to join are ``_waiting[_head:]``, in submission order (a list and an index, not a
        deque: the compiled simulator indexes a list natively)."""
        self._finishing: dict[int, list[SimRequest]] = {}
        """The running requests, by the iteration at which they finish."""
        self._ends: list[int] = []
        """Heap of the keys of ``_finishing`` (small ints: the cheapest heap there is)."""
        self._num_running = 0
        self._iteration = 0
        self._time_s = 0.0
        """Time at which iteration ``_iteration`` starts."""
        self._context_offset = 0
        """Sum over running requests of (prompt_len - joined_at): their context is this + B * iteration."""
        self._version = 0
        self._join_pending = False
        # the cost model's terms as floats of this class (compiled, sim/compiled.py: native arithmetic)
        self._decode_base_s = float(model.decode_base_s)
        self._decode_per_request_s = float(model.decode_per_request_s)
        self._decode_per_context_s = float(model.decode_per_context_token_s)
        self._per_finish_s = float(model.per_finish_s)
        self._prefill_base_s = float(model.prefill_base_s)
        self._prefill_per_token_s = float(model.prefill_per_token_s)
        self._finish_event: Callable[[int], None] = self._on_finish
        self._join_event: Callable[[None], None] = self._join
        """Bound once: an event per request would otherwise bind a method object each time."""
        self.error: BaseException | None = None
        """Never set: simulated engines do not fail (the Engine protocol's health field)."""

    def num_in_flight(self) -> int:
        return len(self._waiting) - self._head + self._num_running

    def new_step(self) -> None:
        """The engines serve new weights (nothing of this model depends on the old ones)."""

    def progress(self, now: float) -> list[tuple[SimRequest, int]]:
        """The running requests and the tokens each has generated by ``now`` (whole iterations): where drafts stop
        when their window closes (sim/speculative.py)."""
        self._catch_up(now)
        return [(r, self._iteration - r.joined_at) for end in sorted(self._finishing) for r in self._finishing[end]]

    def submit(self, request: SimRequest) -> None:
        request.submitted_s = self.loop.now
        self._waiting.append(request)
        if self._num_running < self.concurrency and not self._join_pending:
            self._join_pending = True  # requests submitted together join together, after the current event
            self.loop.at(self.loop.now, self._join_event)

    def _join(self, _=None) -> None:
        self._join_pending = False
        self._catch_up(self.loop.now)
        self._admit()
        self._schedule()

    def abort(self, request_id: int) -> None:
        for i in range(self._head, len(self._waiting)):
            request = self._waiting[i]
            if request.request_id == request_id:
                del self._waiting[i]
                self.on_result(self.name, [request], True, self.loop.now)
                return
        for end, requests in self._finishing.items():
            for request in requests:
                if request.request_id == request_id:
                    self._catch_up(self.loop.now)
                    requests.remove(request)
                    if not requests:
                        del self._finishing[end]
                        self._ends.remove(end)
                        _heapify(self._ends)
                    self._num_running -= 1
                    self._context_offset -= request.prompt_len - request.joined_at
                    self._schedule()
                    self.on_result(self.name, [request], True, self.loop.now)
                    return

    # -- time ---------------------------------------------------------------------------------------------
    def _context(self) -> int:
        return self._context_offset + self._num_running * self._iteration

    def _catch_up(self, now: float) -> None:
        """Run the whole iterations that end by ``now``; a request joining now starts after them."""
        if not self._num_running:
            self._time_s = max(self._time_s, now)
            return
        k = self.model.iterations_within(now - self._time_s, self._num_running, self._context())
        if k:
            elapsed = self.model.decode_s(k, self._num_running, self._context())
            self._iteration += k
            self._time_s += elapsed

    def _admit(self) -> None:
        num_prompt_tokens, iteration, waiting, finishing = 0, self._iteration, self._waiting, self._finishing
        num_running, head = self._num_running, self._head
        while head < len(waiting) and num_running < self.concurrency:
            request = waiting[head]
            head += 1
            # a verified draft's kept tokens count as generated before it joined (0 without speculation)
            request.joined_at = iteration - request.kept_tokens
            request.started_s = self._time_s
            end = request.joined_at + request.response_len
            same_end = finishing.get(end)
            if same_end is None:
                finishing[end] = [request]
                _heappush(self._ends, end)
            else:
                same_end.append(request)
            num_running += 1
            num_prompt_tokens += request.prompt_len + request.drafted_tokens  # verification prefills the draft
            self._context_offset += request.prompt_len - request.joined_at
        self._num_running = num_running
        if head == len(waiting):
            waiting.clear()
            head = 0
        elif head > 4096:  # a long queue drained from the front: drop what has left it
            del waiting[:head]
            head = 0
        self._head = head
        if num_prompt_tokens:
            prefill = self._prefill_base_s + self._prefill_per_token_s * num_prompt_tokens
            self._time_s += prefill

    def _schedule(self) -> None:
        self._version += 1
        if self._num_running:
            k = self._ends[0] - self._iteration
            finish_s = self._time_s + self.model.decode_s(k, self._num_running, self._context())
            self.loop.at(finish_s, self._finish_event, self._version)

    def _on_finish(self, version: int) -> None:
        """The hot path of the simulator, kept inline: finish the requests of the next finishing iteration;
        while this engine's next finish comes before every other event, go on without the event heap.
        (The time of the next finish is ``model.decode_s`` written out: a call per finish costs ~10%.)"""
        if version != self._version:  # the running batch changed since this was scheduled
            return
        loop, ends, finishing, heappop = self.loop, self._ends, self._finishing, _heappop
        base, per_request, per_context = self._decode_base_s, self._decode_per_request_s, self._decode_per_context_s
        per_finish = self._per_finish_s
        first = True
        while ends:
            if first:  # the event's time is that formula's, as _schedule or the previous round computed it
                finish_s, first = loop.now, False
            else:
                num_running, iteration, k = self._num_running, self._iteration, ends[0] - self._iteration
                finish_s = self._time_s + k * (base + per_request * num_running
                                               + per_context * (self._context_offset + num_running * iteration)) \
                    + per_context * num_running * k * (k - 1) / 2
                if self._join_pending:
                    loop.at(finish_s, self._finish_event, self._version)
                    return
                if not loop.runs_next_or_at(finish_s, self._finish_event, self._version):
                    return
            self._iteration = end = heappop(ends)
            done = finishing.pop(end)
            if len(done) > 1:
                done.sort(key=_request_id)  # the same order whatever the order they joined in
            offset = self._context_offset
            for request in done:
                offset -= request.prompt_len - request.joined_at
            self._context_offset = offset
            self._num_running -= len(done)
            if per_finish:
                finish_s += per_finish * len(done)
            self._time_s = loop.now = finish_s
            if self._head < len(self._waiting):
                self._admit()
            self._version += 1
            # what on_result submits to this engine joins right after it, without a join event of its own
            join_pending, self._join_pending = self._join_pending, True
            self.on_result(self.name, done, False, finish_s)
            self._join_pending = join_pending  # a join event scheduled before this finish is still coming
            if self._head < len(self._waiting) and self._num_running < self.concurrency:
                self._admit()


def _request_id(request: SimRequest) -> int:
    return request.request_id
