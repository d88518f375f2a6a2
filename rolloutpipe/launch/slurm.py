"""Slurm: the rollout and trainer node groups as the two components of one heterogeneous job.

    batch script (written per run to <run_dir>/slurm/<job>_submission.sh; docs/slurm.md shows one)
      #SBATCH job options, then het group 0's resources      rollout node group, hosts the store
      #SBATCH hetjob
      #SBATCH het group 1's resources                         trainer node group
      srun --het-group=0 <task> : --het-group=1 <task>       ONE step across both het groups, so
                                                              SLURM_PROCID numbers all tasks
    each task   python -m rolloutpipe.launch.slurm <folder>: submitit loads the pickled run_task, which runs
                rolloutpipe.launch.node; the task finds its role, rank and the store in Slurm's variables
                (env.NodeEnv.from_slurm) and the run's id, secret and directory in its environment.

Why the colon form and not ``srun --het-group=0,1``: options given once apply to every het group, and
srun from Slurm 22.05 to 23.02 does not inherit --cpus-per-task from the allocation, so each group's
--cpus-per-task has to be said on its own side of the colon. It is still one step.

The run's secret never lands in a file: the launcher hands it to sbatch in sbatch's environment
(--export=ALL), Slurm keeps a job's environment in slurmctld's state directory (readable by SlurmUser
only, and not sent to the accounting database unless AccountingStoreFlags=job_env), and the tasks
inherit it. The batch script, submitit's pickle and the logs hold no secret.

submitit (an optional dependency, ``pip install -e .[slurm]``) has no het-job support; the small
extension in submitit_het.py writes this script, counts the tasks of both groups, and maps sacct's
``<job>+<k>`` component rows back to the job. It is imported only when a job is submitted.

Monitor loop (SlurmLauncher.launch)
    waits for   every task's result file (checked each second) or sacct reporting the job finished
                (asked every launcher.poll_s); meanwhile echoes trainer rank 0's step lines, and through a
                requeue (launch/requeue.py) lets the requeued job start seconds after Slurm's hold is set,
                not when it ends (``_release_requeued``)
    on success  every task returned -> 0
    on failure  prints the job's state (FAILED, CANCELLED, TIMEOUT, ...) and the end of each failed
                task's stderr -> 1; a cancelled job is reported as cancelled
    on Ctrl-C   scancel the job -> 130
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rolloutpipe.config import Config, ConfigError
from rolloutpipe.control.lifetime import REQUEUE_EXIT
from rolloutpipe.launch.config import HetGroupConfig, LauncherKind
from rolloutpipe.launch.requeue import requeueable
from rolloutpipe.launch.sacct import UNFINISHED_STATES

REQUEUE_START_DELAY_S = 2
"""How long after Slurm's hold on a requeued job the launcher lets it start (``_release_requeued``)."""


def check_launch(cfg: Config, run_dir: Path | None = None) -> None:
    """Before anything starts: the het groups must have the shape the config needs, and (kind=slurm) every value the
    batch script holds must fit on one line of it (ConfigError if not). ``run_dir``: the run's directory if known
    (Hydra's, when run.dir is not set)."""
    if cfg.launcher.kind is LauncherKind.sbatch:
        check_allocation(cfg)
    elif cfg.launcher.kind is LauncherKind.slurm:
        check_resources(cfg)
        check_script_values(cfg, run_dir)


def check_resources(cfg: Config) -> None:
    """kind=slurm: the trainer het group must have one task per trainer rank, and submitting needs Slurm."""
    if not cfg.launcher.dry_run and (importlib.util.find_spec("submitit") is None or shutil.which("sbatch") is None):
        raise ConfigError("launcher=slurm submits with submitit and sbatch: install them (pip install -e '.[slurm]', "
                          "on a machine with Slurm's client), or add launcher.dry_run=true to see the batch script.")
    trainer = cfg.launcher.trainer
    if trainer.num_tasks != cfg.trainer.num_ranks:
        raise ConfigError(
            f"launcher.trainer.nodes * launcher.trainer.tasks_per_node = {trainer.nodes} * {trainer.tasks_per_node} "
            f"= {trainer.num_tasks} tasks, but trainer.num_ranks={cfg.trainer.num_ranks}: the trainer het group runs "
            "one task per rank; make them equal."
        )


