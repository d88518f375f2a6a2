"""A TCPStore client whose every call has a deadline of its own.

The store's own timeouts cover a store that answers "not yet". A host that is frozen (SIGSTOP, a hung kernel, a
node dropped from the network without a reset) never answers at all, and a client inside such a call waits in C++
forever: no heart-beat check runs, and no stop signal reaches Python. So each client runs its calls, in order, on a
daemon thread of its own (a TCPStore client serialises its operations anyway), and the caller waits for the result
in Python with a deadline: the heart-beat timeout, plus the call's own wait. A stop signal interrupts that wait as
any other. A call past its deadline marks the client lost: it raises ``StoreUnresponsive``, and so does every later
call, at once. The thread stays inside its call.

Calls thread (one per client)
    consumes   the calls of its client, one at a time
    produces   each call's result or exception, for the caller waiting on it
    waits for  the next call; the store's answer
    shuts down never by itself: a daemon, it ends with the process. A process that leaves while a call is still in
               flight (given up on, or its caller stopped by a signal) ends with ``os._exit`` (launch/node.py,
               ``calls_in_flight``): the call returning while the interpreter finalizes would abort it.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta

import torch.distributed as dist

_IN_FLIGHT = [0]
"""Calls of this process's clients inside the store now (``calls_in_flight``), under ``_IN_FLIGHT_LOCK``."""
_IN_FLIGHT_LOCK = threading.Lock()


ABSENT = b"\0rolloutpipe: no such key\0"
"""What ``BoundedStore.get_now`` expects and answers for a missing key: no run writes it (an outsider who does makes
the key read as missing, which a reader already handles as a forged or deleted value)."""


def read_now(raw: dist.TCPStore, key: str) -> bytes | None:
    """``key``'s value, or None where it has none, in one round trip that never waits. TCPStore's ``get`` waits for a
    missing key (to its timeout: here, the deadline, read as a frozen host), and another process may delete a key
    between a ``check`` and a ``get`` (the trainer forgets the rollout's consumed handles; an outsider deletes
    anything). A ``compare_set`` expecting ``ABSENT`` changes nothing and answers the key's value, or ``ABSENT`` where
    the key is missing."""
    value = raw.compare_set(key, ABSENT, ABSENT)
    return None if value == ABSENT else value


class StoreUnresponsive(RuntimeError):
    """The store's host did not answer a call within its deadline. transport.py turns it into PeerGone."""


def calls_in_flight() -> bool:
    """Whether a store call of this process is running now (its thread inside the store's C++ client)."""
    with _IN_FLIGHT_LOCK:
        return _IN_FLIGHT[0] > 0


class BoundedStore:
    """``dist.TCPStore``'s calls with deadlines (module docstring); ``where`` names the store in messages."""

    def __init__(self, store: dist.TCPStore, *, deadline_s: float, where: str) -> None:
        self.raw = store
        self.deadline_s = deadline_s
        self.where = where
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lost: StoreUnresponsive | None = None
        threading.Thread(target=self._serve, name="store-calls", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, done, out = self._calls.get()
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT[0] += 1
            try:
                out.append((True, fn(*args)))
            except BaseException as err:  # noqa: BLE001 - handed to the caller, who raises it
                out.append((False, err))
            finally:
                with _IN_FLIGHT_LOCK:
                    _IN_FLIGHT[0] -= 1
            done.set()

    def call(self, name: str, *args, wait_s: float = 0.0, deadline_s: float | None = None):
        """``store.<name>(*args)`` within ``deadline_s + wait_s`` (``wait_s``: how long the call may wait by design,
        e.g. a ``wait`` with a timeout; ``deadline_s``: this call's own, shorter one, e.g. a last word on the way
        out)."""
        return self.run(lambda raw: getattr(raw, name)(*args), what=f"a {name}",
                        within_s=(self.deadline_s if deadline_s is None else deadline_s) + wait_s)

    def run(self, fn, *, what: str, within_s: float):
        """``fn(raw store)`` on the calls thread, within ``within_s``."""
        if self._lost is not None:
            raise self._lost
        done, out = threading.Event(), []
        self._calls.put((fn, (self.raw,), done, out))
        if not done.wait(within_s):
            self._lost = StoreUnresponsive(
                f"the TCPStore at {self.where} did not answer {what} within {within_s:.0f} s "
                "(pipeline.peer_timeout_s): its host is frozen or unreachable")
            raise self._lost
        ok, value = out[0]
        if not ok:
            raise value
        return value

    @property
    def port(self) -> int:
        return self.raw.port

    # -- the store's API, bounded -----------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self.call("set", key, value)

    def get(self, key: str) -> bytes:
        return self.call("get", key)

    def get_now(self, key: str) -> bytes | None:
        """``key``'s value, or None where it has none, without waiting for it (``read_now``)."""
        return self.run(lambda raw: read_now(raw, key), what="a read", within_s=self.deadline_s)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``desired`` if ``key`` held ``expected``; else the key's value, unchanged (``expected`` if it is missing)."""
        return self.call("compare_set", key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self.call("add", key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.call("check", keys)

    def delete_key(self, key: str) -> bool:
        return self.call("delete_key", key)

    def num_keys(self) -> int:
        return self.call("num_keys")

    def set_timeout(self, timeout: timedelta) -> None:
        self.raw.set_timeout(timeout)  # (local: no round trip)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.call("wait", keys, wait_s=self.raw.timeout.total_seconds())
        else:
            self.call("wait", keys, timeout, wait_s=timeout.total_seconds())
