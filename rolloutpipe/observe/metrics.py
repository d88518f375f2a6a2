"""Spans and per-step metrics: stages return typed records, and this is the one place that reduces them.

Definitions (DESIGN.md, "Measured stages"). For step k, with t0 the step's first admission on the
rollout node and t_end the end of its last optimizer step (on trainer rank 0, whose record this is, that step's
update itself is applied during weight sync, bucket by bucket, and counted in perf/weight_sync_s: grpo_trainer.py):
    perf/rollout_to_train_end_s       t_end - t0 (weight sync is reported apart, perf/weight_sync_s)
    perf/rollout_s                    last group complete - t0
    perf/first_group_s                first group complete - t0
    perf/train_compute_s              forward/backward + optimizer time (mean over trainer ranks)
    perf/trainer_wait_ratio           (window - compute) / window with window = t_end - t0: every moment of
                                      the window a trainer rank is not computing it waits for data or peers
    perf/ideal_rollout_to_train_end_s the best any on-policy pipeline can do with these stage times, the
                                      larger of two lower bounds: rollout_s + the compute that cannot start
                                      before the last group exists (the last micro-batch's forward/backward
                                      and the last optimizer step), and first_group_s + all the compute (the
                                      trainer cannot start before the first group)
    perf/pipeline_efficiency          (T_sync - T) / (T_sync - T_ideal), T = rollout_to_train_end,
                                      T_sync = rollout_s + train_compute_s (what a synchronous schedule would
                                      take), T_ideal as above: 0 for no overlap, 1 for the ideal
    perf/padding_ratio                padding slots / all token slots of the step's micro-batches (each row
                                      right-padded to its micro-batch's longest sequence), over every rank
    train/entropy                     the policy's entropy at the trained response tokens (at the sampling
                                      temperature), mean over the step's tokens: falling fast means collapse
    train/kl                          (grpo.kl_loss_coef > 0) the KL estimate to the reference, mean per token
    train/tis_mean, train/tis_max     (grpo.rollout_correction) rho = exp(trainer old log-prob - engine log-prob)
                                      over the response tokens (a sequence's rho on each of its tokens)
    train/tis_clipfrac                the fraction of tokens whose weight is not rho: truncated (TIS), dropped (MIS)
    train/engine_trainer_logprob_gap  mean |trainer old log-prob - engine log-prob| per response token
    train/weights_digest              (a str) 16 hex digits of the sha256 of the policy after the step's last
                                      optimizer step (control/weights/digest.py): equal in two runs exactly when
                                      their policies are bit-identical; metrics.jsonl and W&B (a text column)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rolloutpipe.control.clock import ClockSync
from rolloutpipe.types import CompleteGroup, EpisodeEnd, FinishReason, Span

SPAN_FLUSH = "spans/flush"
"""The span each flush records of itself; its ``record_s`` attribute is the time spent in ``add`` since the
previous flush, so a run's recording overhead is measured from its own span files."""


