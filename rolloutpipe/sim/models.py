"""Cost and workload models of the simulator, each a typed config with its own cost function.

Engine decode. One decode iteration of an engine running ``B`` requests whose contexts (prompt plus
tokens generated so far) add up to ``C`` tokens takes

    decode_base_s + decode_per_request_s * B + decode_per_context_token_s * C

(fixed launch/scheduling cost, the per-sequence work of sampling and the MLP, and attention reading the
KV cache). Requests join between iterations; a join costs ``prefill_base_s + prefill_per_token_s * P``
for the joiners' P prompt tokens, paid by the whole batch; each finished request costs ``per_finish_s``.
Calibrated on this machine's embedded engine by ``sim/calibrate.py``; GPU figures come from published SGLang
throughput (conf/sim/hardware/*.yaml cite their sources).

Trainer. A micro-batch is padded to its longest sample, as trainer/torch_backend.py does, so it costs
``micro_batch_base_s + num_samples * (per_token_s * padded_len + per_token_squared_s * padded_len**2)``
(the MLP, then attention); an optimizer step costs
``optimizer_step_s``. With several ranks each rank trains its share (batching.BatchConsumer) and the
optimizer step waits for the slowest.

Episodes (multi-turn, agentic samples). With ``episodes.max_turns > 1`` a sample is an episode: a model turn (one
engine request, its length drawn from ``lengths`` like a single response's), an environment call (a latency on
one of ``num_env_workers`` workers, no engine), the next model turn (a new request whose prompt is the whole
conversation so far, the environment's reply appended), ... until the episode ends; see ``EpisodeModel``.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(kw_only=True, slots=True)
class EngineModel:
    decode_base_s: float = 2.0e-3
    decode_per_request_s: float = 5.0e-5
    decode_per_context_token_s: float = 1.0e-8
    prefill_base_s: float = 1.0e-3
    prefill_per_token_s: float = 1.0e-6
    per_finish_s: float = 0.0
    """Time a finished request takes from its engine's device: host work that shares it (the embedded engine
    shares one CPU with detokenising, the reward call and its bookkeeping; ~0 for a GPU engine)."""
    source: str = ""
    """Where the numbers come from (a calibration run, a paper, a benchmark page)."""

    def decode_s(self, num_iterations: int, num_running: int, context_at_start: float) -> float:
        """Time of ``num_iterations`` iterations with a fixed batch whose context grows by B per iteration."""
        k, b = num_iterations, num_running
        per = self.decode_base_s + self.decode_per_request_s * b + self.decode_per_context_token_s * context_at_start
        return k * per + self.decode_per_context_token_s * b * k * (k - 1) / 2

    def iterations_within(self, duration_s: float, num_running: int, context_at_start: float) -> int:
        """The most whole iterations that fit in ``duration_s`` (inverse of ``decode_s``)."""
        if duration_s <= 0:
            return 0
        per = self.decode_base_s + self.decode_per_request_s * num_running + \
            self.decode_per_context_token_s * context_at_start
        q = self.decode_per_context_token_s * num_running / 2
        if q == 0:
            return int(duration_s * (1 + 1e-12) / per)
        lin = per - q  # q k^2 + lin k <= duration
        k = int((-lin + math.sqrt(lin * lin + 4 * q * duration_s)) / (2 * q))
        limit = duration_s * (1 + 1e-12)  # the root's rounding must not lose an iteration that ends exactly then
        while k > 0 and self.decode_s(k, num_running, context_at_start) > limit:
            k -= 1
        while self.decode_s(k + 1, num_running, context_at_start) <= limit:
            k += 1
        return k

    def prefill_s(self, num_prompt_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * num_prompt_tokens


@dataclass(kw_only=True, slots=True)
class TrainerModel:
    micro_batch_base_s: float = 5.0e-3
    per_token_s: float = 1.0e-5
    """Forward + backward per padded token on one rank."""
    per_token_squared_s: float = 0.0
    """Attention: per sample and squared padded length (matters where the sequence is long for the model)."""
    optimizer_step_s: float = 5.0e-3
    corun_slowdown: float = 1.0
    """Micro-batch time multiplier while the rollout generates: the node groups share memory bandwidth and
    caches where they share a machine (this one: one core each of two); 1.0 on separate nodes."""
    source: str = ""

    def micro_batch_s(self, num_samples: int, padded_len: int) -> float:
        return self.micro_batch_base_s + num_samples * padded_len * (self.per_token_s
                                                                       + self.per_token_squared_s * padded_len)


@dataclass(kw_only=True, slots=True)
class OverheadModel:
    """Latencies between the stages, each per item."""

    reward_s: float = 1.0e-3
    """One sample's reward, on one of ``reward.num_workers`` workers."""
    publish_s: float = 1.0e-3
    """Dispatcher: one group's payload and handle into the store (serial)."""
    load_s: float = 1.0e-3
    """Trainer: reading one group's handle and payload (every rank reads every handle)."""
    weight_save_s: float = 0.05
    """Trainer: writing the new weights (the trainer is free again after this in async_one_step)."""
    weight_load_s: float = 0.05
    """Engines: loading them; the next on-policy step starts after save + load."""
    step_start_s: float = 0.0
    """Between the engines serving new weights and the next step's first admission."""


