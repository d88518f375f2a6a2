"""Fault injection: a node-group process is SIGKILLed at a chosen point, the run is resumed, and nothing is lost
or trained twice: every prompt of the data is trained exactly once and the final weights equal those of an
uninterrupted run (float64, so only floating-point accumulation order could differ)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from rolloutpipe.tasks import ReversalTaskConfig, write_reversal_jsonl

from ..conftest import DENSE_REWARD, SMALL, read_metrics, read_samples, run_job, start_nodes

pytestmark = pytest.mark.multiprocess

NUM_STEPS, PROMPTS_PER_STEP = 3, 4


def workload(data: Path) -> list[str]:
    return [*SMALL, *DENSE_REWARD, "model.dtype=float64", "run.save_samples=true", "run.checkpoint_every=1",
            "global_batch_size=8", f"num_rollout={NUM_STEPS}", f"data.path={data}", "pipeline.peer_timeout_s=3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    cfg = ReversalTaskConfig(num_rows=NUM_STEPS * PROMPTS_PER_STEP, seed=7)
    return write_reversal_jsonl(cfg, tmp_path_factory.mktemp("data") / "rows.jsonl")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data) -> dict:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = run_job(run_dir, *workload(data))
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


# (point, the process it kills, which call of the point dies); each lands in step 1 or at the start of step 2
FAULTS = [
    ("mid_rollout", "rollout", 24),  # the 24th rewarded sample: step 1 is half generated
    ("mid_dispatch", "rollout", 6),  # step 1's second group is being published
    ("mid_optimizer_step", "trainer", 4),  # step 1's second optimizer step (2 per step)
    ("mid_checkpoint_write", "trainer", 2),  # step 1's checkpoint: weights written, optimizer not
    ("during_weight_sync", "rollout", 2),  # the engines loading policy_version 2
]


@pytest.mark.parametrize("point,victim,nth", FAULTS, ids=[f[0] for f in FAULTS])
def test_killed_and_resumed_run_trains_every_prompt_once_and_matches_the_uninterrupted_run(
        tmp_path, data, uninterrupted, point, victim, nth):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = start_nodes(run_dir, *workload(data), commands={victim: ["-m", "tests.faults.inject", point, str(nth)]})
    outputs = {role: p.communicate(timeout=180) for role, p in procs.items()}
    assert procs[victim].returncode == -9, outputs[victim][1][-2000:]
    survivor = "trainer" if victim == "rollout" else "rollout"
    assert procs[survivor].returncode == 1, outputs[survivor][1][-2000:]
    assert not (run_dir / "checkpoints" / "final").exists()

    resumed = run_job(run_dir, *workload(data), "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS))
    trained = [s["prompt_index"] for s in read_samples(run_dir) if s["id"].endswith("sample=0")]
    assert sorted(trained) == list(range(NUM_STEPS * PROMPTS_PER_STEP)), "every prompt trained exactly once"
    final = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert max((final[k] - uninterrupted[k]).abs().max().item() for k in final) < 1e-9