class SpanRecorder:
    """One process's spans, kept in memory and appended to ``path`` as JSONL by ``flush``. Thread-safe.

    File format (``spans/<role>-<rank>.jsonl``): a header line ``{"header": {role, rank, host, pid, clock,
    add_cost_s, time_base_s}}`` written at construction, then one line per flush, ``{"spans": [[name,
    step, start_us, end_us, attrs], ...]}``: times in integer microseconds since ``time_base_s``, role and
    rank from the header. (One JSON document per flush, and integers rather than floats, make a flush
    about twice as cheap as one ``json.dumps`` per span.) A process that starts again (resume) appends a
    new header, which applies to the lines after it, and ``{"resume_at": k}``: the spans of step k and later
    before it are dropped on reading (that step is redone). Span times are on the run's clock: callers pass this
    process's ``time.time()`` values and ``add`` adds the clock offset (control/clock.py), so the files of
    different nodes merge as they are; the header keeps the offset and its uncertainty.

    Cost. ``add`` appends a tuple under a lock (about 2-3 us on a busy 2-core machine, most of it the call
    with its keyword arguments); ``flush`` serialises (about 3 us a span) and runs between steps. The
    recorder measures both in CPU time (what recording takes from the process, not what other processes
    on a busy machine take from it) without slowing ``add``: at construction it times ``add`` itself
    (``add_cost_s``, in the header), and each flush records a ``spans/flush`` span of itself with
    ``record_s = num_spans * add_cost_s`` and its own ``cpu_s``; ``trace.recording_overhead`` adds them up.
    """

    def __init__(self, *, role: str, rank: int, path: Path, clock: ClockSync | None = None) -> None:
        self.role = role
        self.rank = rank
        self.path = path
        self.clock = clock or ClockSync.local()
        self._offset_s = self.clock.offset_s
        self._pending: list[tuple[str, int, float, float, dict]] = []
        self._lock = threading.Lock()
        self.add_cost_s = self._calibrate()
        self.time_base_s = float(int(self.now()))
        header = {"role": role, "rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                  "clock": asdict(self.clock), "add_cost_s": self.add_cost_s, "time_base_s": self.time_base_s}
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"header": header}) + "\n")

    def resume_at(self, step: int) -> None:
        """This process resumes the run at ``step`` (a resume or a requeue): spans of ``step`` and later that an
        earlier process wrote to this file are superseded, so no step is counted twice (``read_span_files``)."""
        with self.path.open("a") as f:
            f.write(json.dumps({"resume_at": step}) + "\n")

    def now(self) -> float:
        """time.time() on the run's clock: for timestamps that are compared across processes."""
        return time.time() + self._offset_s

    def add(self, name: str, *, step: int, start_s: float, end_s: float, **attrs: object) -> None:
        """Record a finished stage; ``start_s`` and ``end_s`` are this process's time.time() values."""
        with self._lock:
            self._pending.append((name, step, start_s + self._offset_s, end_s + self._offset_s, attrs))

    @contextlib.contextmanager
    def span(self, name: str, *, step: int, **attrs: object) -> Iterator[dict]:
        """Times the block; the yielded dict may receive more attributes."""
        extra: dict = {}
        start = time.time()
        try:
            yield extra
        finally:
            self.add(name, step=step, start_s=start, end_s=time.time(), **attrs, **extra)

    def flush(self) -> None:
        start, t, cpu = time.time(), time.perf_counter(), time.thread_time()
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        base = self.time_base_s
        rows = [(name, step, round((start_s - base) * 1e6), round((end_s - base) * 1e6), attrs)
                for name, step, start_s, end_s, attrs in pending]
        line = _encode({"spans": rows}) + "\n"
        with self.path.open("a") as f:
            f.write(line)
            flush_s = time.perf_counter() - t
            attrs = {"num_spans": len(pending), "record_s": len(pending) * self.add_cost_s,
                     "cpu_s": time.thread_time() - cpu}
            start_us = round((start + self._offset_s - base) * 1e6)
            own = (SPAN_FLUSH, max(span[1] for span in pending), start_us, start_us + round(flush_s * 1e6), attrs)
            f.write(_encode({"spans": [own]}) + "\n")

    def _calibrate(self, num_calls: int = 1000) -> float:
        """CPU seconds one ``add`` of a typical span costs its caller, timed on this process at startup."""
        start = time.thread_time()
        for i in range(num_calls):
            self.add("calibration", step=0, start_s=0.0, end_s=0.0, engine="engine0", group=i, sample=0,
                     num_tokens=0, queued_s=0.0)
        cost = (time.thread_time() - start) / num_calls
        self._pending.clear()
        return cost


_encode = json.JSONEncoder(default=str, check_circular=False).encode


@dataclass(kw_only=True, slots=True)
class SpanFile:
    """One process's span file: its header (process and clock) and its spans."""

    path: Path
    header: dict
    spans: list[Span]


