"""The package's CPU numerics setting (rolloutpipe/__init__.py): MKL's reproducibility branch by CPU vendor, set for
every process a run starts unless the user set one."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

import rolloutpipe


@pytest.mark.parametrize(("vendor", "branch"), [
    ("GenuineIntel", "AVX2,STRICT"),  # honoured on Intel only
    ("AuthenticAMD", "COMPATIBLE"),  # where MKL ran AVX2,STRICT as AUTO,STRICT
    (None, "COMPATIBLE"),  # no /proc/cpuinfo (not Linux)
])
def test_the_mkl_branch_follows_the_cpu_vendor(monkeypatch, vendor, branch):
    def fake_open(path, *args, **kwargs):
        assert path == "/proc/cpuinfo"
        if vendor is None:
            raise FileNotFoundError(path)
        return io.StringIO(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 25\n")

    monkeypatch.setattr(rolloutpipe, "open", fake_open, raising=False)
    assert rolloutpipe._reproducible_mkl_branch() == branch


@pytest.mark.parametrize("preset", [None, "AUTO"])
def test_importing_the_package_sets_mkl_cbwr_unless_the_user_did(preset):
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | ({"MKL_CBWR": preset} if preset else {})
    out = subprocess.run([sys.executable, "-c", "import os, rolloutpipe; print(os.environ['MKL_CBWR'])"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == (preset or rolloutpipe._reproducible_mkl_branch())
