"""Jobs on the local Slurm cluster (slurm/local_cluster.sh): launch one, find its id, tasks and accounting, cancel."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, node_environ, wait_for

SLURM = ["launcher=slurm", "launcher.poll_s=1"]


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
