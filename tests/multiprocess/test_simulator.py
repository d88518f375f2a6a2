"""The simulator: its engine model is exact, it runs the project's own scheduling code, and its command works."""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys

import numpy as np
import pytest

from rolloutpipe.rollout import slots
from rolloutpipe.sim.calibrate import _fit, geometric_mean_tokens
from rolloutpipe.sim.engine import EventLoop, SimEngine, SimRequest
from rolloutpipe.sim.models import EngineModel, LengthModel, RewardModel, SimConfig, TrainerModel
from rolloutpipe.sim.run import simulate
from tests.conftest import REPO
from tests.conftest import sim_job as job

MODEL = EngineModel(decode_base_s=1e-3, decode_per_request_s=1e-4, decode_per_context_token_s=1e-5,
                    prefill_base_s=2e-3, prefill_per_token_s=1e-4)


def iteration_by_iteration(lengths: list[int], prompt_len: int, concurrency: int) -> list[float]:
    """The engine model run one decode iteration at a time: the reference for the closed form."""
    waiting, running, finish, now = list(range(len(lengths))), {}, [0.0] * len(lengths), 0.0
    while waiting or running:
        joiners = []
        while waiting and len(running) < concurrency:
            r = waiting.pop(0)
            running[r] = 0
            joiners.append(r)
        if joiners:
            now += MODEL.prefill_s(prompt_len * len(joiners))
        context = sum(prompt_len + generated for generated in running.values())
        now += (MODEL.decode_base_s + MODEL.decode_per_request_s * len(running)
                + MODEL.decode_per_context_token_s * context)
        for r in list(running):
            running[r] += 1
            if running[r] == lengths[r]:
                finish[r] = now
                del running[r]
    return finish


def test_engine_finish_times_equal_an_iteration_by_iteration_run():
    lengths, finished = [7, 3, 12, 3, 5, 9, 1], {}
    loop = EventLoop()

    def on_result(name, done, aborted, t):
        finished.update({r.request_id: t for r in done})
        if len(finished) == len(lengths):
            loop.stop()

    engine = SimEngine(name="e", concurrency=3, model=MODEL, loop=loop, on_result=on_result)
    for i, n in enumerate(lengths):
        engine.submit(SimRequest(i, i, 0, 4, n, 1.0, 0))
    loop.run()
    expected = iteration_by_iteration(lengths, prompt_len=4, concurrency=3)
    assert [finished[i] for i in range(len(lengths))] == pytest.approx(expected, rel=1e-12)


def test_iterations_within_inverts_decode_time():
    for k, b, c in [(1, 1, 0), (17, 8, 300), (1000, 64, 5000)]:
        t = MODEL.decode_s(k, b, c)
        assert MODEL.iterations_within(t, b, c) == k
        assert MODEL.iterations_within(t * (1 - 1e-9), b, c) == k - 1


SIM = SimConfig(lengths=LengthModel(median_tokens=20, sigma=1.0, prompt_tokens=8), engine=MODEL,
                trainer=TrainerModel(micro_batch_base_s=1e-3, per_token_s=1e-4, optimizer_step_s=2e-3),
                num_span_steps=4)


def test_every_mode_sees_the_same_samples():
    records = {mode: simulate(job(**{"pipeline.mode": mode}), SIM).records for mode in ("sync", "cgp")}
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/num_samples", "train/num_tokens"):
        assert [r[key] for r in records["sync"]] == [r[key] for r in records["cgp"]], key


def test_sync_trains_after_the_last_group_and_cgp_before():
    for mode, overlaps in (("sync", False), ("cgp", True)):
        spans = simulate(job(**{"pipeline.mode": mode}), SIM).spans
        for step in range(4):
            last_group = max(s.end_s for s in spans if s.step == step and s.name == "rollout/group_complete")
            first_train = min(s.start_s for s in spans if s.step == step and s.name == "train/forward_backward")
            assert (first_train < last_group) is overlaps, (mode, step)


def test_simulated_trainer_packs_micro_batches_within_the_job_s_token_budget():
    """A budget of 100 padded tokens: micro-batches of 1 to 4 rows where micro_batch_size cuts 4 each, and the same
    tokens trained."""
    fixed = simulate(job(**{"trainer.num_ranks": 2}), SIM)
    budget = simulate(job(**{"trainer.num_ranks": 2, "max_tokens_per_micro_batch": 100}), SIM)
    packed = [(s.attrs["num_samples"], s.attrs["num_padded_tokens"]) for s in budget.spans
              if s.name == "train/forward_backward"]
    assert all(padded <= 100 or rows == 1 for rows, padded in packed), packed
    assert {rows for rows, _ in packed} - {4}, "the budget must compose other micro-batches than micro_batch_size"
    assert [r["train/num_tokens"] for r in budget.records] == [r["train/num_tokens"] for r in fixed.records]
    assert all(0 < r["perf/padding_ratio"] < 1 for r in [*fixed.records, *budget.records])


def test_simulated_fgd_runs_the_real_frontier(monkeypatch):
    calls = []
    real = slots.StepSlots.frontier
    monkeypatch.setattr(slots.StepSlots, "frontier", lambda self: calls.append(1) or real(self))
    simulate(job(**{"rollout.admission": "fgd"}), SIM)
    assert calls, "FGD admission in the simulator must ask the real StepSlots for the frontier"


def test_dynamic_filtering_drops_flat_groups_and_still_fills_the_step():
    sim = SimConfig(lengths=SIM.lengths, engine=MODEL, trainer=SIM.trainer,
                    rewards=RewardModel(pass_alpha=0.3, pass_beta=0.3))
    records = simulate(job(**{"rollout.filter_zero_variance": True, "rollout.over_sampling_groups": 2}), sim).records
    assert sum(r["rollout/num_filtered_groups"] for r in records) > 0
    assert all(r["rollout/num_samples"] >= 8 * 4 for r in records)
    assert all(r["train/num_tokens"] > 0 for r in records)


