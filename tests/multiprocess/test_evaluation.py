"""Evaluation during training (rollout/evaluation.py): config, metrics, slots, and real runs that report it."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from rolloutpipe.config import ConfigError, check_overrides, load_config
from rolloutpipe.model import build_tiny_tokenizer
from rolloutpipe.observe.report import flatten, setting_labels
from rolloutpipe.rollout.data import DataConfig
from rolloutpipe.rollout.evaluation import EVAL_PRIORITY, EvalConfig, EvalSample, EvalSetConfig, Evaluation, set_metrics
from rolloutpipe.rollout.rewards import RewardConfig
from rolloutpipe.rollout.tasks import ReversalTaskConfig, heldout_rows, reversal_rows
from rolloutpipe.types import EpisodeEnd, FinishReason, GenerationResult
from tests.conftest import REPO, SMALL, read_metrics, run_job, wait_for
from tests.fakes import FakeEngine, Rollout


# ---- config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "message"), [
    ({"eval": {"intervall": 1}}, "unknown config key 'eval.intervall'. Did you mean 'eval.interval'?"),
    ({"eval": {"sets": [{"name": "x", "pathh": None}]}}, "unknown config key 'eval.sets.0.pathh'"),
    ({"eval": {"interval": -1}}, "eval.interval=-1 must be >= 0"),
    ({"eval": {"sets": [{"name": "a b"}]}}, "eval.sets name 'a b' must be letters"),
    ({"eval": {"sets": [{"name": "x", "n_samples_per_prompt": 0}]}}, r"eval.sets\[x\].n_samples_per_prompt=0"),
    ({"eval": {"sets": [{"name": "x"}, {"name": "x"}]}}, "must be unique"),
    ({"eval": {"sets": [{"name": "x", "path": "rows.csv"}]}}, "must end in .jsonl or .parquet"),
    ({"eval": {"mode": "later"}}, "bad config value at eval.mode: Invalid value 'later', expected one of"),
])
def test_a_bad_eval_config_is_a_config_error_that_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


def test_eval_set_overrides_are_checked_down_to_the_key():
    check_overrides(["eval.interval=5", "eval.sets.0.path=/data/gpqa.jsonl", "eval.sets.1.max_prompts=8"])
    with pytest.raises(ConfigError, match="unknown config key 'eval.sets.0.pathh'. Did you mean 'eval.sets.0.path'"):
        check_overrides(["eval.sets.0.pathh=/data/gpqa.jsonl"])
    with pytest.raises(ConfigError, match="unknown config key 'eval.intervl'"):
        check_overrides(["eval.intervl=5"])


def test_eval_is_due_from_step_0_every_interval():
    assert [s for s in range(25) if EvalConfig(interval=10).due(s)] == [0, 10, 20]
    assert not any(EvalConfig(interval=0).due(s) for s in range(25))


# ---- the held-out split -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", [ReversalTaskConfig(), ReversalTaskConfig(length=2, alphabet_size=3),
                                  ReversalTaskConfig(length=6, alphabet_size=8, num_rows=500)])
def test_the_heldout_split_is_never_trained_on(task):
    train = {r["label"] for r in reversal_rows(task)}
    heldout = {r["label"] for r in heldout_rows(task)}
    assert heldout and train and not heldout & train
    assert len(reversal_rows(task)) == task.num_rows


# ---- metrics ----------------------------------------------------------------------------------------------------
def _sample(prompt: int, reward: float, *, error: str | None = None, truncated: bool = False) -> EvalSample:
    return EvalSample(set_name="s", prompt=prompt, reward=reward, num_tokens=4 if truncated else 2,
                      truncated=truncated, reward_error=error, policy_version=0, finished_s=0.0)


def test_eval_metrics_are_the_mean_the_per_prompt_mean_and_the_per_prompt_best():
    samples = [_sample(0, 1.0), _sample(0, 0.0), _sample(1, 0.0, error="boom", truncated=True), _sample(1, 0.0)]
    m = set_metrics("s", 2, samples)
    assert m == {"eval/s/pass@1": 0.25, "eval/s/avg@2": 0.25, "eval/s/pass@2": 0.5, "eval/s/response_len_mean": 2.5,
                 "eval/s/truncated_ratio": 0.25, "eval/s/num_reward_errors": 1, "eval/s/num_samples": 4}
    assert set(set_metrics("s", 1, samples[:1])) == {"eval/s/pass@1", "eval/s/response_len_mean",
                                                    "eval/s/truncated_ratio", "eval/s/num_reward_errors",
                                                    "eval/s/num_samples"}


# ---- slots: eval only where training leaves them free -------------------------------------------------------
def heldout_evaluation(engines: list, tmp_path, *, n_samples: int, max_prompts: int, concurrency: int,
                       **kwargs) -> Evaluation:
    """Evaluation of the synthetic task's held-out split every step on ``engines`` (``kwargs``: an environment's)."""
    cfg = EvalConfig(interval=1, sets=[EvalSetConfig(name="heldout", n_samples_per_prompt=n_samples,
                                                     max_prompts=max_prompts)])
    return Evaluation(cfg=cfg, data=DataConfig(), reward=RewardConfig(), tokenizer=build_tiny_tokenizer(),
                      engines=engines, concurrency=concurrency, run_seed=1, max_response_len=4, run_dir=tmp_path,
                      **kwargs)


def test_eval_requests_take_only_the_slots_training_leaves_free_and_survive_a_failed_engine(tmp_path):
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    evaluation = heldout_evaluation(engines, tmp_path, n_samples=2, max_prompts=5, concurrency=4)
    try:
        evaluation.begin(step=3, policy_version=3)
        training = {"e0": 4, "e1": 6}  # e1 holds more than its slots (FIFO queues them at the engine)
        evaluation.pump(lambda e: training[e.name])
        assert [len(e.submitted) for e in engines] == [0, 0], "no eval request while training fills every slot"
        training = {"e0": 1, "e1": 4}
        evaluation.pump(lambda e: training[e.name])
        assert [len(e.submitted) for e in engines] == [3, 0]
        assert all(r.priority == EVAL_PRIORITY and r.request_id.startswith("eval=heldout/step=3/")
                   for r in engines[0].submitted)
        engines[0].error = RuntimeError("crashed")  # its three come back in line and go to e1
        training = {"e0": 0, "e1": 0}
        evaluation.pump(lambda e: training[e.name])
        assert len(engines[1].submitted) == 4 and {r.request_id for r in engines[0].submitted} < {
            r.request_id for r in engines[1].submitted}
        late = engines[0].submitted[0]
        assert evaluation.on_result(_result(late.request_id, "e0"))  # the failed engine's: taken, not counted
        answered: set[str] = set()
        while not evaluation.done():  # e1 answers, and gets the rest as its slots free
            for request in [r for r in engines[1].submitted if r.request_id not in answered]:
                answered.add(request.request_id)
                assert evaluation.on_result(_result(request.request_id, "e1"))
            evaluation.pump(lambda e: 0)
        assert len(engines[1].submitted) == len({r.request_id for r in engines[1].submitted}) == 10
        evaluation.wait(check=lambda: None)
        assert not evaluation.on_result(_result("step=3/group=0/sample=0", "e1")), "training results are not eval's"
        record = evaluation.metrics(rollout_end_s=None, wait_s=0.0)
        assert record["eval/heldout/num_samples"] == 10 and record["eval/heldout/policy_version"] == 3
    finally:
        evaluation.close()


def test_a_stopping_evaluation_scores_none_of_the_results_still_queued(tmp_path):
    """A stop (RolloutNode.close) waits for the eval scoring calls in progress only, as for training's rewards."""
    engines = [FakeEngine("e0")]
    evaluation = heldout_evaluation(engines, tmp_path, n_samples=1, max_prompts=5, concurrency=8)
    scored, started, release = [], threading.Event(), threading.Event()

    def score(r, result) -> None:  # the one call in progress holds until the stop has begun
        scored.append(result.request_id)
        started.set()
        release.wait(timeout=30)

    evaluation._score = score
    evaluation.begin(step=0, policy_version=0)
    evaluation.pump(lambda e: 0)
    assert len(engines[0].submitted) == 5
    for request in engines[0].submitted:
        assert evaluation.on_result(_result(request.request_id, "e0"))
    assert started.wait(timeout=30)
    closer = threading.Thread(target=evaluation.close)
    closer.start()
    wait_for(lambda: evaluation._results.qsize() == 4 + len(evaluation._threads), "close to queue its stops")
    release.set()
    closer.join(timeout=30)
    assert not closer.is_alive() and scored == [engines[0].submitted[0].request_id] and evaluation.error is None


