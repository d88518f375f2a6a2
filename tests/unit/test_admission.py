"""Admission and batch membership: pure logic, no processes."""

import random
from functools import partial
from types import SimpleNamespace

import pytest

from rolloutpipe.rollout.admission import POLICIES, Admission, AdmissionPolicy, FgdPolicy, FifoPolicy, Policy
from rolloutpipe.rollout.data import PromptSource
from rolloutpipe.rollout.schedule import RolloutSchedule
from rolloutpipe.rollout.slots import GroupState, StepSlots
from rolloutpipe.types import DropReason, Prompt
from tests import fakes

FakeEngine = partial(fakes.FakeEngine, running_ids=True)
"""The shared fake engine; here ``running`` lists request ids, which the tests compare to strings."""


def group_requests(group: int, n: int = 2):
    return [SimpleNamespace(request_id=f"group={group}/sample={s}") for s in range(n)]


def test_fgd_admits_frontier_groups_first_then_the_rest_in_group_order():
    engine = FakeEngine("e0")
    admission = Admission(policy=AdmissionPolicy.fgd, engines=[engine], concurrency=2)
    for g in (3, 4, 7, 9, 12):
        admission.add_group(g, group_requests(g))
    assert engine.running == [], "FGD holds requests until pump"
    order = []
    for _ in range(5):
        admission.pump(lambda: [7, 9])
        order.append(int(engine.running[0].split("/")[0].split("=")[1]))
        for r in list(engine.running):  # the engine finishes the whole group
            engine.running.remove(r)
            admission.finished(r, "e0")
    assert order == [7, 9, 3, 4, 12]


def test_fifo_submits_everything_at_once_a_group_to_an_engine_and_aborts_only_unfinished_requests():
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    admission = Admission(policy=AdmissionPolicy.fifo, engines=engines, concurrency=1)
    for g in range(3):
        admission.add_group(g, group_requests(g))
    # a group's samples share their prompt: one engine's prefix cache serves them all; the groups take turns
    assert engines[0].running == ["group=0/sample=0", "group=0/sample=1", "group=2/sample=0", "group=2/sample=1"]
    assert engines[1].running == ["group=1/sample=0", "group=1/sample=1"]
    admission.finished("group=1/sample=0", "e1")
    assert admission.abort_groups([1]) == 1
    assert engines[1].aborted == ["group=1/sample=1"] and engines[0].aborted == []


def test_an_episodes_next_turn_goes_to_its_engine_under_fifo_and_in_line_by_its_group_under_fgd():
    """FIFO sends a turn to the engine that served the previous one (its cache holds the conversation so far); FGD
    holds it with the groups, so a frontier group's turn goes before a later group's first turns. A turn of an
    aborted group is refused: its episode ends."""
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    fifo = Admission(policy=AdmissionPolicy.fifo, engines=engines, concurrency=4)
    for g in range(2):
        fifo.add_group(g, group_requests(g, 1))
    assert fifo.add_turn(1, SimpleNamespace(request_id="group=1/sample=0/turn=1"), "e1")  # (round robin: e0)
    assert fifo.add_turn(0, SimpleNamespace(request_id="group=0/sample=0/turn=1"), "e0")
    assert engines[0].running == ["group=0/sample=0", "group=0/sample=0/turn=1"]
    assert engines[1].running == ["group=1/sample=0", "group=1/sample=0/turn=1"]
    engine = FakeEngine("e0")
    fgd = Admission(policy=AdmissionPolicy.fgd, engines=[engine], concurrency=1)
    for g in (1, 2):
        fgd.add_group(g, group_requests(g, 1))
    fgd.pump(lambda: [1])
    assert fgd.add_turn(0, SimpleNamespace(request_id="group=0/sample=0/turn=1"), "e0")
    assert engine.running == ["group=1/sample=0"], "held while the engine is full"
    engine.running.clear()
    fgd.finished("group=1/sample=0", "e0")
    fgd.pump(lambda: [0])
    assert engine.running == ["group=0/sample=0/turn=1"]
    assert fgd.abort_groups([2]) == 1 and not fgd.add_turn(2, SimpleNamespace(request_id="group=2/sample=0/turn=1"))
    # FGD sends a group's turns back to the engine of their previous turns while it has a free slot, though another
    # has more
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    fgd = Admission(policy=AdmissionPolicy.fgd, engines=engines, concurrency=3)
    fgd.add_group(0, group_requests(0, 2))
    fgd.pump(lambda: [0])
    assert engines[0].running == ["group=0/sample=0", "group=0/sample=1"]
    fgd.finished("group=0/sample=0", "e0")
    fgd.add_turn(0, SimpleNamespace(request_id="group=0/sample=0/turn=1"), "e0")
    fgd.pump(lambda: [0])
    assert engines[0].running[-1] == "group=0/sample=0/turn=1" and engines[1].running == []