def read_span_files(run_dir: Path) -> list[SpanFile]:
    """Every ``spans/*.jsonl`` of a run. A last line cut short (its process was killed mid-write) is skipped."""
    files = []
    for path in sorted((run_dir / "spans").glob("*.jsonl")):
        first: dict = {}
        header: dict = {}
        spans: list[Span] = []
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    break
                raise ValueError(f"{path}:{i + 1}: not a span record: {line[:80]!r}") from None
            if "header" in record:
                header = record["header"]
                first = first or header
            elif "resume_at" in record:  # a resumed process redoes these steps: drop what the last one wrote
                spans = [s for s in spans if s.step < record["resume_at"]]
            elif "spans" in record:
                role, rank, base = header["role"], header["rank"], header.get("time_base_s")
                unit = 1e-6 if base is not None else 1.0  # files without time_base_s hold seconds
                spans.extend(Span(name=name, role=role, rank=rank, step=step, start_s=(base or 0.0) + start * unit,
                                  end_s=(base or 0.0) + end * unit, attrs=attrs)
                             for name, step, start, end, attrs in record["spans"])
            else:  # one span per line: files written before spans were batched
                spans.append(Span(**{"role": header.get("role"), "rank": header.get("rank"), **record}))
        files.append(SpanFile(path=path, header=first, spans=spans))
    return files


def read_spans(run_dir: Path) -> list[Span]:
    """All spans of a run, every process, on the run's clock, by start time."""
    return sorted((s for f in read_span_files(run_dir) for s in f.spans), key=lambda s: s.start_s)