def check_script_values(cfg: Config, run_dir: Path | None = None) -> None:
    """kind=slurm: no value the batch script holds has a line break (or another control character). The script is
    read line by line, by sbatch for its #SBATCH lines and by bash for the rest: quoting keeps a value one word on
    its line, but a line break inside an #SBATCH line or a comment would start a line of its own (a command)."""
    launcher = cfg.launcher
    values = {"run.id": cfg.run.id, "run.dir": cfg.run.dir or (run_dir and str(run_dir)),
              "launcher.job_name": launcher.job_name, "launcher.partition": launcher.partition,
              "launcher.account": launcher.account}
    for name, group in (("rollout", launcher.rollout), ("trainer", launcher.trainer)):
        values[f"launcher.{name}.partition"] = group.partition
        values |= {f"launcher.{name}.sbatch[{i}]": extra for i, extra in enumerate(group.sbatch)}
    values |= {f"launcher.setup[{i}]": line for i, line in enumerate(launcher.setup)}
    for key, value in values.items():
        if value is not None and has_control_characters(str(value)):
            raise ConfigError(f"{key}={str(value)!r} holds a line break or another control character, which would "
                              "split a line of the Slurm batch script: write it on one line, without them.")


def has_control_characters(value: str) -> bool:
    """A line break, a carriage return, NUL or another ASCII control character but tab."""
    return any(ord(c) < 32 and c != "\t" or c == "\x7f" for c in value)


def script_word(value: str) -> str:
    """``value`` as one word to both readers of the batch script: bash, and sbatch for its #SBATCH lines.
    shlex.quote, except for a backslash: sbatch reads one as an escape even inside single quotes, so it goes
    inside double quotes, where both read ``"\\\\"`` as one backslash."""
    return '"\\\\"'.join(shlex.quote(part) for part in value.split("\\"))


def _group_lines(cfg: Config, group: HetGroupConfig, comment: str) -> list[str]:
    launcher = cfg.launcher
    options = {
        "partition": group.partition or launcher.partition,
        "account": launcher.account,
        "time": str(launcher.time_min),
        "nodes": str(group.nodes),
        "ntasks-per-node": str(group.tasks_per_node),
        "cpus-per-task": group.cpus_per_task and str(group.cpus_per_task),
        "gpus-per-node": group.gpus_per_node and str(group.gpus_per_node),
        "mem": group.mem_gb and f"{int(group.mem_gb * 1024)}M",
    }
    lines = [f"# {comment}"]
    lines += [f"#SBATCH --{key}={script_word(value)}" for key, value in options.items() if value]
    lines += [f"#SBATCH {script_word(extra)}" for extra in group.sbatch]  # one option each: '--constraint=h100'
    return lines


