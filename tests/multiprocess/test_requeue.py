"""Stop and continue the way Slurm does (launch/requeue.py): warned before the time limit, the run stops after a
step's checkpoint, every process exits REQUEUE_EXIT, and the requeued job (SLURM_RESTART_COUNT > 0) resumes from
that checkpoint by itself; the update is that of an uninterrupted run. Here without Slurm: the batch script's
``requeue`` record is put into the store by hand, and the requeue wrapper runs around a stand-in for srun. (On the
Slurm cluster: tests/cluster/test_slurm_requeue.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rolloutpipe.control.checkpoint import latest_checkpoint
from rolloutpipe.control.env import attempt_key, free_port
from rolloutpipe.control.lifetime import REQUEUE_EXIT
from rolloutpipe.control.transport import StoreAddress, Transport
from rolloutpipe.observe.metrics import read_spans
from tests.conftest import (
    DENSE_REWARD,
    REPO,
    SMALL,
    node_environ,
    read_metrics,
    read_samples,
    run_job,
    start_nodes,
    wait_for,
)

pytestmark = pytest.mark.multiprocess

NUM_STEPS = 12
WORKLOAD = [*SMALL, *DENSE_REWARD, "model.dtype=float64", "run.save_samples=true", "run.checkpoint_every=100",
            "global_batch_size=8", f"num_rollout={NUM_STEPS}"]


def store_client(port: int, run_dir: Path, attempt: int = 0) -> Transport:
    """A client of start_nodes' run with the key of its attempt ``attempt`` (SLURM_RESTART_COUNT)."""
    return Transport.open(address=StoreAddress(host="127.0.0.1", port=port, hosted_by="rollout rank 0"),
                          is_host=False, run_id="bytest", secret=attempt_key(b"k" * 32, "bytest", attempt),
                          run_dir=run_dir, connect_timeout_s=30)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The uninterrupted run both tests end equal to (letter_fraction_waiting, one reward worker and the grace period
    of the second test change neither the samples nor the update: the same run, only slower)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "whole"
    result = run_job(run_dir, *WORKLOAD)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def captured(client: Transport, keys: list[str], procs: dict) -> dict[str, bytes]:
    """The raw values of ``keys`` in a running attempt's store, each as soon as it appears: what anyone who reaches
    the store can read (reading needs no key)."""
    found: dict[str, bytes] = {}
    while len(found) < len(keys) and all(p.poll() is None for p in procs.values()):
        found |= {k: client.get(k) for k in keys if k not in found and client.has(k)}
        time.sleep(0.02)
    return found


def test_warned_run_stops_at_a_checkpoint_and_the_requeued_one_resumes_to_the_uninterrupted_weights(job_dir, whole):
    """Attempt 0 is warned and stops at a checkpoint; its sealed ``requeue`` record and the ``abort`` that stops it
    for the requeue are read from its store and written into attempt 1's (same run id, secret and keys): refused, as
    sealed with attempt 0's key, and attempt 1 runs to the end."""
    split = job_dir("split")
    split.mkdir(parents=True)
    port = free_port()
    procs = start_nodes(split, *WORKLOAD, port=port)
    wait_for(lambda: (split / "metrics.jsonl").exists() and len(read_metrics(split)) >= 2, "two steps",
             running=procs.values(), details=lambda: {r: p.communicate()[1][-2000:] for r, p in procs.items()})
    client = store_client(port, split)
    client.put_record("rp/bytest/requeue", {"requested": True})  # what launch/requeue.py puts
    replay = captured(client, ["rp/bytest/requeue", "rp/bytest/abort"], procs)
    outputs = {role: p.communicate(timeout=120) for role, p in procs.items()}
    for role, p in procs.items():
        assert p.returncode == REQUEUE_EXIT, outputs[role][1][-3000:]
    stopped = latest_checkpoint(split)
    assert stopped is not None and stopped.step < NUM_STEPS - 1, "stopped early, at a checkpoint of its own"
    assert f"stopped after step {stopped.step}'s checkpoint" in outputs["trainer"][1]
    assert [m["step"] for m in read_metrics(split)] == list(range(stopped.step + 1))

    assert sorted(replay) == ["rp/bytest/abort", "rp/bytest/requeue"]
    assert b"requeue" in replay["rp/bytest/abort"]

    port = free_port()
    procs = start_nodes(split, *WORKLOAD, port=port, environ={"SLURM_RESTART_COUNT": "1"})  # the requeued job
    replayer = store_client(port, split, attempt=1)
    for key, raw in replay.items():
        replayer.set(key, raw)
    outputs = {role: p.communicate(timeout=180) for role, p in procs.items()}
    for role, p in procs.items():
        assert p.returncode == 0, outputs[role][1][-3000:]
    assert "Slurm requeued this job (1 time(s)): resuming from the run's last checkpoint" in outputs["trainer"][1]
    # trainer rank 0's requeue watch reads the requeue record every 0.5 s, the rollout loop the abort every poll
    for role, key in (("trainer", "rp/bytest/requeue"), ("rollout", "rp/bytest/abort")):
        assert f"refused a store record: {key}: not sealed with this run's secret" in outputs[role][1], role
    metrics = read_metrics(split)
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS)), "every step once"
    assert [m["run/requeues"] for m in metrics] == [0] * (stopped.step + 1) + [1] * (NUM_STEPS - stopped.step - 1)
    assert [(s["id"], s["response_ids"]) for s in read_samples(split)] == [
        (s["id"], s["response_ids"]) for s in read_samples(whole)]
    steps = [s.step for s in read_spans(split) if s.name == "train/optimizer_step"]
    assert sorted(steps) == [k for k in range(NUM_STEPS) for _ in range(2)], "no step's spans counted twice"
    a, b = (load_file(str(d / "checkpoints" / "final" / "model.safetensors")) for d in (whole, split))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-9


