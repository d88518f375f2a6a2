"""Run a node-group process with one fault armed: ``python -m tests.faults.inject <point> <nth>``.

The process runs ``rolloutpipe.node`` as usual, except that the ``nth`` call of the function named by
``point`` kills it with SIGKILL: no cleanup, no abort key, exactly like an OOM kill or a node loss.
This wrapper is the only place faults are injected; production code has no hooks for it.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys

POINTS = {
    # point: (module, attribute path) of the function whose nth call dies
    "mid_rollout": ("rolloutpipe.rollout", "RewardThreads._reward"),
    "mid_dispatch": ("rolloutpipe.dispatcher", "Dispatcher._publish"),
    "mid_optimizer_step": ("rolloutpipe.trainer", "PolicyTrainer.finish_batch"),
    "mid_checkpoint_write": ("rolloutpipe.checkpoint", "save_file"),
    "during_weight_sync": ("rolloutpipe.engine.embedded", "EmbeddedEngine.update_weights_from_disk"),
}


def arm(point: str, nth: int) -> None:
    module_name, path = POINTS[point]
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)
    calls = 0

    @functools.wraps(original)
    def dying(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, dying)


if __name__ == "__main__":
    arm(sys.argv[1], int(sys.argv[2]))
    from rolloutpipe.node import main

    sys.exit(main())
