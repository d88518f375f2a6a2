"""Multi-turn episodes in the simulator (sim.episodes, models.EpisodeModel): each later turn re-enters the real
admission through ``Admission.add_turn`` after an environment call, a group completes only when all its episodes
have ended, every mode sees the same episodes, FGD puts a ready turn ahead of later groups' first turns, and the
single-turn default is the simulator it was."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict

import pytest

from rolloutpipe.rollout.admission import Admission
from rolloutpipe.rollout.groups import GroupAssembler
from rolloutpipe.sim.engine import EventLoop, SimRequest
from rolloutpipe.sim.models import (
    EngineModel,
    EpisodeModel,
    LengthModel,
    RewardModel,
    SchedulerKind,
    SchedulerModel,
    SimConfig,
    TrainerModel,
    TurnsKind,
)
from rolloutpipe.sim.run import Simulation, simulate
from rolloutpipe.sim.sglang import SGLangSimEngine
from rolloutpipe.types import EpisodeEnd, FinishReason
from tests.conftest import sim_job

MODEL = EngineModel(decode_base_s=1e-3, decode_per_request_s=1e-4, decode_per_context_token_s=1e-5,
                    prefill_base_s=2e-3, prefill_per_token_s=1e-4)
TRAINER = TrainerModel(micro_batch_base_s=1e-3, per_token_s=1e-4, optimizer_step_s=2e-3)
EPISODES = EpisodeModel(max_turns=4, mean_turns=2.5, env_tokens=10, env_tokens_sigma=0.5, env_latency_s=0.01,
                        env_latency_sigma=1.0, num_env_workers=4)
"""A long tail of turns (1-4), replies of ~10 tokens, calls of ~10 ms on 4 workers."""
SIM = SimConfig(lengths=LengthModel(median_tokens=20, sigma=1.0, prompt_tokens=8), engine=MODEL, trainer=TRAINER,
                episodes=EPISODES, num_span_steps=4)
SGLANG = dataclasses.replace(SIM, scheduler=SchedulerModel(kind=SchedulerKind.sglang, max_total_tokens=2000))


def job(**overrides):
    """The simulator tests' small job (8 prompts x 4 samples, 2 engines of 6 slots, 4 steps), an episode budget of
    128 tokens (some episodes end by the budget)."""
    return sim_job(**{"rollout_max_response_len": 128, **overrides})


@pytest.fixture
def episodes(monkeypatch):
    """Every complete group's samples, and every ``Admission.add_turn`` call (group, sample, turn), of the runs in
    the test."""
    seen = {"samples": [], "add_turn": [], "request_ids": defaultdict(list)}
    add, add_turn, submit = GroupAssembler.add, Admission.add_turn, Admission.submit

    def spy_add(self, sample):
        complete = add(self, sample)
        if complete is not None:
            seen["samples"].extend((self.step, s.group, s.index, s.num_turns, len(s.response_ids), s.reward,
                                    s.episode_end, s.finish_reason, list(s.response_mask)) for s in complete.samples)
        return complete

    def spy_add_turn(self, group, request):
        seen["add_turn"].append((group, request.index, request.turn))
        return add_turn(self, group, request)

    def spy_submit(self, group, requests, engine):
        seen["request_ids"][self].extend(r.request_id for r in requests)  # (an Admission per step, kept alive)
        return submit(self, group, requests, engine)

    monkeypatch.setattr(GroupAssembler, "add", spy_add)
    monkeypatch.setattr(Admission, "add_turn", spy_add_turn)
    monkeypatch.setattr(Admission, "submit", spy_submit)
    return seen


def requests_by_sample(spans) -> dict[tuple[int, int, int], list]:
    """(step, group, sample) -> its requests' spans, in turn order."""
    out = defaultdict(list)
    for s in sorted((s for s in spans if s.name == "rollout/request"), key=lambda s: s.attrs["turn"]):
        out[s.step, s.attrs["group"], s.attrs["sample"]].append(s)
    return out


