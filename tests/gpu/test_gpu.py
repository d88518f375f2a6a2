"""On a GPU machine: tools/gpu_check.py, the one command (docs/gpu.md).

Skips without CUDA; the SGLang test also without sglang (``pip install -e ".[sglang]"``), and the check's own SGLang
parts skip there too.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs an NVIDIA GPU (CUDA is not available here)")]

NO_SGLANG = "trainer_size,distributed_optimizer,default_run,resume,bit_identity,fsdp_nccl"


def gpu_check(out, *args: str) -> list[dict]:
    result = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(out), *args], check=False,
                            cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    return json.loads((out / "gpu_check.json").read_text())["rows"]


@pytest.mark.timeout(900)
def test_gpu_check_passes_without_sglang(tmp_path):
    """Trainer sizes against the memory plan, the distributed optimizer and its resume, the default run on CUDA,
    bf16 bit-identity of sync and cgp+fgd on every backend, FSDP over NCCL: under 5 minutes on one H200."""
    rows = gpu_check(tmp_path, "--parts", NO_SGLANG)
    assert {r["part"] for r in rows} == set(NO_SGLANG.split(",")) and all(r["result"] == "pass" for r in rows), rows


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason='needs sglang: pip install -e ".[sglang]"')
@pytest.mark.timeout(1800)
def test_sglang_engine_and_trainer_agree_and_cgp_equals_sync(tmp_path):
    rows = gpu_check(tmp_path, "--parts", "logprobs,parity")
    assert rows and all(r["result"] == "pass" for r in rows), rows


def test_bucket_buffers_on_a_gpu_node_are_page_locked():
    """Rank 0's bucket buffers (FSDP, Megatron) take copies off the GPU: page-locked, they take them directly."""
    from rolloutpipe.control.weights.buckets import BufferRing

    ring = BufferRing(2, pinned=True)
    first = ring(0, 1 << 20)
    assert first.is_pinned() and ring(1, 1 << 20).is_pinned()
    assert ring(2, 1 << 20).data_ptr() == first.data_ptr()  # reused, not allocated again
    assert not BufferRing(1)(0, 16).is_pinned()