class SchedulerKind(enum.Enum):
    slots = "slots"
    """At most ``rollout.concurrency`` requests run, the rest wait in submission order (sim/engine.py)."""
    sglang = "sglang"
    """SGLang's scheduler: KV-pool admission, priority order, preemption, retraction, radix cache (sim/sglang.py)."""


@dataclass(kw_only=True, slots=True)
class SchedulerModel:
    kind: SchedulerKind = SchedulerKind.slots
    max_total_tokens: int | None = None
    """KV pool of one engine in tokens (SGLang's ``--max-total-tokens``; None: it never limits)."""
    max_running_requests: int | None = None
    """SGLang's ``--max-running-requests`` (None: ``rollout.concurrency``)."""
    init_new_token_ratio: float = 0.7
    """SGLANG_INIT_NEW_TOKEN_RATIO (x --schedule-conservativeness, 1.0)."""
    min_new_token_ratio_factor: float = 0.14
    """SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR."""
    new_token_ratio_decay_steps: int = 600
    """SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS."""
    retract_decode_steps: int = 20
    """SGLANG_RETRACT_DECODE_STEPS."""
    clip_max_new_tokens: int = 4096
    """SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION."""
    priority_scheduling: bool | None = None
    """None: on under FGD, as the launcher starts SGLang (rollout/engines/hosts.py)."""
    priority_preemption_threshold: int = 10
    """--priority-scheduling-preemption-threshold: a request preempts running ones whose priority value is more
    than this above its own (FGD's priorities are group indices: groups more than 10 apart)."""
    radix_cache: bool = True
    """False: --disable-radix-cache."""

    def __post_init__(self) -> None:
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"sim.scheduler.max_total_tokens={self.max_total_tokens} must be at least 1 (or null).")
        if not 0 < self.init_new_token_ratio <= 1 or not 0 < self.min_new_token_ratio_factor <= 1:
            raise ValueError("sim.scheduler.init_new_token_ratio and min_new_token_ratio_factor must be in (0, 1].")


class LengthKind(enum.Enum):
    lognormal = "lognormal"
    geometric = "geometric"
    """Stop with probability ``1 / mean_tokens`` per token (an untrained model's end-of-sequence rate)."""
    histogram = "histogram"
    """Draw from the lengths listed in ``histogram_path`` (one integer per line)."""


