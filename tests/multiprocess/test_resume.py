"""Checkpoint and resume: a resumed run redoes the interrupted step with the same samples and ends with the
weights of an uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rolloutpipe.control.checkpoint import latest_checkpoint
from tests.conftest import DENSE_REWARD, SMALL, needs_extra, read_metrics, read_samples, run_job
from tests.helpers.parity import EXACT, weights_digests

pytestmark = pytest.mark.multiprocess

WORKLOAD = [*SMALL, *DENSE_REWARD, *EXACT, "run.save_samples=true", "run.checkpoint_every=1", "pipeline.mode=cgp",
            "global_batch_size=8"]
"""Exact accumulation and batch-invariant engines, so that the groups' arrival order cannot move a bit either."""


MEGATRON_DISTRIBUTED = ["trainer.backend=megatron", "trainer.megatron.distributed_optimizer=true",
                        "trainer.num_ranks=2", "model.dtype=float32", "trainer.megatron.ddp_bucket_size=4000"]
"""Megatron's DistributedOptimizer on two data-parallel ranks (on the CPU under trainer/megatron/cpu.py's redirection):
each rank checkpoints its own shards and reads back the ranges its layout needs on resume, also on one rank, torch's
AdamW step counts in state.json. DDP buckets of 4000 parameters: each step's last update is stepped and all-gathered
a bucket at a time as weight sync reads the policy. float32, where the shards are views of the parameters (copied
into under no_grad); bfloat16's masters on one rank: tests/unit/test_megatron_checkpoint.py."""


MKL_ANY_RANKS = {} if "GenuineIntel" in Path("/proc/cpuinfo").read_text() else {"MKL_CBWR": "COMPATIBLE"}
"""Every run of the test alike. On an AMD EPYC (Zen 4, 2026-12-06) MKL runs the package's AVX2,STRICT as AUTO,STRICT
(rolloutpipe/__init__.py), and there the Megatron update resumed on one data-parallel rank differed from the same
update on two at the last step (test_resume at 77a5391 and later); with COMPATIBLE, the branch every x86 CPU runs
alike, the bits agreed. On Intel CPUs the package's own setting gave them the same bits."""


@pytest.mark.parametrize("backend", [
    ["model.dtype=bfloat16"],  # where a resume rebuilding the float32 masters from the bf16 policy would land elsewhere
    pytest.param(MEGATRON_DISTRIBUTED, marks=needs_extra("megatron", "megatron.core")),
], ids=["torch-bfloat16", "megatron-distributed-optimizer-2-ranks"])
def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(job_dir, backend):
    whole, split = job_dir("whole"), job_dir("split")
    assert run_job(whole, *WORKLOAD, *backend, "num_rollout=4", environ=MKL_ANY_RANKS).returncode == 0
    first = run_job(split, *WORKLOAD, *backend, "num_rollout=2", environ=MKL_ANY_RANKS)
    assert first.returncode == 0, first.stderr[-2000:]
    assert latest_checkpoint(split).step == 1
    (split / "checkpoints" / "step=7.tmp").mkdir()  # an interrupted checkpoint write is never resumed from
    resharded = None
    if backend is MEGATRON_DISTRIBUTED:  # each rank's file, nothing gathered; also resumed on one rank
        assert latest_checkpoint(split).sharded
        shutil.copytree(split, resharded := job_dir("resharded"))
    second = run_job(split, *WORKLOAD, *backend, "num_rollout=4", "run.resume=auto", environ=MKL_ANY_RANKS)
    assert second.returncode == 0, second.stderr[-2000:]
    if resharded is not None:  # exact accumulation: the same bits on any number of data-parallel ranks
        third = run_job(resharded, *WORKLOAD, *backend, "trainer.num_ranks=1", "num_rollout=4", "run.resume=auto",
                        environ=MKL_ANY_RANKS)
        assert third.returncode == 0, third.stderr[-2000:]
        assert weights_digests(resharded) == weights_digests(whole)

    assert [m["step"] for m in read_metrics(split)] == [0, 1, 2, 3]
    assert [(s["id"], s["response_ids"]) for s in read_samples(split)] == [
        (s["id"], s["response_ids"]) for s in read_samples(whole)]
    a = load_file(str(whole / "checkpoints" / "final" / "model.safetensors"))
    b = load_file(str(split / "checkpoints" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert weights_digests(whole) == weights_digests(split)
    assert sorted(p.name for p in (split / "checkpoints").glob("step=?")) == ["step=2", "step=3"]  # keep_last=2


def test_resume_with_nothing_to_resume_starts_fresh(job_dir):
    run_dir = job_dir("fresh")
    result = run_job(run_dir, *WORKLOAD, "num_rollout=1", "run.resume=auto")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [0]
