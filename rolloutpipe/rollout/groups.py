"""Group assembly: rewarded samples -> complete groups with their advantages. Pure logic, thread-safe.

A group is complete when all ``n_samples`` of its samples are rewarded, in whatever order the engines and
reward workers finish them; its samples are put back in sample order and its advantages computed from its own
rewards (advantages.py). The rollout node's reward threads add samples (rollout/samples.py), the simulator
(rolloutpipe/sim) its simulated ones; RolloutSchedule (schedule.py) then drops or places the complete group.
The simulator runs this file compiled with mypyc (sim/compiled.py), so it is fully typed.
"""

from __future__ import annotations

import threading
import time

from rolloutpipe.rollout.advantages import group_advantages
from rolloutpipe.types import CompleteGroup, Prompt, Sample


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