class ThreeTurns:
    """An eval set's episode runner (``Evaluation``'s ``episodes``): every episode takes three model turns."""

    def __init__(self, turn_request, max_response_len: int) -> None:
        self.turn_request = turn_request

    def first_request(self, episode):
        return self.turn_request(episode, 0, [1, 2], 4)

    def on_turn(self, episode, result: GenerationResult):
        turn = int(result.request_id.split("/turn=")[1]) if "/turn=" in result.request_id else 0
        if turn < 2:
            return self.turn_request(episode, turn + 1, [1, 2, 3], 4)
        return SimpleNamespace(reward=1.0, response_ids=[5], reward_error=None, episode_end=EpisodeEnd.done,
                               policy_version=3)


def test_an_eval_episodes_next_turn_goes_back_to_its_engine_while_that_engine_has_a_free_slot(tmp_path):
    """Its prefix cache holds the conversation so far: the next turn goes there, not to the first engine with a slot;
    when training fills that engine, the turn goes to one that has a slot rather than wait."""
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    evaluation = heldout_evaluation(engines, tmp_path, n_samples=1, max_prompts=1, concurrency=1, episodes=ThreeTurns)

    def answer(engine: FakeEngine, training: dict[str, int]) -> None:
        """``engine`` answers its latest request; pump until the episode's next turn is out (the scoring thread
        makes it)."""
        assert evaluation.on_result(_result(engine.submitted[-1].request_id, engine.name))
        submitted = sum(len(e.submitted) for e in engines)
        while sum(len(e.submitted) for e in engines) == submitted:
            evaluation.pump(lambda e: training[e.name])
            time.sleep(0.005)

    try:
        evaluation.begin(step=3, policy_version=3)
        evaluation.pump(lambda e: {"e0": 1, "e1": 0}[e.name])  # training fills e0: turn 0 goes to e1
        assert [len(e.submitted) for e in engines] == [0, 1]
        answer(engines[1], {"e0": 0, "e1": 0})  # both free: turn 1 goes back to e1
        assert [len(e.submitted) for e in engines] == [0, 2] and engines[1].submitted[-1].request_id.endswith("/turn=1")
        answer(engines[1], {"e0": 0, "e1": 1})  # training fills e1: turn 2 goes to e0
        assert [len(e.submitted) for e in engines] == [1, 2] and engines[0].submitted[-1].request_id.endswith("/turn=2")
        assert evaluation.on_result(_result(engines[0].submitted[-1].request_id, "e0"))
        evaluation.wait(check=lambda: None)
        assert evaluation.metrics(rollout_end_s=None, wait_s=0.0)["eval/heldout/num_samples"] == 1
    finally:
        evaluation.close()


