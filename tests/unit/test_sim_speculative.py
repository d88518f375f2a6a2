"""Speculative next-step rollout in the simulator (sim/speculative.py): drafts change no sample, cost only their
verification when nothing is kept, reach the trainer's bound when everything is, keep a prefix of what was drafted
with the per-token acceptance, and run only where the engines have nothing left of the current step."""

from __future__ import annotations

import dataclasses

import pytest

from rolloutpipe.sim.engine import SimRequest
from rolloutpipe.sim.models import EngineModel, LengthModel, SchedulerKind, SchedulerModel, SimConfig, TrainerModel
from rolloutpipe.sim.run import simulate
from rolloutpipe.sim.speculative import draft
from tests.conftest import sim_job

MODEL = EngineModel(decode_base_s=1e-3, decode_per_request_s=1e-4, decode_per_context_token_s=1e-5,
                    prefill_base_s=2e-3, prefill_per_token_s=1e-4)
SIM = SimConfig(lengths=LengthModel(median_tokens=20, sigma=1.0, prompt_tokens=8), engine=MODEL,
                trainer=TrainerModel(micro_batch_base_s=1e-3, per_token_s=1e-4, optimizer_step_s=2e-3),
                num_span_steps=3)
SLOW_TRAINER = TrainerModel(micro_batch_base_s=1e-3, per_token_s=2e-2, optimizer_step_s=2e-3)
"""A training tail long enough for every draft to run to its end: unlimited idle time."""


def job(**overrides):
    """FGD admission, 6 steps."""
    return sim_job(**{"rollout.admission": "fgd", "num_rollout": 6, **overrides})


def speculative(sim: SimConfig, acceptance: float) -> SimConfig:
    return dataclasses.replace(sim, speculative=True, acceptance=acceptance)


SGLANG = dataclasses.replace(SIM, scheduler=SchedulerModel(kind=SchedulerKind.sglang, max_total_tokens=2000))


def test_speculation_changes_no_sample():
    plain = simulate(job(), SIM).records
    for acceptance in (0.0, 0.9, 1.0):
        records = simulate(job(), speculative(SIM, acceptance)).records
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/num_samples", "train/num_tokens"):
            assert [r[key] for r in records] == [r[key] for r in plain], (acceptance, key)
        assert all(r["rollout/policy_lag"] == 0 for r in records)


@pytest.mark.parametrize("sim", [SIM, SGLANG], ids=["slots", "sglang"])
def test_acceptance_zero_costs_the_verification_and_gains_nothing(sim):
    """a = 0: every draft is rejected at its first token, so a step is cgp+fgd's plus the verification prefills."""
    plain = simulate(job(), sim).records
    records = simulate(job(), speculative(sim, 0.0)).records
    assert all(r["sim/num_drafted_tokens"] > 0 for r in records[1:])
    assert all(r["sim/num_kept_tokens"] == 0 for r in records)
    for spec, base in zip(records, plain):
        assert spec["perf/rollout_to_train_end_s"] >= base["perf/rollout_to_train_end_s"]
    assert sum(r["sim/step_s"] for r in records) > sum(r["sim/step_s"] for r in plain)


@pytest.mark.parametrize("sim", [SIM, SGLANG], ids=["slots", "sglang"])
def test_acceptance_one_with_unlimited_idle_time_reaches_the_trainer_bound(sim):
    """a = 1 and a training tail long enough for every draft: each sample is verified whole, the rollout is its
    verification, and a step is the trainer's own time (compute, reading handles, weight sync) plus the first group's
    verification, reward and publish; far under the on-policy bound."""
    sim = dataclasses.replace(sim, trainer=SLOW_TRAINER)
    plain = simulate(job(), sim).records
    records = simulate(job(), speculative(sim, 1.0)).records
    over, groups = sim.overheads, 8
    for spec, base in zip(records[1:], plain[1:]):
        assert spec["sim/num_kept_tokens"] == spec["sim/num_drafted_tokens"] == spec["train/num_tokens"]
        assert spec["perf/rollout_s"] < 0.3 * base["perf/rollout_s"]  # prefills and rewards (1 ms each) are left
        trainer_bound = spec["perf/train_compute_s"] + groups * over.load_s + spec["perf/weight_sync_s"]
        first_group = spec["perf/first_group_s"] + over.publish_s
        assert trainer_bound <= spec["sim/step_s"] <= trainer_bound + first_group + 1e-9
        assert spec["sim/step_s"] < base["sim/on_policy_bound_s"]


