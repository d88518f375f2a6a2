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
from dataclasses import dataclass

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


class AdmissionPolicy(enum.Enum):
    fifo = "fifo"
    """Submit every request of the step in prompt order and let the engines interleave them (Slime)."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: EngineKind = EngineKind.embedded
    num_engines: int = 1
    concurrency: int = 64
    """Requests one engine runs at once (SGLang's max_running_requests)."""
    admission: AdmissionPolicy = AdmissionPolicy.fifo

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be >= 1.")
        if self.concurrency < 1:
            raise ValueError(
                f"rollout.concurrency={self.concurrency} must be >= 1: it is how many requests an engine runs at once."
            )


def sampling_seed(run_seed: int, step: int, group: int, sample: int) -> int:
    """The seed of one sample's random stream: a function of its id only, never of timing or batch-mates."""
    digest = hashlib.sha256(f"{run_seed}/{sample_id(step, group, sample)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class GroupAssembler:
    """Collects rewarded samples; a group is complete when all ``n_samples`` are in. Thread-safe."""

    def __init__(self, *, step: int, policy_version: int, prompts: list[Prompt], n_samples: int,
                 normalize_std: bool) -> None:
        self.step = step
        self.policy_version = policy_version
        self.prompts = prompts
        self.n_samples = n_samples
        self.normalize_std = normalize_std
        self.completed: list[CompleteGroup] = []
        self._pending: dict[int, dict[int, Sample]] = {g: {} for g in range(len(prompts))}
        self._lock = threading.Condition()

    def add(self, sample: Sample) -> CompleteGroup | None:
        with self._lock:
            samples = self._pending[sample.group]
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
            self.completed.append(group)
            self._lock.notify_all()
            return group

    def wait_all(self, timeout_s: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout_s)


@dataclass(kw_only=True, slots=True)
class InFlight:
    """What the reward threads need to turn a result into a sample."""

    prompt: Prompt
    group: int
    sample: int
    engine: str = ""


class RewardThreads:
    """Turns finished generations into rewarded samples and complete groups (see module docstring)."""

    def __init__(self, *, pool: RewardPool, tokenizer, num_threads: int, spans: SpanRecorder) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.spans = spans
        self.error: BaseException | None = None
        self.results: queue.Queue = queue.Queue()
        self._in_flight: dict[str, InFlight] = {}
        self._assembler: GroupAssembler | None = None
        self._on_group = None
        self._threads = [
            threading.Thread(target=self._run, name=f"reward-{i}", daemon=True) for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def begin_step(self, assembler: GroupAssembler, in_flight: dict[str, InFlight], on_group) -> None:
        self._assembler = assembler
        self._in_flight = in_flight
        self._on_group = on_group

    def on_result(self, result: GenerationResult) -> None:
        """The engines' completion callback: never blocks an engine thread."""
        self.results.put(result)

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

    def _reward(self, result: GenerationResult) -> None:
        ctx = self._in_flight[result.request_id]
        assert self._assembler is not None
        step = self._assembler.step
        self.spans.add(
            "rollout/request", step=step, start_s=result.started_s, end_s=result.finished_s, engine=ctx.engine,
            group=ctx.group, sample=ctx.sample, num_tokens=len(result.output_ids),
            queued_s=result.started_s - result.submitted_s,
        )
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


def make_requests(*, step: int, prompts: list[Prompt], n_samples: int, run_seed: int, max_new_tokens: int,
                  temperature: float, top_p: float, stop_token_ids: list[int]) -> list[GenerationRequest]:
    """The step's requests in prompt order, all samples of a group together."""
    return [
        GenerationRequest(
            request_id=sample_id(step, g, s),
            input_ids=prompt.input_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            sampling_seed=sampling_seed(run_seed, step, g, s),
            stop_token_ids=stop_token_ids,
        )
        for g, prompt in enumerate(prompts)
        for s in range(n_samples)
    ]


def admit(requests: list[GenerationRequest], engines: list[Engine], policy: AdmissionPolicy, n_samples: int,
          in_flight: dict[str, InFlight]) -> None:
    """Submit the step's requests, recording each one's engine in ``in_flight`` before it can finish.

    FIFO: everything at once in prompt order; each engine queues what it cannot run yet. Groups go to
    engines round-robin, all samples of a group to one engine (their prompt is shared).
    """
    assert policy is AdmissionPolicy.fifo
    for i, request in enumerate(requests):
        engine = engines[(i // n_samples) % len(engines)]
        in_flight[request.request_id].engine = engine.name
        engine.submit(request)


def is_truncated(sample: Sample) -> bool:
    return sample.finish_reason is FinishReason.LENGTH