def batch_script(cfg: Config, *, folder: Path, python: str) -> str:
    """The het-job batch script of a run (pure: docs/slurm.md's example is this function's output)."""
    launcher = cfg.launcher
    task = f"{script_word(python)} -u -m rolloutpipe.launch.slurm {script_word(str(folder))}"

    survive = survives_node_loss(cfg)

    def srun_side(index: int, group: HetGroupConfig) -> str:
        cpus = f" --cpus-per-task={group.cpus_per_task}" if group.cpus_per_task else ""
        no_kill = " --no-kill" if survive and index == 0 else ""
        return f"--het-group={index}{no_kill}{cpus} {task}"

    requeue = []
    if launcher.max_requeues and (why := requeueable(cfg)) is None:
        requeue = ["#SBATCH --requeue"]
    elif launcher.max_requeues:
        print(f"warning: the job is not requeueable at its time limit: {why}", file=sys.stderr)
    lines = [
        "#!/bin/bash",
        (f"# RolloutPipe run {script_word(str(cfg.run.id))}: one heterogeneous job. Het group 0 is the rollout node "
         "group (one"),
        "# task per node, each starting its node's engine servers; the first also runs the rollout and hosts",
        "# the store), het group 1 the trainer node group (one task per trainer rank).",
        f"#SBATCH --job-name={script_word(launcher.job_name)}",
        f"#SBATCH --output={script_word(str(folder / '%j_batch.out'))}",
        "#SBATCH --open-mode=append",
        "# Warned before the time limit, the run stops at a checkpoint and the job requeues itself",
        "# (rolloutpipe/launch/requeue.py).",
        f"#SBATCH --signal=B:USR1@{launcher.requeue_grace_s}",
        *requeue,
        *_group_lines(cfg, launcher.rollout, "het group 0: rollout node group"),
        *([("# A lost rollout node loses its engines, not the job (rolloutpipe/rollout/engines/hosts.py); "
            "the rollout manager's"),
           "# loss stops the run, which then requeues itself (launch/requeue.py).", "#SBATCH --no-kill"]
          if survive else []),
        "#SBATCH hetjob",
        *_group_lines(cfg, launcher.trainer, "het group 1: trainer node group"),
        "",
        "trap 'export RP_SLURM_WARNED=1' USR1  # Slurm's warning, if it comes before the requeue wrapper runs",
        "export SUBMITIT_EXECUTOR=slurm",
        "# The nodes poll the store with bounded waits; torch logs a C++ warning for each that times out.",
        "export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}",
        *launcher.setup,
        "# One step over both het groups; each task writes <folder>/<job>_<task>_log.{out,err}.",
        f"exec {script_word(python)} -m rolloutpipe.launch.requeue -- srun --unbuffered --kill-on-bad-exit=0 \\",
        f"    {srun_side(0, launcher.rollout)} : \\",
        f"    {srun_side(1, launcher.trainer)}",
        "",
    ]
    return "\n".join(lines)


def survives_node_loss(cfg: Config) -> bool:
    """Whether the rollout het group runs with ``--no-kill`` (sbatch and srun): Slurm then keeps the job when one of
    its nodes fails, so an engine host's node is lost as its process would be (its engines retired, the run goes
    on), instead of Slurm cancelling and requeuing the whole job. With several rollout nodes, whichever the weight
    sync: under ``pipeline.weight_sync=distributed`` the lost host's engines leave the weight-update group at the
    next step boundary (control/weights/distributed.py)."""
    return cfg.launcher.rollout.nodes > 1


