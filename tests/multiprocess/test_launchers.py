"""Launchers without a cluster: the Slurm environment contract, the het-job batch script, sacct's ids,
the config checks at the launch edge, a local Hydra sweep and TorchX's local_cwd scheduler."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.control.env import NodeEnv, Role, expand_hostlist, slurm_store_port
from rolloutpipe.launch import local
from rolloutpipe.launch.config import LauncherKind
from rolloutpipe.launch.local import LocalLauncher, plan_cpus
from rolloutpipe.launch.sacct import combine_states, read_sacct
from rolloutpipe.launch.slurm import batch_script, check_allocation, check_launch, submission_environ
from tests.conftest import (
    REPO,
    SMALL,
    assert_import_pulls_none_of,
    descendants,
    needs_extra,
    node_environ,
    read_metrics,
)

RUN = {"RP_RUN_ID": "r1", "RP_RUN_SECRET": "ab" * 32, "RP_RUN_DIR": "/shared/run"}


def het_step(proc_id: int, tasks_per_group: list[int], nodelist_0: str = "node[7-8]") -> dict[str, str]:
    """The variables Slurm 22.05 sets in a task of ``srun --het-group=0 ... : --het-group=1 ...``."""
    env = {**RUN, "SLURM_HET_SIZE": str(len(tasks_per_group)), "SLURM_PROCID": str(proc_id),
           "SLURM_STEP_NUM_TASKS": str(sum(tasks_per_group)), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST_HET_GROUP_0": nodelist_0}
    env.update({f"SLURM_NTASKS_HET_GROUP_{k}": str(n) for k, n in enumerate(tasks_per_group)})
    return env


@needs_extra("slurm", "submitit")
def test_the_slurm_launcher_waits_out_sacct_reading_a_requeued_job_as_failed(tmp_path, monkeypatch):
    """After a requeue, sacct (slurmdbd) can read the ended attempt FAILED while slurmctld already holds the next
    one: seen in the suite, where the launcher then reported a requeued job as failed. A job squeue still lists has
    not ended; the launcher waits on, and reports what the job finally did."""
    from types import SimpleNamespace

    from rolloutpipe.launch import slurm

    sacct = iter(["RUNNING", "REQUEUED", "FAILED", "FAILED", "PENDING", "RUNNING", "COMPLETED"])
    listed = {"REQUEUED": True, "FAILED": True, "PENDING": True, "RUNNING": True, "COMPLETED": False}
    now = {"state": "RUNNING"}

    def get_state(job_id, mode):
        now["state"] = next(sacct)
        return now["state"]

    monkeypatch.setattr(slurm, "_queued", lambda job_id: listed[now["state"]])
    monkeypatch.setattr(slurm, "_result", lambda job, task: None)  # no task wrote a result (it reads submitit's)
    monkeypatch.setattr(slurm, "_release_requeued", lambda job_id, announce: None)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    job = SimpleNamespace(job_id="7", num_tasks=2, paths=SimpleNamespace(folder=tmp_path),
                          watcher=SimpleNamespace(get_state=get_state))
    assert slurm.SlurmLauncher()._wait(job, poll_s=0.0, follow=tmp_path / "log.out") == "COMPLETED"
    listed["FAILED"] = False  # a job that really failed: sacct says so and squeue no longer lists it
    sacct = iter(["RUNNING", "FAILED"])
    assert slurm.SlurmLauncher()._wait(job, poll_s=0.0, follow=tmp_path / "log.out") == "FAILED"


@needs_extra("slurm", "submitit")
def test_a_requeued_job_is_released_seconds_after_slurms_hold_and_again_if_the_hold_comes_back(monkeypatch):
    """The launcher lets a requeued job start before Slurm's two-minute hold ends, but not in the second the requeue
    revoked its credential (slurmd would refuse it, and the job end FAILED): REQUEUE_START_DELAY_S after it saw the
    hold, once; and again when Slurm sets the hold anew (an outside ``scontrol requeue`` sets it once the tasks
    stop)."""
    from types import SimpleNamespace

    from rolloutpipe.launch import slurm

    clock, reason, updates = {"now": 100.0}, {"now": "BeginTime"}, []

    def run(argv, **kwargs):
        if argv[0] == "squeue":
            return SimpleNamespace(returncode=0, stdout=f"{reason['now']}\n{reason['now']}\n")  # both het groups
        updates.append((clock["now"], argv))
        reason["now"] = "Resources"  # released: pending for its nodes
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(slurm.subprocess, "run", run)
    monkeypatch.setattr(slurm.time, "monotonic", lambda: clock["now"])
    held_since, seen = None, []
    for poll in range(12):  # one poll a second
        if poll == 7:
            reason["now"] = "BeginTime"  # the hold, set again
        held_since = slurm._release_requeued("7", held_since)
        seen.append(held_since)
        clock["now"] += 1.0
    assert slurm.REQUEUE_START_DELAY_S >= 2
    assert [t for t, _ in updates] == [100.0 + slurm.REQUEUE_START_DELAY_S, 107.0 + slurm.REQUEUE_START_DELAY_S]
    assert all(argv == ["scontrol", "update", "JobId=7", "StartTime=now"] for _, argv in updates)
    assert seen[:3] == [100.0, 100.0, None] and seen[7] == 107.0


def test_het_group_0_is_the_rollout_and_later_tasks_are_trainer_ranks_in_procid_order():
    envs = [NodeEnv.from_environ(het_step(p, [1, 4])) for p in range(5)]
    assert [(e.role, e.rank, e.world_size) for e in envs] == [
        (Role.rollout, 0, 1), *[(Role.trainer, r, 4) for r in range(4)]]
    assert {(e.store_host, e.store_port) for e in envs} == {("node7", slurm_store_port(4242))}
    assert all(e.run_id == "r1" and e.secret == bytes.fromhex("ab" * 32) for e in envs)


def test_torchx_layout_of_one_het_group_per_trainer_replica_gives_the_same_ranks():
    # TorchX on Slurm: het groups rollout-0, trainer-0, trainer-1 (one task each)
    envs = [NodeEnv.from_environ(het_step(p, [1, 1, 1])) for p in range(3)]
    assert [(e.role, e.rank, e.world_size) for e in envs] == [(Role.rollout, 0, 1), (Role.trainer, 0, 2),
                                                             (Role.trainer, 1, 2)]


def test_store_port_from_the_launcher_wins_over_the_job_id():
    assert NodeEnv.from_environ({**het_step(1, [1, 1]), "RP_STORE_PORT": "23456"}).store_port == 23456


def test_a_step_that_does_not_reach_the_trainer_het_group_is_refused():
    with pytest.raises(RuntimeError, match="must span het group 0"):
        NodeEnv.from_environ({**het_step(0, [1, 2]), "SLURM_STEP_NUM_TASKS": "1"})


def test_missing_run_secret_says_how_the_launcher_passes_it():
    env = het_step(0, [1, 1])
    del env["RP_RUN_SECRET"]
    with pytest.raises(RuntimeError, match=r"RP_RUN_SECRET.*--export=ALL"):
        NodeEnv.from_environ(env)


def test_explicit_role_with_store_host_taken_from_a_named_node_list():
    env = {**RUN, "RP_ROLE": "trainer", "RP_RANK": "1", "RP_WORLD_SIZE": "2", "RP_STORE_PORT": "29999",
           "RP_STORE_HOST_VAR": "SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu[012-013]",
           "SLURM_HET_SIZE": "3"}  # RP_ROLE wins over the het-job derivation
    node = NodeEnv.from_environ(env)
    assert (node.role, node.rank, node.world_size, node.store_host, node.store_port) == (
        Role.trainer, 1, 2, "gpu012", 29999)


@pytest.mark.parametrize("hostlist,hosts", [
    ("node1", ["node1"]),
    ("node[2-3]", ["node2", "node3"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("n[8-11]-ib", ["n8-ib", "n9-ib", "n10-ib", "n11-ib"]),
])
def test_slurm_host_lists_expand_in_order(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("states,combined", [
    (["COMPLETED", "COMPLETED"], "COMPLETED"),
    (["RUNNING", "FAILED"], "RUNNING"),  # not finished while a component still runs
    (["PENDING", "PENDING"], "PENDING"),
    (["CANCELLED by 0", "CANCELLED by 0"], "CANCELLED"),
    (["FAILED", "CANCELLED by 1000"], "CANCELLED"),
    (["COMPLETED", "TIMEOUT"], "TIMEOUT"),
    (["FAILED", "NODE_FAIL"], "FAILED"),
])
def test_het_job_state_combines_its_components(states, combined):
    assert combine_states(states) == combined


def test_sacct_component_rows_map_back_to_the_het_job():
    text = "\n".join([
        "JobID|State|NodeList",
        "123+0|COMPLETED|node1", "123+0.batch|COMPLETED|node1", "123+0.0|COMPLETED|node1",
        "123+1|FAILED|node[2-3]", "123+1.0|FAILED|node[2-3]",
        "124|RUNNING|node4",
    ])
    info = read_sacct(text)
    assert set(info) == {"123", "124"}
    assert info["123"]["State"] == "FAILED" and info["123"]["HetStates"] == "COMPLETED|FAILED"
    assert info["124"]["State"] == "RUNNING"


def cfg_of(*overrides: str):
    return load_config(OmegaConf.from_dotlist(["run.id=readme", *overrides]))


GPU_NODES = ["launcher.kind=slurm", "launcher.partition=gpu", "launcher.account=rl", "launcher.time_min=240",
             "launcher.rollout.gpus_per_node=8", "launcher.rollout.cpus_per_task=64",
             "launcher.trainer.tasks_per_node=8", "launcher.trainer.gpus_per_node=8",
             "launcher.trainer.cpus_per_task=12", "launcher.trainer.sbatch=[--exclusive]", "trainer.num_ranks=8",
             "launcher.setup=[source .venv/bin/activate]"]


def test_batch_script_has_one_hetjob_section_per_node_group_and_one_step_over_both(tmp_path):
    script = batch_script(cfg_of(*GPU_NODES), folder=tmp_path, python="python")
    head, body = script.split("\n\n", 1)
    rollout, trainer = head.split("#SBATCH hetjob\n")
    assert "#SBATCH --job-name=rolloutpipe" in rollout and "--job-name" not in trainer
    for section in (rollout, trainer):
        assert "#SBATCH --partition=gpu" in section and "#SBATCH --account=rl" in section
        assert "#SBATCH --time=240" in section and "#SBATCH --gpus-per-node=8" in section
    assert "#SBATCH --ntasks-per-node=1" in rollout and "#SBATCH --cpus-per-task=64" in rollout
    assert "#SBATCH --ntasks-per-node=8" in trainer and "#SBATCH --exclusive" in trainer
    assert body.count("srun ") == 1 and "--het-group=0 --cpus-per-task=64" in body
    assert "--het-group=1 --cpus-per-task=12" in body and "source .venv/bin/activate" in body
    assert "SECRET" not in script


def test_trainer_het_group_must_have_one_task_per_trainer_rank():
    slurm = ["launcher.kind=slurm", "launcher.dry_run=true"]  # dry run: no need for sbatch on this machine
    with pytest.raises(ConfigError, match=r"launcher.trainer.nodes \* launcher.trainer.tasks_per_node.*num_ranks=2"):
        check_launch(cfg_of(*slurm, "trainer.num_ranks=2"))
    check_launch(cfg_of(*slurm, "trainer.num_ranks=4", "launcher.trainer.nodes=2", "launcher.trainer.tasks_per_node=2"))


def test_rollout_nodes_run_one_engine_host_each_and_the_engines_split_over_them():
    with pytest.raises(ConfigError, match="launcher.rollout.tasks_per_node=2: a rollout node runs one process"):
        cfg_of("launcher.rollout.tasks_per_node=2")
    cfg = cfg_of("launcher.rollout.nodes=2", "rollout.engine=embedded_http", "rollout.engines_per_node=2")
    assert (cfg.rollout.num_engines, cfg.rollout.engines_per_node) == (4, 2)
    cfg = cfg_of("launcher.rollout.nodes=2", "rollout.engine=embedded_http", "rollout.num_engines=4")
    assert (cfg.rollout.num_engines, cfg.rollout.engines_per_node) == (4, 2)
    with pytest.raises(ConfigError, match="rollout.num_engines=3 does not split evenly over launcher.rollout.nodes=2"):
        cfg_of("launcher.rollout.nodes=2", "rollout.engine=embedded_http", "rollout.num_engines=3")
    with pytest.raises(ConfigError, match=r"rollout.num_engines=2 but launcher.rollout.nodes x rollout.engines_per_"
                                          r"node = 2 x 2; drop num_engines"):
        cfg_of("launcher.rollout.nodes=2", "rollout.engine=embedded_http", "rollout.engines_per_node=2",
               "rollout.num_engines=2")
    with pytest.raises(ConfigError, match="rollout.engine=embedded runs its engines inside rollout rank 0"):
        cfg_of("launcher.rollout.nodes=2", "rollout.num_engines=2")
    with pytest.raises(ConfigError, match="rollout.min_engines=5 exceeds the run's 4 engines"):
        cfg_of("launcher.rollout.nodes=2", "rollout.engine=embedded_http", "rollout.engines_per_node=2",
               "rollout.min_engines=5")
    with pytest.raises(ConfigError, match=r"engines_per_node=8 x rollout.sglang_gpus_per_engine=2 GPUs do not fit "
                                          r"a rollout node's launcher.rollout.gpus_per_node=8; use 4 engines"):
        cfg_of("rollout.engine=sglang", "rollout.engines_per_node=8", "rollout.sglang_gpus_per_engine=2",
               "launcher.rollout.gpus_per_node=8", "rollout_batch_size=16")


SBATCH_VARS = {"RP_SBATCH_VARS": "/tmp/job-1.env"}
"""What slurm/rolloutpipe.sbatch sets for launch.py launcher=sbatch: where the run's variables go."""


