"""The cluster tier's guard: every test here skips (fails under RP_REQUIRE_SLURM=1) without the local cluster."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

from tests.conftest import REPO

HOW = ("start the one-machine cluster with `slurm/local_cluster.sh start` (root or sudo; installs Debian's Slurm), "
       "install the launchers with `pip install -e .[slurm]`, then run `python -m pytest -m slurm`")


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    # CI sets RP_REQUIRE_SLURM=1 (.ci/run): there a missing cluster fails the run instead of skipping it.
    not_here = pytest.fail if os.environ.get("RP_REQUIRE_SLURM") == "1" else pytest.skip
    missing = [m for m in ("submitit", "torchx", "hydra_plugins.hydra_submitit_launcher") if not _installed(m)]
    if missing or shutil.which("sbatch") is None:
        not_here(f"no {', '.join(missing) or 'sbatch'} here: {HOW}")
    check = subprocess.run([str(REPO / "slurm" / "local_cluster.sh"), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        not_here(f"the local Slurm cluster is not up ({check.stderr.strip()}): {HOW}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