def submission_environ(run_vars: dict[str, str]) -> dict[str, str]:
    """This process's environment for sbatch, plus the run's variables.

    Without the Slurm variables of an enclosing job (a Hydra sweep's submitit job submits from inside
    one), which sbatch and srun would otherwise read as options for the new job.
    """
    inherited = {k: v for k, v in os.environ.items()
                 if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SUBMITIT_")) or k == "SLURM_CONF"}
    return {**inherited, **run_vars}


def run_vars(cfg: Config, run_dir: Path, secret: str) -> dict[str, str]:
    env = {"RP_RUN_ID": str(cfg.run.id), "RP_RUN_SECRET": secret, "RP_RUN_DIR": str(run_dir)}
    if cfg.launcher.store_port is not None:
        env["RP_STORE_PORT"] = str(cfg.launcher.store_port)
    return env


@dataclass(kw_only=True, slots=True)
class TaskOutcome:
    label: str
    """``rollout rank 0 (task 0)``, ``trainer rank 1 (task 2)``, ..."""
    ok: bool | None
    """None: the task left no result (killed, cancelled, or never started)."""
    said: list[str]
    """Its last words: the node's own error line if it printed one, else the end of its stderr."""


class SlurmLauncher:
    forgotten_after_s: float = 120.0

    def launch(self, cfg: Config, run_dir: Path) -> int:
        folder = run_dir / "slurm"
        script = batch_script(cfg, folder=folder, python=sys.executable)
        if cfg.launcher.dry_run:
            print(script, end="")
            return 0
        from rolloutpipe.launch.submitit_het import HetSlurmExecutor

        num_rollout_tasks = cfg.launcher.rollout.num_tasks
        num_tasks = num_rollout_tasks + cfg.launcher.trainer.num_tasks
        environ = submission_environ(run_vars(cfg, run_dir, secrets.token_bytes(32).hex()))
        job = HetSlurmExecutor(folder, script=script, num_tasks=num_tasks, environ=environ).submit(run_task)
        print(f"submitted het job {job.job_id}; task logs: {folder}/{job.job_id}_<task>_log.{{out,err}}", flush=True)
        try:
            # trainer rank 0 prints one line per step: echo it here, as the local launcher's terminal would
            state = self._wait(job, cfg.launcher.poll_s, follow=folder / f"{job.job_id}_{num_rollout_tasks}_log.out")
        except KeyboardInterrupt:
            job.cancel(check=False)
            print(f"interrupted: cancelled het job {job.job_id}", file=sys.stderr)
            return 130
        if state == "COMPLETED" and all(_result(job, t) == "success" for t in range(num_tasks)):
            return 0
        essential = [0, *range(num_rollout_tasks, num_tasks)]  # the rollout manager and the trainer ranks
        lost = [t for t in range(1, num_rollout_tasks) if _result(job, t) != "success"]
        if lost and all(_result(job, t) == "success" for t in essential):  # an engine host was lost mid-run
            print(f"the run finished (every step trained, final weights written; Slurm says het job {job.job_id} "
                  f"ended {state}): rollout ranks {lost} (engine hosts) were lost during the run and their engines "
                  "taken out of service.", file=sys.stderr)
            return 0
        components = job.watcher.get_info(job.job_id, mode="cache").get("HetStates", "")
        how = "was cancelled" if state == "CANCELLED" else f"ended {state}"
        print(f"run failed: het job {job.job_id} {how} (het groups: {components or 'unknown'}).", file=sys.stderr)
        for task in range(num_tasks if state != "CANCELLED" else 0):  # after scancel, every task just got killed
            o = _outcome(job, task, num_rollout_tasks)
            if not o.ok:
                said = "".join(f"\n    {line}" for line in o.said) or " (nothing)"
                print(f"  {o.label} {'failed' if o.ok is False else 'left no result'}; it said:{said}", file=sys.stderr)
        batch_out = folder / f"{job.job_id}_batch.out"
        srun_errors = [line for line in _read_lines(batch_out) if "error" in line.lower()][-5:]
        if srun_errors:
            print("  srun said:" + "".join(f"\n    {line}" for line in srun_errors), file=sys.stderr)
        return 1

    def _wait(self, job, poll_s: float, follow: Path) -> str:
        """COMPLETED as soon as every task returned, else the job's state once sacct says it is finished and squeue
        no longer lists it."""
        started, last_asked, last_state, followed, ran = time.monotonic(), float("-inf"), "", 0, False
        held_since: float | None = None
        while True:
            followed = _echo_new_lines(follow, followed)
            if all(_result(job, t) == "success" for t in range(job.num_tasks)):
                _echo_new_lines(follow, followed)
                return "COMPLETED"
            if time.monotonic() - last_asked >= poll_s:
                last_asked = time.monotonic()
                state = job.watcher.get_state(job.job_id, mode="force")
                if state != last_state and state in ("PENDING", "RUNNING"):
                    print(f"het job {job.job_id}: {state.lower()}", flush=True)
                if ran and state in ("REQUEUED", "PENDING"):  # no need to sit out Slurm's hold
                    if last_state not in ("REQUEUED", "PENDING"):
                        print(f"het job {job.job_id} was requeued: it resumes from the run's last checkpoint",
                              flush=True)
                    held_since = _release_requeued(job.job_id, held_since)
                ran = ran or state == "RUNNING"
                last_state = state
                # sacct reads slurmdbd, which lags the controller: a requeued job's last attempt reads FAILED there
                # until the next one starts. A job squeue still lists has not ended.
                if state not in UNFINISHED_STATES and not _queued(job.job_id):
                    return state
                too_long = time.monotonic() - started > self.forgotten_after_s
                if state == "UNKNOWN" and too_long and not _queued(job.job_id):
                    raise RuntimeError(
                        f"sacct does not know het job {job.job_id} and squeue no longer lists it: is accounting "
                        "(slurmdbd) enabled on this cluster? The launcher needs sacct to see a job end."
                    )
            time.sleep(1.0)


def _release_requeued(job_id: str, held_since: float | None) -> float | None:
    """A requeued job waits two minutes before it may start again (Slurm holds it with a begin time); the launcher,
    which watches it, lets it start sooner (launch/requeue.py: it resumes from the checkpoint). Called every poll
    while the job is requeued, with what the last call returned: when the hold was first seen, None if none was.

    Not at once: a node's slurmd refuses to launch a job in the second it revoked the job's credential (Slurm 22.05
    compares whole seconds: "Killing non-startable batch job: Job credential revoked"), and the requeued job then ends
    FAILED instead of resuming. The revocation comes with the requeue, which sets the hold, so the job is released
    REQUEUE_START_DELAY_S after its hold was seen, and again if Slurm sets the hold anew (an ``scontrol requeue`` from
    outside sets it when the job's tasks have stopped)."""
    if not _held(job_id):
        return None  # not pending yet, or released
    now = time.monotonic()
    if held_since is None:
        return now
    if now - held_since < REQUEUE_START_DELAY_S:
        return held_since
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
    return None


def _held(job_id: str) -> bool:
    """Whether a component of the pending job waits for its begin time (squeue's reason ``BeginTime``)."""
    listed = subprocess.run(["squeue", "-h", "-t", "PD", "-j", job_id, "-o", "%r"], capture_output=True, text=True)
    return listed.returncode == 0 and "BeginTime" in listed.stdout.split()


def _result(job, task: int) -> str | None:
    """``success`` or ``error`` once the task has written its result, else None."""
    from submitit.core.utils import pickle_load

    path = job.paths.folder / f"{job.job_id}_{task}_result.pkl"
    return pickle_load(path)[0] if path.exists() else None


def _outcome(job, task: int, num_rollout_tasks: int) -> TaskOutcome:
    role = "rollout" if task < num_rollout_tasks else "trainer"
    rank = task if task < num_rollout_tasks else task - num_rollout_tasks
    result = _result(job, task)
    lines = _read_lines(job.paths.folder / f"{job.job_id}_{task}_log.err")
    own = [line for line in lines if line.startswith(f"[{role} rank {rank}]")]
    return TaskOutcome(label=f"{role} rank {rank} (task {task})", ok=None if result is None else result == "success",
                       said=own[-1:] or lines[-6:])


def _echo_new_lines(path: Path, offset: int) -> int:
    """Print the lines completed in ``path`` since ``offset``; returns the new offset."""
    if not path.exists():
        return offset
    with path.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]
    lines = [line for line in complete.decode(errors="replace").splitlines(keepends=True)
             if not line.startswith("submitit ")]  # the job runner's own log lines
    if lines:
        sys.stdout.write("".join(lines))
        sys.stdout.flush()
    return offset + len(complete)


