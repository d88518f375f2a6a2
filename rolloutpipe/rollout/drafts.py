"""Speculative next-step rollout (``rollout.speculative``): drafts of step k+1 made under policy k, verified exactly.

The on-policy bound: rollout k+1 cannot start before policy k+1 exists, so during step k's training tail the engines
sit idle. Here they draft instead. Once step k's rollout (and its eval) is done, the engines run step k+1's first
requests (the prompt source is peeked, not drawn; the same request ids and seeds as step k+1 will use) under policy
k, at the lowest priority. Before policy k+1 is loaded every draft still running is aborted; a partial draft is kept
as far as it got. When step k+1 makes a request, its draft rides along (``GenerationRequest.draft_ids``) and the
engine verifies it under policy k+1 (engines/verify.py): it keeps the prefix its own seeded sampler reproduces and
decodes on from there. So a draft never becomes a sample: every sample is exactly the one policy k+1 makes with its
seed, ``policy_version`` is k+1, and FGD, dynamic sampling, aborts, retries, eval and resume keep their meaning.

A draft is used only for the request it was made for (same id, prompt and seed); the rest are dropped at the next
``start``. One that never comes back (its engine failed) is simply missing. Drafts live in this process only: after
a resume the first step runs without them.

Threads: ``on_result`` runs on the engines' threads; everything else on the rollout main loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from rolloutpipe.rollout.engines.base import Engine
from rolloutpipe.types import GenerationRequest, GenerationResult

DRAFT_PREFIX = "draft/"
DRAFT_PRIORITY = 1 << 30
"""After every request of the step and every eval request an engine holds (lower runs first)."""


class Drafts:
    """The next step's drafts: made on idle engines (``start``), stopped before new weights (``stop``), handed to
    the step's requests (``attach``)."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        """The supervisor's list: a failed engine is replaced in it, in place."""
        self._lock = threading.Lock()
        self._in_flight: dict[str, Engine] = {}  # draft request id -> its engine
        self._for: dict[str, GenerationRequest] = {}  # request id -> the next step's request being drafted
        self._made: dict[str, tuple[GenerationRequest, list[int]]] = {}  # request id -> (request, draft tokens)
        self.num_tokens = 0
        """Tokens attached to requests since ``take_counts``."""
        self.num_kept = 0
        """Of those, kept by verification (the engines' ``num_draft_kept``)."""

    def start(self, requests: list[GenerationRequest]) -> None:
        """Draft ``requests`` (the next step's) on the engines, round robin, behind everything else they hold."""
        with self._lock:
            self._made, self._for = {}, {r.request_id: r for r in requests}
        for i, request in enumerate(requests):
            engine = self.engines[i % len(self.engines)]
            draft = replace(request, request_id=DRAFT_PREFIX + request.request_id, priority=DRAFT_PRIORITY)
            with self._lock:
                self._in_flight[draft.request_id] = engine
            try:
                engine.submit(draft)
            except RuntimeError:  # a failed engine: the supervisor replaces it; this draft is simply not made
                with self._lock:
                    self._in_flight.pop(draft.request_id, None)

    def on_result(self, result: GenerationResult) -> bool:
        """Engine thread: keep a draft's tokens (a finished or an aborted one); False for any other result."""
        if not result.request_id.startswith(DRAFT_PREFIX):
            return False
        request_id = result.request_id[len(DRAFT_PREFIX):]
        with self._lock:
            self._in_flight.pop(result.request_id, None)
            if result.output_ids and request_id in self._for:
                self._made[request_id] = (self._for[request_id], list(result.output_ids))
        return True

    def stop(self, check_health: Callable[[str], None]) -> None:
        """Abort every draft still running and wait until each is back (or its engine is out of service): engines
        load weights only with nothing in flight."""
        with self._lock:
            running = dict(self._in_flight)
        for request_id, engine in running.items():
            engine.abort(request_id)
        while True:
            with self._lock:
                waiting = [rid for rid, e in self._in_flight.items()
                           if e in self.engines and getattr(e, "error", None) is None]
                if not waiting:
                    self._in_flight = {}
                    return
            check_health("the drafts to stop before the next weights load")
            time.sleep(0.01)

    def attach(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with its draft, when one was made for exactly it (same id, prompt and seed)."""
        with self._lock:
            made = self._made.pop(request.request_id, None)
        if made is None:
            return request
        drafted, tokens = made
        if (drafted.input_ids, drafted.sampling_seed) != (request.input_ids, request.sampling_seed):
            return request
        tokens = tokens[: request.max_new_tokens]
        with self._lock:
            self.num_tokens += len(tokens)
        return replace(request, draft_ids=tokens)

    def kept(self, result: GenerationResult) -> None:
        """Engine thread: count what verification kept of a step request's draft."""
        with self._lock:
            self.num_kept += result.num_draft_kept

    def take_counts(self) -> tuple[int, int]:
        """(tokens attached, tokens kept) since the last call."""
        with self._lock:
            counts, self.num_tokens, self.num_kept = (self.num_tokens, self.num_kept), 0, 0
        return counts
