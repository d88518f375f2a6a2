"""Heart-beats of a node-group process, and the check that its peers still beat (and that nobody aborted).

Each process has one ``Liveness`` (pipeline.open_transport); whoever waits on the store calls ``check``
(``Transport.check_peers``) every poll, so a dead peer or an abort ends every wait with its reason.
"""

from __future__ import annotations

import threading
import time

from rolloutpipe.control.transport import PeerGone, PeerLost, RunRequeued, Transport, TransportError


class Liveness:
    """Heart-beats of this process, and the check that every peer still beats.

    Heart-beat thread: produces a sealed, growing count under ``alive/<role>/<rank>`` every ``heartbeat_s``
    on a store client of its own; waits for nothing else; stops when ``stop()`` is called (which joins it)
    or when the store goes away (then ``check`` reports the store as lost). Counts, not timestamps, so clocks of
    different nodes never need to agree; a count only counts when it is sealed and larger than the last
    one seen, so neither a forged nor a replayed beat keeps a dead peer alive.

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
        self._started_s = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{role}{rank}", daemon=True)
        self._check_lock = threading.Lock()
        self._finished = False

    def start(self) -> Liveness:
        self._count = 1
        self._beat_client.put_record(self._key(self.me), {"count": self._count})
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for the thread, so that it is not inside a store call when the interpreter
        finalizes (that aborts the process: trainer/node.py, ``TrainerNode.close``)."""
        self._stop.set()
        self._thread.join()

    def finish(self) -> None:
        """This process is done with the run, healthy: one last beat that says so, so that peers still finishing
        (trainer rank 0 writing the final checkpoint and trace, the rollout waiting for it) stop watching it. Once;
        a second call does nothing."""
        if self._finished:
            return
        self.stop()
        self._count += 1
        self._beat_client.put_record(self._key(self.me), {"count": self._count, "finished": True})
        self._finished = True

    def _key(self, who: tuple[str, int]) -> str:
        return self.transport.key("alive", who[0], who[1])

    def _beat(self) -> None:
        key = self._key(self.me)
        while not self._stop.wait(self.heartbeat_s):
            self._count += 1
            try:
                self._beat_client.put_record(key, {"count": self._count})
            except TransportError:
                return

    def _beats(self, peer: tuple[str, int]) -> tuple[int, bool]:
        """The peer's genuine count (0 before its first beat or while its key holds a forged value), and whether it
        finished healthy (``finish``)."""
        record = self._check_client.read_record(self._key(peer)) or {}
        count = record.get("count", 0)
        return (count, record.get("finished") is True) if isinstance(count, int) else (0, False)

    def check(self, *, waiting_for: str) -> None:
        with self._check_lock:
            aborted = self._check_client.read_record(self._check_client.key("abort"))
            if aborted is not None and aborted.get("requeue") is True:
                raise RunRequeued(f"the run stops to be requeued: {aborted.get('reason')}")
            if aborted is not None:
                raise PeerLost(f"run aborted while waiting for {waiting_for}: {aborted.get('reason')}")
            for peer in self.peers:
                if (reason := self._lost(peer)) is not None:
                    raise PeerGone(f"{reason} (this process was waiting for {waiting_for})")

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
        count, finished = self._beats(peer)
        if finished:
            return None
        now = time.monotonic()
        last = self._seen.get(peer)
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
