"""The rollout node's pieces: engines, admission, reward threads and group assembly.

``pipeline.rollout_step`` strings them together; this module holds each piece on its own.

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
import queue
import threading
import time
from dataclasses import dataclass, field

from rolloutpipe.admission import fgd_order
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
            samples = self._pending.setdefault(sample.group, {})
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
    engine: str = ""
    finished: bool = False


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
            "rollout/request", step=step, start_s=result.started_s, end_s=result.finished_s, engine=ctx.engine,
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
                  temperature: float, top_p: float, stop_token_ids: list[int]) -> list[GenerationRequest]:
    """One group's requests, seeded by their ids."""
    return [
        GenerationRequest(
            request_id=sample_id(step, group, s),
            input_ids=prompt.input_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            sampling_seed=sampling_seed(run_seed, step, group, s),
            stop_token_ids=stop_token_ids,
        )
        for s in range(n_samples)
    ]


class Admission:
    """Hands the step's requests to the engines under FIFO or FGD (see AdmissionPolicy).

    Called from the rollout loop only: ``add_group`` when a group is admitted, ``pump`` whenever an
    engine may have a free slot (a request finished) or the frontier moved, ``abort_groups`` when the
    step is full. Engines count their own in-flight requests (``Engine.num_in_flight``).
    """

    def __init__(self, *, policy: AdmissionPolicy, engines: list[Engine], concurrency: int,
                 in_flight: dict[str, InFlight]) -> None:
        self.policy = policy
        self.engines = engines
        self.concurrency = concurrency
        self.in_flight = in_flight
        self._waiting: dict[int, list[GenerationRequest]] = {}
        self._submitted: dict[int, list[GenerationRequest]] = {}
        self._next_engine = 0

    def add_group(self, group: int, requests: list[GenerationRequest]) -> None:
        if self.policy is AdmissionPolicy.fifo:
            for request in requests:
                engine = self.engines[self._next_engine % len(self.engines)]
                self._next_engine += 1
                self._submit(group, request, engine)
        else:
            self._waiting[group] = requests

    def pump(self, frontier: list[int]) -> None:
        """FGD: fill free engine slots, frontier groups first, a whole group at a time."""
        for group in fgd_order(list(self._waiting), frontier):
            engine = max(self.engines, key=lambda e: self.concurrency - e.num_in_flight())
            if engine.num_in_flight() >= self.concurrency:
                return
            for request in self._waiting.pop(group):
                self._submit(group, request, engine)

    def abort_groups(self, groups: list[int]) -> int:
        """Drop waiting requests and abort submitted ones of ``groups``; returns how many were aborted."""
        num_aborted = 0
        for group in groups:
            num_aborted += len(self._waiting.pop(group, []))
            for request in self._submitted.get(group, []):
                ctx = self.in_flight[request.request_id]
                if not ctx.finished:
                    next(e for e in self.engines if e.name == ctx.engine).abort(request.request_id)
                    num_aborted += 1
        return num_aborted

    def num_in_flight(self) -> int:
        return sum(e.num_in_flight() for e in self.engines)

    def _submit(self, group: int, request: GenerationRequest, engine: Engine) -> None:
        self.in_flight[request.request_id].engine = engine.name
        self._submitted.setdefault(group, []).append(request)
        engine.submit(request)


def is_truncated(sample: Sample) -> bool:
    return sample.finish_reason is FinishReason.LENGTH
