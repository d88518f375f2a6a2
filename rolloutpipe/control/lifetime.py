"""Every process the run starts stops with it: stop signals, process groups, and death with the parent.

The process tree of a local run, and who stops whom on SIGTERM / SIGINT / SIGHUP:

    python launch.py (LocalLauncher)           catches the signal, SIGTERMs each node's process group, waits
     |                                         launcher.stop_grace_s, SIGKILLs the groups that are left
     +- node process (own session)             ``raise_on_stop_signals``: the signal raises ``Stopped`` on the
     |   |                                     main thread; pipeline.run_node writes ``abort`` and closes the
     |   |                                     node, which stops its children; exits 128 + the signal
     |   +- reward workers                     in the node's group: the launcher's killpg reaches them
     |   +- engine server (own session)        ServerProcess.stop: SIGTERM its group, wait, SIGKILL
     |       +- SGLang's scheduler, ...        in the server's group
     +- node process ...

Own sessions (``start_new_session``) make each group a unit the parent can signal as a whole, so a grandchild
cannot escape by outliving its parent; they also keep a terminal's Ctrl-C away from the children, so that
exactly one process (the launcher) decides how the run stops.

A parent that dies abruptly (SIGKILL, OOM) runs no cleanup. For that case every child the run starts asks the
kernel to signal it when its parent dies (``die_with_parent``: Linux's PR_SET_PDEATHSIG). The kernel sends it
when the *thread* that started the child exits, not the process: engine servers and node processes are started
on their parent's main thread (the rollout loop restarts failed engines there too), reward workers on threads
that live as long as their pool (rollout/rewards.py), so the signal comes when the parent process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

PARENT_PID_ENV = "RP_PARENT_PID"
"""Set by a parent for a child it starts: the child dies with that process (``die_with_parent``)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What a scheduler (SIGTERM), a terminal's Ctrl-C (SIGINT) or a closed terminal (SIGHUP) sends."""

REQUEUE_EXIT = 75
"""How a node process exits when the run stopped at a checkpoint to be requeued (EX_TEMPFAIL: try again)."""
PEER_STOPPED_EXIT = 3
"""How a node process exits when it stopped because another process of the run failed or died (an abort, a lost
peer): not the cause, which the launcher names instead (launch/local.py)."""

_PR_SET_PDEATHSIG = 1


class Stopped(BaseException):
    """This process was asked to stop by a signal. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Deferral(threading.local):
    """The main thread's ``stop_deferred`` depth, and a stop signal that came meanwhile."""

    depth = 0
    pending: int | None = None


_deferral = _Deferral()


def raise_on_stop_signals() -> None:
    """From now on the first stop signal raises ``Stopped`` on the main thread (at the end of a ``stop_deferred``
    block if it is inside one); later ones are ignored, so the cleanup the first one starts runs to its end
    (whoever sent them SIGKILLs after its grace period)."""

    def handler(signum, frame) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        if _deferral.depth:
            _deferral.pending = signum
            return
        raise Stopped(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, handler)


@contextlib.contextmanager
def stop_deferred() -> Iterator[None]:
    """A stop signal that arrives inside raises ``Stopped`` only when the block ends: for work that must not be left
    half-done, such as copying the last finished step's state (trainer/restore.py). Python runs signal handlers on
    the main thread only, so this guards the main thread; keep the block short, the sender's grace period runs."""
    _deferral.depth += 1
    try:
        yield
    finally:
        _deferral.depth -= 1
    if _deferral.depth == 0 and _deferral.pending is not None:
        signum, _deferral.pending = _deferral.pending, None
        raise Stopped(signum)


def requeue_margin_s(grace_s: float) -> float:
    """Seconds kept free at the end of the requeue grace period: the wrapper requeues the job one margin before
    the time limit, and trainer rank 0 drops a step that has not ended two margins before it."""
    return max(2.0, min(15.0, grace_s / 4))


def child_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child that must die with this process (it calls ``die_with_parent``)."""
    return {**(os.environ if environ is None else environ), PARENT_PID_ENV: str(os.getpid())}


def die_with_parent(signum: int, parent_pid: int | None = None) -> None:
    """Have the kernel send ``signum`` to this process when its parent (``parent_pid``, else ``RP_PARENT_PID``)
    dies; if it is dead already, send it now. No-op without either (a node started by srun, TorchX or a user)
    or off Linux."""
    parent = os.environ.pop(PARENT_PID_ENV, None) if parent_pid is None else parent_pid
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return  # cannot happen for a valid signal number; the parent's own stop path still covers us
    if os.getppid() != int(parent):  # the parent died before prctl: the kernel will not tell us
        os.kill(os.getpid(), signum)


def stop_groups(processes: list[subprocess.Popen], grace_s: float) -> list[bool]:
    """SIGTERM the process group of each process (each leads its own: ``start_new_session``), wait up to
    ``grace_s`` for all of them to exit, then SIGKILL every group, to reach members that outlived their
    leader too. Returns, for each process, whether it was still running at the deadline (and so killed)."""
    for p in processes:
        if p.poll() is None:
            _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = [p.poll() is None for p in processes]
    for p in processes:
        _signal_group(p.pid, signal.SIGKILL)
    for p in processes:
        p.wait()
    return killed


def call_side_by_side(calls: dict[str, Callable[[], object]]) -> None:
    """Each call on a thread of its own, all at once; returns once every one has returned, then raises the first
    exception (in ``calls``' order) that any raised. For stops that each wait for a process to exit, as an engine's
    shutdown waits for its server (up to STOP_GRACE_S): one after another, a node's eight servers would take eight
    of those, past the margin a warned job has to end in (launch/requeue.py)."""
    errors: dict[str, BaseException] = {}

    def call(name: str) -> None:
        try:
            calls[name]()
        except BaseException as err:  # noqa: BLE001 - raised below, once every call has returned
            errors[name] = err

    threads = [threading.Thread(target=call, args=(name,), name=f"stop-{name}", daemon=True) for name in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in calls:
        if name in errors:
            raise errors[name]


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # the group is gone (and its id may be another's by now)
        pass
