"""The simulated SGLang server (sim/sglang.py): its event-skipping engine equals SGLang's scheduler run one iteration
at a time, and each rule of that scheduler (token admission, priority order, preemption, retraction, radix cache)
shows in what it does."""

from __future__ import annotations

import random

import pytest

from rolloutpipe.config import load_config
from rolloutpipe.sim.engine import EventLoop, SimRequest
from rolloutpipe.sim.models import EngineModel, LengthKind, LengthModel, SchedulerKind, SchedulerModel, SimConfig
from rolloutpipe.sim.run import simulate
from rolloutpipe.sim.sglang import SGLangSimEngine

MODEL = EngineModel(decode_base_s=1e-3, decode_per_request_s=1e-4, decode_per_context_token_s=1e-5,
                    prefill_base_s=2e-3, prefill_per_token_s=1e-4)


def reference(requests, *, capacity, max_running, max_new, priority, radix, init_ratio=0.7, min_factor=0.14,
              decay_steps=600, clip=4096):
    """SGLang's scheduler loop, one iteration at a time, written from its source (scheduler.py
    get_next_batch_to_run / update_running_batch, schedule_policy.PrefillAdder, schedule_batch.retract_decode):
    every request (id, group, prompt_len, response_len) queued at time 0. Returns {id: finish time}, retractions."""
    queue = [{"id": i, "group": g, "prompt": p, "length": n, "gen": 0, "queued": i} for i, g, p, n in requests]
    running, cached, finish, t, seq, retracted, full = [], set(), {}, 0.0, len(queue), 0, False
    ratio, min_ratio = init_ratio, init_ratio * min_factor
    decay = (init_ratio - min_ratio) / decay_steps

    def used():
        if radix:
            return sum({r["group"]: r["prompt"] for r in running}.values()) + sum(r["gen"] for r in running)
        return sum(r["prompt"] + r["gen"] for r in running)

    def extend(r):
        return (0 if radix and r["group"] in cached else r["prompt"]) + r["gen"]

    def done():
        nonlocal full
        for r in [r for r in running if r["gen"] == r["length"]]:
            finish[r["id"]] = t
            running.remove(r)
            full = False

    while queue or running:
        if priority:
            queue.sort(key=lambda r: (r["group"], r["queued"]))
        if priority or not running:
            full = False  # batch_is_full: priority preemption resets it before every pass
        rem = capacity - used() - ratio * sum(min(max_new - r["gen"], clip) for r in running)
        admitted = []
        for r in [] if full else queue:
            if len(running) + len(admitted) >= max_running:
                break
            need = extend(r) + min(max_new - r["gen"], clip)
            if not need < rem:
                full = bool(admitted or running)
                break
            admitted.append(r)
            rem -= need
        if admitted:
            t += MODEL.prefill_s(sum(extend(r) for r in admitted))
            for r in admitted:
                queue.remove(r)
                cached.add(r["group"])
                r["gen"] += 1
            running.extend(admitted)
            done()
            continue
        if used() + len(running) > capacity:
            keep = sorted(running, key=lambda r: (r["gen"], -r["prompt"]), reverse=True)
            while len(keep) > 1:
                r = keep.pop()
                running.remove(r)
                seq += 1
                r["queued"] = seq
                queue.append(r)
                retracted += 1
                full = False
                if used() + len(running) <= capacity:
                    break
            ratio = min(1.0, (sum(r["gen"] for r in running) + 20 * len(running)) / (max_new * len(running) + 1))
        else:
            ratio = max(ratio - decay, min_ratio)
        t += MODEL.decode_base_s + MODEL.decode_per_request_s * len(running) + MODEL.decode_per_context_token_s * sum(
            r["prompt"] + r["gen"] for r in running)
        for r in running:
            r["gen"] += 1
        done()
        if not queue and not running:
            break
    return finish, retracted


def run_engine(requests, *, capacity, max_running, max_new, priority, radix, **scheduler):
    loop, finished = EventLoop(), {}

    def on_result(name, done, aborted, t):
        assert not aborted
        finished.update({r.request_id: t for r in done})
        if len(finished) == len(requests):
            loop.stop()

    engine = SGLangSimEngine(name="e", model=MODEL, max_running_requests=max_running, max_new_tokens=max_new,
                             scheduler=SchedulerModel(kind=SchedulerKind.sglang, max_total_tokens=capacity,
                                                      radix_cache=radix, **scheduler),
                             priority_scheduling=priority, loop=loop, on_result=on_result)
    for i, g, p, n in requests:
        engine.submit(SimRequest(i, g, i, p, n, 1.0, 0))
    loop.run()
    return finished, engine