@dataclass(kw_only=True, slots=True)
class RolloutStats:
    """The rollout node's record of one step (sent to the trainer through the store)."""

    step: int
    policy_version: int
    start_s: float
    """First admission."""
    first_group_s: float
    last_group_s: float
    weight_load_s: float
    num_groups: int
    num_samples: int
    num_tokens: int
    num_truncated: int
    num_reward_errors: int
    num_filtered_groups: int
    """Dropped for zero reward variance (dynamic sampling)."""
    num_timeout_dropped_groups: int
    """Dropped for a timed-out reward (reward.on_timeout=drop_group)."""
    num_returned_prompts: int
    num_aborted_samples: int
    reward_mean: float
    reward_std: float
    response_len_mean: float
    policy_lag: int
    """The largest step - policy_version over the trained samples, from the versions the engines reported."""
    num_engines: int = 0
    """Engines in service at the step's end (a lost engine host's are not), and the hosts they run on."""
    num_engine_hosts: int = 0
    num_draft_tokens: int = 0
    """rollout.speculative: tokens drafted for this step's requests in the previous step's tail, and how many of
    them verification kept (every kept one is a token the step's policy samples there: rollout/drafts.py)."""
    num_draft_tokens_kept: int = 0
    num_episodes: int = 0
    """Multi-turn episodes (rollout/environments/) among the samples; 0 without an environment."""
    num_turns: int = 0
    """Their model turns, all together."""
    episode_ends: dict[str, int] = field(default_factory=dict)
    """How many ended each way (types.EpisodeEnd's values, every one listed)."""

    @classmethod
    def of(cls, *, step: int, policy_version: int, start_s: float, last_group_s: float, weight_load_s: float,
           selected: list[CompleteGroup], complete: list[CompleteGroup], num_filtered: int,
           num_timeout_dropped: int, num_returned: int, num_aborted: int) -> RolloutStats:
        """The record of a step whose ``selected`` groups are trained, out of every ``complete`` one."""
        samples = [s for g in complete for s in g.samples]  # (list comprehensions: the simulator calls this)
        rewards = [s.reward for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        mean = math.fsum(rewards) / len(rewards)  # statistics.pstdev is exact and ~50x slower
        episodes = [s for s in samples if s.response_mask is not None]
        ends = [s.episode_end.value for s in episodes]
        return cls(
            step=step, policy_version=policy_version, start_s=start_s,
            first_group_s=min(g.completed_s for g in selected), last_group_s=last_group_s,
            weight_load_s=weight_load_s, num_groups=len(selected), num_samples=len(samples),
            num_tokens=sum(lengths),
            num_truncated=[s.finish_reason for s in samples].count(FinishReason.LENGTH),
            num_reward_errors=len(samples) - [s.reward_error for s in samples].count(None),
            num_filtered_groups=num_filtered, num_timeout_dropped_groups=num_timeout_dropped,
            num_returned_prompts=num_returned, num_aborted_samples=num_aborted,
            reward_mean=mean, reward_std=math.sqrt(math.fsum([(r - mean) ** 2 for r in rewards]) / len(rewards)),
            response_len_mean=sum(lengths) / len(lengths),
            policy_lag=max([step - s.policy_version for g in selected for s in g.samples]),
            num_episodes=len(episodes), num_turns=sum([s.num_turns for s in episodes]),
            episode_ends={end.value: ends.count(end.value) for end in EpisodeEnd} if episodes else {},
        )


@dataclass(kw_only=True, slots=True)
class TrainStats:
    """One trainer rank's record of one step; ``reduce_step`` takes rank means where ranks differ."""

    step: int
    end_s: float
    """End of the step's last optimizer step."""
    compute_s: float
    tail_compute_s: float
    """The last micro-batch's forward/backward plus the last optimizer step."""
    wait_s: float
    """Time blocked on the store for group handles."""
    first_forward_s: float
    losses: list[float] = field(default_factory=list)
    """One per optimizer step: the batch loss after normalisation."""
    grad_norms: list[float] = field(default_factory=list)
    clip_fraction: float = 0.0
    num_tokens: int = 0
    entropy_sum: float = 0.0
    """The policy's entropy summed over the step's trained response tokens (all data-parallel ranks)."""
    kl_sum: float = 0.0
    tis_sum: float = 0.0
    tis_max: float = 0.0
    num_tis_clipped_tokens: int = 0
    logprob_gap_sum: float = 0.0
    """The loss terms' statistics (trainer/grpo.py LossSums), summed over the step's batches and ranks."""
    kl: bool = False
    """Whether the step trained with a KL term (train/kl is reported)."""
    corrected: bool = False
    """Whether the step trained with rollout correction (train/tis_* are reported)."""
    num_padded_tokens: int = 0
    """Token slots of the step's micro-batches (rows x each one's longest sequence), over every trainer rank once
    TrainerNode.reduce has summed them."""
    num_padding_tokens: int = 0
    """The slots of ``num_padded_tokens`` that hold padding, summed the same way."""
    num_exact_sum_unrepresented: int = 0
    """trainer.exact_accumulation: gradient elements whose values spanned more than the exact sum's window, summed
    over the step's batches (trainer/exact_sum.py; the same on every rank and in every order)."""
    weight_sync_s: float = 0.0
    weights_digest: str = ""
    """Rank 0: ``train/weights_digest`` of the policy this step made (pipeline.sync_weights); "" elsewhere."""

    def add_loss_terms(self, totals) -> None:
        """One batch's ``grpo.BatchTotals`` (over every rank)."""
        self.kl_sum += totals.kl_sum
        self.tis_sum += totals.tis_sum
        self.tis_max = max(self.tis_max, totals.tis_max)
        self.num_tis_clipped_tokens += totals.num_tis_clipped_tokens
        self.logprob_gap_sum += totals.logprob_gap_sum


def reduce_step(rollout: RolloutStats, train: TrainStats, *, mean_compute_s: float, mean_tail_compute_s: float,
                lr: float) -> dict[str, float | int | str]:
    """The metrics.jsonl record of one step (``mean_*`` are means over trainer ranks)."""
    window = train.end_s - rollout.start_s
    rollout_s = rollout.last_group_s - rollout.start_s
    sync_estimate = rollout_s + mean_compute_s
    ideal = max(rollout_s + mean_tail_compute_s, rollout.first_group_s - rollout.start_s + mean_compute_s)
    return {
        "step": rollout.step,
        "policy_version": rollout.policy_version,
        "rollout/reward_mean": rollout.reward_mean,
        "rollout/reward_std": rollout.reward_std,
        "rollout/response_len_mean": rollout.response_len_mean,
        "rollout/num_samples": rollout.num_samples,
        "rollout/truncated_ratio": rollout.num_truncated / max(rollout.num_samples, 1),
        "rollout/num_reward_errors": rollout.num_reward_errors,
        "rollout/num_filtered_groups": rollout.num_filtered_groups,
        "rollout/num_timeout_dropped_groups": rollout.num_timeout_dropped_groups,
        "rollout/num_returned_prompts": rollout.num_returned_prompts,
        "rollout/num_aborted_samples": rollout.num_aborted_samples,
        "rollout/policy_lag": rollout.policy_lag,
        "rollout/num_engines": rollout.num_engines,
        "rollout/num_engine_hosts": rollout.num_engine_hosts,
        "rollout/num_draft_tokens": rollout.num_draft_tokens,
        "rollout/draft_kept_ratio": rollout.num_draft_tokens_kept / max(rollout.num_draft_tokens, 1),
        **({"rollout/turns_mean": rollout.num_turns / rollout.num_episodes} if rollout.num_episodes else {}),
        **{f"rollout/episodes_{end}": n for end, n in rollout.episode_ends.items()},
        "train/loss": sum(train.losses) / max(len(train.losses), 1),
        "train/grad_norm": sum(train.grad_norms) / max(len(train.grad_norms), 1),
        "train/clip_fraction": train.clip_fraction,
        "train/entropy": train.entropy_sum / max(train.num_tokens, 1),
        "train/num_tokens": train.num_tokens,
        "train/exact_sum_unrepresented": train.num_exact_sum_unrepresented,
        "train/lr": lr,
        "perf/rollout_s": rollout_s,
        "perf/first_group_s": rollout.first_group_s - rollout.start_s,
        "perf/train_compute_s": mean_compute_s,
        "perf/trainer_wait_ratio": max(window - mean_compute_s, 0.0) / window if window > 0 else 0.0,
        "perf/train_end_s": train.end_s,  # wall time of the step's last optimizer step: step times are differences
        "perf/rollout_to_train_end_s": window,
        "perf/ideal_rollout_to_train_end_s": ideal,
        "perf/pipeline_efficiency": ((sync_estimate - window) / (sync_estimate - ideal) if sync_estimate > ideal
                                     else 0.0),
        "perf/weight_sync_s": train.weight_sync_s,
        "perf/weight_load_s": rollout.weight_load_s,
        "perf/tokens_per_s": rollout.num_tokens / rollout_s if rollout_s > 0 else 0.0,
        "perf/padding_ratio": train.num_padding_tokens / train.num_padded_tokens if train.num_padded_tokens else 0.0,
    } | loss_term_metrics(train) | ({"train/weights_digest": train.weights_digest} if train.weights_digest else {})


def loss_term_metrics(train: TrainStats) -> dict[str, float]:
    """train/kl and train/tis_*, where the step trained with them (per response token of the step)."""
    tokens = max(train.num_tokens, 1)
    record = {"train/kl": train.kl_sum / tokens} if train.kl else {}
    if train.corrected:
        record |= {"train/tis_mean": train.tis_sum / tokens, "train/tis_max": train.tis_max,
                   "train/tis_clipfrac": train.num_tis_clipped_tokens / tokens,
                   "train/engine_trainer_logprob_gap": train.logprob_gap_sum / tokens}
    return record


def summary_line(record: dict, num_steps: int) -> str:
    return (
        f"step {record['step'] + 1}/{num_steps}  reward {record['rollout/reward_mean']:.3f}  "
        f"loss {record['train/loss']:+.4f}  rollout {record['perf/rollout_s']:.2f}s  "
        f"compute {record['perf/train_compute_s']:.2f}s  "
        f"rollout->train-end {record['perf/rollout_to_train_end_s']:.2f}s  "
        f"wait {100 * record['perf/trainer_wait_ratio']:.0f}%  sync {record['perf/weight_sync_s']:.2f}s"
    )