def test_kept_prefix_follows_the_per_token_acceptance():
    """Drafts of 20 tokens each, a = 0.9: the mean kept prefix is E[min(20, G)] = sum_{j=1..20} 0.9^j (P(G >= j) =
    a^j), and no step keeps more than it drafted."""
    a, length = 0.9, 20
    sim = dataclasses.replace(SIM, trainer=SLOW_TRAINER, lengths=LengthModel(median_tokens=19.5, sigma=0.0,
                                                                               prompt_tokens=8))
    records = simulate(job(num_rollout=40), speculative(sim, a)).records
    assert all(r["sim/num_kept_tokens"] <= r["sim/num_drafted_tokens"] for r in records)
    drafted = sum(r["sim/num_drafted_tokens"] for r in records)
    kept = sum(r["sim/num_kept_tokens"] for r in records)
    num_drafts = drafted // length
    assert num_drafts == 39 * 8 * 4, "every request of steps 1.. drafted whole"
    assert kept / num_drafts == pytest.approx(sum(a**j for j in range(1, length + 1)), rel=0.04)


def test_each_draft_keeps_at_most_what_it_drafted_and_stays_in_its_window():
    """Two engines free at 0.05 s and 0.2 s, the window closes at 0.4 s: drafts start no earlier than their engine is
    free, stop at the window's end, go in FGD order (group by group), and keep min(drafted, G) <= drafted."""
    requests = [SimRequest(g * 4 + s, g, s, 8, 30 + 7 * s, 1.0, 0) for g in range(6) for s in range(4)]
    idle_from, until_s = {"e0": 0.05, "e1": 0.2}, 0.4
    drafts = draft(step=1, prompt_of=list(range(6)), requests=requests, idle_from=idle_from, until_s=until_s,
                   model=MODEL, concurrency=4, acceptance=0.95, seed=0)
    lengths = {r.request_id: r.response_len for r in requests}
    assert drafts.drafted and set(drafts.kept) == set(drafts.drafted)
    for rid, n in drafts.drafted.items():
        assert 0 <= drafts.kept[rid] <= n <= lengths[rid]
    assert any(drafts.kept[rid] < n for rid, n in drafts.drafted.items()), "a < 1 must reject some token"
    for engine, start_s, end_s, _ in drafts.spans:
        assert idle_from[engine] <= start_s <= end_s <= until_s
    drafted_ids = sorted(drafts.drafted)
    assert drafted_ids == list(range(len(drafted_ids))), "the first groups draft first"


@pytest.mark.parametrize("sim", [SIM, SGLANG], ids=["slots", "sglang"])
def test_drafts_never_delay_the_current_step(sim):
    """A draft made during step k runs on an engine only after that engine's last request of step k, and stops
    before the engines pause to load policy k+1."""
    sim = speculative(sim, 0.9)
    spans = simulate(job(), sim).spans
    drafts = [s for s in spans if s.name == "rollout/draft"]
    assert {s.step for s in drafts} == {0, 1, 2}
    for s in drafts:
        engine_busy = [r.end_s for r in spans if r.name == "rollout/request" and r.step == s.step
                       and r.attrs["engine"] == s.attrs["engine"]]
        load = [w for w in spans if w.name == "sync/weights" and w.step == s.step]
        assert engine_busy and s.start_s >= max(engine_busy)
        assert s.end_s <= load[0].end_s - sim.overheads.weight_load_s + 1e-12
