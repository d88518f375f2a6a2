"""The batch script's side of a requeue: ``python -m rolloutpipe.launch.requeue -- srun ...``.

Both batch scripts (the one ``launcher=slurm`` writes, and slurm/rolloutpipe.sbatch) ask Slurm for a warning before
the time limit (``#SBATCH --signal=B:USR1@<launcher.requeue_grace_s>``: to the batch shell only, whose ``trap``
notes one that comes early), mark the job requeueable (``#SBATCH --requeue``), and ``exec`` this wrapper around
the one ``srun`` step. What happens then:

    USR1 (the warning)      a sealed ``requeue`` record in the run's store (on the first rollout node, where the
                            batch script runs; retried until the store is up), never a signal to the tasks (one
                            that came before a task set its handler would kill it): trainer rank 0 writes the last
                            finished step's checkpoint at once, then stops the run after the step in progress and
                            its checkpoint, or drops that step if it cannot end in time (trainer/node.py); every
                            task then exits REQUEUE_EXIT
    the step ends           the decision comes from the attempt's sealed outcome (control/attempt.py), not from
                            srun's exit code (the highest of every task's: 137 for an engine host lost earlier):
                            stopped to be requeued (warned, or a process of the run died without a word: the
                            rollout manager's node lost, which Slurm does not requeue itself under --no-kill):
                            ``scontrol requeue <job>`` while SLURM_RESTART_COUNT < launcher.max_requeues, else a
                            line that says how to resume by hand; finished: exit 0 (the job is COMPLETED, whatever
                            an engine host's task returned); anything else failed: no requeue, srun's code
    one margin before the   the step has not ended (a hung task): requeue anyway; Slurm stops what is left
    time limit
    SIGTERM, SIGINT         (scancel, a preemption, an ``scontrol requeue`` from outside) forwarded to srun; Slurm's
                            own requeue, if any, restarts the job

A requeued job runs its batch script again with the same job id, run id and directory: its tasks see
SLURM_RESTART_COUNT > 0 and resume from the last checkpoint (pipeline.run_node), with the store and the engines
started afresh. A run whose config cannot resume (``requeueable``) is not requeued.
"""

from __future__ import annotations

import signal
import time

_early: list[float] = []
signal.signal(signal.SIGUSR1, lambda signum, frame: _early.append(time.monotonic()))  # first: this process replaced
# the batch shell (exec), whose trap is gone, and USR1's default action ends a process

import argparse  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from rolloutpipe.control.attempt import read_outcome  # noqa: E402
from rolloutpipe.control.env import attempt_key  # noqa: E402
from rolloutpipe.control.lifetime import requeue_margin_s  # noqa: E402