def test_each_config_value_makes_its_own_policy_class_in_the_one_registration():
    """POLICIES is the only place a config value becomes a policy: Admission (the node's and the simulator's)
    makes its policy there, every AdmissionPolicy value has a class of its own, and each class has every method
    of the Policy protocol."""
    assert set(POLICIES) == set(AdmissionPolicy) and len(set(POLICIES.values())) == len(AdmissionPolicy)
    assert POLICIES[AdmissionPolicy.fifo] is FifoPolicy and POLICIES[AdmissionPolicy.fgd] is FgdPolicy
    methods = {name for name, value in vars(Policy).items() if callable(value) and not name.startswith("_")}
    assert methods == {"add_group", "pump", "retry", "engine_back", "add_turn", "drop"}
    for value, policy_class in POLICIES.items():
        assert all(callable(getattr(policy_class, m, None)) for m in methods), policy_class
        assert type(Admission(policy=value, engines=[FakeEngine("e0")], concurrency=1).policy) is policy_class


def test_frontier_is_what_the_next_incomplete_batch_still_needs():
    slots = StepSlots(rollout_batch_size=6, groups_per_batch=2)
    for _ in range(6):
        slots.admit()
    assert slots.frontier() == [0, 1]
    slots.resolve(1, trainable=True)
    assert slots.frontier() == [0]  # group 1 already holds one of batch 0's two slots
    slots.resolve(0, trainable=True)
    assert slots.frontier() == [2, 3]


def test_frontier_moves_past_a_filtered_group():
    slots = StepSlots(rollout_batch_size=4, groups_per_batch=2)
    for _ in range(4):
        slots.admit()
    slots.resolve(0, trainable=True)
    assert slots.frontier() == [1]
    slots.resolve(1, trainable=False)  # dropped: batch 0 now needs group 2
    assert slots.frontier() == [2]
    assert slots.num_to_admit() == 1  # and one replacement group is admitted to keep the step fillable
    slots.admit()
    slots.resolve(2, trainable=True)
    assert slots.frontier() == [3, 4]