LONG_STEPS = {"RP_TEST_REWARD_SLEEP_UNTIL_REQUEUED_S": "0.6"}
"""Until the job is requeued, each reward waits 0.6 s: with one reward worker and 16 samples a step, a step takes at
least 9.6 s, longer than the 5 s trainer rank 0 gives the step in progress after the warning (requeue_grace_s=10
minus two margins of 2.5 s), so the warning always lands in a step that cannot end in time."""


def test_a_warning_during_a_step_longer_than_the_grace_period_loses_no_finished_step(job_dir, whole):
    """GPU steps last minutes, longer than Slurm's warning. Trainer rank 0 writes the last finished step's checkpoint
    as soon as it is warned (run.checkpoint_every=100: none was due), drops the step in progress, and the requeued
    run continues right after the last finished step: none is redone, and the weights are the uninterrupted run's."""
    overrides = [*WORKLOAD, "reward.name=letter_fraction_waiting", "reward.num_workers=1",
                 "launcher.requeue_grace_s=10"]
    split = job_dir("split")
    split.mkdir(parents=True)
    port = free_port()
    procs = start_nodes(split, *overrides, port=port, environ=LONG_STEPS)
    wait_for(lambda: (split / "metrics.jsonl").exists() and len(read_metrics(split)) >= 2, "two steps",
             running=procs.values(), details=lambda: {r: p.communicate()[1][-2000:] for r, p in procs.items()})
    store_client(port, split).put_record("rp/bytest/requeue", {"requested": True, "warned_s_ago": 2.0})  # what
    # launch/requeue.py puts: the grace period counts from Slurm's warning, 2 s before
    outputs = {role: p.communicate(timeout=120) for role, p in procs.items()}
    for role, p in procs.items():
        assert p.returncode == REQUEUE_EXIT, outputs[role][1][-3000:]
    kept = (split / "metrics.jsonl").read_text().splitlines()
    last = len(kept) - 1
    assert f"Slurm warned of the time limit 2s before it read the record: step {last}'s checkpoint is written" in \
        outputs["trainer"][1]
    assert "the step in progress did not end within launcher.requeue_grace_s=10s" in outputs["trainer"][1]
    assert latest_checkpoint(split).step == last, "the last finished step is on disk"

    procs = start_nodes(split, *overrides, environ={"SLURM_RESTART_COUNT": "1"})  # the requeued job
    outputs = {role: p.communicate(timeout=180) for role, p in procs.items()}
    for role, p in procs.items():
        assert p.returncode == 0, outputs[role][1][-3000:]
    lines = (split / "metrics.jsonl").read_text().splitlines()
    assert lines[: last + 1] == kept, "no finished step redone"
    assert [m["step"] for m in read_metrics(split)] == list(range(NUM_STEPS)), "every step once"
    assert [(s["id"], s["response_ids"]) for s in read_samples(split)] == [
        (s["id"], s["response_ids"]) for s in read_samples(whole)]
    a, b = (load_file(str(d / "checkpoints" / "final" / "model.safetensors")) for d in (whole, split))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-9


