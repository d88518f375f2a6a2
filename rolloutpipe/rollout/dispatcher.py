"""The CGP dispatcher: publishes complete groups to the trainer FIFO (the store) from its own thread.

Dispatcher thread
    consumes   CompleteGroup objects put by the reward threads, in completion order
    produces   signed handles (and payloads) in the store, seq = 0, 1, 2, ... per step
    waits for  the next complete group (a queue.Queue)
    unblocked  by ``put`` or ``close``
    shuts down on ``close()`` (a sentinel) once the queue is drained; on an error (store gone) it keeps
               the exception in ``error`` and drops further groups; the rollout loop checks ``error``
               while it waits and stops the run with it.
    also runs  what ``at_position`` puts in the queue, between two handles (a request to the trainer that must
               come between the same two handles for every trainer rank: supervisor.py ``stranded``).

Release policy. ``cgp`` (and ``async_one_step``) publish each group as soon as it is complete and
placed in its training batch, so the trainer starts on the first one. ``sync`` holds the step's groups
back until all of them are complete, then publishes them in completion order: that is Slime's synchronous
schedule (generate the whole batch, then train), with the same trainer code on the other side, so the two modes
differ only in when groups are released.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TypeVar

from rolloutpipe.control.run import PipelineMode
from rolloutpipe.control.transport import Transport
from rolloutpipe.observe.metrics import SpanRecorder
from rolloutpipe.types import CompleteGroup

T = TypeVar("T")


class Release:
    """When placed complete groups go out (the release policy above). Pure; the simulator uses it too."""

    def __init__(self, mode: PipelineMode) -> None:
        self.mode = mode
        self._held: list[CompleteGroup] = []

    def add(self, group: CompleteGroup, num_expected: int) -> list[CompleteGroup]:
        """The groups to publish now, in order, once ``group`` is complete and placed."""
        if self.mode is not PipelineMode.sync:
            return [group]
        self._held.append(group)
        if len(self._held) < num_expected:
            return []
        held, self._held = self._held, []
        return held


_CLOSE = object()


@dataclass(frozen=True, slots=True)
class _AtPosition:
    step: int
    call: Callable[[Transport, int], object]
    done: Future


class Dispatcher:
    def __init__(
        self, *, transport: Transport, mode: PipelineMode, inline_max_bytes: int, spans: SpanRecorder
    ) -> None:
        self.transport = transport
        self.mode = mode
        self.inline_max_bytes = inline_max_bytes
        self.spans = spans
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._num_published: dict[int, int] = {}
        self._expected: dict[int, int] = {}
        self._release = Release(mode)
        self._published = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="cgp-dispatcher", daemon=True)
        self._thread.start()

    def begin_step(self, step: int, num_groups: int) -> None:
        with self._published:
            self._expected[step] = num_groups
            self._num_published[step] = 0

    def put(self, group: CompleteGroup) -> None:
        self._queue.put(group)

    def num_published(self, step: int) -> int:
        with self._published:
            return self._num_published.get(step, 0)

    def wait_all_published(self, step: int, timeout_s: float) -> bool:
        with self._published:
            return self._published.wait_for(
                lambda: self.error is not None or self._num_published[step] == self._expected[step], timeout_s
            )

    def at_position(self, step: int, call: Callable[[Transport, int], T], check: Callable[[], None],
                    poll_s: float = 0.5) -> T:
        """``call(transport, seq)`` on the dispatcher's thread (``transport``: its connection to the store) after the
        groups put so far: ``seq`` handles of ``step`` are published then, and the next one only after ``call``
        returns. Returns what it returned (raises what it raised); ``check()`` runs every ``poll_s`` meanwhile."""
        done: Future = Future()
        self._queue.put(_AtPosition(step, call, done))
        while True:
            try:
                return done.result(timeout=poll_s)
            except FutureTimeout:
                check()

    def close(self) -> None:
        self._queue.put(_CLOSE)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not _CLOSE:
            if isinstance(item, _AtPosition):
                self._call_at(item)
                continue
            if self.error is not None:
                continue
            try:
                self._release_and_publish(item)
            except BaseException as err:  # noqa: BLE001 - kept for the rollout loop, which stops the run
                with self._published:
                    self.error = err
                    self._published.notify_all()

    def _call_at(self, item: _AtPosition) -> None:
        if self.error is not None:
            item.done.set_exception(RuntimeError(f"the dispatcher failed: {self.error!r}"))
            return
        try:
            item.done.set_result(item.call(self.transport, self._num_published[item.step]))
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread
            item.done.set_exception(err)

    def _release_and_publish(self, group: CompleteGroup) -> None:
        for g in self._release.add(group, self._expected[group.step]):
            self._publish(g)

    def _publish(self, group: CompleteGroup) -> None:
        start = time.time()
        seq = self._num_published[group.step]
        handle = self.transport.publish(group, seq=seq, inline_max_bytes=self.inline_max_bytes)
        self.spans.add(
            "dispatch/publish", step=group.step, start_s=start, end_s=time.time(), group=group.group, seq=seq,
            num_bytes=handle.num_bytes,
        )
        with self._published:
            self._num_published[group.step] = seq + 1
            self._published.notify_all()
