"""Entry point of one node-group process: ``python -m rolloutpipe.launch.node`` (control/env.py: its contract).

SIGTERM, SIGINT or SIGHUP (a launcher, a scheduler, a terminal) raises ``Stopped`` on the main thread:
pipeline.run_node writes ``abort`` with that reason and closes the node, which stops its engine servers and
reward workers, and the process exits 128 + the signal (control/lifetime.py). A run stopped at a checkpoint for
its Slurm job to be requeued (launch/requeue.py) exits REQUEUE_EXIT (75).
"""

from __future__ import annotations

import os

# The TCPStore logs a warning with a C++ trace each time a bounded wait times out, which is how we poll.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from rolloutpipe.control.env import NodeEnv, Role  # noqa: E402
from rolloutpipe.control.lifetime import (  # noqa: E402
    PEER_STOPPED_EXIT,
    REQUEUE_EXIT,
    Stopped,
    die_with_parent,
    raise_on_stop_signals,
)


def main() -> int:
    raise_on_stop_signals()  # before the slow imports: a stop during start-up ends the process too
    die_with_parent(signal.SIGTERM)  # started by the local launcher: stop (cleanly) if it dies abruptly
    env = NodeEnv.take()  # the secret leaves the environment before anything can start a child process
    who = f"[{env.role.value} rank {env.rank}]"
    try:
        return _run(env, who)
    except Stopped as stop:
        if env.role is Role.rollout:
            print(f"{who} stopped by {stop.name}, and so were its engine servers and reward workers; exiting with "
                  f"{stop.exit_code}", file=sys.stderr)
        else:
            print(f"{who} stopped by {stop.name}; exiting with {stop.exit_code}", file=sys.stderr)
        return stop.exit_code


def _run(env: NodeEnv, who: str) -> int:
    if env.cpus:  # before torch is imported: the thread it starts then inherits the CPUs as all later ones do
        os.sched_setaffinity(0, env.cpus)
    if env.role is Role.trainer:  # micro-batches of every size: segments that grow instead of a cache of fixed
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # blocks (no effect on CPU)
    import torch

    from rolloutpipe.config import ConfigError, read_config
    from rolloutpipe.control.transport import PeerLost, RunRequeued, TransportError
    from rolloutpipe.pipeline import run_node

    try:
        cfg = read_config(env.config_path)
    except ConfigError as err:
        print(f"{who} bad config in {env.config_path}: {err}", file=sys.stderr)
        return 2
    threads = cfg.trainer.num_threads if env.role is Role.trainer and cfg.trainer.num_threads else None
    torch.set_num_threads(threads or max(1, len(os.sched_getaffinity(0))))
    try:
        run_node(cfg, env)
    except ConfigError as err:
        print(f"{who} {err}", file=sys.stderr)
        return 2
    except RunRequeued as err:
        print(f"{who} stopped: {err}; exiting with {REQUEUE_EXIT}", file=sys.stderr)
        return REQUEUE_EXIT
    except TransportError as err:
        print(f"{who} stopping: {err}", file=sys.stderr)
        return PEER_STOPPED_EXIT if isinstance(err, PeerLost) else 1
    except Exception as err:  # noqa: BLE001 - the process boundary: say who failed and why, exit non-zero
        traceback.print_exc()
        print(f"{who} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


def exit_with(code: int) -> None:
    """Exit without the interpreter's finalization. Once finalization begins, a thread that takes the GIL again ends
    with ``pthread_exit``, and where that thread is inside torch's C++ the process aborts ("terminate called without
    an active exception", exit by SIGABRT after a run that finished): a store call returning (control/
    bounded_store.py), or gloo's worker thread freeing the tensors of the last collective (an FSDP rank's last
    broadcast from rank 0, whose worker thread still held them: seen in a core dump). The node has written and
    closed what it writes by now; as an exit would, this waits for the threads that are not daemons, runs the exit
    handlers (W&B, logging, the policies disk weight sync keeps in /dev/shm), flushes the standard streams, then
    leaves with ``os._exit``. With a store call in flight it runs no exit handler (one that touched the store would
    wait for it) but the removal of those /dev/shm directories."""
    import atexit
    import threading

    from rolloutpipe.control.bounded_store import calls_in_flight
    from rolloutpipe.control.weights.disk import remove_private_dirs

    if calls_in_flight():
        remove_private_dirs()
    else:
        threading._shutdown()  # as CPython's exit does: wait for the non-daemon threads, then the exit handlers
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, a closed stream: nothing more can be said there
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_with(main())
