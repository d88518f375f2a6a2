"""A rollout node group on several nodes (rollout/engines/hosts.py), as local processes standing in for nodes: every
rollout rank starts and registers its node's engine servers, the manager drives them all, and losing an engine
host loses no sample. (The same on the Slurm cluster, through every launcher: tests/cluster/test_slurm.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    final_weights,
    four_engine_workload,
    node_environ,
    read_metrics,
    run_job,
    samples,
    wait_for,
)

pytestmark = pytest.mark.multiprocess

NUM_STEPS, PROMPTS_PER_STEP = 3, 4
TWO_NODES = ["launcher.rollout.nodes=2", "rollout.engines_per_node=2"]


def workload(data: Path) -> list[str]:
    return [*four_engine_workload(data), "pipeline.peer_timeout_s=4"]


def request_spans(run_dir: Path) -> list[dict]:
    lines = (run_dir / "spans" / "rollout-0.jsonl").read_text().splitlines()
    return [s for line in lines if "spans" in (record := json.loads(line)) for s in record["spans"]]


def test_two_rollout_nodes_under_fgd_give_the_samples_and_weights_of_one_node_with_all_four_engines(
        tmp_path, four_engine_data, one_rollout_node):
    """With distributed weight sync: trainer rank 0's broadcast group spans the engines of both nodes. (Disk weight
    sync across nodes: tests/cluster/test_slurm_hosts.py, through every Slurm launcher.) One FGD admission over the
    engines of both hosts (4 engines x rollout.concurrency=2 slots; a group's 4 samples go to one engine): each step
    starts the first training batch's two groups at once and holds the other two on the rollout node until a request
    of the step has finished (FIFO would start all four at once), and both hosts' engines generate. The reference
    (one node) runs FIFO: the samples do not depend on the admission order."""
    run_dir, data, one_node = tmp_path / "run", four_engine_data, one_rollout_node
    result = run_job(run_dir, *workload(data), *TWO_NODES, "pipeline.weight_sync=distributed",
                     "rollout.admission=fgd")
    assert result.returncode == 0, result.stderr[-3000:]
    for step in range(NUM_STEPS):
        requests = [s for s in request_spans(run_dir) if s[0] == "rollout/request" and s[1] == step]
        first_end = min(s[3] for s in requests)
        start = {g: min(s[2] for s in requests if s[4]["group"] == g) for g in range(PROMPTS_PER_STEP)}
        assert start[0] < first_end and start[1] < first_end, "the frontier groups start at once"
        assert start[2] >= first_end and start[3] >= first_end, "the next batch's groups wait for a free slot"
        assert {s[4]["host"].split(" (")[0] for s in requests} == {"rollout rank 0", "rollout rank 1"}
    hosts = {s[4]["engine"]: s[4]["host"] for s in request_spans(run_dir) if s[0] == "rollout/request"}
    assert set(hosts) == {"engine0", "engine1", "engine2", "engine3"}, "every engine of both nodes generated"
    assert [hosts[f"engine{i}"].split(" (")[0] for i in range(4)] == ["rollout rank 0"] * 2 + ["rollout rank 1"] * 2
    assert "[rollout rank 0] 4 engines on 2 hosts: rollout rank 0 (" in result.stderr
    assert {(m["rollout/num_engines"], m["rollout/num_engine_hosts"]) for m in read_metrics(run_dir)} == {(4, 2)}
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    processes = [e["args"]["name"] for e in trace if e.get("name") == "process_name"]
    assert [p for p in processes if p.startswith("engine")] == [f"engine{i} on {hosts[f'engine{i}']}" for i in range(4)]
    assert sorted(p.name for p in (run_dir / "engines" / "host=1").glob("*.log")) == ["engine2.log", "engine3.log"]
    assert samples(run_dir) == samples(one_node) and len(samples(run_dir)) == NUM_STEPS * PROMPTS_PER_STEP * 4
    reference, final = final_weights(one_node), final_weights(run_dir)
    assert max((final[k] - reference[k]).abs().max().item() for k in final) < 1e-9


def host_pid(run_id: str, rank: int) -> int | None:
    """The pid of rollout rank ``rank`` of run ``run_id`` (its environment says who it is)."""
    for proc in Path("/proc").iterdir():
        try:
            pairs = (proc / "environ").read_text(errors="replace").split("\0")
        except OSError:
            continue
        environ = dict(v.split("=", 1) for v in pairs if "=" in v)
        if (environ.get("RP_RUN_ID"), environ.get("RP_ROLE"), environ.get("RP_RANK")) == (run_id, "rollout", str(rank)):
            return int(proc.name)
    return None


SLOW_STEPS = ["reward.name=letter_fraction_waiting"]
"""letter_fraction's rewards (the same samples and update as the reference), each after RP_TEST_REWARD_SLEEP_S=0.3 s:
one reward worker, 16 samples, at least 4.8 s a step, so the two steps after the loss outlast pipeline.peer_timeout_s
(4 s) and the host is declared lost while the run still needs its engines."""


def test_an_engine_host_stopped_by_sigterm_is_lost_as_a_killed_one_and_the_run_matches_the_one_node_run(
        tmp_path, four_engine_data, one_rollout_node):
    """Stopped by SIGTERM (a drained node, a signalled task), an engine host stops its servers and exits 143 without
    aborting the run, as if killed: its engines fail, their requests go elsewhere, the host is declared lost and its
    engines retired (it never beats again), and no sample is lost. (Killed outright: its whole node taken away on the
    Slurm cluster, tests/cluster/test_slurm_hosts.py; a host that beats again: below.)"""
    run_dir, data, one_node = tmp_path / "run", four_engine_data, one_rollout_node
    run_dir.mkdir()
    launcher = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", "run.id=lose-host",
                                 *workload(data), *TWO_NODES, *SLOW_STEPS], cwd=tmp_path,
                                env={**node_environ(), "RP_TEST_REWARD_SLEEP_S": "0.3"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), "step 0 to finish", running=[launcher],
                 details=lambda: launcher.communicate()[1][-3000:])
        pid = host_pid("lose-host", 1)
        assert pid is not None, "rollout rank 1 is not running"
        os.kill(pid, signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    assert ("rollout rank 1 (engine host) ended with exit code 143 (stopped by SIGTERM); the rollout manager takes its "
            "engines") in stderr
    for engine in ("engine2", "engine3"):  # noticed at its next request, then retired once the host is lost
        assert f"engine {engine} failed" in stderr and f"{engine}.log" in stderr, stderr[-3000:]
        assert (f"engine {engine} is out of service until its host beats again: its engine host (rollout rank 1) "
                "is lost") in stderr, stderr[-3000:]
    lost = [s for s in request_spans(run_dir) if s[0] == "rollout/engine_lost"]
    assert sorted(s[4]["engine"] for s in lost) == ["engine2", "engine3"], lost
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS))
    assert metrics[-1]["rollout/num_engines"] == 2 and metrics[-1]["rollout/num_engine_hosts"] == 1
    assert samples(run_dir) == samples(one_node), "every sample of every step exactly once, and the same ones"
    reference, final = final_weights(one_node), final_weights(run_dir)
    assert max((final[k] - reference[k]).abs().max().item() for k in final) < 1e-9


GATED = ["reward.name=letter_fraction_gated", "reward.num_workers=1", "reward.timeout_s=600"]
"""letter_fraction's rewards (the same samples and update as the reference); with RP_TEST_REWARD_GATE set, those past
step 0's 16 samples wait until the test opens the gate: step 1 cannot end, nor step 2 start, before the test has seen
what it waits for. (reward.timeout_s: the wait is not a slow reward.)"""


def test_a_host_whose_heart_beat_stalled_is_used_again_once_it_beats(tmp_path, four_engine_data, one_rollout_node):
    """Rollout rank 1 is paused (SIGSTOP) after step 0, for longer than pipeline.peer_timeout_s: declared lost, its
    engines are retired and their step-1 requests generated elsewhere. Resumed (SIGCONT), it beats again, handles the
    restart requests it missed and registers fresh engines, which come back into service with the current policy and
    generate again; the samples and weights are those of the one-node run without the pause (the same samples on any
    number of nodes: the first test of this module). The run is held at step 1's rewards until both engines are back,
    so step 2 places its groups round robin over all four engines."""
    data, reference = four_engine_data, one_rollout_node
    overrides = [*workload(data), *TWO_NODES, *GATED, "run.id=stall-host"]
    run_dir, log, gate = tmp_path / "run", tmp_path / "launcher.err", tmp_path / "gate"
    run_dir.mkdir()
    with log.open("w") as err:
        launcher = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *overrides],
                                    cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                    env={**node_environ(), "RP_TEST_REWARD_GATE": str(gate),
                                         "RP_TEST_REWARD_GATE_AFTER": str(PROMPTS_PER_STEP * 4)})
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), "step 0 to finish", running=[launcher],
                 details=lambda: log.read_text()[-3000:])
        pid = host_pid("stall-host", 1)
        assert pid is not None, "rollout rank 1 is not running"
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: log.read_text().count("is out of service until its host beats again") == 2,
                     "both engines of rollout rank 1 retired", running=[launcher], timeout_s=120,
                     details=lambda: log.read_text()[-3000:])
        finally:
            os.kill(pid, signal.SIGCONT)
        back = [f"engine {e} restarted as {e}-restart1" for e in ("engine2", "engine3")]
        wait_for(lambda: all(line in log.read_text() for line in back),
                 "both engines of rollout rank 1 back in service", running=[launcher],
                 details=lambda: log.read_text()[-3000:])
        assert len(read_metrics(run_dir)) <= 1, "step 1 waits for the gate"
        gate.touch()
        launcher.wait(timeout=300)
    finally:
        gate.touch()
        if launcher.poll() is None:
            launcher.kill()
    stderr = log.read_text()
    assert launcher.returncode == 0, stderr[-3000:]
    for engine in ("engine2", "engine3"):
        assert f"engine {engine}: its host beats again and registered {engine}-restart1" in stderr, stderr[-3000:]
    served = {s[4]["engine"] for s in request_spans(run_dir) if s[0] == "rollout/request" and s[1] >= 2}
    assert {"engine2-restart1", "engine3-restart1"} <= served, "back in service, and generating"
    assert read_metrics(run_dir)[-1]["rollout/num_engines"] == 4
    assert samples(run_dir) == samples(reference), "every sample once, and the same ones"
    expected, final = final_weights(reference), final_weights(run_dir)
    assert max((final[k] - expected[k]).abs().max().item() for k in final) < 1e-9


def server_pid(run_dir: Path, engine: str) -> int | None:
    """The pid of the embedded engine server ``engine`` of the run (its port file names it on the command line)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "http_server" in cmdline and f"{run_dir}/engines/host=1/{engine}.port" in cmdline:
            return int(proc.name)
    return None


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_an_engine_server_killed_on_another_node_is_restarted_by_its_host(tmp_path, four_engine_data,
                                                                          one_rollout_node, weight_sync):
    """Under distributed weight sync the next policy goes to a weight-update group without the killed engine, and
    its replacement joins a later one (supervisor.py)."""
    run_dir, data, one_node = tmp_path / "run", four_engine_data, one_rollout_node
    run_dir.mkdir()
    launcher = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *workload(data),
                                 *TWO_NODES, f"pipeline.weight_sync={weight_sync}"], cwd=tmp_path,
                                env=node_environ(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), "step 0 to finish", running=[launcher],
                 details=lambda: launcher.communicate()[1][-3000:])
        pid = server_pid(run_dir, "engine3")
        assert pid is not None, "engine3's server (rollout rank 1) is not running"
        os.kill(pid, signal.SIGKILL)  # its host lives on, and restarts it when the manager asks
        _, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    assert "engine engine3: its node's engine host restarts it as engine3-restart1" in stderr, stderr[-3000:]
    assert "rollout rank 1: restarting engine engine3 as engine3-restart1 (the rollout manager asked)" in stderr
    assert (run_dir / "engines" / "host=1" / "engine3-restart1.log").exists(), "restarted on its own node"
    assert "did not confirm the stop" not in stderr, "the host finished its restart and stopped with the run"
    if weight_sync == "distributed":
        assert "goes to a new weight-update group of 3 engine ranks" in stderr, stderr[-3000:]
    # (whether the restarted engine is back before the run's last step depends on its start-up time against the
    # steps left; putting it back is checked with fake engines in tests/unit/test_engine_hosts.py)
    assert samples(run_dir) == samples(one_node)
    reference, final = final_weights(one_node), final_weights(run_dir)
    assert max((final[k] - reference[k]).abs().max().item() for k in final) < 1e-9
