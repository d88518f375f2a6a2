"""Stop and continue the way Slurm does, on the real cluster (slurm/local_cluster.sh), through ``launcher=slurm``: a
job past its time limit is warned, stops at a checkpoint, requeues itself and resumes; an ``scontrol requeue`` from
outside (standing in for a preemption) resumes the same way; both end with the weights of an uninterrupted run
(float64), every step trained once. ``scancel`` leaves no process of the run on any node."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import SMALL, read_metrics, read_samples, run_job, wait_for
from tests.helpers.slurm import job_id_of, launch, sacct_components, stop_if_running, task_process


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

TIME_LIMIT_STEPS = 12
LONG_STEPS = {"RP_TEST_REWARD_SLEEP_UNTIL_REQUEUED_S": "1.5"}
"""Until the job is requeued, each reward waits 1.5 s (one reward worker, 16 samples a step: at least 24 s a step),
longer than the 20 s trainer rank 0 gives the step in progress after Slurm's warning (launcher.requeue_grace_s=40
minus two margins of 10 s): the warning lands in a step that cannot end in time, as with GPU steps of minutes, and
the first start cannot finish 12 steps within its 3 minutes. The last margin leaves every task the time to stop, so
srun ends (137: the killed engine host) before the wrapper would requeue at the margin, and the decision is the
outcome's. (With a grace of 30 s, margins of 7.5 s: the tasks took 5.1 to 6.6 s to stop on a loaded machine, and
once in CI more.) The requeued start runs without the wait; the uninterrupted reference too (the same rewards, the
same update)."""
SLOW = {"RP_TEST_REWARD_SLEEP_UNTIL_REQUEUED_S": "0.3"}
"""With it, the preempted run's first start cannot end before the test requeues it (30 steps of at least 4.8 s, at
least 2 minutes; the requeue comes after 5). The requeued start runs without the wait."""
PREEMPTED_STEPS = 30


def workload(num_steps: int) -> list[str]:
    return [*SMALL, "model.dtype=float64", f"num_rollout={num_steps}", "run.checkpoint_every=100",
            "pipeline.peer_timeout_s=10", "wandb.mode=disabled", "reward.name=letter_fraction_waiting",
            "reward.import_modules=[tests.fixtures.dense_rewards]", "eval.interval=0", "run.save_samples=true"]


HOSTS = ["rollout.engine=embedded_http", "launcher.rollout.nodes=2", "rollout.engines_per_node=1",
         "trainer.num_ranks=2", "global_batch_size=8"]
"""Two rollout nodes (one engine each) and two trainer ranks, two optimizer steps per RL step."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights and samples of an uninterrupted (local) run of ``workload(num_steps)`` (and more)."""
    done: dict[tuple, Path] = {}

    def run(num_steps: int, *more: str) -> Path:
        if (num_steps, *more) not in done:
            run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
            result = run_job(run_dir, *workload(num_steps), *more, timeout_s=600)
            assert result.returncode == 0, result.stderr[-3000:]
            done[(num_steps, *more)] = run_dir
        return done[(num_steps, *more)]

    return run


def assert_resumed_to_the_uninterrupted_run(run_dir: Path, reference: Path, num_steps: int, echoed: str) -> list[dict]:
    """Every step once across the requeues, none finished twice (trainer rank 0 prints a step's line when it
    finishes, and the launcher echoes every start's), and the samples and weights of the uninterrupted run."""
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(num_steps)), "every step once, across the requeues"
    finished = re.findall(rf"^step (\d+)/{num_steps} ", echoed, flags=re.M)
    assert sorted(map(int, finished)) == list(range(1, num_steps + 1)), "no finished step redone"
    assert [(s["id"], s["response_ids"]) for s in read_samples(run_dir)] == [
        (s["id"], s["response_ids"]) for s in read_samples(reference)]
    final, expected = (load_file(str(d / "checkpoints" / "final" / "model.safetensors")) for d in (run_dir, reference))
    assert max((final[k] - expected[k]).abs().max().item() for k in final) < 1e-9
    return metrics