def _read_lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def _queued(job_id: str) -> bool:
    found = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"], capture_output=True, text=True)
    return found.returncode == 0 and bool(found.stdout.strip())


def run_task() -> None:
    """One task of the het-job step (pickled by reference; runs in the task's interpreter)."""
    from rolloutpipe.control.env import NodeEnv
    from rolloutpipe.launch import node

    env = NodeEnv.from_environ()  # who this task is, read before node.main takes the secret out of the environment
    code = node.main()
    if code == REQUEUE_EXIT:  # stopped at a checkpoint for the job's requeue: no result, the requeued job writes it
        raise SystemExit(code)
    if code != 0:
        raise RuntimeError(f"{env.role.value} rank {env.rank} exited with code {code}; its message is above.")


SBATCH_VARS_ENV = "RP_SBATCH_VARS"
"""Names the file launcher=sbatch writes the run's variables to, for slurm/rolloutpipe.sbatch to ``source``."""


def check_allocation(cfg: Config, environ: dict[str, str] | None = None) -> None:
    """kind=sbatch: the job running slurm/rolloutpipe.sbatch must have the shape the config needs."""
    environ = dict(os.environ if environ is None else environ)
    if "SLURM_HET_SIZE" not in environ or not environ.get(SBATCH_VARS_ENV):
        raise ConfigError(
            "launcher=sbatch runs inside slurm/rolloutpipe.sbatch, a heterogeneous job "
            "(sbatch slurm/rolloutpipe.sbatch [overrides]), which names the file for the run's variables in "
            f"{SBATCH_VARS_ENV}; to submit from here use launcher=slurm."
        )
    het_size = int(environ["SLURM_HET_SIZE"])
    tasks = [int(environ.get(f"SLURM_NTASKS_HET_GROUP_{k}", "1")) for k in range(het_size)]
    rollout_nodes = cfg.launcher.rollout.nodes
    if het_size != 2 or tasks[0] != rollout_nodes or tasks[1] != cfg.trainer.num_ranks:
        raise ConfigError(
            f"this job has {het_size} het groups with {tasks} tasks; the config needs 2: het group 0 with 1 task per "
            f"rollout node, launcher.rollout.nodes={rollout_nodes}, and het group 1 with trainer.num_ranks="
            f"{cfg.trainer.num_ranks} tasks. Edit the #SBATCH lines of slurm/rolloutpipe.sbatch (--nodes of the "
            "first group, nodes * ntasks-per-node of the second) or launcher.rollout.nodes and trainer.num_ranks."
        )
    num_nodes = int(environ.get("SLURM_JOB_NUM_NODES_HET_GROUP_0", tasks[0]))
    if num_nodes != tasks[0]:
        raise ConfigError(
            f"het group 0 has {tasks[0]} tasks on {num_nodes} nodes: one task per rollout node (each starts its "
            "node's engine servers); set --ntasks-per-node=1 in its #SBATCH lines."
        )