def test_next_turns_take_no_more_of_their_engine_than_its_free_slots(tmp_path):
    """Two episodes' turns both served by e1, which has one slot free: one goes back to it, the other to e0."""
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    evaluation = heldout_evaluation(engines, tmp_path, n_samples=2, max_prompts=1, concurrency=2, episodes=ThreeTurns,
                                    num_threads=2)
    try:
        evaluation.begin(step=0, policy_version=3)
        evaluation.pump(lambda e: {"e0": 2, "e1": 0}[e.name])  # training fills e0: both first turns go to e1
        assert [len(e.submitted) for e in engines] == [0, 2]
        for request in engines[1].submitted:
            assert evaluation.on_result(_result(request.request_id, "e1"))
        while len(evaluation._turns) < 2:  # (the scoring threads make the next turns; both wait for one pump)
            time.sleep(0.005)
        evaluation.pump(lambda e: {"e0": 0, "e1": 1}[e.name])
        assert [len(e.submitted) for e in engines] == [1, 3]
    finally:
        evaluation.close()


def test_a_failure_scoring_the_steps_last_eval_sample_stops_the_wait(tmp_path):
    """The set's metrics would otherwise go out without that sample."""

    class Broken(ThreeTurns):
        def on_turn(self, episode, result: GenerationResult):
            raise RuntimeError("the environment broke")

    engines = [FakeEngine("e0")]
    evaluation = heldout_evaluation(engines, tmp_path, n_samples=1, max_prompts=1, concurrency=1, episodes=Broken)
    try:
        evaluation.begin(step=0, policy_version=3)
        evaluation.pump(lambda e: 0)
        assert evaluation.on_result(_result(engines[0].submitted[-1].request_id, "e0"))
        while not evaluation.done():  # (the scoring thread has failed: nothing is left to wait for)
            time.sleep(0.005)
        with pytest.raises(RuntimeError, match="evaluation failed: .*the environment broke"):
            evaluation.wait(check=lambda: None)
    finally:
        evaluation.close()


def _result(request_id: str, engine: str) -> GenerationResult:
    return GenerationResult(request_id=request_id, output_ids=[5, 6], output_logprobs=[0.0, 0.0],
                            finish_reason=FinishReason.STOP, policy_version=3, submitted_s=0.0, started_s=0.0,
                            finished_s=0.0, engine=engine)


# ---- real runs ------------------------------------------------------------------------------------------------
EVAL_KEYS = {"pass@1", "avg@4", "pass@4", "response_len_mean", "truncated_ratio", "num_reward_errors",
             "num_samples", "policy_version"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["tail", "phase"])
