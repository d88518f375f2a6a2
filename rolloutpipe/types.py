"""The nouns of RolloutPipe, named once.

One id scheme is used by logs, store keys and traces: ``step=<k>/group=<g>/sample=<s>``.
``step`` is one RL step (one rollout batch and the training on it, policy_version k -> k+1),
``group`` is one prompt and its ``n_samples_per_prompt`` samples, ``sample`` is one completion.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def sample_id(step: int, group: int, sample: int) -> str:
    return f"step={step}/group={group}/sample={sample}"


def turn_id(step: int, group: int, sample: int, turn: int) -> str:
    """A multi-turn episode's turn ``turn``'s request; turn 0's is its sample's id."""
    return sample_id(step, group, sample) + (f"/turn={turn}" if turn else "")


def group_id(step: int, group: int) -> str:
    return f"step={step}/group={group}"


class FinishReason(enum.Enum):
    STOP = "stop"
    """A stop token was generated (it is kept as the last output token)."""
    LENGTH = "length"
    """``max_new_tokens`` was reached."""
    ABORT = "abort"
    """The request was aborted before it finished; its output is partial and must not be trained."""


@dataclass(kw_only=True, slots=True)
class Prompt:
    """One row of the data set, validated and tokenized."""

    index: int
    """Position of the row in the data source (its line number minus one for jsonl)."""
    text: str
    """The prompt as the model sees it (after the chat template, if any)."""
    input_ids: list[int]
    label: Any
    """The verifiable answer, handed to the reward function as it appears in the row."""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class GenerationRequest:
    """One sample to generate. Engines see only this, never groups or steps."""

    request_id: str
    """``step=<k>/group=<g>/sample=<s>``."""
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    sampling_seed: int
    """Seeds the request's own random stream, so its tokens do not depend on its batch-mates."""
    stop_token_ids: list[int]
    priority: int = 0
    """Lower runs first where the engine schedules by priority (SGLang's convention)."""
    draft_ids: list[int] = field(default_factory=list)
    """Tokens drafted for this request under the previous policy (rollout.speculative, rollout/drafts.py). The
    embedded engine keeps the longest prefix its own sampler reproduces and decodes on from there, so the result is
    the one it would make without the draft; they are never output unverified. Empty: no draft."""

    def check(self, context_len: int) -> None:
        """Raise ValueError where an SGLang server refuses this request (HTTP 400) on a model of ``context_len``
        tokens, or where it cannot be generated at all."""
        num_tokens = len(self.input_ids) + self.max_new_tokens
        if num_tokens > context_len:  # SGLang's words (TokenizerManager._validate_one_request)
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context_len} tokens. You "
                f"requested a total of {num_tokens} tokens: {len(self.input_ids)} tokens from the input messages and "
                f"{self.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.")
        problems = []
        if not self.input_ids:
            problems.append("input_ids is empty")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} (must be >= 1)")
        if len(self.draft_ids) > self.max_new_tokens:
            problems.append(f"{len(self.draft_ids)} draft_ids, more than max_new_tokens={self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} (must be >= 0; 0 means greedy)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} (must be in (0, 1])")
        if problems:
            raise ValueError(f"request {self.request_id}: " + "; ".join(problems))


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    request_id: str
    output_ids: list[int]
    output_logprobs: list[float]
    """log p(token) under softmax(logits / temperature) of the serving policy, one per output token."""
    finish_reason: FinishReason
    policy_version: int
    """The weights that generated every token of this result."""
    submitted_s: float
    """Wall time (time.time()) when the engine received the request."""
    started_s: float
    """Wall time when the request entered the running batch."""
    finished_s: float
    engine: str = ""
    """Name of the engine that produced it (a retried request has results from two engines)."""
    num_draft_kept: int = 0
    """Leading output tokens that came from the request's draft, verified (GenerationRequest.draft_ids)."""


class EpisodeEnd(enum.Enum):
    """Why a multi-turn episode ended (rollout/environments/); a single response is ``done``."""

    done = "done"
    """The environment said so (or, without one, the response ended)."""
    max_turns = "max_turns"
    """``environment.max_turns`` model turns were taken."""
    length = "length"
    """The episode's token budget (``rollout_max_response_len`` after the prompt) ran out in a model turn."""
    overflow = "overflow"
    """The environment's reply did not fit what is left of the budget: the episode ends before it, untrained
    tokens never appended."""
    env_error = "env_error"
    """The environment raised, returned something that is not text, or its worker died: reward 0."""
    env_timeout = "env_timeout"
    """An environment call ran past ``environment.timeout_s``: reward 0, a timeout for ``reward.on_timeout``."""


