"""Outages a stop signal or a crash does not cover: a store host that freezes, a stop during the final save. Each
run ends by itself, keeps every finished step, and the resume ends with the uninterrupted run's digests."""

from __future__ import annotations

import concurrent.futures
import random
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from rolloutpipe.control.attempt import read_outcome
from rolloutpipe.control.env import attempt_key, free_port
from rolloutpipe.control.lifetime import PEER_STOPPED_EXIT
from tests.conftest import DENSE_REWARD, SMALL, read_metrics, run_job, start_nodes, wait_for
from tests.helpers.parity import EXACT, weights_digests

pytestmark = pytest.mark.multiprocess

NUM_STEPS = 5
PEER_TIMEOUT_S = 5
WORKLOAD = [*SMALL, *DENSE_REWARD, *EXACT, f"num_rollout={NUM_STEPS}", "run.checkpoint_every=0",
            f"pipeline.peer_timeout_s={PEER_TIMEOUT_S}", "reward.name=letter_fraction_waiting"]
"""No checkpoint is due: only the stop's own (trainer/restore.py) can keep a finished step."""
SLOW = {"RP_TEST_REWARD_SLEEP_S": "0.2"}
"""Rewards of 0.2 s each (16 samples a step, one worker): a step takes over 3 s, so the freeze, sent as soon as step 1
is finished, lands inside step 2."""


def after_steps(run_dir: Path, num_steps: int, *more: str, **start) -> dict[str, subprocess.Popen]:
    """start_nodes' run (WORKLOAD and ``more`` overrides), once ``num_steps`` steps are finished (metrics written)."""
    run_dir.mkdir()
    procs = start_nodes(run_dir, *WORKLOAD, *more, environ=SLOW, **start)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= num_steps,
             f"{num_steps} finished step(s)", running=list(procs.values()))
    return procs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[str]:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = run_job(run_dir, *WORKLOAD)
    assert result.returncode == 0, result.stderr[-3000:]
    return weights_digests(run_dir)


@pytest.mark.parametrize("stop", [None, signal.SIGTERM], ids=["by-itself", "sigterm-meanwhile"])
def test_a_frozen_store_host_ends_the_run_keeping_every_finished_step(tmp_path, uninterrupted, stop):
    """SIGSTOP the store host (rollout rank 0) after 2 finished steps: nothing answers the trainer's store calls any
    more, and nothing errs either. The trainer gives up on the store within the heart-beat timeout (each store call
    has a deadline of its own: control/bounded_store.py), writes the last finished step's checkpoint and its outcome,
    and exits; the resume continues from there to the uninterrupted run's digests. A stop signal meanwhile is handled
    at once, whatever the trainer waits on, with the same checkpoint."""
    run_dir = tmp_path / "run"
    procs = after_steps(run_dir, 2)
    try:
        procs["rollout"].send_signal(signal.SIGSTOP)
        frozen_s = time.monotonic()
        if stop is not None:
            time.sleep(1.0)  # the trainer is inside a store call that will never be answered
            procs["trainer"].send_signal(stop)
        _, stderr = procs["trainer"].communicate(timeout=PEER_TIMEOUT_S + 30)
        took_s = time.monotonic() - frozen_s
    finally:
        procs["rollout"].kill()  # (a stopped process takes SIGKILL)
        procs["rollout"].communicate()
        if procs["trainer"].poll() is None:
            procs["trainer"].kill()
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints and int(checkpoints[-1].removeprefix("step=")) >= 1, (checkpoints, stderr[-3000:])
    outcome = read_outcome(run_dir, attempt_key(b"k" * 32, "bytest", 0), 0)  # (start_nodes' secret and run id)
    if stop is not None:  # handled as a stop (a store call running out of time would exit 1, a lost node)
        assert procs["trainer"].returncode == 128 + stop, stderr[-3000:]
        assert not outcome.requeue and "Stopped" in outcome.reason, outcome
        return
    assert procs["trainer"].returncode == PEER_STOPPED_EXIT, stderr[-3000:]
    assert "did not answer" in stderr and "frozen or unreachable" in stderr, stderr[-3000:]
    assert took_s < PEER_TIMEOUT_S + 30
    assert outcome.requeue and "did not answer" in outcome.reason, outcome  # a lost node: a requeue can fix it

    resumed = run_job(run_dir, *WORKLOAD, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS))
    assert weights_digests(run_dir) == uninterrupted


