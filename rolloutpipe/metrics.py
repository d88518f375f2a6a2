"""Spans and per-step metrics: stages return typed records, and this is the one place that reduces them.

Definitions (DESIGN.md, "Measured stages"). For step k, with t0 the step's first admission on the
rollout node and t_end the end of its last optimizer step:
    perf/rollout_to_train_end_s       t_end - t0 (weight sync is reported apart, perf/weight_sync_s)
    perf/rollout_s                    last group complete - t0
    perf/first_group_s                first group complete - t0
    perf/train_compute_s              forward/backward + optimizer time (mean over trainer ranks)
    perf/trainer_wait_ratio           (window - compute) / window with window = t_end - t0: every moment of
                                      the window a trainer rank is not computing it waits for data or peers
    perf/ideal_rollout_to_train_end_s rollout_s + the compute no pipeline can hide: the forward/backward
                                      of the last micro-batch (it holds the last group) and the last
                                      optimizer step
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rolloutpipe.types import Span


class SpanRecorder:
    """Collects one process's spans in memory; ``flush`` appends them as JSONL. Thread-safe, cheap."""

    def __init__(self, *, role: str, rank: int, path: Path) -> None:
        self.role = role
        self.rank = rank
        self.path = path
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, name: str, *, step: int, start_s: float, end_s: float, **attrs: object) -> Span:
        span = Span(name=name, role=self.role, rank=self.rank, step=step, start_s=start_s, end_s=end_s, attrs=attrs)
        with self._lock:
            self._spans.append(span)
        return span

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
        with self._lock:
            spans, self._spans = self._spans, []
        if not spans:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for s in spans:
                f.write(json.dumps(asdict(s)) + "\n")


def read_spans(run_dir: Path) -> list[Span]:
    spans = []
    for path in sorted((run_dir / "spans").glob("*.jsonl")):
        spans.extend(Span(**json.loads(line)) for line in path.read_text().splitlines())
    return spans


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
    reward_mean: float
    reward_std: float
    response_len_mean: float


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
    weight_sync_s: float = 0.0


def reduce_step(rollout: RolloutStats, train: TrainStats, *, mean_compute_s: float, mean_tail_compute_s: float,
                lr: float) -> dict[str, float | int]:
    """The metrics.jsonl record of one step (``mean_*`` are means over trainer ranks)."""
    window = train.end_s - rollout.start_s
    rollout_s = rollout.last_group_s - rollout.start_s
    return {
        "step": rollout.step,
        "policy_version": rollout.policy_version,
        "rollout/reward_mean": rollout.reward_mean,
        "rollout/reward_std": rollout.reward_std,
        "rollout/response_len_mean": rollout.response_len_mean,
        "rollout/num_samples": rollout.num_samples,
        "rollout/truncated_ratio": rollout.num_truncated / max(rollout.num_samples, 1),
        "rollout/num_reward_errors": rollout.num_reward_errors,
        "train/loss": sum(train.losses) / max(len(train.losses), 1),
        "train/grad_norm": sum(train.grad_norms) / max(len(train.grad_norms), 1),
        "train/clip_fraction": train.clip_fraction,
        "train/num_tokens": train.num_tokens,
        "train/lr": lr,
        "perf/rollout_s": rollout_s,
        "perf/first_group_s": rollout.first_group_s - rollout.start_s,
        "perf/train_compute_s": mean_compute_s,
        "perf/trainer_wait_ratio": max(window - mean_compute_s, 0.0) / window if window > 0 else 0.0,
        "perf/rollout_to_train_end_s": window,
        "perf/ideal_rollout_to_train_end_s": rollout_s + mean_tail_compute_s,
        "perf/weight_sync_s": train.weight_sync_s,
        "perf/weight_load_s": rollout.weight_load_s,
        "perf/tokens_per_s": rollout.num_tokens / rollout_s if rollout_s > 0 else 0.0,
    }


def summary_line(record: dict, num_steps: int) -> str:
    return (
        f"step {record['step'] + 1}/{num_steps}  reward {record['rollout/reward_mean']:.3f}  "
        f"loss {record['train/loss']:+.4f}  rollout {record['perf/rollout_s']:.2f}s  "
        f"compute {record['perf/train_compute_s']:.2f}s  "
        f"rollout->train-end {record['perf/rollout_to_train_end_s']:.2f}s  "
        f"wait {100 * record['perf/trainer_wait_ratio']:.0f}%  sync {record['perf/weight_sync_s']:.2f}s"
    )
