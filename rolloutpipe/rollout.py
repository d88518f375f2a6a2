"""The rollout node's pieces: engines, admission, reward threads and group assembly.

``pipeline.rollout_step`` strings them together; this module holds each piece on its own, and
``RolloutSchedule`` holds one step's bookkeeping (pure, also driven by the simulator).

Reward threads (``reward.num_workers`` of them)
    consume   GenerationResults, put on a queue by the engines' completion callbacks
    produce   rewarded Samples into the GroupAssembler; a group's last sample turns it into a
              CompleteGroup (advantages from its own rewards) handed to the dispatcher
    wait for  the next result; the reward itself runs in a RewardPool worker process with a timeout,
              so a reward function that hangs or raises costs one sample its reward, never the thread
    shut down on a sentinel per thread (``close``); an unexpected exception is kept in ``error`` and the
              rollout loop stops the run with it.
"""

from __future__ import annotations

import enum
import hashlib
import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rolloutpipe.admission import StepSlots
from rolloutpipe.engine.base import Engine
from rolloutpipe.grpo import group_advantages
from rolloutpipe.metrics import SpanRecorder
from rolloutpipe.rewards import RewardPool
from rolloutpipe.types import (
    CompleteGroup,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    Sample,
    sample_id,
)


class EngineKind(enum.Enum):
    embedded = "embedded"
    """The embedded CPU engine (a small request scheduler over the transformers model), in this process."""
    embedded_http = "embedded_http"
    """The embedded engine in its own process behind SGLang's HTTP API (engine/http_server.py), driven by the
    SGLang client: the rollout node as on a cluster, on CPU."""
    sglang = "sglang"
    """SGLang servers: one ``python -m sglang.launch_server`` per engine on this node, or ``engine_urls``."""


class AdmissionPolicy(enum.Enum):
    fifo = "fifo"
    """Submit every request of the step at once in prompt order, spread over the engines request by request
    (a router's round robin), and let the engines interleave them: Slime's behaviour, the baseline."""
    fgd = "fgd"
    """Frontier-group dispatch: hold requests on the rollout node and fill free engine slots with the
    frontier groups first, all samples of a group together, on the engine with the most free slots."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: EngineKind = EngineKind.embedded
    num_engines: int = 1
    concurrency: int = 64
    """Requests one engine runs at once (SGLang's max_running_requests)."""
    admission: AdmissionPolicy = AdmissionPolicy.fifo
    filter_zero_variance: bool = False
    """Dynamic sampling (DAPO): drop groups whose rewards are all equal and admit replacements."""
    over_sampling_groups: int = 0
    """Extra groups admitted at the start of each step when filtering, so replacements are already running."""
    engine_urls: list[str] = field(default_factory=list)
    """With ``engine: sglang`` or ``embedded_http``: attach to these running servers (one per engine, started with
    ``--weight-version 0`` and model.path's weights) instead of starting them. Empty: start them."""
    sglang_launch_args: list[str] = field(default_factory=list)
    """Extra arguments for every ``sglang.launch_server``, e.g. ``[--mem-fraction-static, "0.8"]``."""
    sglang_gpus_per_engine: int = 1
    """GPUs each started SGLang server uses (its --tp-size times --dp-size); engine i starts at GPU i * this."""
    server_start_timeout_s: float = 900.0
    """How long to wait for a started engine server to answer /health."""
    max_engine_failures: int = 3
    """Failures (crash, server exit, timeout) each engine may have in a run; every one is survived by resubmitting
    its unfinished requests and restarting it (supervisor.py). One more stops the run. 0: stop at the first."""
    request_timeout_s: float | None = None
    """An engine that holds requests and hands none back for this long is hung and fails like a crashed one.
    None: no timeout. Set it well above the longest single generation (max response length at full batch)."""

    @property
    def ranks_per_engine(self) -> int:
        """Ranks one engine takes in the weight-update process group (weight_sync.py): one per tensor-parallel
        rank of an SGLang server (its GPUs, assuming --dp-size 1), one for the embedded engine."""
        return self.sglang_gpus_per_engine if self.engine is EngineKind.sglang else 1

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be >= 1.")
        if self.concurrency < 1:
            raise ValueError(
                f"rollout.concurrency={self.concurrency} must be >= 1: it is how many requests an engine runs at once."
            )
        if self.over_sampling_groups < 0:
            raise ValueError(f"rollout.over_sampling_groups={self.over_sampling_groups} must be >= 0.")
        if self.engine_urls and self.engine is EngineKind.embedded:
            raise ValueError("rollout.engine_urls is set but rollout.engine=embedded runs in-process; "
                             "use rollout.engine=sglang (or embedded_http) to attach to servers.")
        if self.engine_urls and len(self.engine_urls) != self.num_engines:
            raise ValueError(f"rollout.engine_urls has {len(self.engine_urls)} URLs but rollout.num_engines="
                             f"{self.num_engines}; give one URL per engine.")
        if self.max_engine_failures < 0:
            raise ValueError(f"rollout.max_engine_failures={self.max_engine_failures} must be >= 0 (0 stops the run "
                             "at an engine's first failure).")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"rollout.request_timeout_s={self.request_timeout_s} must be > 0, or null for no "
                             "timeout.")


