"""Two rollout nodes on the real Slurm cluster (slurm/local_cluster.sh), through every launcher: each rollout node's
task starts and registers its own two engine servers, the first one drives all four, and two trainer ranks train
on two more nodes. The samples and the (float64) final weights equal those of one rollout node running the four
engines (a local run: the reference). These are also the submitit and TorchX launchers' runs to completion; the
shipped batch script's own run is in test_slurm.py. The submitit run trains with FSDP (its update equals the torch
backend's to rounding: tests/multiprocess/test_fsdp.py) and resumes from its sharded checkpoint onto one trainer
node."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rolloutpipe.control.env import expand_hostlist
from tests.conftest import REPO, four_engine_workload, node_environ, read_metrics, read_samples, wait_for
from tests.helpers.slurm import job_id_of, launch, sacct_components, stop_if_running, task_process

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

NUM_STEPS = 3
TWO_NODES = ["launcher.rollout.nodes=2", "rollout.engines_per_node=2"]


def workload(data: Path) -> list[str]:
    return [*four_engine_workload(data), "pipeline.peer_timeout_s=30"]


def assert_same_run(run_dir: Path, reference: Path, *, engines_lost: bool = False) -> None:
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS))
    lines = (run_dir / "spans" / "rollout-0.jsonl").read_text().splitlines()
    engines = {s[4].get("engine") for line in lines if "spans" in (r := json.loads(line)) for s in r["spans"]
               if s[0] == "rollout/request"}
    assert engines == {"engine0", "engine1", "engine2", "engine3"} or engines_lost, "every engine generated"
    samples = {s["id"]: s["response_ids"] for s in read_samples(run_dir)}
    assert samples == {s["id"]: s["response_ids"] for s in read_samples(reference)}
    final, expected = (load_file(str(d / "checkpoints" / "final" / "model.safetensors")) for d in (run_dir, reference))
    assert max((final[k] - expected[k]).abs().max().item() for k in final) < 1e-9


def test_submitit_two_rollout_nodes_and_two_fsdp_trainer_nodes_match_one_rollout_node_and_resume_on_one(
        job_dir, four_engine_data, one_rollout_node):
    data, one_node = four_engine_data, one_rollout_node
    run_dir = job_dir("submitit-hosts")
    fsdp = ["trainer.backend=fsdp", f"run.checkpoint_every={NUM_STEPS}", "launcher.rollout.cpus_per_task=1",
            "launcher.trainer.cpus_per_task=1"]
    result = launch(run_dir, *workload(data), *TWO_NODES, *fsdp, "launcher.trainer.nodes=2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"step {NUM_STEPS}/{NUM_STEPS}" in result.stdout  # the launcher echoes the trainer's step lines
    job_id = job_id_of(run_dir)
    script = (run_dir / "slurm" / f"{job_id}_submission.sh").read_text()
    assert script.count("#SBATCH hetjob") == 1 and script.count("srun ") == 1  # one het job, one srun
    rows = sacct_components(job_id)
    assert [(c, s) for c, s, _ in rows] == [(f"{job_id}+0", "COMPLETED"), (f"{job_id}+1", "COMPLETED")]
    rollout_nodes, trainer_nodes = (set(expand_hostlist(nodes)) for _, _, nodes in rows)
    assert len(rollout_nodes) == 2 and len(trainer_nodes) == 2 and not rollout_nodes & trainer_nodes, rows
    assert sorted(p.name for p in (run_dir / "spans").glob("trainer-*.jsonl")) == ["trainer-0.jsonl", "trainer-1.jsonl"]
    assert_same_run(run_dir, one_node)
    checkpoint = run_dir / "checkpoints" / f"step={NUM_STEPS - 1}"
    assert sorted(p.name for p in (checkpoint / "optimizer").iterdir()) == [
        "rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]

    # one step more, on one trainer node: its rank reads both nodes' shards
    resumed = launch(run_dir, *workload(data), *TWO_NODES, *fsdp, "launcher.trainer.nodes=1", "trainer.num_ranks=1",
                     f"num_rollout={NUM_STEPS + 1}", "run.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS + 1))
    assert metrics[-1]["train/num_tokens"] > 0 and metrics[-1]["train/grad_norm"] > 0
    assert sorted(p.name for p in (run_dir / "spans").glob("trainer-*.jsonl")) == ["trainer-0.jsonl", "trainer-1.jsonl"]


def test_sbatch_two_rollout_nodes_match_one_rollout_node(tmp_path, four_engine_data, one_rollout_node):
    data, one_node = four_engine_data, one_rollout_node
    run_dir = tmp_path / "run"
    script = (REPO / "slurm" / "rolloutpipe.sbatch").read_text()
    assert script.count("#SBATCH --nodes=1\n") == 2
    (tmp_path / "two.sbatch").write_text(script.replace("#SBATCH --nodes=1\n", "#SBATCH --nodes=2\n"))
    result = subprocess.run(["sbatch", "--wait", f"--output={tmp_path}/slurm-%j.out", str(tmp_path / "two.sbatch"),
                             f"run.dir={run_dir}", *workload(data), *TWO_NODES],
                            cwd=REPO, env=node_environ(), capture_output=True, text=True, timeout=300)
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert result.returncode == 0, result.stderr + logs[-3000:]
    assert_same_run(run_dir, one_node)


def test_torchx_two_rollout_replicas_match_one_rollout_node(tmp_path, four_engine_data, one_rollout_node):
    data, one_node = four_engine_data, one_rollout_node
    run_dir = tmp_path / "run"
    component = f"{REPO / 'launchers' / 'components.py'}:grpo"
    result = subprocess.run(["torchx", "run", "-s", "slurm", "--wait", component, f"run.dir={run_dir}",
                             *workload(data), *TWO_NODES], cwd=tmp_path, env=node_environ(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Job finished: SUCCEEDED" in result.stderr
    assert sorted(p.name.split("-", 2)[2] for p in tmp_path.glob("slurm-*-*.out")) == [
        "rollout-0.out", "rollout-1.out", "trainer-0.out", "trainer-1.out"]
    assert_same_run(run_dir, one_node)


def test_a_lost_rollout_node_loses_no_sample_and_the_job_completes(job_dir, four_engine_data, one_rollout_node):
    """A whole node is taken away mid-run (``scontrol update state=down``: Slurm treats it as failed, and its slurmd
    kills the job's tasks there): the node of rollout rank 1, an engine host. The rollout het group runs with
    --no-kill, so Slurm keeps the job (without it, Slurm cancels the whole job and requeues it); the run goes on
    without that node's engines, loses no sample, and the job ends COMPLETED although srun exits 137."""
    run_dir = job_dir("submitit-lose-node")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launcher = launch(run_dir, *workload(four_engine_data), *TWO_NODES, "run.id=lose-node-slurm",
                      "launcher.trainer.nodes=2", "launcher.rollout.cpus_per_task=1",
                      "launcher.trainer.cpus_per_task=1", wait=False)
    node = None
    try:
        wait_for((run_dir / "metrics.jsonl").exists, "step 0", running=[launcher], timeout_s=240)
        _, environ = task_process(run_id="lose-node-slurm", proc_id=1)  # task 1 = rollout rank 1, an engine host
        node = environ["SLURMD_NODENAME"]
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=rolloutpipe-test"], check=True)
        _, stderr = launcher.communicate(timeout=240)
    finally:
        stop_if_running(launcher, run_dir)
        if node is not None:  # back into service (slurmd may have brought it back already)
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    assert launcher.returncode == 0, stderr[-3000:]
    assert "rollout ranks [1] (engine hosts) were lost during the run" in stderr, stderr[-3000:]
    job_id = job_id_of(run_dir)
    batch = (run_dir / "slurm" / f"{job_id}_batch.out").read_text()
    assert f"Node failure on {node}" in batch, batch[-3000:]
    assert "the job ends as completed" in batch, batch[-3000:]
    rows = sacct_components(job_id)  # the rollout component's first record is its resize, when it lost the node
    assert [s for _, s, _ in rows if s != "RESIZING"] == ["COMPLETED"] * 2 and ("RESIZING" in {s for _, s, _ in rows})
    assert_same_run(run_dir, one_rollout_node, engines_lost=True)