STEP = """import signal, sys, time
from pathlib import Path
from rolloutpipe.control.attempt import Outcome, write_outcome
from rolloutpipe.control.env import attempt_key
from rolloutpipe.control.transport import StoreAddress, Transport

def end(*args):  # what trainer rank 0 writes as the attempt ends, with the key of attempt {sealed_by}
    # ("stale": the previous attempt's outcome, which stopped for its requeue, left in the run directory)
    if {outcome!r} != "none":
        write_outcome(Path({run_dir!r}), attempt_key(b"k" * 32, "bytest", {sealed_by}), Outcome(
            attempt={sealed_by}, finished={outcome!r} == "finished", requeue={outcome!r} in ("requeue", "stale"),
            last_step=3, checkpoint_step=3, reason="test"))
    sys.exit({code})

signal.signal(signal.SIGTERM, end)  # scancel, a preemption: the wrapper forwards it
store = Transport.open(address=StoreAddress(host="127.0.0.1", port={port}, hosted_by="test"), is_host=False,
                       run_id="bytest", secret=attempt_key(b"k" * 32, "bytest", {restarts}), run_dir=Path("."),
                       connect_timeout_s=30)
print("ready", flush=True)
while {how!r} == "sigterm" or ({how!r} == "warned" and store.read_record("rp/bytest/requeue") is None):
    time.sleep(0.1)  # (warned: what trainer rank 0 waits for)
end()
"""
LOST_HOST = 137
"""srun's exit code when an engine host's task was SIGKILLed earlier in the run: the highest of every task's."""


@pytest.mark.parametrize("how,outcome,code,restarts,requeued,returns", [
    ("warned", "requeue", REQUEUE_EXIT, 0, True, REQUEUE_EXIT),
    ("warned", "requeue", LOST_HOST, 0, True, LOST_HOST),
    ("warned", "requeue", REQUEUE_EXIT, 3, False, REQUEUE_EXIT),
    ("warned", "finished", 0, 0, False, 0),
    ("quiet", "finished", LOST_HOST, 0, False, 0),
    ("warned", "failed", 1, 0, False, 1),
    ("warned", "stale", REQUEUE_EXIT, 1, False, REQUEUE_EXIT),
    ("quiet", "requeue", 1, 0, True, 1),
    ("sigterm", "requeue", 143, 0, False, 143),
], ids=["stopped-requeued", "stopped-after-a-lost-engine-host", "max-requeues-reached", "finished-meanwhile",
        "finished-after-a-lost-engine-host", "failed-on-its-own", "outcome-of-the-previous-attempt",
        "a-process-of-the-run-died", "stopped-from-outside"])
def test_the_wrapper_requeues_the_job_when_the_run_says_it_stopped_for_it(
        tmp_path, how, outcome, code, restarts, requeued, returns):
    """Slurm's warning (SIGUSR1 to the batch shell) becomes a sealed record in the run's store; once the step ends,
    the attempt's sealed outcome decides, not srun's exit code: stopped for the requeue -> requeued (unless
    launcher.max_requeues, 3, is reached), even when an engine host lost earlier makes srun exit 137; finished -> the
    job completes (exit 0), warned or not; a process of the run died without a word (the rollout manager's node lost:
    under --no-kill Slurm does not requeue) -> requeued unwarned; failed on its own, an outcome sealed in the
    previous attempt, or a stop from outside (scancel, Slurm's own requeue: SIGTERM to the batch shell) -> not."""
    host = Transport.open(address=StoreAddress(host="127.0.0.1", port=0, hosted_by="test"), is_host=True,
                          run_id="bytest", secret=attempt_key(b"k" * 32, "bytest", restarts), run_dir=tmp_path,
                          connect_timeout_s=30)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("launcher:\n  requeue_grace_s: 60\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    step = STEP.format(port=host.store.port, code=code, restarts=restarts, how=how, run_dir=str(run_dir),
                       outcome=outcome, sealed_by=restarts - 1 if outcome == "stale" else restarts)
    environ = {**node_environ(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "RP_RUN_DIR": str(run_dir),
               "RP_RUN_ID": "bytest", "RP_RUN_SECRET": (b"k" * 32).hex(), "RP_STORE_PORT": str(host.store.port),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST_HET_GROUP_0": "127.0.0.1",
               "SLURM_RESTART_COUNT": str(restarts)}
    wrapper = subprocess.Popen([sys.executable, "-m", "rolloutpipe.launch.requeue", "--", sys.executable, "-c", step],
                               cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wrapper.stdout.readline() == "ready\n"  # the step's handler is up (and so are the wrapper's)
    if how != "quiet":
        wrapper.send_signal(signal.SIGUSR1 if how == "warned" else signal.SIGTERM)  # Slurm's --signal=B:USR1@<grace>
    _, stderr = wrapper.communicate(timeout=60)
    assert wrapper.returncode == returns, stderr
    assert ("Slurm warned of the time limit" in stderr) == (how == "warned")
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 4242\n" if requeued else ""), stderr
    if restarts == 3:
        assert "not requeued: the job was requeued 3 times, launcher.max_requeues=3" in stderr
    if outcome in ("failed", "stale"):
        assert "not requeued: the run did not stop for the requeue" in stderr