@dataclass(kw_only=True, slots=True)
class Sample:
    """One completion with its reward, or one multi-turn episode (its turns back to back in ``response_ids``)."""

    group: int
    index: int
    """Sample index within its group, 0 .. n_samples_per_prompt - 1."""
    response_ids: Sequence[int]
    """A list (the simulator's samples: a range of their length)."""
    logprobs: list[float]
    """Engine log-probs of ``response_ids`` (see GenerationResult.output_logprobs)."""
    response_text: str
    finish_reason: FinishReason
    reward: float
    policy_version: int
    """The weights that generated it, as the engine reported them (GenerationResult.policy_version)."""
    reward_error: str | None = None
    """Why the reward function failed (exception or timeout); the reward is then 0."""
    reward_timed_out: bool = False
    """The reward call ran past ``reward.timeout_s``; with ``reward.on_timeout=drop_group`` its group is dropped."""
    response_mask: list[int] | None = None
    """An episode's: 1 where ``response_ids`` holds a token the model sampled (trained), 0 where the environment's
    turn put it (not trained; its ``logprobs`` entry is 0.0). None: every token is the model's."""
    num_turns: int = 1
    """Model turns (engine requests) that made it."""
    episode_end: EpisodeEnd = EpisodeEnd.done


@dataclass(kw_only=True, slots=True)
class CompleteGroup:
    """A prompt with all its samples generated and rewarded: trainable on its own under GRPO."""

    step: int
    group: int
    """Index of the group within the step, 0 .. rollout_batch_size - 1, in prompt order."""
    policy_version: int
    prompt_index: int
    prompt_ids: list[int]
    samples: list[Sample]
    advantages: list[float]
    """One per sample, computed from this group's rewards only."""
    completed_s: float
    """Wall time at which the last sample's reward was known."""
    batch: int = -1
    """The training batch (0 .. num_steps_per_rollout - 1) the group belongs to; set when it is placed."""


@dataclass(kw_only=True, slots=True)
class GroupHandle:
    """What crosses the store for one complete group: small, signed, never pickled."""

    run_id: str
    step: int
    seq: int
    """Publish order within the step, 0, 1, 2, ...; the trainer consumes in this order."""
    group: int
    batch: int
    """Training batch within the step (see rollout/slots.py: StepSlots)."""
    policy_version: int
    location: str
    """``inline`` (payload under its own store key) or ``file:<path relative to the run dir>``."""
    num_bytes: int
    digest: str
    """sha256 hex of the payload bytes."""
    published_s: float
    signature: str = ""
    """HMAC-SHA256 (per-run secret) of every other field."""


@dataclass(kw_only=True, slots=True)
class Span:
    """One timed stage of one process; names are listed in DESIGN.md (``rollout/request``, ``train/wait``, ...)."""

    name: str
    role: str
    """``rollout`` or ``trainer``."""
    rank: int
    step: int
    start_s: float
    end_s: float
    attrs: dict[str, Any] = field(default_factory=dict)


class LifecycleState(enum.Enum):
    """How far a group got; a healthy group goes through every state but DROPPED, in this order."""

    ADMITTED = "admitted"
    """Its first request went to an engine."""
    GENERATED = "generated"
    """Every sample generated."""
    REWARDED = "rewarded"
    """Every sample rewarded."""
    COMPLETE = "complete"
    """Advantages computed; handed to the dispatcher."""
    PUBLISHED = "published"
    """Its handle is in the store."""
    CONSUMED = "consumed"
    """A trainer rank received its handle."""
    TRAINED = "trained"
    """The optimizer step of its training batch is done."""
    DROPPED = "dropped"
    """Dropped (zero reward variance under dynamic sampling, or a reward timeout under reward.on_timeout=drop_group)
    or aborted (an over-sampled group the step did not need): never trained."""


class DropReason(enum.Enum):
    """Why a complete group is not trained (rollout/schedule.py replaces it): a rollout/group_dropped span's reason."""

    zero_variance = "zero_variance"
    """Dynamic sampling (``rollout.filter_zero_variance``): its rewards are all equal, so its advantages are 0."""
    reward_timeout = "reward_timeout"
    """A reward call ran past ``reward.timeout_s`` under ``reward.on_timeout=drop_group``: its 0 would say how
    loaded the machine was, not how good the response is."""


@dataclass(kw_only=True, slots=True)
class GroupLifecycle:
    """One group's life across both node groups, built from every process's spans (``trace.group_lifecycles``).

    Times are on the run's clock (control/clock.py); None means the group never reached that state.
    """

    step: int
    group: int
    state: LifecycleState
    """The last state reached."""
    engine: str = ""
    admitted_s: float | None = None
    generated_s: float | None = None
    rewarded_s: float | None = None
    complete_s: float | None = None
    published_s: float | None = None
    consumed_s: float | None = None
    trained_s: float | None = None
    dropped_s: float | None = None
    drop_reason: str | None = None
    """The ``rollout/group_dropped`` span's reason (``zero_variance``, ``reward_timeout``, ``unused``), else
    ``aborted``, or ``filtered`` (complete, never published, in a step that trained)."""
    policy_version_admitted: int | None = None
    """The weights that generated its samples."""
    policy_version_trained: int | None = None
    """The trainer's policy version when its gradient was applied."""
    batch: int | None = None
    """Its training batch within the step."""
