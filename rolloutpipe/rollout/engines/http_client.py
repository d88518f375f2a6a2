"""``SGLangEngine``: the Engine protocol (base.py) over one server that speaks SGLang's HTTP API.

The same class drives a real SGLang server and the embedded engine's server (http_server.py); every request and
response shape comes from ``sglang_api``.

Request threads (up to ``concurrency`` per engine, started as needed)
    consume   the engine's waiting heap, by (priority, submission order), as the embedded engine admits
    produce   one GenerationResult per request, handed to ``on_result`` from the thread that made the call
    wait for  the blocking /generate call (at most ``concurrency`` at once, so the server's own queue stays
              empty and the client's heap is where requests wait and where they can be dropped before sending)
    shut down ``shutdown`` sets the stop flag, aborts what is running on the server and hands back every waiting
              request as aborted; each thread hands back its running request when it returns, then exits.
              On a failed call (server unreachable or lost, HTTP 5xx, a result from an unexpected weight
              version, a request aborted that the client did not abort: the server shutting down answers what
              it holds that way) the error is kept in ``error`` with the server's URL, no further results are delivered,
              and ``submit``, ``num_in_flight`` and ``update_weights_from_disk`` raise; the rollout node then
              retries its requests elsewhere and replaces it (rolloutpipe/rollout/engines/supervisor.py). The first
              failure is logged once, not once per request in flight.
              An HTTP 4xx answer is about the request, not the engine (the same request fails the same way on
              any engine, restarted or not): the request gets no result, the engine stays healthy, and the first
              refusal is kept in ``request_error`` (a ``RequestRefused`` with the server's message and what to
              change), logged once; from then on ``submit`` raises it. It is for the rollout node to stop the
              run with, not for the supervisor to restart the engine over.

Abort retry thread (one per engine, started by the first abort of a running request)
    re-sends /abort_request every ``ABORT_RETRY_S`` for aborted requests that have not come back: SGLang ignores an
    abort for a rid it has not registered yet, and the client cannot know when it has.

Timings: ``submitted_s`` is when ``submit`` was called, ``started_s`` when the /generate call was sent (the client
holds back requests beyond ``concurrency``, so the server starts a request when it arrives), ``finished_s`` when
the answer came back.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rolloutpipe.rollout.engines import sglang_api
from rolloutpipe.rollout.engines.base import OnResult
from rolloutpipe.types import FinishReason, GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from rolloutpipe.control.weights.buckets import Bucket, BucketMac, WeightGroup

log = logging.getLogger(__name__)

ABORT_RETRY_S = 0.25
SHUTDOWN_JOIN_S = 30.0
CONTROL_POLL_S = 0.2
"""How often a control call in progress checks that its server is still there (``SGLangEngine._control``)."""
PROBE_TIMEOUT_S = 10.0
"""How long ``SGLangEngine.probe`` waits for /health (between steps: nothing else runs on the server)."""


class RequestRefused(ValueError):
    """A server refused a request (HTTP 4xx): the request or the run's configuration is wrong, not the engine.
    Retrying elsewhere or restarting the engine would fail the same way, so the run stops with this message."""


CONTEXT_HINT = ("Make data.max_prompt_len + rollout_max_response_len fit the model's context (SGLang's "
                "--context-length, the model's max_position_embeddings): lower them, or serve a longer context.")
REQUEST_HINT = ("Check the request against the server's flags and the model (rolloutpipe/rollout/engines/"
                "sglang_api.py builds it); this is a request or configuration error, not an engine failure.")


@dataclass(order=True)
class _Waiting:
    priority: int
    seq: int
    request: GenerationRequest = field(compare=False)
    submitted_s: float = field(compare=False)


class SGLangEngine:
    """One engine server at ``endpoint`` (its URL and API key); ``on_result`` gets every request back exactly once.

    ``server_error`` (optional) returns why the server process is gone, or None while it runs; ``stop_server`` is
    called by ``shutdown`` (both are given by whoever started the server, see engine/__init__.py).
    """

    def __init__(self, *, name: str, endpoint: sglang_api.Endpoint, concurrency: int, on_result: OnResult,
                 policy_version: int = 0,
                 request_timeout_s: float = 3600.0, weight_update_timeout_s: float = 600.0,
                 server_error: Callable[[], str | None] = lambda: None,
                 stop_server: Callable[[], None] = lambda: None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} for engine {name!r}: it must be at least 1.")
        self.name = name
        self.endpoint = sglang_api.Endpoint(endpoint.url.rstrip("/"), endpoint.api_key)
        self.url = self.endpoint.url
        self.concurrency = concurrency
        self._on_result = on_result
        self._policy_version = policy_version
        self._request_timeout_s = request_timeout_s
        self._weight_update_timeout_s = weight_update_timeout_s
        self._server_error = server_error
        self._stop_server = stop_server

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: list[_Waiting] = []
        self._running: set[str] = set()
        self._aborting: set[str] = set()
        """Running requests aborted on the server and not back yet (the retry thread re-sends their aborts)."""
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._num_idle_threads = 0
        self._abort_thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.request_error: RequestRefused | None = None
        """The first request the server refused (HTTP 4xx); None while none was. The engine is not failed by it."""

    # --- Engine protocol (any thread) --------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped (a failed call, or its server process exited); None while healthy."""
        if self._error is None and not self._stopping and (reason := self._server_error()) is not None:
            self._error = RuntimeError(f"engine {self.name}: the server at {self.url} {reason}")
        return self._error

    def submit(self, request: GenerationRequest) -> None:
        with self._lock:
            self._raise_if_unusable()
            if self.request_error is not None:  # the next request would be refused too: stop the run, once
                raise self.request_error
            if request.request_id in self._running or any(w.request.request_id == request.request_id
                                                          for w in self._waiting):
                raise ValueError(f"request {request.request_id} is already in flight on engine {self.name}.")
            heapq.heappush(self._waiting, _Waiting(request.priority, next(self._seq), request, time.time()))
            if len(self._waiting) > self._num_idle_threads and len(self._threads) < self.concurrency:
                thread = threading.Thread(target=self._request_loop, name=f"{self.name}-http-{len(self._threads)}",
                                          daemon=True)
                self._threads.append(thread)
                self._num_idle_threads += 1
                thread.start()
            self._wakeup.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            waiting = next((w for w in self._waiting if w.request.request_id == request_id), None)
            if waiting is not None:
                self._waiting.remove(waiting)
                heapq.heapify(self._waiting)
            elif request_id in self._running:
                self._aborting.add(request_id)
                if self._abort_thread is None:
                    self._abort_thread = threading.Thread(target=self._abort_retry_loop, name=f"{self.name}-abort",
                                                          daemon=True)
                    self._abort_thread.start()
                self._wakeup.notify_all()
            else:
                return
        if waiting is not None:  # never sent: it comes back at once, empty
            now = time.time()
            self._on_result(self._result(waiting.request, waiting.submitted_s, now, [], [], FinishReason.ABORT))
        else:
            self._send_abort(request_id)

    def update_weights_from_disk(self, path: str, policy_version: int) -> None:
        self._check_idle("update_weights_from_disk")
        self._control("update_weights_from_disk", lambda: sglang_api.update_weights_from_disk(
            self.endpoint, path, policy_version, timeout_s=self._weight_update_timeout_s))
        self._policy_version = policy_version

    def init_weights_update_group(self, group: WeightGroup, rank_offset: int) -> None:
        """Join the trainer's weight-update process group (rolloutpipe/control/weights/distributed.py); blocks until
        it forms."""
        self._control("init_weights_update_group", lambda: sglang_api.init_weights_update_group(
            self.endpoint, group, rank_offset, timeout_s=self._weight_update_timeout_s))

    def update_weights_from_distributed(self, buckets: list[Bucket], group_name: str, policy_version: int,
                                        macs: Callable[[int], BucketMac] | None) -> None:
        """Receive ``policy_version`` from the trainer's broadcasts (all engines of the group at the same time)."""
        self._check_idle("update_weights_from_distributed")
        self._control("update_weights_from_distributed", lambda: sglang_api.update_weights_from_distributed(
            self.endpoint, buckets, group_name, policy_version, macs=macs, timeout_s=self._weight_update_timeout_s))
        self._policy_version = policy_version

    def leave_weight_group(self, group_name: str) -> None:
        """SGLang's /destroy_weights_update_group, on a thread of its own: a server stuck in the broadcast (SGLang's
        scheduler) answers only when the broadcast times out, and the supervisor recovers it before that."""
        threading.Thread(target=sglang_api.destroy_weights_update_group, args=(self.endpoint, group_name),
                         name=f"{self.name}-leave-{group_name}", daemon=True).start()

    def probe(self) -> None:
        if self.error is None and not self._stopping and not sglang_api.is_healthy(self.endpoint, PROBE_TIMEOUT_S):
            self._failed(RuntimeError(f"engine {self.name}: the server at {self.url} did not answer "
                                      f"{sglang_api.HEALTH} within {PROBE_TIMEOUT_S:g}s"), traceback=False)

    def _control(self, what: str, call: Callable[[], None]) -> None:
        """A control call (minutes of timeout: a weight load), made on a thread of its own and given up as soon as
        ``server_error`` says the server is gone: a call to a node that vanished (its engine host lost: the host
        watch says so within pipeline.peer_timeout_s) may get no answer at all until its timeout."""
        failure: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                call()
            except BaseException as err:  # noqa: BLE001 - raised below, on the caller's thread
                failure.append(err)
            finally:
                done.set()

        threading.Thread(target=run, name=f"{self.name}-{what}", daemon=True).start()
        while not done.wait(CONTROL_POLL_S):
            if (reason := self._server_error()) is not None:
                raise RuntimeError(f"engine {self.name}: {what} given up: the server at {self.url} {reason}")
        if failure:
            raise failure[0]

    def _check_idle(self, what: str) -> None:
        with self._lock:
            self._raise_if_unusable()
            num_in_flight = len(self._waiting) + len(self._running)
            if num_in_flight:
                raise RuntimeError(
                    f"engine {self.name}: {what} called with {num_in_flight} requests in flight; "
                    "weights may change only when no request is in flight (between steps)."
                )

    def num_in_flight(self) -> int:
        with self._lock:
            self._raise_if_unusable()
            return len(self._waiting) + len(self._running)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            waiting, self._waiting = sorted(self._waiting), []
            running = list(self._running)
            self._wakeup.notify_all()
        now = time.time()
        for w in waiting:
            self._on_result(self._result(w.request, w.submitted_s, now, [], [], FinishReason.ABORT))
        for request_id in running:
            self._send_abort(request_id)
        for thread in self._threads + ([self._abort_thread] if self._abort_thread else []):
            thread.join(timeout=SHUTDOWN_JOIN_S)  # a hung server must not hang the run's exit
        self._stop_server()

    def _raise_if_unusable(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"engine {self.name} crashed: {self.error!r}") from self.error
        if self._stopping:
            raise RuntimeError(f"engine {self.name} is shut down.")

    # --- threads -------------------------------------------------------------------------------------------------

    def _request_loop(self) -> None:
        """One request thread: take the best waiting request, run /generate, hand the result back (see module doc)."""
        while True:
            with self._lock:
                while not (self._stopping or self._error or self._waiting):
                    self._wakeup.wait()
                if self._stopping or self._error:
                    self._num_idle_threads -= 1
                    return
                waiting = heapq.heappop(self._waiting)
                self._running.add(waiting.request.request_id)
                self._num_idle_threads -= 1
            result = self._generate(waiting)
            with self._lock:
                self._running.discard(waiting.request.request_id)
                self._aborting.discard(waiting.request.request_id)
                self._num_idle_threads += 1
                deliver = result is not None and self._error is None
            if deliver:
                self._on_result(result)

    def _generate(self, waiting: _Waiting) -> GenerationResult | None:
        started_s = time.time()
        try:
            out = sglang_api.generate(self.endpoint, waiting.request, timeout_s=self._request_timeout_s)
            if out.weight_version != str(self._policy_version):
                raise sglang_api.SGLangError(
                    f"{self.url} generated {waiting.request.request_id} with weight_version {out.weight_version!r}, "
                    f"expected {self._policy_version}: weights changed during a step.")
            with self._lock:
                ours = waiting.request.request_id in self._aborting or self._stopping
            if out.finish_reason is FinishReason.ABORT and not ours:
                raise sglang_api.SGLangError(
                    f"{self.url} aborted {waiting.request.request_id}, which the client did not abort: the server is "
                    "going away (stopped, or its node drained).")
        except sglang_api.SGLangError as err:
            if not self._stopping and err.is_request_error:
                self._refused(waiting.request, err)
            elif not self._stopping:  # else the server went away because we are stopping it
                self._failed(err, traceback=False)  # its message says it all
            return None
        except BaseException as err:
            if not self._stopping:
                self._failed(err, traceback=True)
            return None
        return self._result(waiting.request, waiting.submitted_s, started_s, out.output_ids, out.output_logprobs,
                            out.finish_reason)

    def _failed(self, err: BaseException, *, traceback: bool) -> None:
        """The engine failed: keep the first error and log it once (every other thread in flight fails too)."""
        with self._lock:
            first = self._error is None
            self._error = self._error or err
            self._wakeup.notify_all()
        if first:
            log.error("engine %s failed: %s", self.name, err, exc_info=err if traceback else None)
        else:
            log.debug("engine %s: one more failed call: %s", self.name, err)

    def _refused(self, request: GenerationRequest, err: sglang_api.SGLangError) -> None:
        hint = CONTEXT_HINT if "context length" in err.detail else REQUEST_HINT
        refused = RequestRefused(f"engine {self.name}: the server at {self.url} refused request "
                                 f"{request.request_id} with HTTP {err.status}: {err.detail} {hint}")
        with self._lock:
            first = self.request_error is None
            self.request_error = self.request_error or refused
            self._wakeup.notify_all()
        if first:
            log.error("%s", refused)
        else:
            log.debug("%s", refused)

    def _abort_retry_loop(self) -> None:
        """Re-sends aborts of requests still running; exits on shutdown or error."""
        while True:
            with self._lock:
                self._wakeup.wait_for(lambda: self._stopping or self._error or self._aborting)
                if self._stopping or self._error:
                    return
                pending = list(self._aborting)
            time.sleep(ABORT_RETRY_S)
            for request_id in pending:
                self._send_abort(request_id)

    def _send_abort(self, request_id: str) -> None:
        try:
            sglang_api.abort(self.endpoint, request_id)
        except sglang_api.SGLangError as err:
            log.warning("engine %s: abort of %s failed: %s", self.name, request_id, err)

    def _result(self, request: GenerationRequest, submitted_s: float, started_s: float, output_ids: list[int],
                output_logprobs: list[float], reason: FinishReason) -> GenerationResult:
        return GenerationResult(
            request_id=request.request_id, output_ids=output_ids, output_logprobs=output_logprobs,
            finish_reason=reason, policy_version=self._policy_version, submitted_s=submitted_s,
            started_s=started_s, finished_s=time.time(), engine=self.name,
        )
