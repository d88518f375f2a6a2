"""Launch tests against a real Slurm cluster: slurm/local_cluster.sh's one-machine cluster (.ci/run starts it).

Every path a user has onto Slurm runs a job to completion as one heterogeneous job: here the shipped
``sbatch slurm/rolloutpipe.sbatch`` and a Hydra sweep through hydra-submitit-launcher with the small workload;
submitit (``launch.py launcher=slurm``) and TorchX's slurm scheduler with two rollout and two trainer nodes in
test_slurm_hosts.py (one run each: a one-node run would repeat it). A job that is cancelled or loses its trainer
ends with a message that says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO, SMALL, node_environ, read_metrics, wait_for
from tests.helpers.slurm import SLURM, job_id_of, launch, stop_if_running, task_process

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]


def wait_for_first_step(run_dir: Path, launcher: subprocess.Popen, timeout_s: float = 120) -> None:
    wait_for((run_dir / "metrics.jsonl").exists, "first step", timeout_s=timeout_s, running=[launcher],
             details=lambda: launcher.communicate() if launcher.poll() is not None else "")


def test_sbatch_script_runs_the_default_to_completion(job_dir):
    run_dir = job_dir("sbatch")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["sbatch", "--wait", f"--output={run_dir.parent}/slurm-%j.out",
                             str(REPO / "slurm" / "rolloutpipe.sbatch"), f"run.dir={run_dir}", *SMALL],
                            cwd=REPO, env=node_environ(), capture_output=True, text=True, timeout=240)
    logs = "".join(p.read_text() for p in run_dir.parent.glob("slurm-*.out"))
    assert result.returncode == 0, result.stderr + logs[-3000:]
    assert len(read_metrics(run_dir)) == 2
    assert "step 2/2" in logs


def test_two_point_sweep_through_hydra_submitit_launcher_gives_two_run_directories(tmp_path):
    sweep = tmp_path / "sweep"
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), "-m", "hydra/launcher=submitit_slurm",
                             f"hydra.sweep.dir={sweep}", *SLURM, "pipeline.mode=sync,cgp", *SMALL],
                            cwd=tmp_path, env=node_environ(), capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    run_dirs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in run_dirs] == ["0", "1"]
    configs = [OmegaConf.load(p / "config.yaml") for p in run_dirs]
    assert [c.pipeline.mode for c in configs] == ["sync", "cgp"] and configs[0].run.id != configs[1].run.id
    for run_dir in run_dirs:
        assert len(read_metrics(run_dir)) == 2
        [script] = (run_dir / "slurm").glob("*_submission.sh")  # each point ran as its own het job
        assert "#SBATCH hetjob" in script.read_text()


def test_cancelled_job_is_reported_as_cancelled(job_dir):
    run_dir = job_dir("cancel")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launcher = launch(run_dir, *SMALL, "num_rollout=1000", wait=False)
    try:
        job_id = job_id_of(run_dir)
        wait_for_first_step(run_dir, launcher)
        subprocess.run(["scancel", str(job_id)], check=True)
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 1
        assert f"het job {job_id} was cancelled" in stderr, stderr[-3000:]
    finally:
        stop_if_running(launcher, run_dir)


def test_trainer_death_makes_the_rollout_exit_with_a_clear_error(job_dir):
    """A lost node, which a requeue could fix (the rollout manager writes the outcome in trainer rank 0's place:
    tests/multiprocess/test_outages.py); launcher.max_requeues=0 here, so the job ends and says how."""
    run_dir = job_dir("kill-trainer")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launcher = launch(run_dir, *SMALL, "num_rollout=1000", "pipeline.peer_timeout_s=3", "run.id=kill-trainer",
                      "launcher.max_requeues=0", "wandb.mode=offline", wait=False)  # W&B's files are scanned too
    try:
        job_id = job_id_of(run_dir)
        wait_for_first_step(run_dir, launcher)
        pid, environ = task_process(run_id="kill-trainer", proc_id=1)  # task 1 = trainer rank 0
        os.kill(pid, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=90)
        assert launcher.returncode == 1
        assert f"het job {job_id} ended FAILED" in stderr, stderr[-3000:]
        assert "rollout rank 0 (task 0) failed" in stderr
        assert "[rollout rank 0] stopping: trainer rank 0 stopped heart-beating" in stderr
        # the run's secret reached the task through its environment, and no file of the run holds it
        secret = environ["RP_RUN_SECRET"].encode()
        assert len(secret) == 64
        assert not [p for p in run_dir.rglob("*") if p.is_file() and secret in p.read_bytes()]
    finally:
        stop_if_running(launcher, run_dir)
