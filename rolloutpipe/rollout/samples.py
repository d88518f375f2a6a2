"""The rollout node's pieces around the engines: their config, the requests, the reward threads.

``pipeline.rollout_step`` strings them together with the pure scheduling code (``Admission`` in admission.py,
``GroupAssembler`` in groups.py, ``RolloutSchedule`` in schedule.py, also driven by the simulator).

Reward threads (``reward.num_workers`` of them)
    consume   GenerationResults, put on a queue by the engines' completion callbacks
    produce   rewarded Samples into the GroupAssembler; a group's last sample turns it into a
              CompleteGroup (advantages from its own rewards) handed to the dispatcher
    wait for  the next result; the reward itself runs in a RewardPool worker process with a timeout,
              so a reward function that hangs or raises costs one sample its reward (a timeout, under
              reward.on_timeout=drop_group, its group: rollout/schedule.py), never the thread
    shut down on a sentinel per thread (``close``); an unexpected exception is kept in ``error`` and the
              rollout loop stops the run with it.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rolloutpipe.observe.metrics import SpanRecorder
from rolloutpipe.rollout.environments.episodes import Episode, EpisodeRunner
from rolloutpipe.rollout.groups import GroupAssembler
from rolloutpipe.rollout.rewards import RewardPool
from rolloutpipe.types import (
    CompleteGroup,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    Sample,
    sample_id,
    turn_id,
)


def sampling_seed(run_seed: int, step: int, group: int, sample: int, turn: int = 0) -> int:
    """The seed of one sample's random stream (of an episode's turn ``turn``): a function of its id only, never of
    timing or batch-mates."""
    digest = hashlib.sha256(f"{run_seed}/{turn_id(step, group, sample, turn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(kw_only=True, slots=True)
class InFlight:
    """What the reward threads need to turn a result into a sample."""

    prompt: Prompt
    group: int
    sample: int
    episode: Episode | None = None
    """A multi-turn episode's state (rollout/environments/episodes.py); None: one response."""


class RewardThreads:
    """Turns finished generations into rewarded samples and complete groups (see module docstring)."""

    def __init__(self, *, pool: RewardPool | None, tokenizer, num_threads: int, spans: SpanRecorder,
                 episodes: EpisodeRunner | None = None) -> None:
        self.pool = pool
        """Scores single responses (None with an environment: an episode's reward is the environment's)."""
        self.episodes = episodes
        """Advances multi-turn episodes (environment.name); None: one response per sample."""
        self.tokenizer = tokenizer
        self.spans = spans
        self.error: BaseException | None = None
        self.results: queue.Queue = queue.Queue()
        self.in_flight: dict[str, InFlight] = {}
        self._assembler: GroupAssembler | None = None
        self.host_of: Callable[[str], str | None] = lambda engine: None
        """The host an engine runs on, for its request spans (several rollout nodes); None: one node."""
        self._on_group = None
        self._on_turn = None
        self._outstanding = 0
        self._count_lock = threading.Lock()
        self._closing = False
        """Set by ``close``: results still queued are dropped, not rewarded (the node is stopping)."""
        self._threads = [
            threading.Thread(target=self._run, name=f"reward-{i}", daemon=True) for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def begin_step(self, assembler: GroupAssembler, in_flight: dict[str, InFlight], on_group, on_turn=None) -> None:
        """``on_group(group)`` takes each complete group; ``on_turn(group, request, engine)`` an episode's next turn
        (``engine``: the one that served its previous turn)."""
        self._assembler = assembler
        self.in_flight = in_flight
        self._on_group = on_group
        self._on_turn = on_turn

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
        """Stops after the reward calls in progress: the results still queued are dropped, so a stop does not wait
        for the rewards of a step that will be redone (with a slow reward, a whole step's worth of calls). What a
        call in progress returns is dropped too: no group completes and no turn is asked for once this has begun, so
        the node may close its engines and its dispatcher while the call ends (RolloutNode.close)."""
        self._closing = True
        for _ in self._threads:
            self.results.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while (result := self.results.get()) is not None:
            try:
                if not self._closing:
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
            **({"turn": len(ctx.episode.responses)} if ctx.episode is not None else {}),
            queued_s=result.started_s - result.submitted_s, aborted=result.finish_reason is FinishReason.ABORT,
            policy_version=result.policy_version, **({"host": host} if (host := self.host_of(result.engine)) else {}),
        )
        if result.finish_reason is FinishReason.ABORT:  # over-sampling's leftovers: never rewarded or trained
            return
        if ctx.episode is not None:
            sample = self.episodes.on_turn(ctx.episode, result)
        else:
            sample = self._score(result, ctx, step)
        if self._closing:  # a call that was in progress when the node began to stop: nothing follows from it
            return
        if isinstance(sample, GenerationRequest):  # the episode goes on: its next turn goes in line
            self.in_flight[sample.request_id] = ctx
            self._on_turn(ctx.group, sample, result.engine)
            return
        group = self._assembler.add(sample)
        if group is not None:
            self.spans.add("rollout/group_complete", step=step, start_s=group.completed_s,
                           end_s=group.completed_s, group=group.group)
            self._on_group(group)

    def _score(self, result: GenerationResult, ctx: InFlight, step: int) -> Sample:
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
            policy_version=result.policy_version,
            reward_error=outcome.error,
            reward_timed_out=outcome.timed_out,
        )
        return sample


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


def check_on_policy(step: int, policy_version: int, group: CompleteGroup) -> None:
    """Every sample of step ``step`` must come from the weights the step was generated with: the engines change
    weights only between steps, so another version means that invariant broke (an engine that did not load the
    step's weights, or loaded them mid-step). Stop before the group reaches the trainer."""
    other = [s for s in group.samples if s.policy_version != policy_version]
    if other:
        s = other[0]
        raise RuntimeError(
            f"{sample_id(step, group.group, s.index)} was generated by policy_version {s.policy_version}, but step "
            f"{step} is generated by policy_version {policy_version} ({len(other)} of the group's "
            f"{len(group.samples)} samples): the engines must not change weights within a step. Stopping before "
            "training off-policy; the engine's log says which weights it loaded."
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
                    **({"response_mask": s.response_mask, "num_turns": s.num_turns,
                        "episode_end": s.episode_end.value} if s.response_mask is not None else {}),
                }) + "\n")