def test_a_stop_during_the_final_save_keeps_every_step_and_the_resume_trains_nothing(tmp_path, uninterrupted):
    """SIGTERM as the final policy is being saved (the run's second HF save: the last step's checkpoint is the
    first, run.checkpoint_every=0 having written none): every step is kept, in that checkpoint; the resume trains
    nothing, says so, writes the final policy, and metrics.jsonl holds each step once, its records untouched."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = start_nodes(run_dir, *WORKLOAD, commands={"trainer": ["-m", "tests.faults.inject", "hf_save", "2",
                                                                  "SIGTERM"]})
    outputs = {role: p.communicate(timeout=300) for role, p in procs.items()}
    assert procs["trainer"].returncode == 128 + signal.SIGTERM, outputs["trainer"][1][-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step={NUM_STEPS - 1}"], (
        outputs["trainer"][1][-3000:])
    outcome = read_outcome(run_dir, attempt_key(b"k" * 32, "bytest", 0), 0)
    assert not outcome.finished and outcome.checkpoint_step == NUM_STEPS - 1, outcome
    kept = (run_dir / "metrics.jsonl").read_bytes()

    resumed = run_job(run_dir, *WORKLOAD, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"nothing to train: step {NUM_STEPS - 1}'s checkpoint holds the run's last step" in resumed.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == kept
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS))
    assert weights_digests(run_dir) == uninterrupted


def test_a_bug_is_not_requeued_even_when_the_store_is_gone_before_the_trainer_looks(tmp_path):
    """A reward that fails on every sample from some point on (a deterministic bug) stops the rollout while trainer
    rank 0 is busy for seconds (in an optimizer step): the store host keeps the store up until every peer's heart-beat
    saw the abort, so the trainer, meeting the store gone afterwards, knows it as the abort's consequence, not a lost
    node. The outcome names the bug and asks for no requeue (a requeue would only run the bug again)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    marker = tmp_path / "busy"
    procs = start_nodes(run_dir, *SMALL, *DENSE_REWARD, "reward.name=letter_fraction_until_marked",
                        "reward.max_failure_fraction=0", "global_batch_size=8", f"num_rollout={NUM_STEPS}",
                        f"pipeline.peer_timeout_s={PEER_TIMEOUT_S}",
                        commands={"trainer": ["-m", "tests.faults.inject", "busy_optimizer_step", "3"]},
                        environ={"RP_TEST_MARKER": str(marker), "RP_TEST_BUSY_S": "6", **SLOW})
    outputs = {role: p.communicate(timeout=300) for role, p in procs.items()}
    assert marker.exists(), outputs["trainer"][1][-3000:]  # step 1's first optimizer step: 2 batches a step
    assert procs["rollout"].returncode == 1, outputs["rollout"][1][-3000:]
    assert procs["trainer"].returncode == PEER_STOPPED_EXIT, outputs["trainer"][1][-3000:]
    outcome = read_outcome(run_dir, attempt_key(b"k" * 32, "bytest", 0), 0)
    assert not outcome.requeue and "the reward function" in outcome.reason, outcome


