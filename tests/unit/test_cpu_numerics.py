"""The package's CPU numerics setting (rolloutpipe/__init__.py): MKL's reproducibility branch, set for every process
a run starts unless the user set one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("preset", [None, "AUTO"])
def test_importing_the_package_sets_mkl_cbwr_unless_the_user_did(preset):
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | ({"MKL_CBWR": preset} if preset else {})
    out = subprocess.run([sys.executable, "-c", "import os, rolloutpipe; print(os.environ['MKL_CBWR'])"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == (preset or "AVX2,STRICT")
