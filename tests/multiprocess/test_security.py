"""Only the run steers the run, tried as an outsider would: another process on the same machine that reaches the
store's port and knows the run id (config.yaml is world-readable), but not the secret.

- forged records written into a running job's store (tests/fixtures/outsider.py) are refused and the run finishes;
- a local run listens on loopback only (the store, the trainer's gloo group, the weight-update group, the engine
  servers);
- the secret is not in any child's environment, nor in NodeEnv's repr.

The engine servers' refusal of calls without the run's key is tests/multiprocess/test_sglang_client.py's; the
sealed records, heart-beats and handles one by one are tests/unit/test_transport.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rolloutpipe.control.env import NodeEnv, Role, free_port
from tests.conftest import (
    REPO,
    SMALL,
    descendants,
    listening_addresses,
    node_environ,
    read_metrics,
    start_nodes,
    wait_for,
)

DISTRIBUTED = ["rollout.engine=embedded_http", "pipeline.weight_sync=distributed", "rollout.num_engines=2"]


@pytest.mark.parametrize("mode,extra", [("disk", []), ("distributed", DISTRIBUTED)])
def test_records_forged_into_a_running_jobs_store_are_refused_and_the_run_finishes(job_dir, mode, extra):
    run_dir = job_dir(mode)
    port = free_port()
    overrides = [*SMALL, *extra, "pipeline.connect_timeout_s=60"]
    nodes = start_nodes(run_dir, *overrides, roles=("rollout",), port=port)
    outsider = subprocess.run([sys.executable, "-m", "tests.fixtures.outsider", str(port), "bytest", mode],
                              cwd=REPO, env=node_environ(), capture_output=True, text=True, timeout=90)
    assert outsider.returncode == 0, outsider.stderr
    # The rollout reads these before their genuine versions can exist (the trainer is not started yet), so it must
    # refuse them: wait for the refusals in its log, then start the trainer, which writes the genuine ones.
    first_read = ("abort", "trainer/ready" if mode == "disk" else "weight_sync/group")
    rollout_log: list[str] = []
    reader = threading.Thread(target=lambda: rollout_log.extend(nodes["rollout"].stderr), daemon=True)
    reader.start()
    wait_for(lambda: all(any(f"rp/bytest/{key}: not sealed" in line for line in rollout_log) for key in first_read),
             f"refusal of {first_read} in the rollout's log", timeout_s=120, running=[nodes["rollout"]],
             details=lambda: "".join(rollout_log)[-3000:])
    nodes |= start_nodes(run_dir, *overrides, roles=("trainer",), port=port)
    trainer_out, trainer_err = nodes["trainer"].communicate(timeout=240)
    nodes["rollout"].wait(timeout=60)
    reader.join(timeout=10)
    assert nodes["trainer"].returncode == 0, trainer_err[-3000:]
    assert nodes["rollout"].returncode == 0, "".join(rollout_log)[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1]  # nothing forged was acted on

def test_a_local_run_listens_on_loopback_only_and_no_child_inherits_the_secret(job_dir):
    run_dir = job_dir("sockets")
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *SMALL, *DISTRIBUTED,
                             "trainer.num_ranks=2", "num_rollout=3"],
                            cwd=run_dir.parent, env=node_environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    seen: set[str] = set()
    secret_holders: set[str] = set()
    while proc.poll() is None:
        pids = descendants(proc.pid)
        seen |= set(listening_addresses(*pids))
        for pid in pids[1:]:  # the launcher itself hands the secret to its children
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if b"RP_RUN_SECRET=" in environ and "rolloutpipe.launch.node" not in command:
                secret_holders.add(command)
        time.sleep(0.2)
    _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    # the store, the trainer's gloo pairs, the weight-update rendezvous and its gloo pairs, two engine servers
    assert len(seen) >= 5, seen
    assert all(address.startswith(("127.", "::1")) for address in seen), seen
    assert not secret_holders, f"processes that inherited the run's secret: {secret_holders}"


def test_node_env_never_prints_the_secret():
    env = NodeEnv(role=Role.rollout, rank=0, world_size=1, store_host="127.0.0.1", store_port=1, run_id="r",
                  secret=bytes.fromhex("ab" * 32), run_dir=Path("/run"))
    assert "ab" * 8 not in repr(env) and "ab" * 8 not in str(env)
    assert os.environ.get("RP_RUN_SECRET") is None
