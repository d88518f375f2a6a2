"""Stop and continue the way Slurm does, on the real cluster (slurm/local_cluster.sh), through ``launcher=slurm``: a
job past its time limit is warned, stops at a checkpoint, requeues itself and resumes; an ``scontrol requeue`` from
outside (standing in for a preemption) resumes the same way; both end with the weights of an uninterrupted run
(float64), every step trained once. ``scancel`` leaves no process of the run on any node."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .conftest import SMALL, read_metrics, run_job, wait_for
from .test_slurm import (
    job_id_of,
    launch,
    local_cluster,  # noqa: F401 - the cluster fixture
    sacct_components,
    stop_if_running,
)


def run_processes(run_id: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process on the machine (every virtual node) whose environment names the run:
    the batch script and its requeue wrapper, the node processes, their engine servers and reward workers."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"RP_RUN_ID={run_id}".encode() in environ and state != "Z":
            found.append((int(proc.name), cmdline))
    return found

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

TIME_LIMIT_STEPS = 240
SLOW = {"RP_TEST_REWARD_SLEEP_UNTIL_REQUEUED_S": "0.1"}
"""With it, the time-limit run's first start cannot finish before the time limit on any machine: its rewards wait
0.1 s each (one reward worker, 16 samples a step: at least 1.6 s a step, 240 steps at least 6 minutes, against a
2-minute limit), so the job is warned and requeued at least once, and the first start makes progress. Requeued
starts run without the wait. The preempted run's first start, with it, cannot end before the test requeues it (80
steps, at least 2 minutes; the requeue comes after 20). The uninterrupted reference runs without it: the same rewards,
the same update."""
PREEMPTED_STEPS = 80


def workload(num_steps: int) -> list[str]:
    return [*SMALL, "model.dtype=float64", f"num_rollout={num_steps}", "run.checkpoint_every=100",
            "pipeline.peer_timeout_s=10", "wandb.mode=disabled", "reward.name=letter_fraction_waiting",
            "reward.import_modules=[tests.fixtures.dense_rewards]"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights of an uninterrupted (local) run of ``workload(num_steps)``."""
    done: dict[int, dict] = {}

    def weights(num_steps: int) -> dict:
        if num_steps not in done:
            run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
            result = run_job(run_dir, *workload(num_steps), timeout_s=400)
            assert result.returncode == 0, result.stderr[-3000:]
            done[num_steps] = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
        return done[num_steps]

    return weights


def assert_resumed_to_the_uninterrupted_run(run_dir: Path, uninterrupted: dict, num_steps: int) -> list[dict]:
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(num_steps)), "every step once, across the requeues"
    final = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert max((final[k] - uninterrupted[k]).abs().max().item() for k in final) < 1e-9
    return metrics


@pytest.mark.timeout(900)  # two or three starts of a 2-minute job
def test_a_job_past_its_time_limit_requeues_itself_and_ends_with_the_uninterrupted_weights(job_dir, uninterrupted):
    run_dir = job_dir("time-limit")
    result = launch(run_dir, *workload(TIME_LIMIT_STEPS), "launcher.time_min=2", "launcher.requeue_grace_s=10",
                    "launcher.max_requeues=6", timeout_s=900, environ=SLOW)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "was requeued: it resumes from the run's last checkpoint" in result.stdout
    batch = "".join(p.read_text() for p in (run_dir / "slurm").glob("*_batch.out"))
    assert "[requeue] Slurm warned of the time limit" in batch and "[requeue] requeueing job" in batch, batch
    metrics = assert_resumed_to_the_uninterrupted_run(run_dir, uninterrupted(TIME_LIMIT_STEPS), TIME_LIMIT_STEPS)
    assert metrics[0]["run/requeues"] == 0 and metrics[-1]["run/requeues"] >= 1
    [(component, state, _), *_] = sacct_components(job_id_of(run_dir))
    assert state == "COMPLETED", (component, state)


def test_scontrol_requeue_from_outside_mid_step_resumes_to_the_uninterrupted_weights(job_dir, uninterrupted):
    run_dir = job_dir("preempted")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launcher = launch(run_dir, *workload(PREEMPTED_STEPS), wait=False, environ=SLOW)  # cannot end before the requeue
    try:
        job_id = job_id_of(run_dir)
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 20, "20 steps",
                 running=[launcher], timeout_s=300)
        subprocess.run(["scontrol", "requeue", str(job_id)], check=True)  # as a preemption with PreemptMode=REQUEUE
        stdout, stderr = launcher.communicate(timeout=600)
    finally:
        stop_if_running(launcher, run_dir)
    assert launcher.returncode == 0, stderr[-3000:]
    metrics = assert_resumed_to_the_uninterrupted_run(run_dir, uninterrupted(PREEMPTED_STEPS), PREEMPTED_STEPS)
    assert metrics[-1]["run/requeues"] == 1


def test_scancel_of_a_running_het_job_leaves_no_process_on_any_node(job_dir):
    run_dir = job_dir("scancel")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launcher = launch(run_dir, *SMALL, "num_rollout=1000", "run.id=scancel-all", "rollout.engine=embedded_http",
                      "launcher.rollout.nodes=2", "rollout.engines_per_node=2", "trainer.num_ranks=2",
                      "launcher.trainer.nodes=2", "launcher.rollout.cpus_per_task=1",
                      "launcher.trainer.cpus_per_task=1",
                      wait=False)
    try:
        job_id = job_id_of(run_dir)
        wait_for((run_dir / "metrics.jsonl").exists, "first step", running=[launcher], timeout_s=300)
        ours = lambda: run_processes("scancel-all")  # noqa: E731
        assert len([c for _, c in ours() if "http_server" in c]) == 4, "two engine servers on each rollout node"
        subprocess.run(["scancel", str(job_id)], check=True)
        _, stderr = launcher.communicate(timeout=120)
        assert f"het job {job_id} was cancelled" in stderr, stderr[-3000:]
        wait_for(lambda: not ours(), "every process of the run to end", timeout_s=30,  # KillWait (5 s), our grace
                 details=ours)
    finally:
        stop_if_running(launcher, run_dir)
