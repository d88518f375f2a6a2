"""A simulated SGLang server: SGLang 0.5's scheduler over the simulator's cost model (``sim.scheduler.kind=sglang``).

``SimEngine`` (sim/engine.py) runs at most ``concurrency`` requests and admits the rest in submission order: an
engine whose only limit is a request count. ``SGLangSimEngine`` decides what runs the way SGLang's scheduler does
(sglang/srt/managers/scheduler.py, schedule_policy.py, schedule_batch.py, mem_cache/prefill_budget.py, read at
0.5.23), with the same cost model (models.EngineModel):

    loop         each iteration is either a prefill of the requests just admitted (their first token) or one decode
                 step of every running request (no mixed chunks, SGLang's default)
    admission    before each iteration, queue order: a request joins while fewer than ``max_running_requests`` run
                 and its tokens fit the KV pool, ``extend + min(max_new - generated, clip) < remaining``, where
                 ``remaining = max_total_tokens - used - sum(ratio * min(max_new - generated, clip))`` over the
                 running requests (and the full ``extend + max_new`` of each one admitted before it in this pass).
                 ``ratio`` (new_token_ratio) starts at ``init_new_token_ratio``, falls by
                 ``(init - init * min_factor) / decay_steps`` on each decode step, and is reset when idle. The first
                 request that does not fit stops the pass, and no pass is tried again until a running request leaves
                 (SGLang's batch_is_full), except under priority scheduling, which tries every iteration
    order        first come first served; under priority scheduling (what the launcher asks for under FGD) sorted by
                 (priority, time queued): the group index, lower first
    preemption   under priority scheduling, a request that finds every slot taken preempts running requests whose
                 priority value is more than ``priority_preemption_threshold`` (SGLang's 10) above its own (the
                 lowest, latest first) when their reservations make room for it
    retraction   when a decode step does not fit the KV pool, running requests are retracted (the fewest generated
                 tokens first, the longest prompt among equals) until it fits, at least one kept; they go back to the
                 queue with their tokens (recomputed by a prefill when readmitted) and the ratio becomes
                 ``(decoded + retract_decode_steps * B) / (sum max_new + 1)`` over the requests kept
    radix cache  a prompt prefilled on the engine stays cached: its group's other samples prefill only their own
                 tokens, and a prompt's KV is counted once while any of its samples runs. An episode's next turn
                 (sim.episodes) prefills only what is not cached of its conversation: the environment's reply
                 when its previous turn ran here; its own earlier turns count as its own KV, and its max_new_tokens
                 is what is left of the episode's budget
    drafts       (sim.speculative) a request's first prefill also covers its draft's tokens; it keeps the verified
                 prefix and samples the token after it (sim/speculative.py)

Time moves the way SimEngine's does: between two changes (a finish, a retraction, an admission becoming possible)
every running request gains a token per decode step, so a run of ``k`` plain decode steps is one closed form and one
event; a change is one iteration done at once. A request submitted during a run of plain steps is considered as if
it had come when the step in progress began, at most one step early (SimEngine's approximation). Inside such a run,
a preemption that becomes possible only because reservations shrink is found at the run's end. This file is not in
the mypyc build (sim/compiled.py): it runs interpreted, called from the compiled simulation.
"""

from __future__ import annotations

from rolloutpipe.sim.engine import EventLoop, OnSimResult, SimRequest
from rolloutpipe.sim.models import EngineModel, SchedulerModel


class _Run:
    """A request on the engine: its progress and the priority and time it was queued with."""

    __slots__ = ("generated", "priority", "queued", "request", "verify")

    def __init__(self, request: SimRequest, priority: int, queued: int) -> None:
        self.request, self.generated, self.priority, self.queued = request, 0, priority, queued
        self.verify = request.drafted_tokens
        """Draft tokens its first prefill verifies (sim/speculative.py), 0 once verified or without a draft."""


