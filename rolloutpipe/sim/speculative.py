"""Speculative next-step rollout in the simulator (``sim.speculative=true``, ``sim.acceptance=a``).

While step k trains, engines with nothing left of step k draft step k+1's requests under policy k with step k+1's
seeds. When policy k+1 is served, each draft is verified (one prefill of prompt + draft), the prefix policy k+1
reproduces is kept, and decoding continues from there under k+1. No draft is ever a sample: every sample is still
the one policy k+1 generates, so lengths and rewards are those of the same run without speculation. The model:

    window      engine e drafts from the moment it finished (or aborted) its last request of step k until the
                engines pause to load policy k+1 (the end of step k's last optimizer step + weight_save_s). No
                request of step k reached e after that moment, so drafts delay nothing of step k (they are
                taken to be invisible to step k's admission, as lowest-priority work would be).
    order       step k+1's initial groups in group order, all samples of a group together: FGD's order at a step's
                start (the first training batch's groups first). An engine takes the next draft when a slot frees.
    engine      the slot engine (sim/engine.py) with the engine cost model and rollout.concurrency slots, whatever
                sim.scheduler.kind (at the paper preset's 32 running requests the KV pool does not bind).
    length      a draft runs until its sample's length or until the window closes, whichever comes first (after a
                disagreement its tokens are wasted; its length is taken to be the sample's).
    acceptance  each drafted token is kept with probability a, independently: the kept prefix of a draft of L tokens
                is min(L, G) with P(G >= j) = a^j, G = floor(log u / log a), u uniform per (seed, step, request):
                the same u whatever a, so a higher a never keeps less.
    verify      the request's first prefill in step k+1 covers its prompt and all L drafted tokens (the engine's own
                prefill cost) and leaves it with min(L, G) tokens generated, plus what that engine's ordinary prefill
                yields (SGLang's samples the next token; the slot engine's none). G = 0: the whole draft is prefilled
                for nothing and the sample decodes from scratch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rolloutpipe.sim.engine import EventLoop, SimEngine, SimRequest
from rolloutpipe.sim.models import EngineModel


@dataclass(kw_only=True, slots=True)
class Drafts:
    """The drafts made for one step during the previous step's tail."""

    step: int
    prompt_of: list[int]
    """The prompt index each drafted group was drafted for (a draft is used only for that prompt)."""
    drafted: dict[int, int] = field(default_factory=dict)
    """Request id -> tokens drafted (only requests with at least one)."""
    kept: dict[int, int] = field(default_factory=dict)
    """Request id -> tokens of its draft that verification keeps, min(drafted, G)."""
    spans: list[tuple[str, float, float, int]] = field(default_factory=list)
    """(engine, start_s, end_s, request id) of each draft that ran."""

    @property
    def num_drafted_tokens(self) -> int:
        return sum(self.drafted.values())


def accepted_prefixes(acceptance: float, num: int, seed: int, step: int) -> list[float]:
    """G of each request id 0 .. num-1 of ``step``: the number of leading draft tokens policy k+1 reproduces."""
    u = 1.0 - np.random.default_rng((seed, step, 0x5BEC)).random(num)  # (0, 1]
    if acceptance >= 1.0:
        return [math.inf] * num
    if acceptance <= 0.0:
        return [0.0] * num
    return np.floor(np.log(u) / math.log(acceptance)).tolist()


def draft(*, step: int, prompt_of: list[int], requests: list[SimRequest], idle_from: dict[str, float],
          until_s: float, model: EngineModel, concurrency: int, acceptance: float, seed: int) -> Drafts:
    """Run the drafts of ``requests`` (step ``step``'s, in FGD order) on engines free from ``idle_from`` until
    ``until_s``; returns what each drafted and what verification will keep."""
    drafts = Drafts(step=step, prompt_of=prompt_of)
    loop = EventLoop()
    pending = list(reversed(requests))  # the next draft is pending[-1]
    engines: dict[str, SimEngine] = {}

    def fill(name: str) -> None:
        engine = engines[name]
        while pending and engine.num_in_flight() < concurrency:
            engine.submit(pending.pop())

    def on_result(name: str, done: list[SimRequest], aborted: bool, finished_s: float) -> None:
        for request in done:
            drafts.drafted[request.request_id] = request.response_len
            drafts.spans.append((name, request.started_s, finished_s, request.request_id))
        fill(name)

    for name, free_s in idle_from.items():
        engines[name] = SimEngine(name=name, concurrency=concurrency, model=model, loop=loop, on_result=on_result)
        if free_s < until_s:
            loop.at(free_s, fill, name)
    loop.at(until_s, _stop, loop)
    loop.run()
    for name, engine in engines.items():
        for request, generated in engine.progress(until_s):
            if generated > 0:
                drafts.drafted[request.request_id] = min(generated, request.response_len)
                drafts.spans.append((name, request.started_s, until_s, request.request_id))
    prefixes = accepted_prefixes(acceptance, max(drafts.drafted, default=-1) + 1, seed, step)
    drafts.kept = {rid: int(min(n, prefixes[rid])) for rid, n in drafts.drafted.items()}
    return drafts


def _stop(loop: EventLoop) -> None:
    loop.stop()
