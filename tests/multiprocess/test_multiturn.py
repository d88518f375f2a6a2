"""Multi-turn episodes in whole runs: on-policy bits under CGP and FGD, a real Gymnasium environment, and an
environment that fails every way at once while the run goes on."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SMALL, needs_extra, read_metrics, read_samples, run_job, run_jobs
from tests.helpers.parity import EXACT, publish_order, weights_digests

pytestmark = pytest.mark.multiprocess

SCRIPTED = ["environment.name=scripted", "environment.import_modules=[tests.fixtures.environments]",
            "environment.num_workers=2", "environment.max_turn_tokens=6", "rollout_max_response_len=80",
            "data.apply_chat_template=true", "run.save_samples=true"]
"""Three-turn episodes of the scripted environment (tests/fixtures/environments.py) on the synthetic task's rows."""


def test_multiturn_sync_and_cgp_with_fgd_train_the_same_bits(job_dir):
    """Ten steps of three-turn episodes: sync on one rank, cgp with FGD on two, the environment's seeded delays making
    the groups complete in other orders. The same episodes (ids and masks), and every step's weights the same bits.
    Evaluation rides in the tail (steps 0 and 5, the synthetic task's held-out rows as episodes): the same metrics."""
    runs = {mode: job_dir(mode) for mode in ("sync", "cgp")}
    results = run_jobs({mode: (runs[mode], [*SMALL, *SCRIPTED, *EXACT, "num_rollout=10", "rollout.num_engines=2",
                                            "eval.interval=5", "environment.num_workers=4", "rollout.concurrency=6",
                                            f"pipeline.mode={mode}", *extra], {"RP_TEST_ENV_JITTER": jitter})
                        for mode, jitter, extra in (("sync", "1", ["trainer.num_ranks=1"]),
                                                    ("cgp", "5", ["trainer.num_ranks=2", "rollout.admission=fgd"]))},
                       timeout_s=600)
    for result in results.values():
        assert result.returncode == 0, result.stderr[-3000:]
    samples = {mode: [(s["id"], s["batch"], s["response_ids"], s["response_mask"]) for s in read_samples(run_dir)]
               for mode, run_dir in runs.items()}
    assert samples["sync"] == samples["cgp"]
    assert {sum(mask) < len(mask) for *_, mask in samples["sync"]} == {True}, "every episode has tool turns"
    assert publish_order(runs["sync"]) != publish_order(runs["cgp"]), "the groups must arrive in other orders"
    metrics = read_metrics(runs["cgp"])
    assert [m["rollout/episodes_done"] for m in metrics] == [16] * 10 and metrics[0]["rollout/turns_mean"] == 3
    digests = {mode: weights_digests(run_dir) for mode, run_dir in runs.items()}
    assert len(digests["sync"]) == 10 and digests["sync"] == digests["cgp"], digests
    evals = {mode: [{k: v for k, v in m.items() if k.startswith("eval/reversal_heldout/")}
                    for m in read_metrics(run_dir) if m["step"] % 5 == 0] for mode, run_dir in runs.items()}
    assert evals["sync"] == evals["cgp"] and evals["sync"][1]["eval/reversal_heldout/num_samples"] == 32, evals


def test_a_failing_environment_is_counted_and_the_run_goes_on(job_dir, tmp_path):
    """Rows whose environment raises, returns a number for text, hangs past its timeout, or floods the context: each
    episode ends counted (reward 0, a timeout a timeout), and the run finishes its steps."""
    faults = ["raise", "non_text", "hang", "flood", None, None, None, None]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "ab", "label": f"row{i}", "metadata": {"fault": f} if f else {}})
                            + "\n" for i, f in enumerate(faults)))
    run_dir = job_dir("faults")
    result = run_job(run_dir, *SMALL, *SCRIPTED, f"data.path={path}", "environment.timeout_s=2", "eval.interval=0",
                     "reward.on_timeout=zero", "reward.max_failure_fraction=1.0", "rollout_batch_size=8",
                     "global_batch_size=32", "data.shuffle=false", timeout_s=400)
    assert result.returncode == 0, result.stderr[-3000:]
    ends = {}
    for s in read_samples(run_dir):
        ends.setdefault(s["episode_end"], set()).add(s["reward_error"] is not None)
    assert ends == {"env_error": {True}, "env_timeout": {True}, "overflow": {False}, "done": {False}}, ends
    metrics = read_metrics(run_dir)
    assert [(m["rollout/episodes_env_error"], m["rollout/episodes_env_timeout"], m["rollout/episodes_overflow"])
            for m in metrics] == [(8, 4, 4)] * 2


@needs_extra("gymnasium", "gymnasium")
def test_a_gymnasium_environment_trains_end_to_end(job_dir, tmp_path):
    """FrozenLake-v1 (Gymnasium's own) through the adapter: episodes of several moves, each seeded by its row."""
    path = tmp_path / "lake.jsonl"
    path.write_text("".join(json.dumps({"prompt": "walk to the goal 0 left 1 down 2 right 3 up", "label": i,
                                        "metadata": {"seed": i}}) + "\n" for i in range(8)))
    run_dir = job_dir("lake")
    result = run_job(run_dir, *SMALL, "environment.name=gymnasium", "+environment.args.id=FrozenLake-v1",
                     "+environment.args.kwargs.is_slippery=false", "+environment.args.max_invalid_actions=3",
                     "environment.max_turns=6", "environment.max_turn_tokens=4", "rollout_max_response_len=120",
                     "data.apply_chat_template=true", f"data.path={path}", "eval.interval=0", "run.save_samples=true")
    assert result.returncode == 0, result.stderr[-3000:]
    samples = read_samples(run_dir)
    assert len(samples) == 32 and max(s["num_turns"] for s in samples) > 1
    assert all(s["reward_error"] is None for s in samples)