def sampling_seed(run_seed: int, step: int, group: int, sample: int) -> int:
    """The seed of one sample's random stream: a function of its id only, never of timing or batch-mates."""
    digest = hashlib.sha256(f"{run_seed}/{sample_id(step, group, sample)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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


@dataclass(kw_only=True, slots=True)
class InFlight:
    """What the reward threads need to turn a result into a sample."""

    prompt: Prompt
    group: int
    sample: int


class RewardThreads:
    """Turns finished generations into rewarded samples and complete groups (see module docstring)."""

    def __init__(self, *, pool: RewardPool, tokenizer, num_threads: int, spans: SpanRecorder) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.spans = spans
        self.error: BaseException | None = None
        self.results: queue.Queue = queue.Queue()
        self.in_flight: dict[str, InFlight] = {}
        self._assembler: GroupAssembler | None = None
        self._on_group = None
        self._outstanding = 0
        self._count_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"reward-{i}", daemon=True) for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def begin_step(self, assembler: GroupAssembler, in_flight: dict[str, InFlight], on_group) -> None:
        self._assembler = assembler
        self.in_flight = in_flight
        self._on_group = on_group

    def on_result(self, result: GenerationResult) -> None:
        """The engines' completion callback: never blocks an engine thread."""
        with self._count_lock:
            self._outstanding += 1
        self.results.put(result)

    def idle(self) -> bool:
        """Every result handed in so far has been rewarded (or skipped, if aborted)."""
        with self._count_lock:
            return self._outstanding == 0

    def close(self) -> None:
        for _ in self._threads:
            self.results.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while (result := self.results.get()) is not None:
            try:
                self._reward(result)
            except BaseException as err:  # noqa: BLE001 - kept for the rollout loop, which stops the run
                self.error = err
            with self._count_lock:
                self._outstanding -= 1

    def _reward(self, result: GenerationResult) -> None:
        ctx = self.in_flight[result.request_id]
        assert self._assembler is not None
        step = self._assembler.step
        self.spans.add(
            "rollout/request", step=step, start_s=result.started_s, end_s=result.finished_s, engine=result.engine,
            group=ctx.group, sample=ctx.sample, num_tokens=len(result.output_ids),
            queued_s=result.started_s - result.submitted_s, aborted=result.finish_reason is FinishReason.ABORT,
            policy_version=result.policy_version,
        )
        if result.finish_reason is FinishReason.ABORT:  # over-sampling's leftovers: never rewarded or trained
            return
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        start = time.time()
        outcome = self.pool.score(text, ctx.prompt.label, ctx.prompt.metadata)
        self.spans.add(
            "rollout/reward", step=step, start_s=start, end_s=time.time(), group=ctx.group, sample=ctx.sample,
            error=outcome.error,
        )
        sample = Sample(
            group=ctx.group,
            index=ctx.sample,
            response_ids=result.output_ids,
            logprobs=result.output_logprobs,
            response_text=text,
            finish_reason=result.finish_reason,
            reward=outcome.reward,
            reward_error=outcome.error,
        )
        group = self._assembler.add(sample)
        if group is not None:
            self.spans.add("rollout/group_complete", step=step, start_s=group.completed_s,
                           end_s=group.completed_s, group=group.group)
            self._on_group(group)


