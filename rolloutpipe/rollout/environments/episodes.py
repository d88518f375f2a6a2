"""One episode, turn by turn, token in and token out: engine results in, the next turn's request or a sample out.

    prompt ids --> engine (turn 0) --> model ids (mask 1, the engine's log-probs)
               --> environment step (pool.py, a worker) --> its reply through the chat template (chat.py), ids
                   appended once (mask 0, log-prob 0.0)
               --> engine (turn 1, input: prompt + every id so far, never re-tokenized text) --> ... --> Sample

The episode's tokens after the prompt are its ``response_ids``: the trainer scores exactly what the engine sampled,
and ``response_mask`` keeps the environment's tokens out of the loss. A turn's request is seeded by its id
(``step=<k>/group=<g>/sample=<s>/turn=<t>``; turn 0's id and seed are the single-response sample's), so every turn
is reproducible on any engine and in any arrival order, and sync and cgp see the same episodes.

Limits. The episode's budget is ``rollout_max_response_len`` tokens after the prompt, the model's and the
environment's together; a model turn takes at most ``environment.max_turn_tokens`` of what is left. An episode ends
when the environment is done, after ``environment.max_turns`` model turns (the last turn still gets its reward), when
a model turn uses up the budget, or when the environment's reply does not fit what is left (``overflow``: it is
never appended). An environment call that raises, returns something that is not text, or whose reply cannot be
tokenized ends it with reward 0 (``env_error``); one past ``environment.timeout_s`` likewise (``env_timeout``, a
timeout for ``reward.on_timeout``). Each ending is a ``types.EpisodeEnd``, counted per step in the metrics.

Pure logic over a pool and a tokenizer: the reward threads (rollout/samples.py) call ``EpisodeRunner.on_turn`` for
every result of an episode's request; the tests drive it with a scripted engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rolloutpipe.rollout.environments.chat import TurnTemplate
from rolloutpipe.rollout.environments.config import EnvironmentConfig
from rolloutpipe.rollout.environments.pool import EnvPool
from rolloutpipe.types import EpisodeEnd, GenerationRequest, GenerationResult, Prompt, Sample, sample_id


@dataclass(kw_only=True, slots=True)
class Episode:
    """One sample's episode so far (what the reward threads keep between its turns)."""

    prompt: Prompt
    step: int
    group: int
    sample: int
    id_prefix: str = ""
    """Set apart from training's episodes on the environment workers (an eval set's: ``eval=<set>/``)."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: model turns and environment turns back to back."""
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    """Each model turn's text, as the environment saw it (a rebuilt environment replays them: pool.py)."""
    reward: float = 0.0
    policy_versions: list[int] = field(default_factory=list)
    """Each model turn's weights, as the engine reported them."""

    @property
    def episode_id(self) -> str:
        """Its environment worker's name for it: ``step=<k>/group=<g>/sample=<s>`` (after ``id_prefix``)."""
        return self.id_prefix + sample_id(self.step, self.group, self.sample)


def policy_version(episode: Episode) -> int:
    """The episode's weights: its first turn's, or the first later turn's that differs (rollout/samples.
    check_on_policy then stops the run), never hidden by a turn that came back to the first's."""
    first = episode.policy_versions[0]
    return next((v for v in episode.policy_versions if v != first), first)


TurnRequest = Callable[[Episode, int, list[int], int], GenerationRequest]
"""Makes turn t's request of an episode from its input ids and its max new tokens (rollout/node.py)."""


class EpisodeRunner:
    """Advances episodes one engine result at a time (see the module docstring). Thread-safe: an episode has one
    request in flight at a time, so only one thread touches it at once."""

    def __init__(self, *, cfg: EnvironmentConfig, pool: EnvPool, tokenizer, stop_token_ids: list[int],
                 max_response_len: int, turn_request: TurnRequest, on_env_call=None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.tokenizer = tokenizer
        self.template = TurnTemplate(tokenizer, stop_token_ids)
        self.max_response_len = max_response_len
        self.turn_request = turn_request
        self.on_env_call = on_env_call or (lambda episode, start_s, end_s, error: None)
        """Told of every environment call (rollout/samples.py: its ``rollout/environment`` span)."""

    def first_request(self, episode: Episode) -> GenerationRequest:
        return self.turn_request(episode, 0, episode.prompt.input_ids, self._max_new_tokens(episode))

    def on_turn(self, episode: Episode, result: GenerationResult) -> GenerationRequest | Sample:
        """A model turn came back (not aborted): the next turn's request, or the finished episode."""
        episode.response_ids += result.output_ids
        episode.mask += [1] * len(result.output_ids)
        episode.logprobs += result.output_logprobs
        episode.policy_versions.append(result.policy_version)
        episode.responses.append(self.tokenizer.decode(result.output_ids, skip_special_tokens=True))
        if len(episode.response_ids) >= self.max_response_len:
            return self._ended(episode, result, EpisodeEnd.length)
        start = time.time()
        outcome = self.pool.step(episode.episode_id, episode.prompt.label, episode.prompt.metadata,
                                 episode.responses)
        self.on_env_call(episode, start, time.time(), outcome.error)
        if outcome.turn is None:
            end = EpisodeEnd.env_timeout if outcome.timed_out else EpisodeEnd.env_error
            return self._sample(episode, result, end, error=f"the environment failed: {outcome.error}",
                                timed_out=outcome.timed_out)
        episode.reward += outcome.turn.reward
        if outcome.turn.done:
            return self._sample(episode, result, EpisodeEnd.done)
        if len(episode.responses) >= self.cfg.max_turns:
            return self._ended(episode, result, EpisodeEnd.max_turns)
        try:
            reply = self.template.ids(outcome.turn.messages)
        except Exception as err:  # tokenizers raises a bare Exception for characters it does not know
            return self._ended(episode, result, EpisodeEnd.env_error,
                               error=f"the environment's reply cannot be tokenized: {err}")
        if len(episode.response_ids) + len(reply) >= self.max_response_len:  # (the model needs a token after it)
            return self._ended(episode, result, EpisodeEnd.overflow)
        episode.response_ids += reply
        episode.mask += [0] * len(reply)
        episode.logprobs += [0.0] * len(reply)
        return self.turn_request(episode, len(episode.responses), episode.prompt.input_ids + episode.response_ids,
                                 self._max_new_tokens(episode))

    def _max_new_tokens(self, episode: Episode) -> int:
        left = self.max_response_len - len(episode.response_ids)
        return left if self.cfg.max_turn_tokens is None else min(left, self.cfg.max_turn_tokens)

    def _ended(self, episode: Episode, last: GenerationResult, end: EpisodeEnd, *, error: str | None = None
               ) -> Sample:
        """The episode ends on our side while its environment worker still holds it: the worker closes it."""
        self.pool.end(episode.episode_id)
        return self._sample(episode, last, end, error=error)

    def _sample(self, episode: Episode, last: GenerationResult, end: EpisodeEnd, *, error: str | None = None,
                timed_out: bool = False) -> Sample:
        return Sample(
            group=episode.group, index=episode.sample, response_ids=episode.response_ids, logprobs=episode.logprobs,
            response_text=self.tokenizer.decode(episode.response_ids, skip_special_tokens=True),
            finish_reason=last.finish_reason,
            reward=0.0 if error is not None else episode.reward, policy_version=policy_version(episode),
            reward_error=error, reward_timed_out=timed_out, response_mask=episode.mask,
            num_turns=len(episode.responses), episode_end=end)
