"""On a GPU machine: the SGLang engine and the Megatron trainer, end to end (tools/gpu_check.py).

Skips without CUDA or without the sglang and megatron extras (``pip install -e ".[sglang,megatron,dev]"``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.gpu


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (CUDA is not available here)"
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("megatron") is None:
        return 'needs the GPU extras: pip install -e ".[sglang,megatron,dev]"'
    return None


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
@pytest.mark.timeout(900)
def test_sglang_engine_and_megatron_trainer_agree_and_cgp_equals_sync(tmp_path):
    result = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None,
                    reason="needs an NVIDIA GPU and megatron-core")
@pytest.mark.timeout(900)
def test_both_trainers_at_real_width_agree_and_use_the_memory_they_plan():
    """bf16 at Qwen3-1.7B's width and vocabulary, token-budget micro-batches, chunked log-probs, recompute on and
    off, Transformer Engine's spec when it imports (tools/gpu_check_trainer.py)."""
    result = subprocess.run([sys.executable, "tools/gpu_check_trainer.py", "--layers", "2"], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