@dataclass(kw_only=True, slots=True)
class LengthModel:
    kind: LengthKind = LengthKind.lognormal
    median_tokens: float = 64.0
    """lognormal: the median response length."""
    sigma: float = 1.0
    """lognormal: spread of log length (1.0: the 99th percentile is ~10x the median)."""
    mean_tokens: float = 45.0
    """geometric: mean length before the cut-off."""
    histogram_path: str | None = None
    prompt_tokens: int = 16
    prompt_sigma: float = 0.0
    """Spread of log prompt length around ``prompt_tokens`` (0: every prompt the same length)."""

    def __post_init__(self) -> None:
        if self.kind is LengthKind.histogram and (self.histogram_path is None
                                                  or not Path(self.histogram_path).is_file()):
            raise ValueError(f"sim.lengths.histogram_path={self.histogram_path!r} is not a file; give a text file "
                             "with one response length per line (tools/simulate.py calibrate writes one).")

    def draw(self, rng: np.random.Generator, size: int | tuple[int, ...], max_tokens: int) -> np.ndarray:
        """Response lengths in tokens, 1 .. max_tokens (the cut-off is rollout_max_response_len)."""
        if self.kind is LengthKind.lognormal:
            lengths = rng.lognormal(math.log(self.median_tokens), self.sigma, size)
        elif self.kind is LengthKind.geometric:
            lengths = rng.geometric(1.0 / self.mean_tokens, size)
        else:
            lengths = rng.choice(_histogram(self.histogram_path), size)
        return np.clip(np.ceil(lengths), 1, max_tokens).astype(np.int64)

    def draw_prompts(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.prompt_sigma == 0:
            return np.full(size, self.prompt_tokens, dtype=np.int64)
        return np.maximum(1, rng.lognormal(math.log(self.prompt_tokens), self.prompt_sigma, size)).astype(np.int64)


@functools.lru_cache(maxsize=8)
def _histogram(path: str) -> np.ndarray:
    return np.loadtxt(path, dtype=np.int64, ndmin=1)


@dataclass(kw_only=True, slots=True)
class RewardModel:
    """Each prompt has a pass rate p ~ Beta(alpha, beta); each sample passes with probability p (reward 1)."""

    pass_alpha: float = 1.0
    pass_beta: float = 1.0

    def draw_pass_rates(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.beta(self.pass_alpha, self.pass_beta, size)


class TurnsKind(enum.Enum):
    geometric = "geometric"
    """After each model turn the environment goes on with probability ``1 - 1 / mean_turns`` (a long tail)."""
    weights = "weights"
    """The environment ends the episode after 1, 2, ... model turns in proportion to ``turn_weights``."""


@dataclass(kw_only=True, slots=True)
class EpisodeModel:
    """Multi-turn samples (the real side: rollout/environments/, types.EpisodeEnd).

    An episode's number of model turns, each turn's length and each environment reply's tokens and latency are
    drawn per (seed, step, group, sample, turn), so every mode sees the same episodes; its first turn is exactly
    the single response a single-turn run draws. The episode's budget is ``rollout_max_response_len`` tokens
    after the prompt, the model's and the environment's together: a turn is cut at what is left (the episode ends,
    ``length``), and an environment reply that leaves no token for the next turn ends it before the reply
    (``overflow``). It also ends when the environment says so (``done``, the drawn number of turns) or after
    ``max_turns`` turns (``max_turns``). The sample the trainer gets is the prompt, then every turn and reply back
    to back (replies masked out of the loss).
    """

    max_turns: int = 1
    """Model turns per episode at most (``environment.max_turns``). 1: one response per sample, no environment
    (the single-turn simulator, unchanged)."""
    turns: TurnsKind = TurnsKind.geometric
    """How many turns the environment wants before it says done (then cut at ``max_turns``)."""
    mean_turns: float = 2.0
    """geometric: the mean number of turns before the cut (a turn count of 1, 2, 3, ... with probability p, p(1-p),
    ... for p = 1 / mean_turns)."""
    turn_weights: list[float] = field(default_factory=list)
    """weights: relative frequency of episodes of 1, 2, ... turns (e.g. [0, 0, 1]: always 3)."""
    env_tokens: float = 64.0
    """Median tokens an environment reply appends to the conversation (prefill for the next turn; trained over,
    masked out of the loss)."""
    env_tokens_sigma: float = 0.0
    """Spread of log reply length around ``env_tokens`` (0: every reply that long)."""
    env_latency_s: float = 0.5
    """Median latency of one environment call (a tool, a game step), excluding waiting for a worker."""
    env_latency_sigma: float = 0.0
    """Spread of log latency around ``env_latency_s``, log-normal (0: every call takes exactly that; 1.0: the 99th
    percentile is ~10x the median)."""
    num_env_workers: int | None = None
    """Environment calls run in parallel on this many workers (``environment.num_workers``); a call waits for the
    first free one, in the order the calls come (the real pool keeps an episode on one worker: with few workers
    this is the optimistic side). None: a worker per call, no call ever waits."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"sim.episodes.max_turns={self.max_turns} must be at least 1 (1: single-turn samples).")
        if self.turns is TurnsKind.geometric and not self.mean_turns >= 1:
            raise ValueError(f"sim.episodes.mean_turns={self.mean_turns} must be at least 1 (model turns).")
        if self.turns is TurnsKind.weights and (not self.turn_weights or min(self.turn_weights) < 0
                                                or not sum(self.turn_weights) > 0):
            raise ValueError(f"sim.episodes.turn_weights={self.turn_weights} must list non-negative weights of "
                             "episodes of 1, 2, ... turns, not all 0 (with sim.episodes.turns=weights).")
        if min(self.env_tokens, self.env_tokens_sigma, self.env_latency_s, self.env_latency_sigma) < 0:
            raise ValueError("sim.episodes.env_tokens, env_tokens_sigma, env_latency_s and env_latency_sigma must "
                             "not be negative.")
        if self.num_env_workers is not None and self.num_env_workers < 1:
            raise ValueError(f"sim.episodes.num_env_workers={self.num_env_workers} must be at least 1, or null (a "
                             "worker per call).")

    @property
    def multi_turn(self) -> bool:
        return self.max_turns > 1

    def draw_turns(self, rng: np.random.Generator, size: tuple[int, ...]) -> np.ndarray:
        """The turns each episode's environment wants before it says done, not cut at ``max_turns`` (so an
        episode cut there is told from one that ended there)."""
        if self.turns is TurnsKind.geometric:
            return rng.geometric(1.0 / self.mean_turns, size)
        weights = np.asarray(self.turn_weights, dtype=np.float64)
        return rng.choice(np.arange(1, len(weights) + 1), size, p=weights / weights.sum())

    def draw_env_tokens(self, rng: np.random.Generator, size: tuple[int, ...]) -> np.ndarray:
        if self.env_tokens_sigma == 0 or self.env_tokens == 0:
            return np.full(size, math.ceil(self.env_tokens), dtype=np.int64)
        return np.ceil(rng.lognormal(math.log(self.env_tokens), self.env_tokens_sigma, size)).astype(np.int64)

    def draw_env_latency(self, rng: np.random.Generator, size: tuple[int, ...]) -> np.ndarray:
        if self.env_latency_sigma == 0 or self.env_latency_s == 0:
            return np.full(size, float(self.env_latency_s))
        return rng.lognormal(math.log(self.env_latency_s), self.env_latency_sigma, size)


@dataclass(kw_only=True, slots=True)
class SimConfig:
    engine: EngineModel = field(default_factory=EngineModel)
    scheduler: SchedulerModel = field(default_factory=SchedulerModel)
    """What decides which request runs: a request count (SimEngine) or SGLang's scheduler (sim/sglang.py)."""
    trainer: TrainerModel = field(default_factory=TrainerModel)
    overheads: OverheadModel = field(default_factory=OverheadModel)
    lengths: LengthModel = field(default_factory=LengthModel)
    rewards: RewardModel = field(default_factory=RewardModel)
    episodes: EpisodeModel = field(default_factory=EpisodeModel)
    """Multi-turn samples (episodes); the default, ``max_turns: 1``, is one response per sample."""
    num_prompts: int = 4096
    """Size of the synthetic data set (its prompts get lengths and pass rates once)."""
    num_span_steps: int = 0
    """Record spans (for the timeline picture) of the first N steps."""
    speculative: bool = False
    """Speculative next-step rollout (sim/speculative.py): while step k trains, idle engines draft step k+1's
    requests, verified when policy k+1 is served. With pipeline.mode sync or cgp."""
    acceptance: float = 0.995
    """Speculative: the probability that policy k+1 reproduces a drafted token, each token independently."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"sim.acceptance={self.acceptance} must be in [0, 1]: the probability a drafted token "
                             "is kept.")
        if self.speculative and self.episodes.multi_turn:
            raise ValueError("sim.speculative=true with sim.episodes.max_turns > 1: speculative drafts of episodes "
                             "(whose later turns wait on an environment) are not modelled; use one or the other.")