def test_sbatch_mode_checks_the_allocation_against_the_config():
    cfg = cfg_of("launcher.kind=sbatch", "trainer.num_ranks=2")
    assert cfg.launcher.kind is LauncherKind.sbatch
    with pytest.raises(ConfigError, match="inside slurm/rolloutpipe.sbatch"):
        check_allocation(cfg, {})
    with pytest.raises(ConfigError, match="names the file for the run's variables in RP_SBATCH_VARS"):
        check_allocation(cfg, {"SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2"})
    with pytest.raises(ConfigError, match=r"\[1, 1\] tasks.*trainer.num_ranks=2"):
        check_allocation(cfg, {**SBATCH_VARS, "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1",
                                "SLURM_NTASKS_HET_GROUP_1": "1"})
    check_allocation(cfg, {**SBATCH_VARS, "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1",
                                "SLURM_NTASKS_HET_GROUP_1": "2"})
    with pytest.raises(ConfigError, match=r"\[2, 2\] tasks.*1 task per rollout node, launcher.rollout.nodes=1"):
        check_allocation(cfg, {**SBATCH_VARS, "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "2",
                                "SLURM_NTASKS_HET_GROUP_1": "2"})
    two = cfg_of("launcher.kind=sbatch", "trainer.num_ranks=2", "launcher.rollout.nodes=2",
                 "rollout.engine=embedded_http")
    with pytest.raises(ConfigError, match="2 tasks on 1 nodes: one task per rollout node"):
        check_allocation(two, {**SBATCH_VARS, "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "2",
                               "SLURM_JOB_NUM_NODES_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2"})
    check_allocation(two, {**SBATCH_VARS, "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "2",
                           "SLURM_JOB_NUM_NODES_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "2"})


def test_the_sbatch_script_reaches_srun_when_the_launch_logs_warnings(tmp_path):
    """slurm/rolloutpipe.sbatch, run by bash with Slurm's variables and a stand-in srun: launch.py launcher=sbatch logs
    the memory plan's warning (a KV cache no GPU holds) through Hydra's log handler, on stdout, yet the script sources
    the run's variables from the file it named and reaches srun; the requeued job sources the same file without
    launching again."""
    for name in ("launch.py", "conf"):  # the script runs from the repository root: a stand-in for it
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "slurm").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\necho \"$RP_RUN_DIR|$RP_RUN_ID|$*\" >> {tmp_path / 'srun.log'}\n")
    (bin_dir / "srun").chmod(0o755)
    run_dir = tmp_path / "run"
    environ = {**node_environ(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "777",
               "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "1",
               "SLURM_RESTART_COUNT": "0"}
    script = [str(REPO / "slurm" / "rolloutpipe.sbatch"), f"run.dir={run_dir}", "run.id=warned",
              "rollout.engine=sglang", "rollout.concurrency=10000000"]
    first = subprocess.run(["bash", *script], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "memory plan: each rollout engine" in first.stdout + first.stderr, "the warning was logged"
    assert (tmp_path / ".rolloutpipe" / "job-777.env").read_text() == (
        f"export RP_RUN_DIR={run_dir}\nexport RP_RUN_ID=warned\n")
    config = (run_dir / "config.yaml").stat().st_mtime_ns
    requeued = subprocess.run(["bash", *script], cwd=tmp_path, env={**environ, "SLURM_RESTART_COUNT": "1"},
                              capture_output=True, text=True, timeout=120)
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    assert "memory plan" not in requeued.stdout + requeued.stderr, "the requeued job does not launch again"
    assert (run_dir / "config.yaml").stat().st_mtime_ns == config
    calls = (tmp_path / "srun.log").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith(f"{run_dir}|warned|--unbuffered") for c in calls), calls
    assert all("--het-group=0" in c and "--het-group=1" in c for c in calls), calls


def test_submission_from_inside_a_job_does_not_leak_that_jobs_slurm_options(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    env = submission_environ({"RP_RUN_ID": "x"})
    assert "SLURM_CPUS_PER_TASK" not in env and "SUBMITIT_EXECUTOR" not in env
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf" and env["RP_RUN_ID"] == "x"


def test_local_sweep_gives_each_point_its_own_run_directory_and_run_id(tmp_path):
    # Hydra's basic launcher; each point prints its het-job script instead of submitting it (the real
    # sweep runs in tests/cluster/test_slurm.py), so this checks the sweep's bookkeeping in seconds.
    sweep = tmp_path / "sweep"
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), "-m", f"hydra.sweep.dir={sweep}",
                             "launcher=slurm", "launcher.dry_run=true", "pipeline.mode=sync,cgp", *SMALL],
                            cwd=tmp_path, env=node_environ(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in run_dirs] == ["0", "1"]
    configs = [OmegaConf.load(p / "config.yaml") for p in run_dirs]
    assert [c.pipeline.mode for c in configs] == ["sync", "cgp"]
    assert configs[0].run.id != configs[1].run.id and [c.run.dir for c in configs] == [str(p) for p in run_dirs]
    for run_dir, cfg in zip(run_dirs, configs):
        assert f"# RolloutPipe run {cfg.run.id}:" in result.stdout
        assert f"-m rolloutpipe.launch.slurm {run_dir / 'slurm'}" in result.stdout


