"""A node process ends with nothing of the run still running: no thread with a store client, no process group.

Why it matters: a thread still inside a c10d store call when the interpreter finalizes aborts the process as the
call returns ("terminate called without an active exception", SIGABRT: re-taking the GIL then ends the thread with
pthread_exit, whose unwinding cannot cross pybind11's noexcept guard). A trainer rank died that way once, under
load, in the 2-rank bfloat16 parity run. The abort itself needs a store reply to land inside the few milliseconds
of teardown, so the test checks what rules it out instead: when ``run_node`` returns, no thread that waits on a store
client and no gloo thread is left (trainer/node.py, ``TrainerNode.close``; control/liveness.py, ``Liveness.stop``).
Each store client's own calls thread (control/bounded_store.py) stays, idle: a process leaving with a call in flight
skips the finalization (launch/node.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from rolloutpipe.config import load_config, save_config
from rolloutpipe.control.clock import ClockServer
from rolloutpipe.control.env import NodeEnv, Role, attempt_key, loopback_interface
from rolloutpipe.control.transport import StoreAddress, Transport
from rolloutpipe.rollout.samples import RewardThreads
from rolloutpipe.types import FinishReason
from tests.conftest import REPO, SMALL, node_environ, wait_for

pytestmark = pytest.mark.multiprocess

TRAINER_RANK = """
import json, os, sys, threading
from rolloutpipe.config import read_config
from rolloutpipe.control.env import NodeEnv
from rolloutpipe.control.transport import TransportError
from rolloutpipe.pipeline import run_node

env = NodeEnv.take()
try:
    run_node(read_config(env.config_path), env)
except TransportError as err:
    print(f"stopped: {err}", file=sys.stderr)
except Exception as err:  # noqa: BLE001 - a failed start: what launch/node.py prints, then the threads
    print(f"failed: {type(err).__name__}: {err}", file=sys.stderr)
native = []
for t in os.listdir("/proc/self/task"):
    try:
        native.append(open(f"/proc/self/task/{t}/comm").read().strip())
    except FileNotFoundError:  # that thread ended between the listing and the read: not alive into teardown
        pass
print(json.dumps({"python": [t.name for t in threading.enumerate()], "native": native}))
"""
"""One trainer rank as launch/node.py runs it; then the threads still alive in its process, Python's and the
kernel's (gloo names its C++ threads ``gloo_tcp_loop`` and ``pt_gloo_runloop``)."""
STORE_THREADS = ("heartbeat-", "requeue-watch")
"""A trainer rank's threads with a store client of their own (others, like tqdm's monitor, hold none)."""


@pytest.mark.parametrize("how", ["abort", "truncated-model"])
def test_a_stopped_trainer_rank_leaves_no_thread_or_process_group_into_interpreter_teardown(tmp_path, how):
    """Two trainer ranks (so a gloo process group, and rank 0's requeue watch) stop on an abort while they wait for
    their first group: the error path of pipeline.run_node, the one every failure and stop signal takes. Or they fail
    to start, after their process group exists: the model file is truncated (the node releases what it made)."""
    run_dir = tmp_path / "run"
    model = []
    if how == "truncated-model":
        from rolloutpipe.model import ModelConfig, build_tiny_tokenizer, load_model, save_hf_checkpoint

        tokenizer = build_tiny_tokenizer()
        save_hf_checkpoint(load_model(ModelConfig(), len(tokenizer)), tokenizer, tmp_path / "model")
        weights = tmp_path / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        model = [f"model.path={tmp_path / 'model'}"]
    cfg = load_config(OmegaConf.from_dotlist([*SMALL, "trainer.num_ranks=2", "wandb.mode=disabled", *model,
                                              f"run.dir={run_dir}", "run.id=bytest"]))
    save_config(cfg, run_dir / "config.yaml")
    host = Transport.open(address=StoreAddress(host="127.0.0.1", port=0, hosted_by="this test"), is_host=True,
                          run_id="bytest", secret=attempt_key(b"k" * 32, "bytest", 0), run_dir=run_dir,
                          connect_timeout_s=30)
    host.address.port = host.store.port
    clock = ClockServer(host.connect_another()).start()  # what rollout rank 0 serves; the ranks measure against it
    environ = {**node_environ(), **({"GLOO_SOCKET_IFNAME": i} if (i := loopback_interface()) else {})}
    ranks = [subprocess.Popen(
        [sys.executable, "-c", TRAINER_RANK], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**environ, **NodeEnv(role=Role.trainer, rank=r, world_size=2, store_host="127.0.0.1",
                                  store_port=host.store.port, run_id="bytest", secret=b"k" * 32,
                                  run_dir=run_dir).to_environ()})
        for r in range(2)]
    try:
        if how == "abort":
            wait_for(lambda: host.read_record(host.key("trainer", "ready")), "trainer rank 0 to start", running=ranks)
            host.abort("this test stops the run")
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
        clock.stop()
    for r, (rank, (out, err)) in enumerate(zip(ranks, outputs)):
        said = "this test stops the run" if how == "abort" else "failed: "
        assert rank.returncode == 0 and said in err, f"trainer rank {r}:\n{err[-3000:]}"
        threads = json.loads(out.splitlines()[-1])
        assert not [t for t in threads["python"] if t.startswith(STORE_THREADS)], f"trainer rank {r}: {threads}"
        assert not [t for t in threads["native"] if "gloo" in t], f"trainer rank {r}: {threads}"