def workload(seed: int, num: int = 24, shortest: int = 1):
    rng = random.Random(seed)
    return [(i, i // 4, 6 + (i // 4) % 3, rng.randint(shortest, 60)) for i in range(num)]


CASES = {
    "request_limit": dict(capacity=10**9, max_running=8, priority=False, radix=False),
    "kv_pressure": dict(capacity=400, max_running=32, priority=False, radix=True),
    "kv_pressure_priority": dict(capacity=400, max_running=32, priority=True, radix=True),
    # long responses and a fast-decaying ratio: room for the queue's head opens between two finishes
    "kv_opens_mid_decode": dict(capacity=400, max_running=32, priority=True, radix=False, shortest=50,
                                scheduler={"new_token_ratio_decay_steps": 10}),
    "retraction": dict(capacity=300, max_running=32, priority=True, radix=False,
                       scheduler={"init_new_token_ratio": 0.05, "min_new_token_ratio_factor": 0.5}),
    "retraction_fifo": dict(capacity=300, max_running=32, priority=False, radix=True, shortest=30,
                            scheduler={"init_new_token_ratio": 0.01, "min_new_token_ratio_factor": 0.5}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_engine_equals_sglangs_loop_run_one_iteration_at_a_time(case, seed):
    spec = dict(CASES[case])
    scheduler, requests = spec.pop("scheduler", {}), workload(seed, shortest=spec.pop("shortest", 1))
    got, engine = run_engine(requests, max_new=64, **spec, **scheduler)
    expected, retracted = reference(requests, max_new=64, **spec, **{
        {"init_new_token_ratio": "init_ratio", "min_new_token_ratio_factor": "min_factor",
         "new_token_ratio_decay_steps": "decay_steps"}[k]: v for k, v in scheduler.items()})
    assert [got[i] for i, *_ in requests] == pytest.approx([expected[i] for i, *_ in requests], rel=1e-9)
    assert len(engine.retracted) == retracted
    if case.startswith("retraction"):
        assert retracted > 0, "the retraction cases must retract"


def test_retraction_takes_the_request_with_the_fewest_generated_tokens_back_to_the_queue():
    # three requests join a 60-token pool at different times (the low ratio lets them all in) and outgrow it: the
    # last one in has generated the fewest tokens, so it goes first, then the next; the first one in is never
    # retracted and finishes first, the retracted ones rejoin in the order they went back to the queue
    loop, order = EventLoop(), []
    engine = SGLangSimEngine(name="e", model=MODEL, max_running_requests=8, max_new_tokens=40,
                             scheduler=SchedulerModel(kind=SchedulerKind.sglang, max_total_tokens=60,
                                                      init_new_token_ratio=0.01, min_new_token_ratio_factor=1.0),
                             priority_scheduling=False, loop=loop,
                             on_result=lambda n, done, a, t: order.extend(r.request_id for r in done))
    engine.submit(SimRequest(0, 0, 0, 4, 40, 1.0, 0))
    loop.at(0.005, lambda _: engine.submit(SimRequest(1, 1, 0, 4, 40, 1.0, 0)))
    loop.at(0.010, lambda _: engine.submit(SimRequest(2, 2, 0, 4, 40, 1.0, 0)))
    loop.at(10.0, lambda _: loop.stop())
    loop.run()
    assert engine.retracted == [2, 1]
    assert order == [0, 2, 1]


@pytest.mark.parametrize("threshold", [0, 1, 10])
def test_priority_scheduling_runs_the_lowest_group_first_and_preempts_beyond_the_threshold(threshold):
    loop, started = EventLoop(), {}
    engine = SGLangSimEngine(name="e", model=MODEL, max_running_requests=1, max_new_tokens=50,
                             scheduler=SchedulerModel(kind=SchedulerKind.sglang,
                                                      priority_preemption_threshold=threshold),
                             priority_scheduling=True, loop=loop, on_result=lambda n, done, a, t: started.update(
                                 {r.request_id: r.started_s for r in done}))
    for group in (2, 1):
        engine.submit(SimRequest(group, group, 0, 4, 30, 1.0, 0))
    loop.at(0.01, lambda _: engine.submit(SimRequest(0, 0, 0, 4, 30, 1.0, 0)))  # group 0 comes while 1 runs
    loop.at(10.0, lambda _: loop.stop())
    loop.run()
    if threshold == 0:
        assert engine.num_preempted == 1, "group 0 takes the only slot from group 1"
    else:
        assert engine.num_preempted == 0, "groups 0 and 1 are not more than the threshold apart"
        assert started[1] < started[0]
    assert started[0] < started[2] and started[1] < started[2], "group 2 waits for both"


def test_the_radix_cache_prefills_a_groups_prompt_once():
    def rollout_s(radix: bool) -> float:
        finished, _ = run_engine([(i, 0, 100, 5) for i in range(4)], capacity=10**6, max_running=1, max_new=8,
                                 priority=False, radix=radix)
        return max(finished.values())

    saved = rollout_s(False) - rollout_s(True)
    assert saved == pytest.approx(3 * 100 * MODEL.prefill_per_token_s, rel=1e-6)


def test_a_kv_pool_smaller_than_one_request_is_a_clear_error():
    with pytest.raises(ValueError, match="never fits its KV pool of 50 tokens; raise sim.scheduler.max_total_tokens"):
        run_engine([(0, 0, 10, 5)], capacity=50, max_running=4, max_new=64, priority=False, radix=False)


def test_a_whole_simulated_run_on_sglangs_scheduler_keeps_its_samples_and_steps():
    job = load_config({"rollout_batch_size": 8, "n_samples_per_prompt": 4, "global_batch_size": 16,
                       "micro_batch_size": 4, "rollout_max_response_len": 64, "num_rollout": 3,
                       "rollout": {"num_engines": 2, "concurrency": 32, "admission": "fgd"}})
    lengths = LengthModel(kind=LengthKind.geometric, mean_tokens=20, prompt_tokens=4)
    records = {kind: simulate(job, SimConfig(lengths=lengths, scheduler=SchedulerModel(
        kind=kind, max_total_tokens=600, max_running_requests=32))).records for kind in SchedulerKind}
    for kind, steps in records.items():
        assert [r["step"] for r in steps] == [0, 1, 2], kind
    # the same samples (lengths are drawn by group, never by timing), scheduled differently
    assert [(r["rollout/response_len_mean"], r["rollout/reward_mean"]) for r in records[SchedulerKind.slots]] == \
        [(r["rollout/response_len_mean"], r["rollout/reward_mean"]) for r in records[SchedulerKind.sglang]]
    assert [r["perf/rollout_s"] for r in records[SchedulerKind.slots]] != \
        [r["perf/rollout_s"] for r in records[SchedulerKind.sglang]]