def test_a_sweep_refuses_one_run_dir_for_all_its_points(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), "-m", f"hydra.sweep.dir={tmp_path / 's'}",
                             f"run.dir={tmp_path / 'one'}", "pipeline.mode=sync,cgp"], cwd=tmp_path,
                            env=node_environ(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "run.dir and run.id name one run" in result.stderr
    assert not (tmp_path / "one" / "config.yaml").exists()


@pytest.mark.multiprocess
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the node groups share the CPU when there is one")
def test_the_local_launcher_pins_every_thread_of_each_node_group_to_its_own_cpus(tmp_path):
    # Every thread: the one `import torch` starts before a node knows its CPUs, the engines', rewards' and store's,
    # and the child processes'. Read once the first step has ended (each thread's last affinity counts: a node's
    # main thread starts on all CPUs and pins itself).
    rollout_cpus, trainer_cpus = plan_cpus(sorted(os.sched_getaffinity(0)), 1)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *SMALL, "num_rollout=4"],
                            cwd=tmp_path, env=node_environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    allowed: dict[tuple[int, str], tuple[str, set[int]]] = {}  # (tid, its process's role) -> (name, its CPUs)
    gpu_ranks = set()  # (RP_RANK, LOCAL_RANK) of each trainer process: the GPU it binds to (control/env.py)
    while proc.poll() is None:
        if not (run_dir / "metrics.jsonl").exists():
            time.sleep(0.05)
            continue
        for pid in descendants(proc.pid)[1:]:
            try:
                environ = dict(line.decode().split("=", 1) for line in
                               Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in line)
                role = environ["RP_ROLE"]
                if role == "trainer":
                    gpu_ranks.add((environ["RP_RANK"], environ.get("LOCAL_RANK")))
                for task in Path(f"/proc/{pid}/task").iterdir():
                    name = (task / "comm").read_text().strip()
                    allowed[(int(task.name), role)] = (name, set(os.sched_getaffinity(int(task.name))))
            except (OSError, KeyError):  # gone, or not a node group's (the launcher's own children)
                continue
    _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    assert gpu_ranks == {("0", "0")}  # on a GPU machine, trainer rank r takes the r-th GPU
    roles = {role for _, role in allowed}
    assert roles == {"rollout", "trainer"}, f"threads of {roles} seen"
    expected = {"rollout": set(rollout_cpus), "trainer": set(trainer_cpus[0])}
    stray = {f"{role} thread {tid} ({name})": sorted(cpus) for (tid, role), (name, cpus) in allowed.items()
             if not cpus <= expected[role]}
    assert not stray, f"threads not on their node group's CPUs {expected}: {stray}"


