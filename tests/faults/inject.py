"""Run a node-group process with one fault armed: ``python -m tests.faults.inject <point> <nth> [SIGTERM]``.

The process runs ``rolloutpipe.launch.node`` as usual, except that the ``nth`` call of the function named by
``point`` fails:
- a ``POINTS`` entry kills the process with SIGKILL: no cleanup, no abort key, exactly like an OOM kill or a
  node loss; with ``SIGTERM`` as the third argument it sends itself SIGTERM instead, as a preemption, ``scancel``
  or ``scontrol requeue`` does, and the process stops the way it would (the signal reaches the process before
  ``kill`` returns, so its handler raises there: the call is not made);
- ``busy_optimizer_step`` only delays the call (``keep_busy``);
- ``engine_crash`` raises inside an embedded engine's scheduler thread (its next decode step), which sets
  ``engine.error`` as any crash of that thread would;
- ``engine_server_killed`` SIGKILLs the server process of the SGLang-API engine being submitted to (the
  ``nth`` submit of the run), as an OOM kill of that server would;
- ``engines_killed_at_publish`` SIGKILLs the server of every SGLang-API engine in service as the dispatcher
  publishes the ``nth`` group of the run (before it does);
- ``engine_server_killed_mid_broadcast`` SIGKILLs the server of the engine making the ``nth`` broadcast weight load of
  the run (``update_weights_from_distributed``) once it has received the policy's first bucket, before the second:
  every other engine of the group has the first bucket and waits for the second;
- ``weight_group_left_open`` makes trainer rank 0's ``nth`` leave of a weight-update group (after a broken broadcast)
  drop the group without destroying it, as a broadcast still in flight makes it (and as an NCCL collective would
  hold the survivors whatever rank 0 does): its connections stay open, so a survivor waits in the broken broadcast.
This wrapper is the only place faults are injected; production code has no hooks for it.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import time


def kill_process(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def stop_process(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)


def keep_busy(*args, **kwargs):
    """The call takes $RP_TEST_BUSY_S seconds longer, and says so first in the file $RP_TEST_MARKER (which a test's
    reward reads: tests/fixtures/dense_rewards.py ``letter_fraction_until_marked``)."""
    open(os.environ["RP_TEST_MARKER"], "w").close()
    time.sleep(float(os.environ["RP_TEST_BUSY_S"]))


def kill_server_before_second_bucket(original, engine, buckets, group_name, policy_version, macs):
    """Wraps the call (``arm`` hands it ``original``): the server dies as the call takes the second bucket, before
    its MAC (if any: SGLang's calls have none) is asked for and its request made."""
    return original(engine, _KillsAtSecond(buckets, engine), group_name, policy_version, macs)


class _KillsAtSecond(list):
    """The buckets, which kill ``engine``'s server when iteration reaches the second one."""

    def __init__(self, buckets, engine) -> None:
        super().__init__(buckets)
        self.engine = engine

    def __iter__(self):
        for index, bucket in enumerate(super().__iter__()):
            if index == 1:
                kill_engine_server(self.engine)
            yield bucket


kill_server_before_second_bucket.wraps = True


def leave_group_open(original, broadcaster):
    """Wraps ``Broadcaster.leave``: the group is dropped, not destroyed (its branch for a broadcast in flight)."""
    print(f"injected: trainer rank 0 leaves {broadcaster.group.group_name} open", file=sys.stderr, flush=True)
    broadcaster._pg, broadcaster._in_flight = None, [None, None]


leave_group_open.wraps = True


def crash_engine(engine, *args, **kwargs):
    raise RuntimeError(f"injected crash of engine {engine.name}")


def _server(engine):
    return engine._stop_server.__self__  # the ServerProcess the rollout node started (engine/__init__.py)


def kill_engine_server(engine, *args, **kwargs):
    server = _server(engine)
    print(f"injected: SIGKILL to {engine.name}'s server (pid {server._proc.pid})", file=sys.stderr, flush=True)
    os.killpg(server._proc.pid, signal.SIGKILL)


def kill_every_engine_server(*args, **kwargs):
    import gc

    from rolloutpipe.rollout.engines.http_client import SGLangEngine

    for engine in [o for o in gc.get_objects() if isinstance(o, SGLangEngine)]:
        if _server(engine)._proc.poll() is None:  # (replaced engines' servers are gone already)
            kill_engine_server(engine)


POINTS = {
    # point: (module, attribute path) of the function whose nth call fails, and how it fails
    "mid_rollout": ("rolloutpipe.rollout.samples", "RewardThreads._reward", kill_process),
    "mid_dispatch": ("rolloutpipe.rollout.dispatcher", "Dispatcher._publish", kill_process),
    "mid_optimizer_step": ("rolloutpipe.trainer.torch_backend", "PolicyTrainer.finish_batch", kill_process),
    "mid_checkpoint_write": ("rolloutpipe.control.checkpoint", "save_file", kill_process),
    "hf_save": ("rolloutpipe.model", "save_hf_checkpoint", kill_process),  # a checkpoint's weights, or the final
    "busy_optimizer_step": ("rolloutpipe.trainer.grpo_trainer", "GRPOTrainer.finish_batch", keep_busy),
    "during_weight_sync": ("rolloutpipe.rollout.engines.embedded", "EmbeddedEngine.weights_in_place",
                           kill_process),
    "engine_crash": ("rolloutpipe.rollout.engines.embedded", "EmbeddedEngine._decode_step", crash_engine),
    "engine_server_killed": ("rolloutpipe.rollout.engines.http_client", "SGLangEngine.submit", kill_engine_server),
    "engines_killed_at_publish": ("rolloutpipe.rollout.dispatcher", "Dispatcher._publish", kill_every_engine_server),
    "engine_server_killed_mid_broadcast": ("rolloutpipe.rollout.engines.http_client",
                                           "SGLangEngine.update_weights_from_distributed",
                                           kill_server_before_second_bucket),
    "weight_group_left_open": ("rolloutpipe.control.weights.group", "Broadcaster.leave", leave_group_open),
}


def arm(point: str, nth: int, how: str = "SIGKILL") -> None:
    module_name, path, fail = POINTS[point]
    if how == "SIGTERM":
        fail = stop_process
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)
    calls = 0

    @functools.wraps(original)
    def failing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == nth:
            if getattr(fail, "wraps", False):  # it makes the call itself
                return fail(original, *args, **kwargs)
            fail(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, failing)


if __name__ == "__main__":
    arm(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
    from rolloutpipe.launch.node import main

    sys.exit(main())
