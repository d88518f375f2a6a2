"""Fault injection: a node-group process is SIGKILLed at a chosen point, the run is resumed, and nothing is lost
or trained twice: every prompt of the data is trained exactly once and the final weights equal those of an
uninterrupted run (float64, so only floating-point accumulation order could differ)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rolloutpipe.control.attempt import read_outcome
from rolloutpipe.control.env import attempt_key
from rolloutpipe.control.lifetime import PEER_STOPPED_EXIT
from rolloutpipe.rollout.tasks import ReversalTaskConfig, write_reversal_jsonl

from ..conftest import DENSE_REWARD, SMALL, outputs_of, read_metrics, read_samples, run_job, start_nodes

pytestmark = pytest.mark.multiprocess

NUM_STEPS, PROMPTS_PER_STEP = 3, 4


def workload(data: Path) -> list[str]:
    return [*SMALL, *DENSE_REWARD, "model.dtype=float64", "run.save_samples=true", "run.checkpoint_every=1",
            "global_batch_size=8", f"num_rollout={NUM_STEPS}", f"data.path={data}", "pipeline.peer_timeout_s=3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    cfg = ReversalTaskConfig(num_rows=NUM_STEPS * PROMPTS_PER_STEP, seed=7)
    return write_reversal_jsonl(cfg, tmp_path_factory.mktemp("data") / "rows.jsonl")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data) -> dict:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = run_job(run_dir, *workload(data))
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


# (point, the process it kills, which call of the point dies); each lands in step 1 or at the start of step 2
FAULTS = [
    ("mid_rollout", "rollout", 24),  # the 24th rewarded sample: step 1 is half generated
    ("mid_dispatch", "rollout", 6),  # step 1's second group is being published
    ("mid_optimizer_step", "trainer", 4),  # step 1's second optimizer step (2 per step)
    ("mid_checkpoint_write", "trainer", 2),  # step 1's checkpoint: weights written, optimizer not
    ("during_weight_sync", "rollout", 2),  # the engines loading policy_version 2
]


@pytest.mark.parametrize("point,victim,nth", FAULTS, ids=[f[0] for f in FAULTS])
def test_killed_and_resumed_run_trains_every_prompt_once_and_matches_the_uninterrupted_run(
        tmp_path, data, uninterrupted, point, victim, nth):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = start_nodes(run_dir, *workload(data), commands={victim: ["-m", "tests.faults.inject", point, str(nth)]})
    outputs = {role: p.communicate(timeout=180) for role, p in procs.items()}
    assert procs[victim].returncode == -9, outputs[victim][1][-2000:]
    survivor = "trainer" if victim == "rollout" else "rollout"
    assert procs[survivor].returncode == PEER_STOPPED_EXIT, outputs[survivor][1][-2000:]
    assert not (run_dir / "checkpoints" / "final").exists()

    resumed = run_job(run_dir, *workload(data), "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS))
    trained = [s["prompt_index"] for s in read_samples(run_dir) if s["id"].endswith("sample=0")]
    assert sorted(trained) == list(range(NUM_STEPS * PROMPTS_PER_STEP)), "every prompt trained exactly once"
    final = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert max((final[k] - uninterrupted[k]).abs().max().item() for k in final) < 1e-9


# A stop (SIGTERM: a preemption, scancel, scontrol requeue) with no checkpoint due: every finished step is kept.
# (point, the process it stops, which call of the point stops it, the last finished step: the checkpoint written)
STOPS = [
    ("mid_optimizer_step", "trainer", 4, 0),  # step 1's second optimizer step: the model is half-way through step 1
    ("during_weight_sync", "rollout", 2, 0),  # step 1 is trained, its weights not served: its metrics not written
]


@pytest.mark.parametrize("point,victim,nth,finished", STOPS, ids=[f[0] for f in STOPS])
def test_a_stop_writes_the_last_finished_steps_checkpoint_and_the_resume_matches_the_uninterrupted_run(
        tmp_path, data, uninterrupted, point, victim, nth, finished):
    """With run.checkpoint_every=100 no checkpoint is due, so only the stop checkpoint (trainer/restore.py) keeps
    step ``finished``: written from the copy taken when its metrics were, not from the live model, which is already
    one optimizer step into step 1 in the first case. The resumed run continues after it without redoing it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [*workload(data), "run.checkpoint_every=100"]
    procs = start_nodes(run_dir, *overrides,
                        commands={victim: ["-m", "tests.faults.inject", point, str(nth), "SIGTERM"]})
    outputs = {role: p.communicate(timeout=180) for role, p in procs.items()}
    assert procs[victim].returncode == 128 + 15, outputs[victim][1][-2000:]
    assert f"stopping: step {finished}'s checkpoint is written (the last finished step)" in outputs["trainer"][1], (
        outputs["trainer"][1][-3000:])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step={finished}"]
    kept = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == list(range(finished + 1))

    resumed = run_job(run_dir, *overrides, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines[: finished + 1] == kept, "the finished steps' records are kept, not redone"
    assert [json.loads(line)["step"] for line in lines] == list(range(NUM_STEPS))
    trained = [s["prompt_index"] for s in read_samples(run_dir) if s["id"].endswith("sample=0")]
    assert sorted(trained) == list(range(NUM_STEPS * PROMPTS_PER_STEP)), "every prompt trained exactly once"
    final = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert max((final[k] - uninterrupted[k]).abs().max().item() for k in final) < 1e-9


# Engine failure: the run goes on. (point, rollout.engine, which call of the point fails, weight sync, the trainer,
# rollout.num_engines): each in step 1 or at its end
ENGINE_FAULTS = [
    ("engine_crash", "embedded", 14, "disk", "torch", 2),  # a decode step of step 1 raises in an engine's scheduler
    ("engine_server_killed", "embedded_http", 20, "disk", "torch", 2),  # step 1's 4th request: its server SIGKILLed
    # the same under broadcast weight sync: the replacement joins a new weight-update group before step 2's policy
    ("engine_server_killed", "embedded_http", 20, "distributed", "torch", 2),
    # the same with the only engine (step 1's 4th request; step 0 made 16): no engine is left in service, so trainer
    # rank 0 sends policy 1 again mid-step, to a group of the replacement alone, before it takes the step's first
    # group (no optimizer step of step 1 has come: a batch is 2 groups)
    ("engine_server_killed", "embedded_http", 20, "distributed", "torch", 1),
    # the same with the policy sharded over two FSDP ranks: the other rank joins rank 0's gathers mid-step; and over
    # two Megatron tensor-parallel ranks (each bucket gathered from both)
    ("engine_server_killed", "embedded_http", 20, "distributed", "fsdp", 1),
    ("engine_server_killed", "embedded_http", 20, "distributed", "megatron-tp2", 1),
    # an engine's server dies during the broadcast of step 2's policy (the 3rd load: 2 engines), between its first
    # and second bucket: the other engine gives the broadcast up, and the policy goes again to a new group. Trainer
    # rank 0 had applied part of the step's update bucket by bucket; the second send applies the rest, once
    ("engine_server_killed_mid_broadcast", "embedded_http", 3, "distributed", "torch", 2),
    # the same with the policy sharded over two FSDP ranks: the first send's gathers stop at the bucket in hand, and
    # the second gathers every bucket again, the other rank joining each
    ("engine_server_killed_mid_broadcast", "embedded_http", 3, "distributed", "fsdp", 2),
]


TRAINERS = {"torch": ["trainer.backend=torch"], "fsdp": ["trainer.backend=fsdp", "trainer.num_ranks=2"],
            "megatron-tp2": ["trainer.backend=megatron", "trainer.num_ranks=2",
                             "trainer.megatron.tensor_parallel_size=2"]}


@pytest.mark.parametrize("point,engine,nth,weight_sync,trainer,num_engines", ENGINE_FAULTS,
                         ids=[f"{f[0]}-{f[3]}-{f[4]}-{f[5]}" for f in ENGINE_FAULTS])
def test_a_failed_engine_loses_no_sample_and_the_run_matches_the_uninterrupted_one(
        tmp_path, data, uninterrupted, point, engine, nth, weight_sync, trainer, num_engines):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = start_nodes(run_dir, *workload(data), f"rollout.engine={engine}", f"rollout.num_engines={num_engines}",
                        f"pipeline.weight_sync={weight_sync}", "pipeline.weight_sync_bucket_mb=0.001",  # 1 KiB: buckets
                        *TRAINERS[trainer], commands={"rollout": ["-m", "tests.faults.inject", point, str(nth)]})
    outputs = outputs_of(procs, 180)
    for role, p in procs.items():
        assert p.returncode == 0, outputs[role][1][-3000:]
    assert "restarted as engine" in outputs["rollout"][1], "the fault never fired"

    samples = read_samples(run_dir)
    assert sorted(s["id"] for s in samples) == sorted(
        f"step={k}/group={g}/sample={s}" for k in range(NUM_STEPS) for g in range(PROMPTS_PER_STEP)
        for s in range(4)), "every sample of every step exactly once"
    restarts = [s for s in spans(run_dir) if s[0] == "rollout/engine_restart"]
    assert len(restarts) == 1 and restarts[0][1] == 1, restarts  # one restart, in step 1
    again = [s for s in spans(run_dir) if s[0] == "sync/weights_again"]
    assert [s[1] for s in again] == ([1] if num_engines == 1 else []), again  # the policy sent again mid-step 1
    final = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    # (Megatron against the torch backend: HF's float32 RMSNorm shows, ~1e-6; a policy sent wrong moves ~lr)
    assert max((final[k] - uninterrupted[k]).abs().max().item() for k in final) < (
        2e-5 if trainer.startswith("megatron") else 1e-9)


def test_the_only_engine_lost_after_the_first_training_batch_requeues_and_the_resume_matches(
        tmp_path, data, uninterrupted):
    """Distributed sync, one engine, two training batches per step (concurrency 4: one group at a time): its server
    dies as step 1's second group is published, so trainer rank 0 may have stepped past policy 1 before the
    replacement could take it. The run stops to be requeued (outcome ``requeue``, step 0's checkpoint), and the
    resume ends with the weights of the uninterrupted run."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [*workload(data), "rollout.engine=embedded_http", "rollout.num_engines=1", "rollout.concurrency=4",
                 "pipeline.weight_sync=distributed"]
    procs = start_nodes(run_dir, *overrides, commands={"rollout": ["-m", "tests.faults.inject",
                                                                   "engines_killed_at_publish", "6"]})
    outputs = outputs_of(procs, 180)
    assert procs["rollout"].returncode == 1, outputs["rollout"][1][-3000:]
    stderr = outputs["rollout"][1]
    assert re.search(r"PolicyGone: engine engine0 failed mid-step\. .*\(\d groups of step 1 published, a training "
                     r"batch is 2\); stopping the run to be requeued", stderr), stderr[-3000:]
    outcome = read_outcome(run_dir, attempt_key(b"k" * 32, "bytest", 0), 0)  # (start_nodes' secret and run id)
    assert outcome is not None and outcome.requeue and not outcome.finished, outputs["trainer"][1][-3000:]
    assert outcome.checkpoint_step == 0 and "PolicyGone" in outcome.reason, outcome

    resumed = run_job(run_dir, *overrides, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(NUM_STEPS))
    final = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert max((final[k] - uninterrupted[k]).abs().max().item() for k in final) < 1e-9


def test_with_max_engine_failures_zero_a_failed_engine_stops_the_run_naming_it(tmp_path, data):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = start_nodes(run_dir, *workload(data), "rollout.num_engines=2", "rollout.max_engine_failures=0",
                        commands={"rollout": ["-m", "tests.faults.inject", "engine_crash", "3"]})
    outputs = {role: p.communicate(timeout=180) for role, p in procs.items()}
    assert procs["rollout"].returncode == 1 and procs["trainer"].returncode == PEER_STOPPED_EXIT
    assert re.search(r"engine engine\d failed: RuntimeError\('injected crash of engine engine\d'\)\. That is "
                     r"failure 1 .* rollout.max_engine_failures=0; stopping the run\. Look at engine\d runs inside "
                     r"the rollout process", outputs["rollout"][1]), outputs["rollout"][1][-3000:]


def spans(run_dir: Path) -> list[list]:
    """Every span the rollout node recorded: [name, step, start_us, end_us, attrs]."""
    lines = (run_dir / "spans" / "rollout-0.jsonl").read_text().splitlines()
    return [s for line in lines if "spans" in (record := json.loads(line)) for s in record["spans"]]
