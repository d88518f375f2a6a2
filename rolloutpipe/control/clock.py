"""One clock for every span of a run: the wall clock of the store host, measured once per process at startup.

Processes on different nodes have wall clocks that disagree by milliseconds to seconds, which is the
scale of a pipeline bubble. So every process but the store host (rollout rank 0) estimates the offset
of its clock from the host's, Cristian-style, through the store the run already has:

    client                                     store host (clock server thread)
    t0 = time(); set ping=<t>   ------------>  wakes on ping=<t>, set pong=<t> = its time()
    t1 = time(); read pong      <------------
    offset = host_time - (t0 + t1) / 2         error at most (t1 - t0) / 2

over ``num_rounds`` round trips, keeping the one with the smallest round trip. Spans are recorded
as ``local time + offset`` (metrics.SpanRecorder) and the offset and round trip go into the header
of the process's span file. One estimate per run: clock drift over a run (NTP slews by at most
~0.5 ms/s) is not followed.

Clock server thread (store host only)
    consumes  ``clock/ping=<t>`` keys in ticket order t = 1, 2, ...; each client takes its tickets
              from the ``clock/ticket`` counter, so any number of processes can ask, in any order
    produces  ``clock/pong=<t>``: the host's time.time() when it saw the ping
    waits for the next ping (store.wait in 0.5 s slices, on a store client of its own)
    shuts down when ``stop()`` is called (at interpreter exit at the latest) or the store goes away;
              a ticket whose ping never comes (its client died between taking it and pinging) is
              skipped once a later ticket has been taken and ``skip_after_s`` has passed.
"""

from __future__ import annotations

import atexit
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutpipe.control.transport import Transport


@dataclass(kw_only=True, slots=True)
class ClockSync:
    """How this process's wall clock relates to the run's clock (the store host's)."""

    offset_s: float
    """Add to this process's time.time() to get the store host's."""
    rtt_s: float
    """Round trip of the best sample; the offset is within rtt_s / 2 of the truth."""
    num_rounds: int
    reference: str
    """Whose clock the run uses, e.g. ``store host``; ``local`` when no store was asked."""

    @classmethod
    def local(cls) -> ClockSync:
        return cls(offset_s=0.0, rtt_s=0.0, num_rounds=0, reference="local")


def sync_clock(transport: Transport, *, num_rounds: int = 8) -> ClockSync:
    """On the store host: start serving the clock and return offset 0. Elsewhere: measure the offset."""
    if transport.is_host:
        ClockServer(transport.connect_another()).start()
        return ClockSync(offset_s=0.0, rtt_s=0.0, num_rounds=0, reference="store host (this process)")
    return measure_offset(transport, num_rounds=num_rounds)


def measure_offset(transport: Transport, *, num_rounds: int = 8) -> ClockSync:
    best: tuple[float, float] | None = None  # (rtt, offset)
    for _ in range(num_rounds):
        ticket = transport.add(transport.key("clock", "ticket"), 1)
        t0 = time.time()
        transport.set(transport.key("clock", f"ping={ticket}"), b"")
        host_s = float(transport.wait_record(transport.key("clock", f"pong={ticket}"),
                                             what="the store host's clock")["time_s"])
        t1 = time.time()
        sample = (t1 - t0, host_s - (t0 + t1) / 2)
        best = sample if best is None or sample[0] < best[0] else best
    assert best is not None
    return ClockSync(offset_s=best[1], rtt_s=best[0], num_rounds=num_rounds, reference="store host")


class ClockServer:
    """Answers clock pings on the store host (see module docstring)."""

    def __init__(self, transport: Transport, *, skip_after_s: float = 5.0) -> None:
        self.transport = transport
        self.skip_after_s = skip_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clock-server", daemon=True)

    def start(self) -> ClockServer:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Joined without a time limit: the thread is almost always inside ``store.wait``, and one still there when
        the interpreter finalizes aborts the process (trainer/node.py, ``TrainerNode.close``). Each wait is 0.5 s."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import torch.distributed as dist

        transport, store = self.transport, self.transport.store
        ticket, waiting_since = 1, time.monotonic()
        while not self._stop.is_set():
            ping = transport.key("clock", f"ping={ticket}")
            try:
                store.wait([ping], timedelta(seconds=0.5))
            except dist.DistStoreError as err:
                if "timeout" not in str(err).lower():
                    return  # the store is gone: the run is over
                stale = time.monotonic() - waiting_since > self.skip_after_s
                if stale and store.add(transport.key("clock", "ticket"), 0) > ticket:
                    ticket, waiting_since = ticket + 1, time.monotonic()
                continue
            except RuntimeError:
                return
            try:
                pong = transport.key("clock", f"pong={ticket}")
                store.set(pong, transport.seal(pong, {"time_s": time.time()}))
            except RuntimeError:
                return
            ticket, waiting_since = ticket + 1, time.monotonic()