WARNED_ENV = "RP_SLURM_WARNED"
"""Set by the batch script's ``trap`` when Slurm's warning came before this wrapper started."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    grace_s, max_requeues = requeue_settings(Path(os.environ["RP_RUN_DIR"]) / "config.yaml")
    job_id, restarts = os.environ.get("SLURM_JOB_ID"), int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    key = attempt_key(bytes.fromhex(os.environ["RP_RUN_SECRET"]), os.environ["RP_RUN_ID"], restarts)
    warned_s: list[float] = []

    def warned() -> None:
        if warned_s:
            return
        warned_s.append(time.monotonic())
        say(f"Slurm warned of the time limit (launcher.requeue_grace_s={grace_s}): the run stops at its next "
            f"checkpoint, then the job is requeued (requeue {restarts + 1} of launcher.max_requeues={max_requeues})")
        threading.Thread(target=ask_to_stop, args=(step, key, warned_s[0]), name="ask-to-stop", daemon=True).start()

    stopped: list[int] = []  # SIGTERM or SIGINT from outside: Slurm (a preemption) or the user decides, never us

    def on_signal(signum, frame) -> None:
        if signum == signal.SIGUSR1:
            warned()
            return
        stopped.append(signum)
        if step.poll() is None:
            step.send_signal(signum)

    step = subprocess.Popen(command)  # (a warning meanwhile lands in _early)
    for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    if _early or os.environ.get(WARNED_ENV):
        warned()
    while step.poll() is None:
        if warned_s and time.monotonic() > warned_s[0] + grace_s - requeue_margin_s(grace_s):
            say("the step did not end before the time limit's margin; requeueing now")
            break
        time.sleep(0.2)
    code = step.poll()
    if warned_s and code is not None:
        say(f"the step ended {time.monotonic() - warned_s[0]:.1f} s after the warning (the wrapper would requeue "
            f"at {grace_s - requeue_margin_s(grace_s):.1f} s)")
    outcome = None if code is None else read_outcome(Path(os.environ["RP_RUN_DIR"]), key, restarts)
    if outcome is not None and outcome.finished:
        if code != 0:
            say(f"the run finished (every step trained, the final policy written); srun's exit code {code} is a task "
                "the run survived losing (an engine host): the job ends as completed")
        return 0
    if code is not None and (outcome is None or not outcome.requeue or stopped):
        if warned_s:
            say(f"not requeued: the run did not stop for the requeue ("
                f"{outcome.reason if outcome is not None else 'trainer rank 0 wrote no outcome'}); see the tasks' "
                "logs, then continue it with run.resume=auto and the same run.dir")
        return code  # (not warned: failed, or stopped from outside: Slurm's own requeue, if any)
    if restarts >= max_requeues or job_id is None:
        say(f"not requeued: the job was requeued {restarts} times, launcher.max_requeues={max_requeues}. The run "
            "stopped at its last checkpoint; continue it with run.resume=auto and the same run.dir")
        return step.wait() if code is None else code
    why = "" if warned_s else f" (the run stopped: {outcome.reason})"
    say(f"requeueing job {job_id}{why}: it resumes from the run's last checkpoint")
    subprocess.run(["scontrol", "requeue", job_id], check=False)
    return step.wait() if code is None else code


def ask_to_stop(step: subprocess.Popen, key: bytes, warned_s: float) -> None:
    """Put the ``requeue`` record, sealed with the attempt's ``key``, into the run's store, trying until it is up or
    the step has ended. It says how long ago the warning came (``warned_s``, this process's monotonic clock), so
    trainer rank 0 counts the grace period from the warning, not from reading the record: a slow start of this
    process, a store not up yet or a loaded machine do not eat the margin the tasks have to stop in."""
    from rolloutpipe.control.env import expand_hostlist, slurm_store_port
    from rolloutpipe.control.transport import StoreAddress, Transport

    host = expand_hostlist(os.environ["SLURM_JOB_NODELIST_HET_GROUP_0"])[0]
    port = int(os.environ.get("RP_STORE_PORT") or slurm_store_port(int(os.environ["SLURM_JOB_ID"])))
    while step.poll() is None:
        try:
            transport = Transport.open(
                address=StoreAddress(host=host, port=port, hosted_by="rollout rank 0"), is_host=False,
                run_id=os.environ["RP_RUN_ID"], secret=key,
                run_dir=Path(os.environ["RP_RUN_DIR"]), connect_timeout_s=5.0)
            transport.put_record(transport.key("requeue"),
                                 {"requested": True, "warned_s_ago": time.monotonic() - warned_s})
            return
        except Exception as err:  # noqa: BLE001 - the store is not up yet (or already gone): try again
            say(f"the run's store at {host}:{port} does not answer yet ({type(err).__name__}); trying again")
            time.sleep(2.0)


def requeue_settings(config_yaml: Path) -> tuple[int, int]:
    """``launcher.requeue_grace_s`` and ``launcher.max_requeues`` of the run (0 requeues if it cannot resume)."""
    from rolloutpipe.config import read_config

    cfg = read_config(config_yaml)
    return cfg.launcher.requeue_grace_s, cfg.launcher.max_requeues if requeueable(cfg) is None else 0


def requeueable(cfg) -> str | None:
    """Why this run cannot be requeued (resumed from a checkpoint), or None: what ``Config.check_resumable`` refuses,
    which every requeued attempt checks too (pipeline.run_node)."""
    try:
        cfg.check_resumable()
    except ValueError as err:
        return str(err)
    return None


def say(line: str) -> None:
    print(f"[requeue] {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
