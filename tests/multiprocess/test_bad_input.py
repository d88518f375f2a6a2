"""Bad input and dead processes: a clear error that says what is wrong, never a hang or a silent loss."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutpipe.control.lifetime import PEER_STOPPED_EXIT
from tests.conftest import (
    REPO,
    SMALL,
    assert_import_pulls_none_of,
    node_environ,
    read_metrics,
    run_job,
    start_nodes,
    wait_for,
)

pytestmark = pytest.mark.multiprocess


UNKNOWN_KEY = ("error: unknown config key 'trainer.lrr'. Did you mean 'trainer.lr'? Every key and its default: "
               "python launch.py --cfg job")


@pytest.mark.parametrize("where", ["command line", "with +", "sweep", "preset"])
def test_unknown_config_key_is_named_before_anything_starts(job_dir, tmp_path, where):
    """Hydra's own refusal would advise ``+trainer.lrr=``, and that ended in a traceback: both get one line."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  lrr: 1.0e-3\n")
    run_dir = job_dir("typo")
    args = {"command line": [f"run.dir={run_dir}", "trainer.lrr=1e-3"],
            "with +": [f"run.dir={run_dir}", "+trainer.lrr=1e-3"],
            "sweep": ["-m", "trainer.lrr=1e-3,1e-4", f"hydra.sweep.dir={run_dir}"],
            "preset": [f"run.dir={run_dir}", f"hydra.searchpath=[file://{tmp_path}]", "+experiment=typo"]}[where]
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=tmp_path, env=node_environ(),
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [UNKNOWN_KEY])
    assert not run_dir.exists() or not any(run_dir.iterdir())


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.lr=abc", "bad config value at trainer.lr: Value 'abc' of type 'str' could not be converted to Float"),
    ("pipeline.mode=fast", "bad config value at pipeline.mode: Invalid value 'fast', expected one of "
                           "[sync, cgp, async_one_step]"),
    ("reward.on_timeout=skip", "bad config value at reward.on_timeout: Invalid value 'skip', expected one of "
                               "[zero, drop_group]"),
    ("lr=1e-3", "unknown config key 'lr'. Did you mean 'trainer.lr'? Every key and its default: "
                "python launch.py --cfg job"),
])
def test_a_config_mistake_gets_one_line_and_no_traceback(job_dir, override, message):
    result = run_job(job_dir("mistake"), override, timeout_s=60)
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [f"error: {message}"])


@pytest.mark.parametrize(("override", "message"), [
    ("job.trainer.lrr=1", "unknown config key 'job.trainer.lrr'. Did you mean 'job.trainer.lr'?"),
    ("+sim.engine.decode_bas_s=1", "unknown config key 'sim.engine.decode_bas_s'. Did you mean "
                                   "'sim.engine.decode_base_s'?"),
    ("+sweep.job.rollout.concurrenc=[8]", "job: unknown config key 'rollout.concurrenc'. Did you mean "
                                          "'rollout.concurrency'?"),
])
def test_the_simulator_names_an_unknown_key_the_same_way(override, message):
    result = subprocess.run([sys.executable, str(REPO / "tools" / "simulate.py"), "num_steps=1", "modes=[sync]",
                             override], cwd=REPO, env={**os.environ, "ROLLOUTPIPE_SIM_COMPILED": "0"},
                            capture_output=True, text=True, timeout=120)
    said = f"error: {message} Every key and its default: python tools/simulate.py --cfg job"
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [said])


def test_impossible_batch_arithmetic_says_how_to_fix_it(job_dir):
    result = run_job(job_dir("arith"), "rollout_batch_size=3", "n_samples_per_prompt=4", "global_batch_size=8",
                     timeout_s=60)
    assert result.returncode == 2
    assert "global_batch_size=8" in result.stderr and "divisor of 12" in result.stderr


def test_dynamic_sampling_that_finds_no_trainable_group_stops_with_the_share_it_dropped(job_dir):
    """Every group is dropped and replaced: with 4 groups per step and a budget of 12, the 9th drop would need a
    13th group."""
    result = run_job(job_dir("flat"), *SMALL, "reward.name=always_flat",
                     "reward.import_modules=[tests.fixtures.dense_rewards]", "rollout.filter_zero_variance=true",
                     "rollout.max_groups_per_step=12", timeout_s=120)
    assert result.returncode != 0
    assert ("the step needs more than rollout.max_groups_per_step=12 groups: 0 of the 9 complete ones are trainable "
            "and 9 (100%) had rewards all equal (zero variance)") in result.stderr, result.stderr[-2000:]
    assert not (job_dir("flat") / "metrics.jsonl").exists()