def test_the_default_run_evaluates_its_heldout_split_from_the_initial_policy(job_dir, mode):
    run_dir = job_dir(mode)
    result = run_job(run_dir, *SMALL, "num_rollout=3", "eval.interval=2", f"eval.mode={mode}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run_dir)
    evaluated = [m["step"] for m in metrics if "eval/reversal_heldout/pass@1" in m]
    assert evaluated == [0, 2]
    heldout = {json.loads(line)["label"] for line in (run_dir / "data" / "reversal_heldout.jsonl").open()}
    for m in metrics:
        if m["step"] in evaluated:
            assert {k.rpartition("/")[2] for k in m if k.startswith("eval/reversal_heldout/")} == EVAL_KEYS
            assert m["eval/reversal_heldout/policy_version"] == m["policy_version"] == m["step"]
            assert m["eval/reversal_heldout/num_samples"] == 4 * len(heldout)
            assert 0.0 <= m["eval/reversal_heldout/pass@1"] <= m["eval/reversal_heldout/pass@4"] <= 1.0
    trained = {json.loads(line)["label"] for line in (run_dir / "data" / "reversal.jsonl").open()}
    assert heldout and not heldout & trained


GPQA_SHAPED = ["+experiment=gpqa", "model.path=null", "model.dtype=float32", "rollout.engine=embedded",
               "rollout.engines_per_node=1", "rollout.concurrency=16", "trainer.backend=torch", "trainer.num_ranks=1",
               "reward.num_workers=1", "data.max_prompt_len=200", "eval.interval=1", "eval.sets.0.max_response_len=6",
               "eval.sets.0.n_samples_per_prompt=2", "eval.sets.0.temperature=1.0"]
"""The gpqa preset, shrunk to the embedded engine and tiny model: its own eval set, given a path."""


@pytest.mark.multiprocess
def test_a_gpqa_shaped_run_reports_its_eval_set_and_counts_reward_errors_without_stopping(job_dir, tmp_path):
    def row(question: str, label, choices=("one", "two", "three", "four")) -> str:
        return json.dumps({"prompt": f"{question}? a: {choices[0]} b: {choices[1]} c: {choices[2]} d: {choices[3]}",
                           "label": label, "metadata": {"choices": list(choices)}}) + "\n"

    train, heldout = tmp_path / "train.jsonl", tmp_path / "gpqa_eval.jsonl"
    train.write_text("".join(row(f"which is {n}", "ABCD"[i % 4]) for i, n in enumerate("abcdefgh")))
    # three rows the reward reads, and one whose label it cannot read: two reward errors, counted, never trained
    heldout.write_text(row("which is x", "C") + row("which is y", 1) + row("which is z", "four")
                       + row("which is w", "zz", choices=("p", "q", "r", "s")))
    run_dir = job_dir("gpqa")
    result = run_job(run_dir, *SMALL, *GPQA_SHAPED, f"data.path={train}", f"eval.sets.0.path={heldout}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["eval/gpqa/num_samples"] for m in metrics] == [8, 8]
    assert [m["eval/gpqa/num_reward_errors"] for m in metrics] == [2, 2]
    assert [m["eval/gpqa/policy_version"] for m in metrics] == [0, 1]
    assert all(m["rollout/num_reward_errors"] == 0 for m in metrics), "eval samples never count as training's"
    assert all({"eval/gpqa/pass@1", "eval/gpqa/avg@2", "eval/gpqa/pass@2"} <= set(m) for m in metrics)


def test_the_presets_carry_eval_sets():
    for name, reward in (("gpqa", "gpqa"), ("math", "math")):
        preset = OmegaConf.load(REPO / "conf" / "experiment" / f"{name}.yaml")
        assert preset.eval.interval > 0 and [(s.name, s.reward) for s in preset.eval.sets] == [(name, reward)]


def test_the_report_tells_settings_apart_by_their_eval_sets():
    """A list of eval sets flattens to hashable keys (a tuple of dicts would make settings unhashable)."""
    flat = flatten({"eval": {"interval": 10, "sets": [{"name": "a", "path": None}]}, "rollout": {"engine_urls": []}})
    assert flat == {"eval.interval": 10, "eval.sets.0.name": "a", "eval.sets.0.path": None, "rollout.engine_urls": ()}
    assert setting_labels([tuple(sorted(flat.items())), (("eval.sets.0.name", "b"),)])


def test_an_engine_hung_on_eval_requests_alone_is_restarted():
    rollout = Rollout(num_engines=1, request_timeout_s=0.05)
    rollout.supervisor.also_held = lambda engine: 2  # eval requests only: Admission holds nothing there
    rollout.supervisor.check()
    time.sleep(0.08)
    rollout.supervisor.check()
    assert [e.name for e in rollout.restarted] == ["engine0-restart1"]