def make_requests(*, step: int, group: int, prompt: Prompt, n_samples: int, run_seed: int, max_new_tokens: int,
                  temperature: float, top_p: float, stop_token_ids: list[int], priority: int = 0
                  ) -> list[GenerationRequest]:
    """One group's requests, seeded by their ids. Under FGD ``priority`` is the group index, so an engine that
    schedules by priority (SGLang with --enable-priority-scheduling, the embedded engine) also runs the
    frontier (the lowest pending groups) first among what it holds; the samples do not depend on it."""
    return [
        GenerationRequest(
            request_id=sample_id(step, group, s),
            input_ids=prompt.input_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            sampling_seed=sampling_seed(run_seed, step, group, s),
            stop_token_ids=stop_token_ids,
            priority=priority,
        )
        for s in range(n_samples)
    ]


class Admission:
    """Hands the step's requests to the engines under FIFO or FGD (see AdmissionPolicy).

    Called from the rollout loop only (``finished`` also from engine threads, hence the lock): ``add_group`` when
    a group is admitted, ``pump`` whenever an engine may have a free slot (a request finished) or the frontier
    moved, ``abort_groups`` when the step is full. ``assigned`` remembers which engine holds each request, and
    Admission counts what each engine holds itself (a crashed engine cannot be asked).

    Engine failure (the EngineSupervisor decides when): ``take_out`` puts a failed engine's unfinished requests
    back in line, unchanged (same id, same seed), and they go to the engines in service as new ones would:
    under FIFO at once, round robin; under FGD by ``pump``, frontier groups first. ``put_back`` puts its
    replacement (``engines`` is the supervisor's list, replaced in place) into service. A result counts only
    if it comes from the engine the request is assigned to now (``finished``), so a late result of the failed
    engine is ignored and no sample is counted twice.
    """

    def __init__(self, *, policy: AdmissionPolicy, engines: list[Engine], concurrency: int) -> None:
        self.policy = policy
        self.engines = engines
        self.concurrency = concurrency
        self.assigned: dict[str, Engine] = {}
        """The engine holding each unfinished request."""
        self._num_held: dict[str, int] = {}
        """Unfinished requests per engine name (names are unique: a restarted engine gets a new one)."""
        self._total_held = 0
        """Their sum: while it is at least every engine's concurrency, no engine has a free slot (pump is hot)."""
        self._waiting: dict[int, list[GenerationRequest]] = {}
        """FGD's held groups (and requests to retry), in group order."""
        self._orphans: list[tuple[int, GenerationRequest]] = []
        """FIFO's requests to retry while no engine is in service."""
        self._out_of_service: list[Engine] = []
        self._serving = list(engines)
        """``engines`` minus those out of service (recomputed on take_out / put_back only: pump is hot)."""
        self._capacity = concurrency * len(engines)
        """Slots of the engines in service."""
        self._submitted: dict[int, dict[str, GenerationRequest]] = {}
        self._aborted: set[str] = set()
        self._next_engine = 0
        self._lock = threading.Lock()

    def add_group(self, group: int, requests: list[GenerationRequest]) -> None:
        if self.policy is AdmissionPolicy.fifo:
            for request in requests:
                self._submit_round_robin(group, request)
        else:
            self._waiting[group] = requests

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

    def finished(self, request_id: str, engine_name: str) -> bool:
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

    def num_held(self, engine: Engine) -> int:
        with self._lock:
            return self._num_held.get(engine.name, 0)

    def take_out(self, engine: Engine) -> int:
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
                self._submit_round_robin(group, request)
            else:
                self._waiting.setdefault(group, []).append(request)
        self._waiting = dict(sorted(self._waiting.items()))
        return len(retry)

    def put_back(self, failed: Engine, replacement: Engine) -> None:
        """``replacement`` (already in ``engines``) serves from now on; FIFO hands it the requests that waited."""
        self._out_of_service.remove(failed)
        self._serving = self._in_service()
        self._capacity = self.concurrency * len(self._serving)
        orphans, self._orphans = self._orphans, []
        for group, request in orphans:
            self._submit_round_robin(group, request)

    def _in_service(self) -> list[Engine]:
        return [e for e in self.engines if e not in self._out_of_service]

    def _most_free(self) -> Engine | None:
        """The engine in service with the most free slots, if it has one (a lock-free read of the counts)."""
        if self._total_held >= self._capacity:
            return None
        held, best, fewest = self._num_held, None, self.concurrency
        for engine in self._serving:
            num = held.get(engine.name, 0)
            if num < fewest:
                best, fewest = engine, num
        return best

    def _submit_round_robin(self, group: int, request: GenerationRequest) -> None:
        engines = self._serving
        if not engines:
            self._orphans.append((group, request))
            return
        self._submit(group, [request], engines[self._next_engine % len(engines)])
        self._next_engine += 1

    def _submit(self, group: int, requests: list[GenerationRequest], engine: Engine) -> None:
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
    """What one complete group changed: whether it is trainable, and the groups now placed in their batches."""

    trainable: bool
    placed: list[CompleteGroup]