class SGLangSimEngine:
    def __init__(self, *, name: str, model: EngineModel, scheduler: SchedulerModel, max_running_requests: int,
                 max_new_tokens: int, priority_scheduling: bool, loop: EventLoop, on_result: OnSimResult) -> None:
        self.name, self.model, self.loop, self.on_result = name, model, loop, on_result
        self.capacity = scheduler.max_total_tokens if scheduler.max_total_tokens is not None else float("inf")
        self.max_running = max_running_requests
        self.max_new = max_new_tokens
        self.clip = scheduler.clip_max_new_tokens
        self.priority_scheduling = priority_scheduling
        self.preemption_threshold = scheduler.priority_preemption_threshold
        self.radix_cache = scheduler.radix_cache
        self.retract_decode_steps = scheduler.retract_decode_steps
        self.init_ratio = min(scheduler.init_new_token_ratio, 1.0)
        self.min_ratio = min(self.init_ratio * scheduler.min_new_token_ratio_factor, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / scheduler.new_token_ratio_decay_steps
        self.ratio = self.init_ratio
        self.queue: list[_Run] = []
        self.running: list[_Run] = []
        self.batch_full = False
        """SGLang's ``running_batch.batch_is_full``: set when admission stops for want of tokens, cleared when a
        running request leaves (finishes, is retracted or aborted). While set, no admission is tried, except under
        priority scheduling (SGLang clears it before every pass, to try preemption)."""
        self.cached: set[int] = set()
        """Groups whose prompt is in this engine's radix cache (this step: the simulator clears it between steps)."""
        self.cached_turns: dict[tuple[int, int], int] = {}
        """Episodes (group, sample) whose conversation is in the radix cache: how many tokens of it (a turn that
        finished here leaves its prompt and its tokens)."""
        self.retracted: list[int] = []
        """Ids of the requests retracted, in order (one entry per retraction)."""
        self.num_preempted = 0
        self._time_s = 0.0
        """When the next iteration can start: everything before it is done."""
        self._plain = 0
        """Plain decode steps planned from ``_time_s`` before the next change (the event at their end)."""
        self._version = 0
        self._seq = 0
        self._done: list[SimRequest] = []
        self.error: BaseException | None = None
        """Never set: simulated engines do not fail (the Engine protocol's health field)."""

    # -- the Engine interface -------------------------------------------------------------------------------------
    def num_in_flight(self) -> int:
        return len(self.queue) + len(self.running)

    def submit(self, request: SimRequest) -> None:
        request.submitted_s = self.loop.now
        self._seq += 1
        self.queue.append(_Run(request, request.group if self.priority_scheduling else 0, self._seq))
        self._replan()

    def abort(self, request_id: int) -> None:
        for where in (self.queue, self.running):
            for i, run in enumerate(where):
                if run.request.request_id == request_id:
                    self._catch_up()
                    del where[i]
                    if where is self.running:
                        self.batch_full = False
                    self.on_result(self.name, [run.request], True, self.loop.now)
                    self._replan()
                    return

    def new_step(self) -> None:
        """Weights change between steps: SGLang flushes its cache (the simulator has cleared its events)."""
        assert not self.queue and not self.running and not self._done, "a step ended with requests on an engine"
        self.cached.clear()
        self.cached_turns.clear()
        self._plain = 0
        self._version += 1
        self.ratio = self.init_ratio

    # -- planning -------------------------------------------------------------------------------------------------
    def _replan(self) -> None:
        """State changed at ``loop.now``: apply the plain steps that ended by then and plan again."""
        if self._time_s > self.loop.now:
            return  # inside a change's iteration: its event plans when it ends
        self._catch_up()
        self._version += 1
        self._time_s = max(self._time_s, self.loop.now)
        if not self.running and not self.queue:
            self.ratio = self.init_ratio
            return
        self._plain = self._plain_steps()
        end_s = self._time_s + self.model.decode_s(self._plain, len(self.running), self._context())
        self.loop.at(end_s, self._on_change, self._version)

    def _catch_up(self) -> None:
        if not self._plain:
            return
        k = min(self._plain, self.model.iterations_within(self.loop.now - self._time_s, len(self.running),
                                                          self._context()))
        if k:
            self._decode(k)
            self._plain -= k

    def _plain_steps(self) -> int:
        """Decode steps before the next change: a finish, a retraction, an admission becoming possible."""
        if not self.running or self._admissible():
            return 0
        b = len(self.running)
        steps = min(self._remaining(run) for run in self.running) - 1  # the finishing step is a change
        if self.capacity != float("inf"):
            steps = min(steps, int((self.capacity - self._used()) // b))  # the next one retracts
        if self.queue and len(self.running) < self.max_running and not self._latched():
            steps = min(steps, self._steps_until_admissible(steps))
        return max(steps, 0)

    def _steps_until_admissible(self, limit: int) -> int:
        """The first j <= limit after which the queue's head would fit, with the ratio and reservations of then."""
        head = self._ordered_queue()[0]
        need = self._need(head)
        b, used, clip = len(self.running), self._used(), self.clip
        left = sorted((self.max_new - run.generated for run in self.running), reverse=True)
        above = [0]  # above[p]: the sum of the p largest
        for n in left:
            above.append(above[-1] + n)
        p = b  # left[:p] are still clipped after j steps
        for j in range(1, limit + 1):
            while p and left[p - 1] - j <= clip:
                p -= 1
            reserved = max(self.ratio - self.ratio_decay * j, self.min_ratio) * (
                p * clip + above[b] - above[p] - (b - p) * j)
            if need < self.capacity - used - b * j - reserved:
                return j
        return limit

    def _on_change(self, version: int) -> None:
        if version != self._version:
            return
        if self._plain:
            self._decode(self._plain)
            self._plain = 0
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        elif self.running:
            self._decode(1, decay=not self._retract_if_full())
        elif self.queue:
            raise ValueError(f"simulated SGLang engine {self.name}: a request of {self.queue[0].request.prompt_len} "
                             f"prompt tokens and max_new_tokens={self.max_new} never fits its KV pool of "
                             f"{self.capacity} tokens; raise sim.scheduler.max_total_tokens.")
        self._version += 1
        if self._done:
            self.loop.at(self._time_s, self._deliver, self._version)
        else:
            self.loop.at(self._time_s, self._after_change, self._version)

    def _deliver(self, version: int) -> None:
        done, self._done = self._done, []
        if len(done) > 1:
            done.sort(key=_request_id)
        self.on_result(self.name, done, False, self.loop.now)
        if version == self._version:
            self._replan()

    def _after_change(self, version: int) -> None:
        if version == self._version:
            self._replan()

    # -- iterations -----------------------------------------------------------------------------------------------
    def _decode(self, k: int, *, decay: bool = True) -> None:
        """``k`` decode steps of the running batch (no finish before the last); the ratio decays on each, except
        on the step of a retraction."""
        self._time_s += self.model.decode_s(k, len(self.running), self._context())
        if decay:
            self.ratio = max(self.ratio - self.ratio_decay * k, self.min_ratio)
        for run in self.running:
            run.generated += k
        self._finish()

    def _prefill(self, admitted: list[_Run]) -> None:
        tokens = sum(self._extend(run) for run in admitted)
        self._time_s += self.model.prefill_s(tokens)
        for run in admitted:
            if run.generated == 0:
                run.request.started_s = self._time_s
            self.cached.add(run.request.group)
            if run.verify:  # a verified draft: its kept prefix stands, the KV of the rest is dropped
                run.generated, run.verify = run.request.kept_tokens, 0
            run.generated = min(run.generated + 1, run.request.response_len)  # a prefill samples the next token
        self.running.extend(admitted)
        self._finish()

    def _finish(self) -> None:
        done = [run for run in self.running if run.generated >= run.request.response_len]
        if done:
            self.batch_full = False
            self.running = [run for run in self.running if run.generated < run.request.response_len]
            self._done.extend(run.request for run in done)
            if self.radix_cache:
                for run in done:
                    request = run.request
                    self.cached_turns[request.group, request.index] = request.prompt_len + request.response_len

    def _admit(self) -> list[_Run]:
        """SGLang's PrefillAdder over the queue: the requests that join now (taken out of the queue); under
        priority scheduling the running requests preempted for them go back to the queue."""
        if self.priority_scheduling or not self.running:
            self.batch_full = False
        if self.batch_full:
            return []
        rem = self.capacity - self._used() - self._reserved(self.running)
        admitted: list[_Run] = []
        preempted: list[_Run] = []
        for run in self._ordered_queue():
            if len(self.running) + len(admitted) >= self.max_running:
                victims = self._preemptible(run, rem) if self.priority_scheduling else None
                if not victims:
                    break
                for victim in victims:
                    rem += self.ratio * self._left(victim) + self._kv_released(victim)
                    self.running.remove(victim)
                    preempted.append(victim)
            need = self._need(run)
            if not need < rem:
                self.batch_full = bool(admitted or self.running)
                break
            admitted.append(run)
            rem -= need
        if admitted:
            chosen = set(map(id, admitted))
            self.queue = [run for run in self.queue if id(run) not in chosen]
        for victim in preempted:
            self.num_preempted += 1
            self._requeue(victim)
        return admitted

    def _preemptible(self, run: _Run, rem: float) -> list[_Run]:
        """Running requests of a priority value more than the threshold above the request's, lowest and latest
        first, whose reservations make room."""
        to_free = self._need(run) - rem
        victims = []
        for other in sorted(self.running, key=lambda r: (-r.priority, -r.queued)):
            if other.priority - run.priority <= self.preemption_threshold:
                break
            victims.append(other)
            to_free -= self.ratio * self._left(other)
            if to_free <= 0:
                return victims
        return []

    def _retract_if_full(self) -> bool:
        """The next decode step needs a token per running request: retract until it fits (SGLang's order)."""
        if self._used() + len(self.running) <= self.capacity:
            return False
        keep = sorted(self.running, key=lambda r: (r.generated, -r.request.prompt_len), reverse=True)
        retracted = []
        while len(keep) > 1:
            retracted.append(keep.pop())
            self.running = keep
            if self._used() + len(keep) <= self.capacity:
                break
        if self._used() + len(keep) > self.capacity:
            raise ValueError(f"simulated SGLang engine {self.name}: one request outgrows its KV pool of "
                             f"{self.capacity} tokens (SGLang aborts it); raise sim.scheduler.max_total_tokens.")
        self.batch_full = False
        for run in retracted:
            self.retracted.append(run.request.request_id)
            self._requeue(run)
        decoded = sum(run.generated for run in self.running)
        self.ratio = min(1.0, (decoded + self.retract_decode_steps * len(self.running))
                         / (self.max_new * len(self.running) + 1))
        return True

    def _requeue(self, run: _Run) -> None:
        self._seq += 1
        run.queued = self._seq
        self.queue.append(run)

    # -- accounting -----------------------------------------------------------------------------------------------
    def _ordered_queue(self) -> list[_Run]:
        if self.priority_scheduling:
            self.queue.sort(key=lambda r: (r.priority, r.queued))
        return self.queue

    def _extend(self, run: _Run) -> int:
        """Tokens its prefill computes: its prompt but what is cached (the group's prompt; an episode's conversation
        up to its last reply), and what it generated before a retraction."""
        request = run.request
        prompt = request.prompt_len
        if self.radix_cache:
            shared = request.prompt_len - request.episode_tokens if request.group in self.cached else 0
            prompt -= min(max(shared, self.cached_turns.get((request.group, request.index), 0)), prompt)
        return prompt + run.generated + run.verify

    def _left(self, run: _Run) -> int:
        """Its max_new_tokens (an episode's turn: what is left of the budget) not generated yet, clipped."""
        return min(self.max_new - run.request.episode_tokens - run.generated, self.clip)

    def _need(self, run: _Run) -> int:
        """What admitting a queued request reserves: its prefill and its whole (clipped) remaining budget."""
        return self._extend(run) + self._left(run)

    def _reserved(self, runs: list[_Run]) -> float:
        return self.ratio * sum(self._left(run) for run in runs)

    def _used(self) -> int:
        """KV tokens the running requests hold (a cached prompt once per group while a sample of it runs)."""
        if not self.radix_cache:
            return sum(run.request.prompt_len + run.generated for run in self.running)
        prompts = {run.request.group: run.request.prompt_len - run.request.episode_tokens for run in self.running}
        return sum(prompts.values()) + sum(run.request.episode_tokens + run.generated for run in self.running)

    def _kv_released(self, run: _Run) -> int:
        shared = self.radix_cache and any(o is not run and o.request.group == run.request.group for o in self.running)
        own = run.request.episode_tokens + run.generated
        return own + (0 if shared else run.request.prompt_len - run.request.episode_tokens)

    def _context(self) -> int:
        return sum(run.request.prompt_len + run.generated for run in self.running)

    def _remaining(self, run: _Run) -> int:
        return run.request.response_len - run.generated

    def _admissible(self) -> bool:
        """Whether a request of the queue would join before the next decode step."""
        if not self.queue or self._latched():
            return False
        head = self._ordered_queue()[0]
        rem = self.capacity - self._used() - self._reserved(self.running)
        if len(self.running) >= self.max_running:
            return self.priority_scheduling and bool(self._preemptible(head, rem))
        return self._need(head) < rem


    def _latched(self) -> bool:
        return self.batch_full and bool(self.running) and not self.priority_scheduling


def _request_id(request: SimRequest) -> int:
    return request.request_id