def test_an_episode_of_k_turns_makes_k_requests_the_later_ones_through_add_turn(episodes):
    always_3 = dataclasses.replace(SIM, lengths=LengthModel(median_tokens=20, sigma=0.0, prompt_tokens=8),
                                   episodes=EpisodeModel(max_turns=4, turns=TurnsKind.weights, turn_weights=[0, 0, 1],
                                                         env_tokens=4))
    result = simulate(job(rollout_max_response_len=512), always_3)
    assert Counter(episodes["add_turn"]) == {(g, s, t): 4 for g in range(8) for s in range(4) for t in (1, 2)}
    for key, spans in requests_by_sample(result.spans).items():
        assert [s.attrs["turn"] for s in spans] == [0, 1, 2], key
    assert len(episodes["samples"]) == 4 * 8 * 4
    assert {(n, end) for _, _, _, n, *_, end, _, _ in episodes["samples"]} == {(3, EpisodeEnd.done)}
    assert all(r["rollout/turns_mean"] == 3 and r["rollout/episodes_done"] == 32 for r in result.records)

    # a long tail of turns: a sample's turns are its requests, each later one in through add_turn
    for seen in episodes.values():
        seen.clear()
    result = simulate(job(), SIM)
    by_sample = requests_by_sample(result.spans)
    turns = {(step, g, s): n for step, g, s, n, *_ in episodes["samples"]}
    assert turns.keys() == by_sample.keys()
    assert all(len(by_sample[key]) == n for key, n in turns.items())
    assert len(episodes["add_turn"]) == sum(n - 1 for n in turns.values())
    assert max(turns.values()) > 2 and min(turns.values()) == 1
    ids = list(episodes["request_ids"].values())
    assert len(ids) == 4 and all(len(set(step_ids)) == len(step_ids) for step_ids in ids), "one id per turn"


def test_a_group_completes_only_after_its_episodes_last_turns(episodes):
    result = simulate(job(), SIM)
    requests = requests_by_sample(result.spans)
    env_calls = defaultdict(list)
    for s in result.spans:
        if s.name == "rollout/env_call":
            env_calls[s.step, s.attrs["group"], s.attrs["sample"]].append(s)
    complete = {(s.step, s.attrs["group"]): s.end_s for s in result.spans if s.name == "rollout/group_complete"}
    assert len(complete) == 4 * 8
    for (step, group, sample), spans in requests.items():
        # its last turn (and its reward) before the group completes; each later turn after the previous env call
        assert spans[-1].end_s + SIM.overheads.reward_s <= complete[step, group] + 1e-12
        calls = sorted(env_calls[step, group, sample], key=lambda s: s.attrs["turn"])
        assert len(calls) == len(spans) - 1
        for turn, call in enumerate(calls):  # (a request joins the iteration in progress: submitted_s is when it came)
            submitted_s = spans[turn + 1].start_s - spans[turn + 1].attrs["queued_s"]
            assert spans[turn].end_s <= call.start_s and call.end_s <= submitted_s + 1e-12
    for step, group, sample, n, length, _, end, finish, mask in episodes["samples"]:
        assert len(mask) == length <= 128  # the episode's budget: turns and replies, after the prompt
        assert sum(mask) == sum(s.attrs["num_tokens"] for s in requests[step, group, sample])  # the model's tokens
        assert (finish is FinishReason.LENGTH) == (end is EpisodeEnd.length)
        assert mask[0] == 1 and mask[-1] == 1 and sum(a != b for a, b in itertools.pairwise(mask)) == 2 * (n - 1)
    ends = Counter(end for *_, end, _, _ in episodes["samples"])
    assert all(ends[end] for end in (EpisodeEnd.done, EpisodeEnd.length, EpisodeEnd.max_turns, EpisodeEnd.overflow))


@pytest.mark.parametrize("sim", [SIM, SGLANG], ids=["slots", "sglang"])
def test_every_mode_trains_the_same_episodes(sim, episodes):
    """Episodes are drawn per (seed, step, group, sample, turn): sync, cgp and cgp+fgd (and either engine model)
    see the same turns, replies and rewards, though their turns run in different orders and at different times."""
    runs = {}
    for mode, admission in (("sync", "fifo"), ("cgp", "fifo"), ("cgp", "fgd")):
        episodes["samples"].clear()
        records = simulate(job(**{"pipeline.mode": mode, "rollout.admission": admission}), sim).records
        runs[mode, admission] = (sorted(episodes["samples"], key=lambda s: s[:3]), records)
    (samples, records), *others = runs.values()
    assert len(samples) == 4 * 8 * 4
    for other_samples, other_records in others:
        assert other_samples == samples
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/num_samples", "train/num_tokens",
                    "rollout/turns_mean", "rollout/episodes_length", "sim/num_env_calls"):
            assert [r[key] for r in other_records] == [r[key] for r in records], key
    assert runs["cgp", "fgd"][1] != runs["cgp", "fifo"][1], "the orders (and so the times) differ"