@pytest.mark.multiprocess
@needs_extra("slurm", "torchx")
def test_torchx_component_runs_the_default_with_the_local_cwd_scheduler(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(["torchx", "run", "-s", "local_cwd", str(REPO / "launchers" / "components.py") + ":grpo",
                             f"run.dir={run_dir}", *SMALL], cwd=tmp_path, env=node_environ(),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Job finished: SUCCEEDED" in result.stderr
    assert len(read_metrics(run_dir)) == 2


def test_slurm_modules_import_without_submitit_or_torchx():
    assert_import_pulls_none_of(["rolloutpipe.launch.slurm", "rolloutpipe.launch.local", "rolloutpipe.control.env"],
                                ["submitit", "torchx", "hydra_plugins"])


def test_the_docs_batch_script_for_four_rollout_nodes_is_what_the_launcher_writes():
    cfg = cfg_of("run.id=gpqa-4x8", "run.dir=/shared/runs/gpqa-4x8", "rollout_batch_size=32", "rollout.engine=sglang",
                 "rollout.engines_per_node=8", "trainer.num_ranks=16", "launcher.kind=slurm", "launcher.partition=gpu",
                 "launcher.account=rl", "launcher.time_min=240", "launcher.rollout.nodes=4",
                 "launcher.rollout.gpus_per_node=8", "launcher.rollout.cpus_per_task=64", "launcher.trainer.nodes=2",
                 "launcher.trainer.tasks_per_node=8", "launcher.trainer.gpus_per_node=8",
                 "launcher.trainer.cpus_per_task=12", "launcher.setup=[source /shared/venvs/rolloutpipe/bin/activate]")
    assert cfg.rollout.num_engines == 32
    script = batch_script(cfg, folder=Path("/shared/runs/gpqa-4x8/slurm"),
                          python="/shared/venvs/rolloutpipe/bin/python")
    page = (REPO / "docs" / "slurm.md").read_text()
    assert f"```bash\n{script}```" in page, "docs/slurm.md's 4 x 8-GPU rollout batch script is stale: regenerate it"


class FakeClock:
    """time.monotonic and time.sleep of the launcher's monitor loop, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeProcess:
    """A child that exits with ``code`` at ``ends_at`` (fake seconds), or keeps running."""

    def __init__(self, clock: FakeClock, code: int | None = None, ends_at: float = 0.0) -> None:
        self.clock, self.code, self.ends_at, self.returncode = clock, code, ends_at, None

    def poll(self) -> int | None:
        if self.returncode is None and self.code is not None and self.clock.now >= self.ends_at:
            self.returncode = self.code
        return self.returncode


@pytest.mark.parametrize("failed,stopped_after", [
    ("rollout rank 0", LocalLauncher.grace_s),  # hosted the store: the others can only lose it
    ("trainer rank 1", 30.0 + LocalLauncher.grace_s),  # the others notice through the store, given peer_timeout_s
])
def test_the_launcher_stops_the_others_sooner_when_the_failed_child_hosted_the_store(monkeypatch, failed,
                                                                                      stopped_after):
    """A malformed dataset fails rollout rank 0 at start: a trainer thread still connecting to its store would hold
    its process for the connect timeout, so the launcher waits only its grace before stopping the others."""
    clock, stopped = FakeClock(), []
    monkeypatch.setattr(local, "time", clock)
    monkeypatch.setattr(local, "stop_groups", lambda procs, grace_s: stopped.append(clock.now) or [False] * len(procs))
    children = [local.Child(label=label, process=FakeProcess(clock, 1 if label == failed else None, ends_at=5.0),
                            hosts_store=label == "rollout rank 0")
                for label in ("rollout rank 0", "trainer rank 0", "trainer rank 1")]
    assert local.LocalLauncher()._monitor(children, peer_timeout_s=30.0, stop_grace_s=10.0) == 1
    assert len(stopped) == 1 and stopped_after < stopped[0] - 5.0 <= stopped_after + 0.5, stopped