@pytest.mark.timeout(900)  # two starts of a 3-minute job
def test_a_job_warned_in_a_long_step_requeues_itself_keeping_every_finished_step(job_dir, uninterrupted):
    """launcher=slurm, two rollout nodes and two trainer ranks; an engine host's task is SIGKILLed after step 0 (srun
    then exits 137 however the run ends). Warned of the 3-minute time limit in a step longer than the grace period,
    trainer rank 0 writes the last finished step's checkpoint at once and drops the step in progress (or stops after
    it, when the warning came in its last seconds);
    the wrapper requeues the job because the run's sealed outcome says it stopped for it; the requeued job continues
    after the last finished step and ends with every step trained once and the uninterrupted run's weights."""
    run_dir = job_dir("time-limit")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    overrides = [*workload(TIME_LIMIT_STEPS), *HOSTS, "run.id=time-limit", "launcher.trainer.nodes=2",
                 "launcher.rollout.cpus_per_task=1", "launcher.trainer.cpus_per_task=1", "launcher.time_min=3",
                 "launcher.requeue_grace_s=40", "launcher.max_requeues=3"]
    launcher = launch(run_dir, *overrides, wait=False, environ=LONG_STEPS, stdout=True)
    try:
        wait_for((run_dir / "metrics.jsonl").exists, "step 0", running=[launcher], timeout_s=240)
        pid, _ = task_process(run_id="time-limit", proc_id=1)  # task 1 = rollout rank 1, an engine host
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=840)
    finally:
        stop_if_running(launcher, run_dir)
    assert launcher.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "was requeued: it resumes from the run's last checkpoint" in stdout
    job_id = job_id_of(run_dir)
    batch = (run_dir / "slurm" / f"{job_id}_batch.out").read_text()
    assert "[requeue] Slurm warned of the time limit" in batch and "[requeue] requeueing job" in batch, batch
    assert "did not end before the time limit's margin" not in batch, "srun ended: the outcome decides"
    trainer = (run_dir / "slurm" / f"{job_id}_2_log.err").read_text()  # task 2: trainer rank 0
    assert re.search(r"Slurm warned of the time limit \d+s before it read the record: step \d+'s checkpoint is "
                     r"written", trainer), trainer[-3000:]
    # (the warning may land in a step's last seconds, and that step then ends in time: both ways keep every step)
    metrics = assert_resumed_to_the_uninterrupted_run(
        run_dir, uninterrupted(TIME_LIMIT_STEPS, *HOSTS), TIME_LIMIT_STEPS, stdout)
    assert metrics[0]["run/requeues"] == 0 and metrics[-1]["run/requeues"] == 1
    assert any(m["rollout/num_engines"] == 1 for m in metrics if m["run/requeues"] == 0), "engine host 1 was lost"
    [(component, state, _), *_] = sacct_components(job_id)
    assert state == "COMPLETED", (component, state)


@pytest.mark.timeout(900)  # the local reference (30 steps), then two starts of the job
def test_scontrol_requeue_from_outside_mid_step_resumes_to_the_uninterrupted_weights(job_dir, uninterrupted):
    """Slurm's own requeue (a preemption): SIGTERM mid-step, then the job starts again. Trainer rank 0 writes the last
    finished step's checkpoint as it stops (none is due: run.checkpoint_every=100), so no finished step is redone."""
    run_dir = job_dir("preempted")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launcher = launch(run_dir, *workload(PREEMPTED_STEPS), wait=False, environ=SLOW, stdout=True)  # cannot end first
    try:
        job_id = job_id_of(run_dir)
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 5, "5 steps",
                 running=[launcher], timeout_s=300)
        subprocess.run(["scontrol", "requeue", str(job_id)], check=True)  # as a preemption with PreemptMode=REQUEUE
        stdout, stderr = launcher.communicate(timeout=600)
    finally:
        stop_if_running(launcher, run_dir)
    assert launcher.returncode == 0, stderr[-3000:]
    metrics = assert_resumed_to_the_uninterrupted_run(run_dir, uninterrupted(PREEMPTED_STEPS), PREEMPTED_STEPS, stdout)
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
