"""Stop and continue the way Slurm does (launch/requeue.py): warned before the time limit, the run stops after a
step's checkpoint, every process exits REQUEUE_EXIT, and the requeued job (SLURM_RESTART_COUNT > 0) resumes from
that checkpoint by itself; the update is that of an uninterrupted run. Here without Slurm: the batch script's
``requeue`` record is put into the store by hand, and the requeue wrapper runs around a stand-in for srun. (On the
Slurm cluster: tests/test_slurm_requeue.py.)"""

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
from rolloutpipe.control.env import free_port
from rolloutpipe.control.lifetime import REQUEUE_EXIT
from rolloutpipe.control.transport import StoreAddress, Transport
from rolloutpipe.observe.metrics import read_spans

from .conftest import (
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


def store_client(port: int, run_dir: Path) -> Transport:
    return Transport.open(address=StoreAddress(host="127.0.0.1", port=port, hosted_by="rollout rank 0"),
                          is_host=False, run_id="bytest", secret=b"k" * 32, run_dir=run_dir, connect_timeout_s=30)


def test_warned_run_stops_at_a_checkpoint_and_the_requeued_one_resumes_to_the_uninterrupted_weights(job_dir):
    whole, split = job_dir("whole"), job_dir("split")
    assert run_job(whole, *WORKLOAD).returncode == 0
    split.mkdir(parents=True)
    port = free_port()
    procs = start_nodes(split, *WORKLOAD, port=port)
    wait_for(lambda: (split / "metrics.jsonl").exists() and len(read_metrics(split)) >= 2, "two steps",
             running=procs.values(), details=lambda: {r: p.communicate()[1][-2000:] for r, p in procs.items()})
    store_client(port, split).put_record("rp/bytest/requeue", {"requested": True})  # what launch/requeue.py puts
    outputs = {role: p.communicate(timeout=120) for role, p in procs.items()}
    for role, p in procs.items():
        assert p.returncode == REQUEUE_EXIT, outputs[role][1][-3000:]
    stopped = latest_checkpoint(split)
    assert stopped is not None and stopped.step < NUM_STEPS - 1, "stopped early, at a checkpoint of its own"
    assert f"stopped after step {stopped.step}'s checkpoint" in outputs["trainer"][1]
    assert [m["step"] for m in read_metrics(split)] == list(range(stopped.step + 1))

    procs = start_nodes(split, *WORKLOAD, environ={"SLURM_RESTART_COUNT": "1"})  # the requeued job: same config
    outputs = {role: p.communicate(timeout=180) for role, p in procs.items()}
    for role, p in procs.items():
        assert p.returncode == 0, outputs[role][1][-3000:]
    assert "Slurm requeued this job (1 time(s)): resuming from the run's last checkpoint" in outputs["trainer"][1]
    metrics = read_metrics(split)
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS)), "every step once"
    assert [m["run/requeues"] for m in metrics] == [0] * (stopped.step + 1) + [1] * (NUM_STEPS - stopped.step - 1)
    assert [(s["id"], s["response_ids"]) for s in read_samples(split)] == [
        (s["id"], s["response_ids"]) for s in read_samples(whole)]
    steps = [s.step for s in read_spans(split) if s.name == "train/optimizer_step"]
    assert sorted(steps) == [k for k in range(NUM_STEPS) for _ in range(2)], "no step's spans counted twice"
    a, b = (load_file(str(d / "checkpoints" / "final" / "model.safetensors")) for d in (whole, split))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-9


STEP = """import sys, time
from pathlib import Path
from rolloutpipe.control.transport import StoreAddress, Transport
store = Transport.open(address=StoreAddress(host="127.0.0.1", port={port}, hosted_by="test"), is_host=False,
                       run_id="bytest", secret=b"k" * 32, run_dir=Path("."), connect_timeout_s=30)
while store.read_record("rp/bytest/requeue") is None:  # what trainer rank 0 waits for
    time.sleep(0.1)
sys.exit({code})
"""


@pytest.mark.parametrize("code,restarts,requeued", [(REQUEUE_EXIT, 0, True), (REQUEUE_EXIT, 3, False), (0, 0, False)],
                         ids=["stopped-requeued", "max-requeues-reached", "finished-meanwhile"])
def test_the_wrapper_asks_the_run_to_stop_through_the_store_and_requeues_the_job_once_it_did(
        tmp_path, code, restarts, requeued):
    """Slurm's warning (SIGUSR1 to the batch shell) becomes a sealed record in the run's store; once the step ends
    with REQUEUE_EXIT the job is requeued, unless launcher.max_requeues (3) is reached or the run finished."""
    host = Transport.open(address=StoreAddress(host="127.0.0.1", port=0, hosted_by="test"), is_host=True,
                          run_id="bytest", secret=b"k" * 32, run_dir=tmp_path, connect_timeout_s=30)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("launcher:\n  requeue_grace_s: 60\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    step = STEP.format(port=host.store.port, code=code)
    environ = {**node_environ(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "RP_RUN_DIR": str(run_dir),
               "RP_RUN_ID": "bytest", "RP_RUN_SECRET": (b"k" * 32).hex(), "RP_STORE_PORT": str(host.store.port),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST_HET_GROUP_0": "127.0.0.1",
               "SLURM_RESTART_COUNT": str(restarts)}
    wrapper = subprocess.Popen([sys.executable, "-m", "rolloutpipe.launch.requeue", "--", sys.executable, "-c", step],
                               cwd=REPO, env=environ, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # (a warning before the wrapper's handler is up is caught by the batch script's trap)
    wrapper.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@<grace>
    _, stderr = wrapper.communicate(timeout=60)
    assert wrapper.returncode == code, stderr
    assert "Slurm warned of the time limit" in stderr
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 4242\n" if requeued else ""), stderr
    if restarts == 3:
        assert "not requeued: the job was requeued 3 times, launcher.max_requeues=3" in stderr