@pytest.mark.parametrize("sim", [SIM, SGLANG], ids=["slots", "sglang"])
def test_over_sampled_groups_episodes_are_aborted_and_sync_and_cgp_still_train_the_same_samples(sim, monkeypatch):
    """Dynamic sampling with over-sampling: the step ends with unused groups' turns on the engines, held, or in an
    environment call; they are aborted or dropped (the SGLang model checks that no request is left on an engine
    when the next step starts), and the samples trained do not depend on the mode."""
    sim = dataclasses.replace(sim, rewards=RewardModel(pass_alpha=4, pass_beta=4))
    records, trained = {}, defaultdict(set)
    publish = Simulation._publish

    def spy_publish(self, group):
        trained[self.job.pipeline.mode.value].add((self.step, group.group, group.batch, tuple(
            (s.index, s.num_turns, len(s.response_ids), s.reward) for s in group.samples)))
        publish(self, group)

    monkeypatch.setattr(Simulation, "_publish", spy_publish)
    for mode, admission in (("sync", "fifo"), ("cgp", "fgd")):
        records[mode] = simulate(job(**{"pipeline.mode": mode, "rollout.admission": admission,
                                        "rollout.filter_zero_variance": True, "rollout.over_sampling_groups": 4}),
                                 sim).records
    assert sum(r["rollout/num_returned_prompts"] for r in records["cgp"]) > 0
    assert sum(r["rollout/num_aborted_samples"] for r in records["cgp"]) > 0
    assert len(trained["sync"]) == 4 * 8 and trained["sync"] == trained["cgp"]
    assert [r["train/num_tokens"] for r in records["sync"]] == [r["train/num_tokens"] for r in records["cgp"]]


def test_fgd_puts_a_ready_turn_ahead_of_later_groups_first_turns_and_fifo_does_not():
    """Scarce slots (one engine of 4, groups of 4, every turn 21 tokens, two turns an episode): once a group's next
    turn is back from its environment call, FGD admits it before any later group's first turn still waiting
    (the frontier first, then group order); FIFO has sent every first turn to the engine at the step's start, so a
    turn waits behind them all."""
    sim = dataclasses.replace(SIM, lengths=LengthModel(median_tokens=20, sigma=0.0, prompt_tokens=8),
                              episodes=EpisodeModel(max_turns=2, turns=TurnsKind.weights, turn_weights=[0, 1],
                                                    env_tokens=4, env_latency_s=1e-3))
    overtaken = {}
    for admission in ("fifo", "fgd"):
        result = simulate(job(**{"rollout.admission": admission, "rollout.num_engines": 1, "rollout.concurrency": 4,
                                 "rollout_max_response_len": 256}), sim)
        ready = {(s.step, s.attrs["group"], s.attrs["sample"]): s.end_s for s in result.spans
                 if s.name == "rollout/env_call"}
        requests = requests_by_sample(result.spans)
        overtaken[admission] = [
            (key, h) for key, (_, turn) in requests.items()
            for (step, h, _), (first, *_) in requests.items()
            if step == key[0] and h > key[1] and ready[key] <= first.start_s < turn.start_s]
    assert not overtaken["fgd"]
    assert overtaken["fifo"], "slots are scarce: under FIFO later groups' first turns go ahead of a ready turn"


def test_single_turn_is_the_simulator_it_was():
    """The default (max_turns 1) gives what the simulator gave before episodes existed (figures of that run), and an
    episode model whose episodes all end after one turn gives the same records."""
    plain = dataclasses.replace(SIM, episodes=EpisodeModel(), lengths=LengthModel(median_tokens=20, sigma=1.0,
                                                                                  prompt_tokens=8, prompt_sigma=0.3))
    before = {  # perf/rollout_to_train_end_s and perf/trainer_wait_ratio per step, from the simulator before episodes
        ("slots", "cgp", "fgd"): ([0.4088300000000001, 0.3544499999999998, 0.4406099999999985, 0.3085999999999993],
                                  [0.4873174669177898, 0.4763718437015091, 0.49887655749982796, 0.44394037589111984]),
        ("sglang", "sync", "fifo"): ([0.54257, 0.4671599999999996, 0.5633699999999984, 0.43273999999999724],
                                     [0.6136903993954697, 0.6027057111054025, 0.6080728473294625, 0.6034570411794595]),
    }
    for (engine, mode, admission), (r2t, wait) in before.items():
        sim = plain if engine == "slots" else dataclasses.replace(
            plain, scheduler=SchedulerModel(kind=SchedulerKind.sglang, max_total_tokens=600))
        j = sim_job(**{"pipeline.mode": mode, "rollout.admission": admission, "reward.num_workers": 2})
        records = simulate(j, sim).records
        assert [r["perf/rollout_to_train_end_s"] for r in records] == pytest.approx(r2t, rel=1e-12, abs=0)
        assert [r["perf/trainer_wait_ratio"] for r in records] == pytest.approx(wait, rel=1e-12, abs=0)
        assert not any(key.startswith(("rollout/episodes_", "sim/num_env_calls")) for key in records[0])

        # 24 groups: two blocks of draws per step, so an episode draw taken from the samples' stream would show
        j = sim_job(**{"pipeline.mode": mode, "rollout.admission": admission, "rollout_batch_size": 24,
                       "global_batch_size": 48})
        one_turn = dataclasses.replace(sim, episodes=EpisodeModel(max_turns=4, turns=TurnsKind.weights,
                                                                  turn_weights=[1]))
        records, episode_records = simulate(j, sim).records, simulate(j, one_turn).records
        for got, want in zip(episode_records, records, strict=True):
            assert {k: v for k, v in got.items() if k in want} == want
            assert got["rollout/turns_mean"] == 1 and got["sim/num_env_calls"] == 0


