"""``bench_agent``: a tool-using agent's shape, for bench/pipeline_bench.py's multiturn workload.

An episode takes a long-tailed number of model turns (1 + geometric, mean about 2.5, at most environment.max_turns),
and every environment call takes a long-tailed time, like a tool or a sandbox (lognormal: median 0.1 s, one call in
twenty over 0.5 s). Both are drawn from the row and the episode's responses, so an episode is the same in every mode
and on a rebuilt worker (rollout/environments/pool.py). The reward is the share of the letters a-d in the model's
turns (dense: groups have variance). Registered when a run lists this module in environment.import_modules.
"""

import hashlib
import math
import random
import time

from rolloutpipe.rollout.environments.base import Turn, register_environment

MEDIAN_LATENCY_S = 0.1
LATENCY_SIGMA = 1.0
CONTINUE_P = 0.6
"""The chance that an episode goes on after a turn: 1 + geometric turns, mean 1 / (1 - p) = 2.5."""


def _rng(*parts) -> random.Random:
    return random.Random(hashlib.sha256("/".join(map(str, parts)).encode()).digest())


class BenchAgent:
    def reset(self, label, metadata):
        self.label, self.turns, self.letters, self.chars = label, 0, 0, 0
        return []

    def step(self, response):
        self.turns += 1
        rng = _rng(self.label, self.turns, response)
        time.sleep(MEDIAN_LATENCY_S * math.exp(LATENCY_SIGMA * rng.gauss(0.0, 1.0)))
        self.letters += sum(c in "abcd" for c in response)
        self.chars += len(response)
        if rng.random() >= CONTINUE_P:
            return Turn(reward=self.letters / max(self.chars, 1), done=True)
        return Turn(messages=[{"role": "tool", "content": "ok"}])


@register_environment("bench_agent")
def bench_agent(args):
    return BenchAgent()