def write_sbatch_vars(cfg: Config, run_dir: Path) -> Path:
    """kind=sbatch: the run's directory, id (and store port) as ``export`` lines in the file slurm/rolloutpipe.sbatch
    names (``RP_SBATCH_VARS``), which it sources; a requeued job sources the same file again. A file, not stdout:
    Hydra's log handler writes there too, and a warning in an ``eval`` broke the script before srun."""
    run_vars = {"RP_RUN_DIR": str(run_dir), "RP_RUN_ID": str(cfg.run.id)}
    if cfg.launcher.store_port:
        run_vars["RP_STORE_PORT"] = str(cfg.launcher.store_port)
    path = Path(os.environ[SBATCH_VARS_ENV])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in run_vars.items()))
    tmp.rename(path)
    return path


def _task_main(folder: str) -> None:
    """Entry of each task: its own log files, then submitit's job runner.

    Not srun --output: in a het step srun's %j is the component's id and %t is not SLURM_PROCID.
    """
    name = f"{os.environ['SLURM_JOB_ID']}_{os.environ['SLURM_PROCID']}_log"
    for fd, suffix in ((1, "out"), (2, "err")):
        log = os.open(os.path.join(folder, f"{name}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, fd)
        os.close(log)
    from submitit.core.submission import process_job

    process_job(folder)


if __name__ == "__main__":
    _task_main(sys.argv[1])