def test_malformed_row_stops_the_run_with_file_and_line(job_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "abc=", "label": "cba"}) + "\n" + '{"prompt": "abd=", "label": \n')
    result = run_job(job_dir("bad-row"), *SMALL, f"data.path={data}", timeout_s=120)
    assert result.returncode != 0
    assert f"{data}:2" in result.stderr
    assert "rollout rank 0" in result.stderr


def _rows_with_labels(path: Path, labels: list[str]) -> Path:
    letters = "abcd"
    with path.open("w") as f:
        for i, label in enumerate(labels):
            f.write(json.dumps({"prompt": f"{letters[i % 4]}{letters[(i // 4) % 4]}a=", "label": label}) + "\n")
    return path


@pytest.mark.parametrize("reward,bad_label,error", [("raises", "fail", "ValueError"), ("hangs", "hang", "timeout")])
def test_failing_reward_gives_zero_and_is_counted_without_stopping_the_run(job_dir, tmp_path, reward, bad_label,
                                                                           error):
    """A timeout too, when reward.on_timeout=zero says so (the default drops its group: the tests below)."""
    data = _rows_with_labels(tmp_path / "rows.jsonl", ["ok", bad_label, "ok", "ok"])
    run_dir = job_dir(reward)
    result = run_job(run_dir, *SMALL, "num_rollout=1", f"data.path={data}", "data.shuffle=false",
                     f"reward.name={reward}", "reward.timeout_s=1",
                     "reward.import_modules=[tests.fixtures.faulty_rewards]", "reward.on_timeout=zero",
                     "run.save_samples=true", timeout_s=180)
    assert result.returncode == 0, result.stderr[-3000:]
    [metrics] = read_metrics(run_dir)
    assert metrics["rollout/num_reward_errors"] == 4  # the 4 samples of the one bad prompt
    assert metrics["rollout/num_timeout_dropped_groups"] == 0
    samples = [json.loads(line) for line in (run_dir / "rollouts" / "step=0.jsonl").read_text().splitlines()]
    failed = [s for s in samples if s["reward_error"]]
    assert len(failed) == 4 and all(s["reward"] == 0.0 and error in s["reward_error"] for s in failed)
    assert all(s["reward"] == 1.0 for s in samples if not s["reward_error"])


HANGS = ["reward.name=hangs", "reward.timeout_s=1", "reward.import_modules=[tests.fixtures.faulty_rewards]",
         "reward.on_timeout=drop_group", "data.shuffle=false", "num_rollout=1", "run.save_samples=true"]
"""Rows in file order; the prompt labelled ``hang`` hangs its reward past the timeout, the others score 1."""


def test_a_group_whose_reward_times_out_is_not_trained_and_is_replaced_under_drop_group(job_dir, tmp_path):
    """Prompt 1 hangs: its group is dropped, the step's last slot goes to the next prompt (row 0 again, the next
    epoch), and the trainer sees 4 groups whose rewards are all the reward function's own."""
    data = _rows_with_labels(tmp_path / "rows.jsonl", ["ok", "hang", "ok", "ok"])
    run_dir = job_dir("timeout-dropped")
    result = run_job(run_dir, *SMALL, *HANGS, f"data.path={data}", timeout_s=180)
    assert result.returncode == 0, result.stderr[-3000:]
    [metrics] = read_metrics(run_dir)
    assert (metrics["rollout/num_timeout_dropped_groups"], metrics["rollout/num_filtered_groups"]) == (1, 0)
    assert metrics["rollout/num_reward_errors"] == 4  # counted (reward.max_failure_fraction), not trained
    samples = [json.loads(line) for line in (run_dir / "rollouts" / "step=0.jsonl").read_text().splitlines()]
    assert sorted({s["prompt_index"] for s in samples}) == [0, 2, 3] and len(samples) == 16
    assert all(s["reward"] == 1.0 and s["reward_error"] is None for s in samples)
    lives = {g["group"]: g for g in map(json.loads, (run_dir / "lifecycle.jsonl").read_text().splitlines())}
    assert (lives[1]["state"], lives[1]["drop_reason"], lives[1]["consumed_s"]) == ("dropped", "reward_timeout", None)
    assert [g for g, life in sorted(lives.items()) if life["state"] == "trained"] == [0, 2, 3, 4]


