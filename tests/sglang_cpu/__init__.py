"""TEST SUPPORT ONLY: the recipe that runs SGLang 0.5.23 on a CPU machine (tests/sglang_real/test_sglang_real.py and
bench/sglang_fgd_bench.py; docs/sglang.md explains each flag)."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent

LAUNCH_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
               "--mem-fraction-static", "0.2", "--disable-cuda-graph", "--sleep-on-idle"]
"""``sglang.launch_server`` flags of every CPU server; callers add the KV cache size (``--max-total-tokens``)."""


MAX_ENGINES = 8
"""Servers of one run that may share this machine's NUMA node (``environ``'s bind list)."""


def environ(repo: Path) -> dict[str, str]:
    """What the SGLang servers' environment needs: SGLang's CPU path, this directory's sitecustomize.py (the
    stand-in modules and the seeded sampler) first on the path, before ``repo``, and one entry per engine in
    SGLang's CPU bind list: a CPU server takes the entry of its ``--base-gpu-id`` (the rollout node's engine slot),
    and without the list, one per NUMA node, a second engine on a one-node machine stops at start. Every entry is
    every core (SGLang binds threads to them only on CPUs with AMX)."""
    every_core = f"0-{os.cpu_count() - 1}"
    return {"SGLANG_USE_CPU_ENGINE": "1", "RP_SGLANG_CPU_SEEDED_SAMPLER": "1",
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join([every_core] * MAX_ENGINES),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(repo)])}