def test_environment_workers_bound_the_calls_in_parallel():
    one = dataclasses.replace(SIM, episodes=dataclasses.replace(EPISODES, num_env_workers=1))
    unbounded = dataclasses.replace(SIM, episodes=dataclasses.replace(EPISODES, num_env_workers=None))
    for sim, bounded in ((one, True), (unbounded, False)):
        result = simulate(job(), sim)
        calls = sorted((s for s in result.spans if s.name == "rollout/env_call"), key=lambda s: s.start_s)
        overlaps = sum(b.start_s < a.end_s for a, b in itertools.pairwise(calls))
        assert (overlaps == 0) is bounded
        assert all(r["sim/env_wait_s"] > 0 for r in result.records) is bounded
        assert all(r["sim/env_wait_s"] == 0 for r in result.records) is not bounded


def test_sglang_radix_cache_prefills_only_the_reply_of_a_turn_whose_previous_turn_ran_there():
    """An episode's turn 1 (prompt 8 + turn 0's 5 tokens + a 3-token reply) on the engine that ran its turn 0
    prefills the reply alone; without the radix cache, or on another engine, the whole conversation."""
    started = {}
    for radix, same_engine in ((True, True), (False, True), (True, False)):
        loop, done = EventLoop(), []

        def on_result(name, requests, aborted, t, loop=loop, done=done):
            done.extend(requests)
            loop.stop()

        engines = [SGLangSimEngine(name=f"e{i}", model=MODEL, scheduler=SchedulerModel(kind=SchedulerKind.sglang,
                                                                                       radix_cache=radix),
                                   max_running_requests=4, max_new_tokens=64, priority_scheduling=False, loop=loop,
                                   on_result=on_result) for i in range(2)]
        engines[0].submit(SimRequest(0, 0, 0, 8, 5, 1.0, 0))
        loop.run()
        turn = SimRequest(1, 0, 0, 8 + 5 + 3, 4, 1.0, 0)
        turn.turn, turn.episode_tokens = 1, 5 + 3
        submitted_s = loop.now
        engines[0 if same_engine else 1].submit(turn)
        loop.run()
        started[radix, same_engine] = done[-1].started_s - submitted_s
    assert started[True, True] == pytest.approx(MODEL.prefill_s(3))
    assert started[False, True] == pytest.approx(MODEL.prefill_s(16))
    assert started[True, False] == pytest.approx(MODEL.prefill_s(16))


def test_the_multiturn_preset_binds_and_runs_episodes():
    """conf/sim/experiment/multiturn.yaml, as tools/simulate.py composes it: one step of its first setting."""
    from hydra import compose, initialize_config_dir

    from rolloutpipe.config import bind, register_hydra_schema
    from rolloutpipe.sim.sweep import SimulateConfig, run_sweep
    from tests.conftest import REPO

    register_hydra_schema("simulate_schema", SimulateConfig)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose("simulate", overrides=["+sim/experiment=multiturn", "num_steps=1", "modes=[cgp+fgd]",
                                             "sweep.job.rollout_batch_size=[32]",
                                             "sweep.sim.episodes.env_latency_s=[0.5]"])
    cfg = bind(SimulateConfig, raw)
    assert cfg.sim.episodes.max_turns == 8 and cfg.sim.episodes.env_latency_s == 0.5
    assert cfg.modes == ["cgp+fgd"]
    (row,) = run_sweep(cfg, raw.job, raw.sim)
    record = row.result.records[0]
    assert 1 < record["rollout/turns_mean"] < 8 and record["sim/num_env_calls"] > 0


def test_geometric_turns_have_their_mean_and_are_cut_at_max_turns():
    import numpy as np

    model = EpisodeModel(max_turns=8, mean_turns=3.0)
    wanted = model.draw_turns(np.random.default_rng(0), (200_000,))
    assert wanted.mean() == pytest.approx(3.0, rel=0.01)
    assert (wanted > 8).mean() == pytest.approx((2 / 3) ** 8, rel=0.05)  # the tail cut at max_turns


def test_episode_config_is_checked_at_the_edge():
    with pytest.raises(ValueError, match="turn_weights"):
        EpisodeModel(max_turns=3, turns=TurnsKind.weights, turn_weights=[0, 0])
    with pytest.raises(ValueError, match="num_env_workers"):
        EpisodeModel(max_turns=3, num_env_workers=0)
    with pytest.raises(ValueError, match="speculative"):
        SimConfig(speculative=True, episodes=EpisodeModel(max_turns=2))