def test_async_one_step_generates_with_the_previous_policy_and_overlaps_steps():
    records = simulate(job(**{"pipeline.mode": "async_one_step"}), SIM).records
    assert [r["rollout/policy_lag"] for r in records] == [0, 1, 1, 1]


def test_calibration_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    rows = rng.uniform(1, 100, size=(30, 3)).tolist()
    truth = np.array([2e-3, 5e-5, 1e-6])
    times = (np.asarray(rows) @ truth).tolist()
    assert _fit(rows, times) == pytest.approx(truth.tolist(), rel=1e-6)
    lengths = np.minimum(np.random.default_rng(1).geometric(1 / 45, 20000), 100).tolist()
    assert geometric_mean_tokens(lengths, 100) == pytest.approx(45, rel=0.05)


def test_simulate_command_sweeps_prints_every_mode_and_draws_the_timeline(tmp_path):
    result = subprocess.run(
        [sys.executable, "tools/simulate.py", "sim/hardware=h100_qwen3_1p7b", "num_steps=3",
         "+sweep.job.rollout.concurrency=[16,32]", f"csv={tmp_path / 'sim.csv'}",
         f"timeline={tmp_path / 'sim.png'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines()[2:] if not line.startswith("timeline:")]
    assert {(r[0], r[1]) for r in rows} == {(f"concurrency={n}", m) for n in (16, 32)
                                            for m in ("sync", "cgp", "cgp+fgd", "async_one_step")}
    assert len((tmp_path / "sim.csv").read_text().splitlines()) == 9
    assert (tmp_path / "sim.png").stat().st_size > 10_000, "the timeline of the first setting, drawn like a real run's"


def test_simulate_command_rejects_a_bad_key_with_a_hint():
    result = subprocess.run([sys.executable, "tools/simulate.py", "+sweep.job.rollout_batch_sise=[4]", "num_steps=1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "rollout_batch_size" in result.stderr


def test_speed_bench_times_the_scale_preset_and_says_whether_the_target_is_met():
    pytest.importorskip("mypyc", reason="the bench's compiled variant needs mypyc: pip install -e .[sim]")
    result = subprocess.run([sys.executable, "bench/sim_speed.py", "--steps", "2", "--modes", "sync", "cgp+fgd",
                             "--variants", "compiled", "interpreted"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines[2:6]]
    assert [(r[0], r[1], r[2]) for r in rows] == [(v, m, "2") for v in ("compiled", "interpreted")
                                                 for m in ("sync", "cgp+fgd")]
    assert all(float(r[3]) > 0 and r[6] in ("met", "missed") for r in rows)
    assert [line.split(":")[0] for line in lines[6:]] == ["sync", "cgp+fgd"]  # the interpreted / compiled ratios


def compared_runs() -> list:
    """Records and spans of small runs that take every path of the simulator: each mode, FGD, several ranks and
    reward workers, micro-batches by a token budget, dynamic filtering with over-sampling (its aborts), span
    recording, speculative drafts and their verification."""
    flat = SimConfig(lengths=SIM.lengths, engine=MODEL, trainer=SIM.trainer, num_span_steps=2,
                     rewards=RewardModel(pass_alpha=0.3, pass_beta=0.3))
    runs = [(job(**{"pipeline.mode": "sync"}), SIM),
            (job(**{"rollout.admission": "fgd", "trainer.num_ranks": 2, "reward.num_workers": 3,
                    "max_tokens_per_micro_batch": 160}), SIM),
            (job(**{"pipeline.mode": "async_one_step"}), SIM),
            (job(**{"rollout.admission": "fgd", "rollout.filter_zero_variance": True,
                    "rollout.over_sampling_groups": 2}), flat),
            (job(**{"rollout.admission": "fgd"}), dataclasses.replace(SIM, speculative=True, acceptance=0.9))]
    out = []
    for j, sim in runs:
        result = simulate(j, sim)
        out.append([result.records, [[s.name, s.role, s.rank, s.step, s.start_s, s.end_s, s.attrs]
                                     for s in result.spans]])
    return out


def leftover_objects() -> list[int]:
    """Objects the cyclic collector frees after a simulation of 1 step and of 4: the run keeps the collector off,
    so a reference cycle made every step (a compiled closure and its environment make one) piles up."""
    counts = []
    for steps in (1, 4):
        gc.collect()
        simulate(job(**{"rollout.admission": "fgd"}), SIM, steps)
        counts.append(gc.collect())
    return counts


def test_the_compiled_simulator_gives_exactly_what_the_sources_give():
    """sim/compiled.py: the same files compiled with mypyc (every one of them), in a child process, against the sources
    here."""
    pytest.importorskip("mypyc", reason="the compiled simulator needs mypyc: pip install -e .[sim]")
    child = ("import json, sys\n"
             "from rolloutpipe.sim import compiled\n"
             "assert compiled.activate('1')\n"
             "from tests.multiprocess.test_simulator import compared_runs, leftover_objects\n"
             "import importlib\n"
             "assert all(importlib.import_module(m).__file__.endswith('.so') for m in compiled.module_names())\n"
             "print(json.dumps([compared_runs(), leftover_objects()]))\n")
    result = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled, compiled_leftover = json.loads(result.stdout.splitlines()[-1])
    expected = json.loads(json.dumps(compared_runs()))
    assert len(compiled) == len(expected) == 5
    for got, want in zip(compiled, expected):
        assert got == want
    assert compiled_leftover == leftover_objects(), "the compiled run leaves garbage the sources do not: a cycle"