def test_a_killed_trainer_rank_0_still_leaves_an_outcome(tmp_path):
    """Trainer rank 0 killed outright writes nothing; the rollout manager, finding its heart-beat gone, writes the
    attempt's outcome in its place: a lost node, which a requeue can fix (launch/requeue.py reads it)."""
    run_dir = tmp_path / "run"
    procs = after_steps(run_dir, 1)
    try:
        procs["trainer"].kill()
        _, stderr = procs["rollout"].communicate(timeout=PEER_TIMEOUT_S + 60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert procs["rollout"].returncode == PEER_STOPPED_EXIT, stderr[-3000:]
    outcome = read_outcome(run_dir, attempt_key(b"k" * 32, "bytest", 0), 0)
    assert outcome is not None and outcome.requeue and not outcome.finished, stderr[-3000:]
    assert "trainer rank 0 stopped heart-beating" in outcome.reason and outcome.last_step >= 0, outcome


def test_a_requeued_attempt_of_a_run_that_cannot_resume_ends_with_the_refusal(tmp_path):
    """A requeued Slurm job resumes by itself (SLURM_RESTART_COUNT): the refusals of run.resume=auto apply to it
    as they do at launch, so it ends naming the reason instead of resuming wrong."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = start_nodes(run_dir, *SMALL, "pipeline.mode=async_one_step", environ={"SLURM_RESTART_COUNT": "1"})
    outputs = {role: p.communicate(timeout=120) for role, p in procs.items()}
    for role, p in procs.items():
        assert p.returncode == 2, outputs[role][1][-3000:]
        assert "Slurm requeued this job (1 time(s)), but it cannot resume: run.resume=auto is not supported with " \
               "pipeline.mode=async_one_step" in outputs[role][1], outputs[role][1][-3000:]


def attack(port: int, until: threading.Event, steps: range) -> int:
    """A process with the store's port and the run id, not its secret: until ``until``, over and over, every key in
    the store and every key the run will use, each set to garbage or to a value copied from another key (a replay).
    Returns how many writes it made."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    rng = random.Random(0)
    run = "rp/bytest"
    named = [f"{run}/{k}" for k in ("abort", "requeue", "trainer/ready", "trainer/done", "clock/ticket")]
    named += [f"{run}/alive/{role}/0" for role in ("rollout", "trainer")]
    for step in steps:
        named += [f"{run}/step={step}/{k}" for k in ("rollout_stats", "source_state", "eval")]
        named += [f"{run}/step={step}/{kind}/seq={seq}" for kind in ("handle", "payload") for seq in range(4)]
        named += [f"{run}/{kind}/policy_version={step + 1}" for kind in ("weights", "serving")]
    values, writes = [b"garbage", b"{}", b'{"mac": "00", "body": "{}"}'], 0
    while not until.is_set():
        try:
            for key in [k for k in store.list_keys() if k.startswith(run)] + named:
                if store.check([key]) and rng.random() < 0.5:
                    values.append(store.get(key))  # replayed later, to another key or this one
                store.set(key, rng.choice(values[-50:]))
                writes += 1
        except RuntimeError:  # the run ended: the store is gone
            return writes
        time.sleep(0.01)
    return writes


def test_an_outsider_writing_every_key_for_20_s_neither_stops_nor_steers_the_run(tmp_path, uninterrupted):
    """Garbage and replays over every key the run uses, for 20 s mid-run: every record is sealed or signed (refused
    and waited past), heart-beats it overwrites are not read as missing ones, and what the run's processes wrote is
    written back (control/kept.py). The run ends normally, with the uninterrupted run's digests."""
    port = free_port()
    # (a heart-beat timeout of 15 s: the attacker's writes load both cores; what is tested is that its writes are
    # never read as missing beats, which a peer's death would not be either way)
    procs = after_steps(run_dir := tmp_path / "run", 1, "pipeline.peer_timeout_s=15", port=port)
    done = threading.Event()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            writes = pool.submit(attack, port, done, range(NUM_STEPS))
            time.sleep(20)
            done.set()
            assert writes.result(timeout=60) > 1000
        outputs = {role: p.communicate(timeout=300) for role, p in procs.items()}
    finally:
        done.set()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for role, p in procs.items():
        assert p.returncode == 0, outputs[role][1][-3000:]
    assert "refused a store record" in outputs["trainer"][1] + outputs["rollout"][1]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS))
    assert weights_digests(run_dir) == uninterrupted