def test_a_timed_out_group_that_nothing_may_replace_stops_the_run_with_the_cap(job_dir, tmp_path):
    """rollout.max_groups_per_step=4 leaves no room for a replacement: the run stops instead of training 3 groups."""
    data = _rows_with_labels(tmp_path / "rows.jsonl", ["ok", "hang", "ok", "ok"])
    run_dir = job_dir("timeout-capped")
    result = run_job(run_dir, *SMALL, *HANGS, f"data.path={data}", "rollout.max_groups_per_step=4", timeout_s=180)
    assert result.returncode != 0
    stopped = re.search(r"the step needs more than rollout.max_groups_per_step=4 groups: (\d) of the (\d) complete "
                        r"ones are trainable and 1 \(\d+%\) had a reward call that ran past reward.timeout_s, which "
                        r"reward.on_timeout=drop_group drops\. ", result.stderr)
    assert stopped, result.stderr[-2000:]
    assert int(stopped[1]) == int(stopped[2]) - 1  # how many others completed first depends on timing; not this
    assert not (run_dir / "metrics.jsonl").exists()


def test_mostly_failing_rewards_stop_the_run_before_training_on_them(job_dir, tmp_path):
    data = _rows_with_labels(tmp_path / "rows.jsonl", ["fail"] * 4)
    run_dir = job_dir("all-fail")
    result = run_job(run_dir, *SMALL, "num_rollout=1", f"data.path={data}", "reward.name=raises",
                     "reward.import_modules=[tests.fixtures.faulty_rewards]", timeout_s=180)
    assert result.returncode != 0
    assert "more than reward.max_failure_fraction=0.5" in result.stderr
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("victim,survivor,message", [
    ("trainer", "rollout", "trainer rank 0 stopped heart-beating"),
    ("rollout", "trainer", "lost the TCPStore"),
])
def test_killed_node_group_makes_the_other_exit_with_a_clear_error(tmp_path, victim, survivor, message):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = start_nodes(run_dir, *SMALL, "num_rollout=1000", "pipeline.peer_timeout_s=3")
    try:
        wait_for((run_dir / "metrics.jsonl").exists, "first step", timeout_s=120, running=procs.values(),
                 details=lambda: {k: p.communicate() for k, p in procs.items() if p.poll() is not None})
        os.kill(procs[victim].pid, signal.SIGKILL)
        _, stderr = procs[survivor].communicate(timeout=30)
        assert procs[survivor].returncode == PEER_STOPPED_EXIT  # it stopped for the other: not the cause
        assert message in stderr, stderr[-2000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.communicate()


def test_launcher_names_the_process_that_died(job_dir):
    run_dir = job_dir("launcher-kill")
    launcher = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *SMALL,
                                 "num_rollout=1000", "pipeline.peer_timeout_s=3"],
                                cwd=run_dir.parent, env=node_environ(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        wait_for((run_dir / "metrics.jsonl").exists, "first step", timeout_s=120, running=[launcher])
        children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        trainer = next(pid for pid in children
                       if b"RP_ROLE=trainer" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        os.kill(int(trainer), signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 1
        assert "trainer rank 0 exited with signal SIGKILL" in stderr
        assert "trainer rank 0 stopped heart-beating" in stderr  # the rollout said why it stopped, too
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()


def test_core_import_pulls_no_heavy_backend():
    assert_import_pulls_none_of(["rolloutpipe", "rolloutpipe.pipeline", "rolloutpipe.config",
                                 "rolloutpipe.launch.local"],
                                ["sglang", "megatron", "wandb", "submitit"])


def test_the_launcher_starts_the_nodes_without_importing_torch():
    """launch.py reads and checks the config and starts the node processes; torch (about 1.3 s) is theirs."""
    assert_import_pulls_none_of(["rolloutpipe.config", "rolloutpipe.launch.local", "rolloutpipe.launch.preflight"],
                                ["torch", "transformers"])


def test_a_response_budget_beyond_the_models_context_stops_the_run_before_any_engine_starts(job_dir):
    """SGLang answers such requests with HTTP 400 (and the embedded server does the same); found at start, once."""
    run_dir = job_dir("context")
    result = run_job(run_dir, *SMALL, "rollout.engine=embedded_http", "rollout_max_response_len=600", timeout_s=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"the longest prompt \(\d+ tokens\) \+ rollout_max_response_len=600 exceeds the model's context "
                     r"of 512 tokens \(max_position_embeddings\)", result.stderr), result.stderr[-3000:]
    assert not (run_dir / "engines").exists(), "no engine server was started"