class RolloutSchedule:
    """One step's rollout bookkeeping: which groups to admit and when, and which complete groups go out.

    Pure (no threads, no clock, no I/O): the rollout node (pipeline.py) drives it with real engines and
    the simulator (rolloutpipe/sim) with simulated ones, so both run the same scheduling code.
    ``draw(k)`` returns the next k prompts of the source; ``requests_for(group, prompt)`` makes a
    group's requests. ``start`` admits the step's groups (plus over-sampling when filtering);
    ``on_group`` resolves a complete group (filter, place, admit a replacement, refill engines);
    ``on_slot_freed`` refills engines; once ``full``, ``finish`` aborts what is not needed.
    """

    def __init__(self, *, rollout_batch_size: int, groups_per_batch: int, filter_zero_variance: bool,
                 over_sampling_groups: int, admission: Admission, draw: Callable[[int], list[Prompt]],
                 requests_for: Callable[[int, Prompt], list[GenerationRequest]]) -> None:
        self.slots = StepSlots(rollout_batch_size=rollout_batch_size, groups_per_batch=groups_per_batch)
        self.filter_zero_variance = filter_zero_variance
        self.num_initial_groups = rollout_batch_size + (over_sampling_groups if filter_zero_variance else 0)
        self.admission = admission
        self.draw = draw
        self.requests_for = requests_for
        self.prompts: list[Prompt] = []
        """The step's admitted prompts, by group."""
        self.complete: dict[int, CompleteGroup] = {}
        self.num_filtered = 0

    def start(self) -> None:
        self._admit(self.num_initial_groups)
        self.admission.pump(self.slots.frontier)

    def on_group(self, group: CompleteGroup) -> Resolution:
        self.complete[group.group] = group
        trainable = not (self.filter_zero_variance and len({s.reward for s in group.samples}) == 1)
        self.num_filtered += not trainable
        placed = []
        for p in self.slots.resolve(group.group, trainable=trainable):
            self.complete[p.group].batch = p.batch
            placed.append(self.complete[p.group])
        self._admit(self.slots.num_to_admit())
        self.admission.pump(self.slots.frontier)
        return Resolution(trainable=trainable, placed=placed)

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
        for prompt in self.draw(num_groups) if num_groups else []:
            group = self.slots.admit()
            self.prompts.append(prompt)
            self.admission.add_group(group, self.requests_for(group, prompt))


def check_reward_failures(step: int, groups, *, num_expected: int, max_fraction: float, reward_name: str) -> None:
    """Stop before the failures reach the trainer's optimizer step once they pass the configured share."""
    failed = [s for g in groups for s in g.samples if s.reward_error is not None]
    if len(failed) > max_fraction * num_expected:
        raise RuntimeError(
            f"step {step}: the reward function '{reward_name}' failed on {len(failed)} samples, more than "
            f"reward.max_failure_fraction={max_fraction} of the step's {num_expected}; stopping instead of training "
            f"on them. First error: {failed[0].reward_error}. Fix the reward function (or its timeout, "
            "reward.timeout_s) and rerun."
        )


def write_samples(path: Path, step: int, prompts: list[Prompt], groups: list[CompleteGroup]) -> None:
    """Every sample of the step's trained groups, one JSON line each (``run.save_samples``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for g in sorted(groups, key=lambda g: g.group):
            for s, adv in zip(g.samples, g.advantages):
                f.write(json.dumps({
                    "id": sample_id(step, g.group, s.index), "batch": g.batch, "prompt_index": g.prompt_index,
                    "prompt": prompts[g.group].text, "response": s.response_text, "response_ids": s.response_ids,
                    "reward": s.reward, "advantage": adv, "finish_reason": s.finish_reason.value,
                    "reward_error": s.reward_error,
                }) + "\n")
