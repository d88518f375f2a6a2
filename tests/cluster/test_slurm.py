"""Launch tests against a real Slurm cluster: slurm/local_cluster.sh's one-machine cluster (.ci/run starts it).

Every path a user has onto Slurm runs a job to completion as one heterogeneous job: here the shipped
``sbatch slurm/rolloutpipe.sbatch`` and a Hydra sweep through hydra-submitit-launcher with the small workload;
submitit (``launch.py launcher=slurm``) and TorchX's slurm scheduler with two rollout and two trainer nodes in
test_slurm_hosts.py (one run each: a one-node run would repeat it). A job that is cancelled or loses its trainer
ends with a message that says so.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO, SMALL, node_environ, read_metrics, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

HOW = ("start the one-machine cluster with `slurm/local_cluster.sh start` (root or sudo; installs Debian's Slurm), "
       "install the launchers with `pip install -e .[slurm]`, then run `python -m pytest -m slurm`")
SLURM = ["launcher=slurm", "launcher.poll_s=1"]


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


def launch(run_dir: Path, *overrides: str, wait: bool = True, timeout_s: float = 240,
           environ: dict[str, str] | None = None, stdout: bool = False):
    args = [sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *SLURM, *overrides]
    env = {**node_environ(), **(environ or {})}
    if wait:
        return subprocess.run(args, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=timeout_s)
    # stdout (the trainer's step lines) is dropped unless asked for: then the caller must read it (communicate),
    # or a full pipe blocks the launcher
    return subprocess.Popen(args, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def stop_if_running(launcher: subprocess.Popen, run_dir: Path) -> None:
    """A test's cleanup: the launcher killed and its job cancelled, if the test left them running."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.communicate()
        subprocess.run(["scancel", str(job_id_of(run_dir))])


def sacct_components(job_id: int) -> list[tuple[str, str, str]]:
    """(component, state, nodes) rows of a het job, once accounting has recorded its end."""
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "JobID,State,NodeList"],
                             capture_output=True, text=True, check=True).stdout
        rows = [tuple(line.split("|")) for line in out.splitlines()]
        if rows and all(state.split()[0] not in ("RUNNING", "COMPLETING", "PENDING") for _, state, _ in rows):
            return rows
        assert time.monotonic() < deadline, rows
        time.sleep(1)


def job_id_of(run_dir: Path, timeout_s: float = 60) -> int:
    submissions = lambda: list((run_dir / "slurm").glob("*_submission.sh"))  # noqa: E731
    wait_for(submissions, "submission of the job by the launcher", timeout_s=timeout_s)
    return int(submissions()[0].name.split("_")[0])


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
    run_dir = job_dir("kill-trainer")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launcher = launch(run_dir, *SMALL, "num_rollout=1000", "pipeline.peer_timeout_s=3", "run.id=kill-trainer",
                      "wandb.mode=offline", wait=False)  # W&B's files are scanned for the secret too
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


def task_process(*, run_id: str, proc_id: int) -> tuple[int, dict[str, str]]:
    """Pid and environment of one task of the job step (Slurm runs it on this machine, in a virtual node)."""
    for proc in Path("/proc").iterdir():
        try:
            pairs = (proc / "environ").read_text(errors="replace").split("\0")
            environ = dict(v.split("=", 1) for v in pairs if "=" in v)
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        task = (environ.get("RP_RUN_ID"), environ.get("SLURM_PROCID"))
        if task == (run_id, str(proc_id)) and b"rolloutpipe.launch.slurm" in cmdline:
            return int(proc.name), environ
    raise AssertionError(f"no task {proc_id} of run {run_id} is running")
