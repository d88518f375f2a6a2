"""``python -m sglang.launch_server`` with its ``--api-key`` taken from the environment, not the command line.

    RP_ENGINE_API_KEY=<key> python -m rolloutpipe.rollout.engines.sglang_launch --model-path ... (SGLang's flags)

A process's command line is readable by every user of the machine (``ps``, ``/proc/<pid>/cmdline``); its
environment only by its owner. This module takes the key out of the environment (so SGLang's own child processes
do not inherit it either), adds ``--api-key <key>`` to ``sys.argv`` inside this process and runs SGLang's entry
point as ``__main__``. The real-SGLang tier (tests/sglang_real/test_sglang_real.py, on the CPU) and
tools/gpu_check.py run it.
"""

from __future__ import annotations

import os
import runpy
import sys

from rolloutpipe.rollout.engines.server_process import die_with_the_rollout_node
from rolloutpipe.rollout.engines.sglang_api import API_KEY_ENV


def main() -> None:
    die_with_the_rollout_node()
    key = os.environ.pop(API_KEY_ENV, None)
    sys.argv = ["sglang.launch_server", *sys.argv[1:], *(["--api-key", key] if key else [])]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
