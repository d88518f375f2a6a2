"""TEST SUPPORT ONLY: the recipe that runs SGLang 0.5.23 on a CPU machine (tests/sglang_real/test_sglang_real.py and
bench/sglang_fgd_bench.py; docs/sglang.md explains each flag)."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent

LAUNCH_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
               "--mem-fraction-static", "0.2", "--disable-cuda-graph", "--sleep-on-idle"]
"""``sglang.launch_server`` flags of every CPU server; callers add the KV cache size (``--max-total-tokens``)."""


def environ(repo: Path) -> dict[str, str]:
    """What the SGLang servers' environment needs: SGLang's CPU path, and this directory's sitecustomize.py (the
    stand-in modules and the seeded sampler) first on the path, before ``repo``."""
    return {"SGLANG_USE_CPU_ENGINE": "1", "RP_SGLANG_CPU_SEEDED_SAMPLER": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE), str(repo)])}
