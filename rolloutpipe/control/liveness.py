"""Heart-beats of a node-group process, and the check that its peers still beat (and that nobody aborted).

Each process has one ``Liveness`` (pipeline.open_transport); whoever waits on the store calls ``check``
(``Transport.check_peers``) every poll, so a dead peer or an abort ends every wait with its reason.
"""

from __future__ import annotations

import threading
import time

from rolloutpipe.control.seal import Forged
from rolloutpipe.control.transport import ABORT_S, PeerGone, PeerLost, RunRequeued, Transport, TransportError


class Liveness:
    """Heart-beats of this process, and the check that every peer still beats.

    Heart-beat thread: produces a sealed, growing count under ``alive/<role>/<rank>`` every ``heartbeat_s``
    on a store client of its own, and reads the run's ``abort`` record: once one is there, each beat says it was
    seen (``aborted``), which is what the store host waits for before it stops hosting the store (``wait_seen``),
    and this process keeps the abort as its cause: a store that goes away after it is its consequence, not a lost
    node (``aborted``: control/transport.py reads it). Waits for nothing else; stops when ``stop()`` is called (which
    joins it) or when the store goes away (then ``check`` reports the store as lost). Counts, not timestamps, so
    clocks of different nodes never need to agree; a count only counts when it is sealed and larger than the last one
    seen.
    Any other change of a peer's key (an outsider's garbage, a replayed older beat) is refused, and is not read as a
    missing beat either: a dead peer's key holds its last beat unchanged. So an outsider cannot make a live peer look
    dead (only one that rewrote the peer's latest beat over each newer one, faster than it is read, could), and can
    keep a dead one looking alive only while it writes: the run then waits, it does not stop.

    ``check`` (called by whoever waits) raises PeerLost when the run was aborted (by a genuine abort
    record: a forged one is refused), when a peer that was seen once has not beaten for
    ``peer_timeout_s``, or when a peer never showed up within ``startup_timeout_s``.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        role: str,
        rank: int,
        peers: list[tuple[str, int]],
        heartbeat_s: float,
        peer_timeout_s: float,
        startup_timeout_s: float,
    ) -> None:
        self.transport = transport
        self.me = (role, rank)
        self.peers = peers
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._beat_client = transport.connect_another()
        self._check_client = transport.connect_another()
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._raw: dict[tuple[str, int], bytes | None] = {}
        """Each peer's key as last read: a change without a newer genuine count is an outsider's write."""
        self._started_s = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{role}{rank}", daemon=True)
        self._check_lock = threading.Lock()
        self._finished = False
        self.aborted: dict | None = None
        """The run's genuine abort record once this process saw it (the heart-beat thread or ``check``)."""
        self.lost_peer: tuple[str, int] | None = None
        """The peer ``check`` found gone (PeerGone), for the outcome the rollout writes in its place."""

    def start(self) -> Liveness:
        self._count = 1
        self._beat_client.put_record(self._key(self.me), {"count": self._count}, keep=False)
        self._thread.start()
        return self

    def stop(self, *, aborted: bool = False) -> None:
        """Stop beating and wait for the thread (its store calls run on the client's own thread: control/
        bounded_store.py; a process that leaves with one in flight skips finalization), at most ``ABORT_S``: a beat
        that a frozen store host never answers does not hold the stop. ``aborted``: this process leaves because
        of the run's abort (pipeline.run_node); one last beat says it saw it, so the store host's ``wait_seen`` does
        not wait ``peer_timeout_s`` for a process that left between two beats (best effort, within ``ABORT_S``)."""
        self._stop.set()
        self._thread.join(timeout=ABORT_S)
        if not aborted or self._finished or self._thread.is_alive():
            return
        self._count += 1
        key = self._key(self.me)
        sealed = self._beat_client.seal(key, {"count": self._count, "aborted": True})
        try:
            self._beat_client.store.call("set", key, sealed, deadline_s=ABORT_S)
        except (RuntimeError, TransportError):
            pass  # the store is gone or frozen: nobody waits on this beat then

    def finish(self) -> None:
        """This process is done with the run, healthy: one last beat that says so, so that peers still finishing
        (trainer rank 0 writing the final checkpoint and trace, the rollout waiting for it) stop watching it. Once;
        a second call does nothing."""
        if self._finished:
            return
        self.stop()
        self._count += 1
        self._beat_client.put_record(self._key(self.me), {"count": self._count, "finished": True}, keep=False)
        self._finished = True

    def _key(self, who: tuple[str, int]) -> str:
        return self.transport.key("alive", who[0], who[1])

    def _beat(self) -> None:
        key = self._key(self.me)
        while not self._stop.wait(self.heartbeat_s):
            self._count += 1
            try:
                if self.aborted is None:
                    self.aborted = self._beat_client.read_record(self._beat_client.key("abort"))
                self._beat_client.put_record(key, {"count": self._count, "aborted": self.aborted is not None},
                                             keep=False)
                self.transport.kept.heal(self._beat_client.store)  # what this process wrote and an outsider changed
            except TransportError:
                return

    def wait_seen(self, timeout_s: float) -> None:
        """The store host, after an abort: until every peer's beat says it saw it (or that it finished), or the peer
        stopped beating, at most ``timeout_s``. A peer busy computing then meets the store gone knowing why."""
        deadline = time.monotonic() + timeout_s
        pending = set(self.peers)
        while pending and time.monotonic() < deadline:
            for peer in list(pending):
                try:
                    with self._check_lock:
                        record = self._check_client.read_record(self._key(peer)) or {}
                        stale = self._lost(peer) is not None
                except TransportError:
                    return
                if record.get("aborted") is True or record.get("finished") is True or stale:
                    pending.discard(peer)
            time.sleep(0.1)

    def _beats(self, peer: tuple[str, int]) -> tuple[int, bool, bool]:
        """The peer's genuine count (0 before its first beat or while its key holds another value), whether it
        finished healthy (``finish``), and whether its key changed without a genuine newer count: an outsider's write
        (garbage, or a replayed older beat; refused and logged), which says nothing of the peer's death."""
        key = self._key(peer)
        raw = self._check_client.get_now(key)
        changed, self._raw[peer] = raw != self._raw.get(peer), raw
        try:
            record = {} if raw is None else self._check_client.unseal(key, raw)
        except Forged as err:
            self._check_client.refuse(key, raw, str(err))
            return 0, False, changed
        count = record.get("count", 0)
        if not isinstance(count, int):
            return 0, False, changed
        return count, record.get("finished") is True, changed

    def check(self, *, waiting_for: str) -> None:
        with self._check_lock:
            try:
                self.aborted = self.aborted or self._check_client.read_record(self._check_client.key("abort"))
            except PeerGone as err:
                raise self.cause(err) from None
            if self.aborted is not None:
                raise self.cause(None, waiting_for=waiting_for)
            for peer in self.peers:
                if (reason := self._lost(peer)) is not None:
                    self.lost_peer = peer
                    raise PeerGone(f"{reason} (this process was waiting for {waiting_for})")

    def cause(self, lost: PeerGone | None, *, waiting_for: str = "the store") -> TransportError:
        """What stops this process: the run's abort, if it saw one (a store gone after it is its consequence), else
        ``lost``."""
        if self.aborted is None:
            return lost
        if self.aborted.get("requeue") is True:
            return RunRequeued(f"the run stops to be requeued: {self.aborted.get('reason')}")
        return PeerLost(f"run aborted while waiting for {waiting_for}: {self.aborted.get('reason')}")

    def finished(self, peer: tuple[str, int]) -> bool:
        """Whether ``peer`` finished healthy (its last beat said so: ``finish``)."""
        with self._check_lock:
            return self._beats(peer)[1]

    def lost(self, peer: tuple[str, int]) -> str | None:
        """Why ``peer`` (watched, not one of ``peers``: a rollout engine host) counts as gone, or None while it beats
        or once it finished healthy. The same rules as ``check``, without raising."""
        with self._check_lock:
            return self._lost(peer)

    def _lost(self, peer: tuple[str, int]) -> str | None:
        count, finished, changed = self._beats(peer)
        if finished:
            return None
        now = time.monotonic()
        last = self._seen.get(peer)
        if last is not None and count <= last[0] and changed:  # something wrote its key, not a newer beat of its
            self._seen[peer] = (last[0], now)  # own: an outsider, never read as a missing beat (a dead peer's key
            return None  # holds its last beat unchanged)
        if last is None or count > last[0]:
            if count > 0:
                self._seen[peer] = (count, now)
            elif now - self._started_s > self.startup_timeout_s:
                return (f"{peer[0]} rank {peer[1]} never showed up within {self.startup_timeout_s:.0f} s (check that "
                        "its component started and see its log; raise pipeline.connect_timeout_s if it is only slow "
                        "to start)")
            return None
        if now - last[1] > self.peer_timeout_s:
            return (f"{peer[0]} rank {peer[1]} stopped heart-beating {now - last[1]:.0f} s ago (limit "
                    f"pipeline.peer_timeout_s={self.peer_timeout_s:.0f}): it has probably died; see its log")
        return None