def test_batch_membership_is_the_jth_trainable_group_in_group_order_whatever_the_completion_order():
    rng = random.Random(0)
    trainable = [rng.random() > 0.3 for _ in range(40)]
    expected_selected = [g for g, t in enumerate(trainable) if t][:8]
    for trial in range(50):
        slots = StepSlots(rollout_batch_size=8, groups_per_batch=2)
        placements = {}
        order = list(range(40))
        random.Random(trial).shuffle(order)
        for _ in range(8):
            slots.admit()
        while not slots.full():
            pending = [g for g in order if g < len(slots.states) and slots.states[g] is GroupState.PENDING]
            g = pending[0]
            order.remove(g)
            for p in slots.resolve(g, trainable=trainable[g]):
                assert p.group not in placements
                placements[p.group] = p.batch
            for _ in range(slots.num_to_admit()):
                slots.admit()
        assert slots.selected() == expected_selected
        assert placements == {g: j // 2 for j, g in enumerate(expected_selected)}


def test_a_group_is_placed_as_soon_as_its_batch_is_certain():
    slots = StepSlots(rollout_batch_size=4, groups_per_batch=2)
    for _ in range(4):
        slots.admit()
    assert [p.group for p in slots.resolve(3, trainable=True)] == []  # slot 1..3: batch unknown
    assert [(p.group, p.batch) for p in slots.resolve(1, trainable=True)] == [(1, 0)]  # slot 0 or 1
    # group 0 fills batch 0; group 3 now has slot 2 or 3 (group 2 pending): batch 1 either way
    assert [(p.group, p.batch) for p in slots.resolve(0, trainable=True)] == [(0, 0), (3, 1)]
    assert [(p.group, p.batch) for p in slots.resolve(2, trainable=False)] == []
    assert slots.placed == {0: 0, 1: 0, 3: 1} and not slots.full()


@pytest.mark.parametrize("seed", range(5))
def test_over_sampling_loses_no_prompt(seed):
    """Over several steps, every prompt drawn is trained once, filtered once, or returned and drawn again."""
    prompts = [Prompt(index=i, text=str(i), input_ids=[i], label=str(i)) for i in range(200)]
    source = PromptSource(prompts, shuffle=True, seed=seed)
    rng = random.Random(seed)
    trainable = {i: rng.random() > 0.25 for i in range(200)}
    trained, filtered, drawn = [], [], []
    for _step in range(6):
        slots = StepSlots(rollout_batch_size=8, groups_per_batch=4)
        step_prompts = []

        def admit(k):
            for p in source.next_batch(k):
                slots.admit()
                step_prompts.append(p)
                drawn.append(p.index)

        admit(8 + 3)  # over-sampling
        while not slots.full():
            pending = [g for g, s in enumerate(slots.states) if s is GroupState.PENDING]
            g = rng.choice(pending)
            slots.resolve(g, trainable=trainable[step_prompts[g].index])
            admit(slots.num_to_admit())
        unused = slots.unused()
        trained += [step_prompts[g].index for g in slots.selected()]
        filtered += [step_prompts[g].index for g in range(len(step_prompts))
                     if slots.states[g] is GroupState.FILTERED and g not in unused]
        source.give_back([step_prompts[g] for g in unused])
    assert len(trained) == 6 * 8 and len(set(trained)) == len(trained)
    assert not set(trained) & set(filtered)
    returned_now = set(drawn) - set(trained) - set(filtered)
    assert returned_now == {p.index for p in source.next_batch(len(returned_now))}  # handed out first
    assert all(trainable[i] for i in trained) and not any(trainable[i] for i in filtered)


def certain_batches(states: list[GroupState], size: int, per_batch: int) -> dict[int, int]:
    """The module docstring's rule, read literally: a trainable group's slot lies in [t, t + p]."""
    certain, trainable_below, pending_below = {}, 0, 0
    for g, state in enumerate(states):
        lo, hi = trainable_below, trainable_below + pending_below
        if state is GroupState.TRAINABLE and hi < size and lo // per_batch == hi // per_batch:
            certain[g] = lo // per_batch
        trainable_below += state is GroupState.TRAINABLE
        pending_below += state is GroupState.PENDING
    return certain


def frontier_by_definition(states: list[GroupState], size: int, per_batch: int) -> list[int]:
    """Walk the groups from the first pending one: the next incomplete batch has ``budget`` slots left, and a
    pending group is needed while fewer than ``budget`` live (pending or trainable) groups lie before it."""
    pending = [g for g, s in enumerate(states) if s is GroupState.PENDING]
    start = pending[0] if pending else len(states)
    filled = sum(s is GroupState.TRAINABLE for s in states[:start])
    if filled >= size:
        return []
    budget, live, frontier = per_batch - filled % per_batch, 0, []
    for g in range(start, len(states)):
        if live >= budget:
            break
        if states[g] is GroupState.PENDING:
            frontier.append(g)
        live += states[g] is not GroupState.FILTERED
    return frontier


@pytest.mark.parametrize("seed", range(20))
def test_incremental_placement_matches_the_rule_after_every_completion(seed):
    rng = random.Random(seed)
    size, per_batch = rng.choice([(8, 2), (12, 3), (16, 16), (9, 1)])
    slots = StepSlots(rollout_batch_size=size, groups_per_batch=per_batch)
    for _ in range(size + rng.randrange(3)):
        slots.admit()
    while not slots.full():
        pending = [g for g, s in enumerate(slots.states) if s is GroupState.PENDING]
        slots.resolve(rng.choice(pending), trainable=rng.random() > 0.3)
        assert slots.placed == certain_batches(slots.states, size, per_batch)
        assert slots.frontier() == frontier_by_definition(slots.states, size, per_batch)
        for _ in range(slots.num_to_admit()):
            slots.admit()


def test_a_sample_of_another_policy_version_stops_the_step_and_the_lag_is_measured():
    from rolloutpipe.observe.metrics import RolloutStats
    from rolloutpipe.rollout.samples import check_on_policy
    from tests.fakes import make_group

    group = make_group(step=3)
    check_on_policy(3, 3, group)
    group.samples[2].policy_version = 2  # an engine that served the previous weights
    with pytest.raises(RuntimeError, match=r"step=3/group=3/sample=2 was generated by policy_version 2, but step 3"):
        check_on_policy(3, 3, group)
    stats = RolloutStats.of(step=3, policy_version=3, start_s=0.0, last_group_s=1.0, weight_load_s=0.0,
                            selected=[group], complete=[group], num_filtered=0, num_timeout_dropped=0,
                            num_returned=0, num_aborted=0)
    assert stats.policy_lag == 1


def timeout_schedule(*, drop_timed_out: bool, max_groups: int = 40) -> RolloutSchedule:
    """4 groups a step in batches of 2, no dynamic sampling; prompts 0, 1, 2, ... in order."""
    prompts = iter(Prompt(index=i, text=str(i), input_ids=[i], label=str(i)) for i in range(100))
    admission = Admission(policy=AdmissionPolicy.fifo, engines=[FakeEngine("e0")], concurrency=64)
    return RolloutSchedule(rollout_batch_size=4, groups_per_batch=2, filter_zero_variance=False,
                           drop_timed_out=drop_timed_out, over_sampling_groups=2, max_groups=max_groups,
                           admission=admission, draw=lambda k: [next(prompts) for _ in range(k)],
                           requests_for=lambda g, prompt: group_requests(g))


def completed(group: int, *, timed_out: bool = False):
    from tests.fakes import make_group

    done = make_group(group=group)
    done.samples[1].reward_timed_out = timed_out
    return done


@pytest.mark.parametrize("on_timeout", ["zero", "drop_group"])
def test_a_timed_out_reward_drops_its_group_for_a_replacement_only_under_drop_group(on_timeout):
    schedule = timeout_schedule(drop_timed_out=on_timeout == "drop_group")
    schedule.start()
    assert len(schedule.prompts) == 4, "over-sampling is for dynamic sampling only"
    resolutions = {g: schedule.on_group(completed(g, timed_out=g == 1)) for g in (0, 1, 2, 3)}
    if on_timeout == "zero":
        assert [r.dropped for r in resolutions.values()] == [None] * 4
        assert schedule.full() and [g.group for g in schedule.selected()] == [0, 1, 2, 3]
        return
    assert resolutions[1].dropped is DropReason.reward_timeout
    assert (schedule.num_timeout_dropped, schedule.num_filtered) == (1, 0)
    assert len(schedule.prompts) == 5 and not schedule.full(), "a replacement was admitted, as for a filtered group"
    resolutions[4] = schedule.on_group(completed(4))
    assert schedule.full() and [(g.group, g.batch) for g in schedule.selected()] == [(0, 0), (2, 0), (3, 1), (4, 1)]
    assert 1 not in [g.group for r in resolutions.values() for g in r.placed], "the dropped group is never published"


def test_a_timed_out_group_that_cannot_be_replaced_stops_the_step_with_the_count():
    schedule = timeout_schedule(drop_timed_out=True, max_groups=4)
    schedule.start()
    schedule.on_group(completed(0))
    with pytest.raises(RuntimeError) as stopped:
        schedule.on_group(completed(1, timed_out=True))
    assert str(stopped.value).startswith(
        "the step needs more than rollout.max_groups_per_step=4 groups: 1 of the 2 complete ones are trainable and "
        "1 (50%) had a reward call that ran past reward.timeout_s, which reward.on_timeout=drop_group drops. ")

