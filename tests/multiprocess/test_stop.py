"""Every process the run starts stops with it: a stop signal to ``python launch.py`` (a scheduler's SIGTERM, a
terminal's Ctrl-C) or to a node process leaves no engine server, reward worker or trainer rank behind, the
output says how to resume, and the printed resume command finishes the run."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.control.lifetime import stop_groups
from tests.conftest import REPO, SMALL, node_environ, read_metrics, wait_for

NUM_STEPS = 5
GRACE_S = 10
WORKLOAD = [*SMALL, f"num_rollout={NUM_STEPS}", "rollout.engine=embedded_http", "trainer.num_ranks=2",
            "run.checkpoint_every=1", f"launcher.stop_grace_s={GRACE_S}", "reward.name=letter_fraction_waiting",
            "reward.import_modules=[tests.fixtures.dense_rewards]"]
SLOW = {"RP_TEST_REWARD_SLEEP_S": "0.2"}
"""The stopped run's rewards wait 0.2 s each (one reward worker, 16 samples a step): the steps after step 0's
checkpoint take at least 9.6 s, so the signal, sent as soon as that checkpoint is seen, comes before the run can end
on any machine (without it a fast machine finished the run, final checkpoint and all, as the signal arrived). The
printed resume command runs without the wait."""


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    start_ticks: int
    """With the pid, names one process: a pid can be reused, the pair cannot."""
    cmdline: str


def processes() -> dict[int, Proc]:
    """Every process on the machine, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
        if fields[0] == "Z":  # a zombie holds nothing but its pid
            continue
        found[int(entry.name)] = Proc(pid=int(entry.name), ppid=int(fields[1]), pgid=int(fields[2]),
                                      sid=int(fields[3]), start_ticks=int(fields[19]), cmdline=cmdline)
    return found


def descendants(root: int) -> list[Proc]:
    table = processes()
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [p for p in table.values() if p.ppid == parent]
        found += children
        frontier += [c.pid for c in children]
    return found


def leftovers(run: list[Proc], run_dir: Path) -> list[Proc]:
    """Processes still alive that belong to the run: one seen in it, one in a session or process group of it, or
    one whose command line names the run directory."""
    seen = {(p.pid, p.start_ticks) for p in run}
    sessions, groups = {p.sid for p in run}, {p.pgid for p in run}
    return [p for p in processes().values() if (p.pid, p.start_ticks) in seen or p.sid in sessions
            or p.pgid in groups or str(run_dir) in p.cmdline]


ROLLOUT_STOPPED = "[rollout rank 0] stopped by SIGTERM, and so were its engine servers and reward workers"

# (whom the signal goes to, the signal, the launcher's exit code, what the output says, whether the test runs the
# printed resume command: every stop prints the same one, run after a cleaned-up stop and after one without cleanup)
STOPS = [  # a scheduler or `kill` (SIGTERM); Ctrl-C (the terminal signals the launcher's foreground group)
    ("launcher", signal.SIGTERM, 128 + signal.SIGTERM, ["stopped by SIGTERM: rollout rank 0 exited", ROLLOUT_STOPPED],
     True),
    ("terminal", signal.SIGINT, 128 + signal.SIGINT, ["stopped by SIGINT: rollout rank 0 exited", ROLLOUT_STOPPED],
     False),
    # one node process: the run fails, and stops the same way
    ("rollout_node", signal.SIGTERM, 1, ["run failed: rollout rank 0 exited with exit code 143", ROLLOUT_STOPPED],
     False),
    # killed outright, it runs no cleanup: its engine server dies with it (PR_SET_PDEATHSIG)
    ("rollout_node", signal.SIGKILL, 1, ["run failed: rollout rank 0 exited with signal SIGKILL"], True),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("target,signum,exit_code,said,resume", STOPS, ids=[f"{s[1].name}-to-{s[0]}" for s in STOPS])
def test_a_stopped_run_leaves_no_process_behind_and_the_printed_command_resumes_it(
        tmp_path, target, signum, exit_code, said, resume):
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launcher.log"
    with log_path.open("w") as log:  # its own session, like a shell's job: nothing of the run is in pytest's
        launcher = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *WORKLOAD],
                                    cwd=tmp_path, env={**node_environ(), **SLOW}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    run: list[Proc] = []
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step=0").exists(), "checkpoint of step 0", running=[launcher])
        run = descendants(launcher.pid)  # mid-run: step 0 is trained and saved, step 1 is being generated
        server = [p for p in run if "rolloutpipe.rollout.engines.http_server" in p.cmdline]
        nodes = [p for p in run if "rolloutpipe.launch.node" in p.cmdline]
        assert len(server) == 1 and len(nodes) == 3, [p.cmdline for p in run]  # rollout + 2 trainer ranks
        assert any("multiprocessing" in p.cmdline for p in run), "no reward worker seen"
        run.append(processes()[launcher.pid])

        if target == "launcher":
            os.kill(launcher.pid, signum)
        elif target == "terminal":
            os.killpg(launcher.pid, signum)
        else:
            os.kill(next(p.pid for p in nodes if p.pid == server[0].ppid), signum)
        assert launcher.wait(timeout=300) == exit_code, log_path.read_text()[-3000:]
        wait_for(lambda: not leftovers(run, run_dir), "end of every process of the run", timeout_s=GRACE_S)
    finally:  # whatever the outcome, nothing of this run outlives the test
        for p in leftovers(run + descendants(launcher.pid), run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        launcher.wait()
    output = log_path.read_text()
    for line in said:
        assert line in output, output[-3000:]
    assert not (run_dir / "checkpoints" / "final").exists()

    printed = re.findall(r"^to resume from the last checkpoint: (.+)$", output, flags=re.MULTILINE)
    assert len(printed) == 1, output[-3000:]
    command = shlex.split(printed[0])
    assert command[:2] == ["python", str(REPO / "launch.py")] and command[-2:] == [f"run.dir={run_dir}",
                                                                                    "run.resume=auto"], command
    assert command[2:-2] == WORKLOAD, "the same overrides"
    if not resume:
        return
    resumed = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=node_environ(), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS))
    assert (run_dir / "checkpoints" / "final").exists()


def test_stopping_a_group_reaches_the_member_that_outlives_its_leader_and_kills_one_that_ignores_sigterm(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    ignore_sigterm = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      f"open({str(pid_file) + '.tmp'!r}, 'w').write(str(os.getpid())); "
                      f"os.rename({str(pid_file) + '.tmp'!r}, {str(pid_file)!r}); time.sleep(600)")
    spawn = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {ignore_sigterm!r}]); " \
            "time.sleep(600)"
    # the leader exits on SIGTERM; its child, in its group, ignores SIGTERM and outlives it
    leader = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"],
                                start_new_session=True, stdout=subprocess.PIPE)
    try:
        stubborn.stdout.readline()  # its handler is in place
        wait_for(pid_file.exists, "grandchild's handler")
        grandchild = int(pid_file.read_text())

        assert stop_groups([leader, stubborn], grace_s=1.0) == [False, True]
        assert (leader.returncode, stubborn.returncode) == (-signal.SIGTERM, -signal.SIGKILL)
        wait_for(lambda: grandchild not in processes(), "end of the grandchild", timeout_s=10)
    finally:
        for group in (leader.pid, stubborn.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def test_the_stop_grace_period_is_checked_at_the_edge():
    with pytest.raises(ConfigError, match="launcher.stop_grace_s=0"):
        load_config(OmegaConf.from_dotlist(["launcher.stop_grace_s=0"]))