def test_a_stopping_rollout_node_rewards_none_of_the_results_still_queued():
    """With a slow reward, a step's results queue up behind the reward workers; a stop (Slurm's warning, a failed
    peer) waits for the calls in progress only, not for the rewards of a step that will be redone (seen on the
    Slurm cluster: rollout rank 0 was still rewarding when the time limit's margin came)."""
    threads = RewardThreads(pool=None, tokenizer=None, num_threads=1, spans=None)
    rewarded, started, release = [], threading.Event(), threading.Event()

    def reward(result) -> None:  # the one call in progress holds until the stop has begun
        rewarded.append(result)
        started.set()
        release.wait(timeout=30)

    threads._reward = reward
    for result in range(5):
        threads.on_result(result)
    assert started.wait(timeout=30)
    closer = threading.Thread(target=threads.close)
    closer.start()
    wait_for(lambda: threads.results.qsize() == 5, "close to queue its stop")  # 4 results, then the stop
    release.set()
    closer.join(timeout=30)
    assert not closer.is_alive() and rewarded == [0] and threads.idle()


def test_a_reward_call_in_progress_when_the_node_stops_completes_no_group():
    """The node stops its engines and its dispatcher while the reward calls in progress end (RolloutNode.close): what
    such a call returns must not complete a group, which the dispatcher would then publish into a closing run."""
    threads = RewardThreads(pool=None, tokenizer=None, num_threads=1, spans=SimpleNamespace(add=lambda *a, **k: None))
    started, release, completed = threading.Event(), threading.Event(), []

    def score(result, ctx, step):  # the one call in progress holds until the stop has begun
        started.set()
        release.wait(timeout=30)
        return SimpleNamespace(group=ctx.group, completed_s=0.0)

    threads._score = score
    assembler = SimpleNamespace(step=0, add=lambda sample: sample)  # every sample completes its group
    threads.begin_step(assembler, {"r0": SimpleNamespace(group=0, sample=0, episode=None)}, completed.append)
    threads.on_result(SimpleNamespace(request_id="r0", started_s=0.0, finished_s=0.0, submitted_s=0.0, engine="e0",
                                      output_ids=[], finish_reason=FinishReason.STOP, policy_version=0))
    assert started.wait(timeout=30)
    closer = threading.Thread(target=threads.close)
    closer.start()
    wait_for(lambda: threads.results.qsize() == 1, "close to queue its stop")
    release.set()
    closer.join(timeout=30)
    assert not closer.is_alive() and threads.error is None and threads.idle()
    assert completed == []


LEAVING = """
import atexit, datetime, gc, sys, threading, time
import torch.distributed as dist
from rolloutpipe.launch.node import exit_with

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
waiting = threading.Event()


def wait() -> None:  # torch's C++, the GIL released, returning once the interpreter finalizes
    waiting.set()
    try:
        store.wait(["never written"], datetime.timedelta(seconds=1))
    except Exception:  # noqa: BLE001 - the wait's timeout: what matters is that it returns
        pass


class SlowTeardown:  # garbage in a cycle: the finalizing interpreter's collection frees it, slower than the wait
    def __del__(self, sleep=time.sleep, finalizing=sys.is_finalizing) -> None:
        if finalizing():
            sleep(3)


threading.Thread(target=wait, daemon=True).start()
waiting.wait()
gc.set_threshold(1_000_000)  # no collection before the one at exit
teardown = SlowTeardown()
teardown.cycle = teardown
del teardown
atexit.register(lambda: print("exit handler ran", flush=True))
print("written, unflushed", end="")
exit_with(int(sys.argv[1]))
"""
"""A node process leaving while a thread of its own is inside torch's C++ (a raw store call here; gloo's worker
thread freeing the last collective's tensors in the run that aborted), which returns only once the interpreter
would be finalizing."""


@pytest.mark.parametrize("code", [0, 3])
def test_a_node_leaves_with_its_exit_code_while_a_thread_is_inside_torch(code):
    """launch/node.py ``exit_with``: the exit handlers run and the streams are flushed, then the process leaves
    without finalizing the interpreter. (Finalizing, the thread's return into Python aborts it: SIGABRT. An FSDP
    trainer rank did so under load after a run that finished, 3 times in 186 runs on torch 2.9.)"""
    done = subprocess.run([sys.executable, "-c", LEAVING, str(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == code, done.stderr[-3000:]
    assert done.stdout == "written, unflushedexit handler ran\n", done.stdout
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
