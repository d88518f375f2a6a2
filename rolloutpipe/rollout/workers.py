"""A worker process answering JSON calls over a pipe, with a timeout per call: what rewards and environments run in.

The worker is started with "spawn" (safe from a process with threads), imports what it serves, says it is ready
(or why it cannot be), then answers one call at a time: JSON bytes in, JSON bytes out; callables never cross the
pipe and nothing is unpickled. A call that runs past its timeout, or kills its worker, is answered by the parent
(``Reply.error``); the worker is then killed and started again before its next call. A worker dies with this
process (control/lifetime.py), or with the thread that started it: the one that made it or, after a restart, the
one whose ``call`` restarted it, so call from threads that live as long as the worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORKER_START_TIMEOUT_S = 60.0
"""How long a worker may take to import its modules; a hang there is a bug in the user's module."""


@dataclass(kw_only=True, slots=True)
class Reply:
    value: dict[str, Any] | None
    """The worker's answer; None when the call failed (``error`` says why)."""
    error: str | None = None
    timed_out: bool = False
    elapsed_s: float = 0.0
    """From sending the call to its answer (worker start-up excluded)."""


class JsonWorker:
    """One worker process and the parent's end of its pipe; restarted in place when it dies or hangs.

    ``serve(conn, *args)`` runs in the worker: it sends ``{"ready": true}`` or ``{"error": ...}`` once, then answers
    each request it receives until the pipe closes."""

    def __init__(self, context, *, serve: Callable[..., None], args: tuple, name: str) -> None:
        self._context = context
        self._serve, self._args, self._name = serve, args, name
        self._start()

    def _start(self) -> None:
        self._conn, child_conn = self._context.Pipe()
        self._process = self._context.Process(target=self._serve, args=(child_conn, *self._args), name=self._name,
                                              daemon=True)
        self._process.start()
        child_conn.close()
        self._ready = False

    def wait_ready(self) -> None:
        """Wait for the worker's imports; RuntimeError with the worker's reason if it cannot serve."""
        if self._ready:
            return
        if not self._conn.poll(WORKER_START_TIMEOUT_S):
            raise RuntimeError(f"a worker did not finish its imports within {WORKER_START_TIMEOUT_S:g} s")
        try:
            reply = json.loads(self._conn.recv_bytes())
        except EOFError:
            self._process.join(1.0)
            raise RuntimeError(f"a worker exited during start-up (exit code {self._process.exitcode})") from None
        if "error" in reply:
            raise RuntimeError(reply["error"])
        self._ready = True

    def call(self, request: bytes, timeout_s: float, *, what: str) -> Reply:
        """Send ``request``, wait up to ``timeout_s`` for the answer; never raises (``what`` names the worker in
        the error: "the reward worker")."""
        start, timed_out = time.monotonic(), False
        try:
            if not self._process.is_alive():
                self.kill()
                self._start()
            self.wait_ready()
            start = time.monotonic()
            self._conn.send_bytes(request)
            if self._conn.poll(timeout_s):
                return Reply(value=json.loads(self._conn.recv_bytes()), elapsed_s=time.monotonic() - start)
            error, timed_out = f"timeout after {timeout_s:g} s", True
        except (EOFError, OSError):
            self._process.join(1.0)
            error = f"{what} died (exit code {self._process.exitcode})"
        except Exception as err:  # a broken worker costs one call, not the run
            error = f"{what} failed: {type(err).__name__}: {err}"
        self.kill()
        return Reply(value=None, error=error, timed_out=timed_out, elapsed_s=time.monotonic() - start)

    def kill(self) -> None:
        """Stop the process now; the next ``call`` starts a new one."""
        self._process.kill()
        self._process.join()
        self._conn.close()

    def stop(self) -> None:
        """Let the process exit on end-of-pipe; kill it if it does not."""
        self._conn.close()
        self._process.join(1.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
