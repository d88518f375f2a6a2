"""Engine failure (supervisor.py with Admission): pure logic with fake engines, no processes."""

import time

import pytest

from rolloutpipe.control.weights.buckets import WeightGroup
from rolloutpipe.rollout.admission import AdmissionPolicy
from rolloutpipe.rollout.config import RolloutConfig
from rolloutpipe.rollout.engines import supervisor as supervisor_module
from rolloutpipe.rollout.engines.supervisor import EngineFailed
from tests.fakes import Rollout, group_requests


def test_requests_of_a_dead_engine_are_resubmitted_with_their_seeds_and_its_late_results_ignored():
    rollout = Rollout(num_engines=2)
    e0, e1 = rollout.engines
    for g in range(2):  # FIFO: group 0 on engine0, group 1 on engine1
        rollout.admission.add_group(g, group_requests(g, n=2))
    e0.finish("step=0/group=0/sample=0")  # counted: it finished before the failure
    held = [r.request_id for r in e0.running]
    assert held == ["step=0/group=0/sample=1"]
    e0.error = RuntimeError("scheduler thread raised")
    rollout.supervisor.check()

    assert [(r.request_id, r.sampling_seed) for r in e1.running] == [
        ("step=0/group=1/sample=0", 100), ("step=0/group=1/sample=1", 101), ("step=0/group=0/sample=1", 1)]
    replacement = rollout.engines[0]
    assert replacement.name == "engine0-restart1" and e0.shut_down
    e0.finish("step=0/group=0/sample=1")  # the dead engine's late result: the request is on engine1 now
    for request in list(e1.running):
        e1.finish(request.request_id)
    ids = sorted(r.request_id for r in rollout.counted)
    assert ids == [f"step=0/group={g}/sample={s}" for g in range(2) for s in range(2)], "every sample exactly once"
    assert next(r for r in rollout.counted if r.request_id == "step=0/group=0/sample=1").engine == "engine1"
    assert rollout.admission.num_in_flight() == 0
    (name, span), = rollout.spans.spans
    assert name == "rollout/engine_restart" and span["engine"] == "engine0" and span["num_retried"] == 1


def test_a_restarted_engine_serves_the_current_weights_and_takes_new_requests():
    rollout = Rollout(num_engines=2)
    rollout.supervisor.load_weights("/run/weights/policy_v3.safetensors", 3)
    rollout.engines[1].error = RuntimeError("server exited with code -9")
    rollout.supervisor.check()
    replacement = rollout.engines[1]
    assert replacement.weights == ("/run/weights/policy_v3.safetensors", 3)
    for g in range(2):
        rollout.admission.add_group(g, group_requests(g, n=2))
    assert len(replacement.running) == 2 and len(rollout.engines[0].running) == 2


def test_under_broadcast_weight_sync_a_replacement_waits_for_the_next_group_and_joins_it_with_the_others():
    """pipeline.weight_sync=distributed: the replacement cannot join the formed group nor load the current policy, so
    it stays out of service (its requests go to the other engine), a new group is asked for before the next policy,
    and at the step boundary every engine joins that group, the replacement in its slot's rank."""
    rollout = Rollout(num_engines=2)
    supervisor, (e0, e1) = rollout.supervisor, rollout.engines
    supervisor.join_weight_group(WeightGroup(master_address="h", master_port=1, world_size=3, group_name="g-1"), 1)
    supervisor.load_weights_distributed([], 3, macs=None)
    assert supervisor.next_group_size() is None, "nothing changed: the group serves"
    for g in range(2):
        rollout.admission.add_group(g, group_requests(g, n=2))
    e0.error = RuntimeError("server exited with code -9")
    supervisor.check()
    [replacement] = rollout.restarted
    assert rollout.engines == [e1] and len(e1.running) == 4 and replacement.submitted == []
    assert supervisor.replacements_waiting() == ["engine0-restart1"]
    assert rollout.spans.spans == []  # not restarted yet: it serves nothing
    assert supervisor.next_group_size() == 2
    supervisor.rejoin_weight_group(WeightGroup(master_address="h", master_port=2, world_size=3, group_name="g-2"), 1)
    assert rollout.engines == [e1, replacement] and supervisor.replacements_waiting() == []
    assert replacement.groups == [("g-2", 1)] and e1.groups == [("g-1", 2), ("g-2", 2)]
    supervisor.load_weights_distributed([], 4, macs=None)
    assert replacement.weights == e1.weights == ("g-2", 4)
    (name, span), = rollout.spans.spans
    assert name == "rollout/engine_restart" and span["replacement"] == "engine0-restart1"
    assert span["policy_version"] == 4
    replacement.error = e1.error = RuntimeError("both lost")
    with pytest.raises(EngineFailed, match="It was the last engine in service"):
        supervisor.check()


def in_group_of(num_engines: int) -> Rollout:
    """Engines in a weight-update group, serving policy 3, which came by broadcast (a replacement cannot load it)."""
    rollout = Rollout(num_engines=num_engines)
    rollout.supervisor.join_weight_group(WeightGroup(master_address="h", master_port=1, world_size=1 + num_engines,
                                                     group_name="g-1"), 1)
    assert rollout.supervisor.load_weights_distributed([], 3, macs=None)
    return rollout


def dies_mid_broadcast(engine) -> None:
    def receive():
        engine.error = RuntimeError("server exited with code -9")
        raise RuntimeError("given up: the server exited")
    engine.receive = receive


def waits_until_it_leaves(engine, *, gives_up: bool = True) -> None:
    def receive():
        deadline = time.monotonic() + 10
        while not (gives_up and engine.left) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("the broadcast was given up")
    engine.receive = receive


def test_an_engine_dying_during_the_broadcast_has_the_others_give_it_up_and_a_new_group_receive_it_again():
    """pipeline.weight_sync=distributed: a member that dies mid-broadcast leaves the others waiting in a collective
    that cannot end; they are told to leave the group, the dead one is replaced, and the load says the policy must go
    again (to a new group of the engines left and the replacement)."""
    rollout = in_group_of(2)
    supervisor, (e0, e1) = rollout.supervisor, rollout.engines
    dies_mid_broadcast(e0)
    waits_until_it_leaves(e1)
    assert supervisor.load_weights_distributed([], 4, macs=None) is False
    assert e1.left == ["g-1"] and e0.left == [] and e0.shut_down and not e1.shut_down
    assert rollout.engines == [e1] and supervisor.replacements_waiting() == ["engine0-restart1"]
    assert supervisor.policy_version == 3 and supervisor.next_group_size() == 2
    e1.receive = None
    supervisor.rejoin_weight_group(WeightGroup(master_address="h", master_port=2, world_size=3, group_name="g-2"), 1)
    assert supervisor.load_weights_distributed([], 4, macs=None) is True
    assert [e.weights for e in rollout.engines] == [("g-2", 4), ("g-2", 4)] and supervisor.policy_version == 4


def test_an_engine_that_does_not_give_up_the_broken_broadcast_is_replaced_too(monkeypatch):
    monkeypatch.setattr(supervisor_module, "LEAVE_GRACE_S", 0.2)
    rollout = in_group_of(3)
    supervisor, (e0, e1, e2) = rollout.supervisor, rollout.engines
    dies_mid_broadcast(e0)
    waits_until_it_leaves(e1, gives_up=False)  # SGLang's scheduler, stuck in the collective until its timeout
    waits_until_it_leaves(e2)
    assert supervisor.load_weights_distributed([], 4, macs=None) is False
    assert e1.left == e2.left == ["g-1"] and e1.shut_down and not e2.shut_down
    assert rollout.engines == [e2] and supervisor.replacements_waiting() == ["engine0-restart1", "engine1-restart1"]
    assert supervisor.next_group_size() == 3


def test_the_last_engine_in_service_dying_between_steps_is_replaced_and_its_replacement_receives_the_policy():
    """Mid-step, the last engine in service cannot wait for the next group (the test above); between steps it can:
    the new group forms now, of its replacement alone. So it goes for one that died idle (found by the probe before
    the policy) and for one that dies during the broadcast."""
    rollout = in_group_of(1)
    supervisor, [e0] = rollout.supervisor, rollout.engines
    e0.server_gone = True
    assert supervisor.next_group_size() == 1 and rollout.engines == []
    assert supervisor.replacements_waiting() == ["engine0-restart1"]
    supervisor.rejoin_weight_group(WeightGroup(master_address="h", master_port=2, world_size=2, group_name="g-2"), 1)
    [replacement] = rollout.engines
    dies_mid_broadcast(replacement)
    assert supervisor.load_weights_distributed([], 4, macs=None) is False
    assert rollout.engines == [] and supervisor.replacements_waiting() == ["engine0-restart2"]
    assert supervisor.next_group_size() == 1
    supervisor.rejoin_weight_group(WeightGroup(master_address="h", master_port=3, world_size=2, group_name="g-3"), 1)
    assert supervisor.load_weights_distributed([], 4, macs=None) is True
    assert [e.weights for e in rollout.engines] == [("g-3", 4)]
    rollout.engines[0].error = RuntimeError("lost mid-step")
    with pytest.raises(EngineFailed, match="It was the last engine in service"):
        supervisor.check()


def test_a_failed_broadcast_where_no_engine_died_stops_the_run():
    """A refused bucket (its MAC does not match) is no lost member: nothing is sent again, the run stops."""
    rollout = in_group_of(2)
    def refuse():
        raise RuntimeError("the bucket does not match its MAC")
    rollout.engines[0].receive = refuse
    with pytest.raises(EngineFailed, match="does not match its MAC.*this stops the run"):
        rollout.supervisor.load_weights_distributed([], 4, macs=None)
    assert rollout.engines[1].left == [] and rollout.restarted == []


def test_the_last_engine_lost_mid_step_leaves_its_replacement_stranded_until_the_policy_comes_again():
    """With ``sends_again`` (rollout/node.py: distributed sync, not async), the last engine in service failing mid-step
    does not stop the run: its replacement waits (``stranded``), joins a group of its own to receive the current
    policy again (``rejoin_weight_group`` with the version), and takes the requests that waited once it has it."""
    rollout = in_group_of(1)
    supervisor, [e0] = rollout.supervisor, rollout.engines
    supervisor.sends_again = True
    rollout.admission.add_group(0, group_requests(0, n=2))
    e0.error = RuntimeError("server exited with code -9")
    supervisor.check()
    [replacement] = rollout.restarted
    assert rollout.engines == [] and supervisor.stranded() == "engine0"
    assert replacement.submitted == [] and supervisor.next_group_size() == 1
    supervisor.rejoin_weight_group(WeightGroup(master_address="h", master_port=2, world_size=2, group_name="g-2"), 1,
                                   policy_version=3)
    assert rollout.engines == [replacement] and supervisor.stranded() is None and replacement.groups == [("g-2", 1)]
    assert replacement.submitted == [], "no request before the policy has loaded"
    assert supervisor.load_weights_distributed([], 3, macs=None) and replacement.weights == ("g-2", 3)
    supervisor.back_in_service()
    assert sorted(r.request_id for r in replacement.submitted) == [f"step=0/group=0/sample={i}" for i in range(2)]
    (name, span), = rollout.spans.spans
    assert name == "rollout/engine_restart" and span["policy_version"] == 3
    assert supervisor.next_group_size() is None, "the group it joined serves the next policy"


def test_a_replacement_serves_at_once_where_its_policy_needs_no_broadcast():
    """Under distributed sync a replacement that can load the current policy without trainer rank 0 (the model's own
    weights, policy 0; or the file a resumed run's first policy came from) goes back into service at once, and the
    next policy goes to a new group with it."""
    for weights in (None, ("/run/weights/policy_v5.safetensors", 5)):
        rollout = Rollout(num_engines=2)
        supervisor, (e0, e1) = rollout.supervisor, rollout.engines
        if weights is not None:
            supervisor.load_weights(*weights)
        supervisor.join_weight_group(WeightGroup(master_address="h", master_port=1, world_size=3, group_name="g-1"), 1)
        e0.error = RuntimeError("server exited with code -9")
        supervisor.check()
        [replacement] = rollout.restarted
        assert rollout.engines == [replacement, e1] and supervisor.replacements_waiting() == []
        for g in range(2):
            rollout.admission.add_group(g, group_requests(g, n=2))
        assert len(replacement.submitted) == 2 and replacement.weights == weights
        assert supervisor.next_group_size() == 2
    # between steps it joins the new group at once, as every replacement does (the policy goes to it there)
    rollout = in_group_of(2)
    rollout.supervisor.policy_version = 0
    dies_mid_broadcast(rollout.engines[0])
    waits_until_it_leaves(rollout.engines[1])
    assert rollout.supervisor.load_weights_distributed([], 1, macs=None) is False
    assert rollout.supervisor.replacements_waiting() == ["engine0-restart1"]


def test_with_one_engine_its_requests_wait_for_the_restarted_one():
    rollout = Rollout(num_engines=1)
    rollout.admission.add_group(0, group_requests(0, n=2))
    dead = rollout.engines[0]
    dead.error = RuntimeError("boom")
    rollout.supervisor.check()
    assert [r.request_id for r in rollout.engines[0].running] == ["step=0/group=0/sample=0", "step=0/group=0/sample=1"]
    assert rollout.engines[0].name == "engine0-restart1"


def test_fgd_puts_retried_requests_back_in_line_frontier_first_within_concurrency():
    rollout = Rollout(num_engines=2, policy=AdmissionPolicy.fgd, concurrency=2)
    e0, e1 = rollout.engines
    for g in range(3):
        rollout.admission.add_group(g, group_requests(g, n=2))
    rollout.admission.pump(lambda: [0, 1])
    assert [r.request_id for r in e0.running] == ["step=0/group=0/sample=0", "step=0/group=0/sample=1"]
    assert [r.request_id for r in e1.running] == ["step=0/group=1/sample=0", "step=0/group=1/sample=1"]
    e0.error = RuntimeError("boom")
    rollout.supervisor.check()
    rollout.admission.pump(lambda: [0, 1])
    assert len(e1.running) == 2, "engine1 is full: nothing more goes to it"
    replacement = rollout.engines[0]
    assert [r.request_id for r in replacement.running] == ["step=0/group=0/sample=0", "step=0/group=0/sample=1"]


def test_aborted_requests_of_a_dead_engine_are_not_retried():
    rollout = Rollout(num_engines=1)
    rollout.admission.add_group(0, group_requests(0, n=2))
    rollout.admission.add_group(1, group_requests(1, n=2))
    assert rollout.admission.abort_groups([1]) == 2
    rollout.engines[0].error = RuntimeError("boom")
    rollout.supervisor.check()
    assert [r.request_id for r in rollout.engines[0].running] == ["step=0/group=0/sample=0", "step=0/group=0/sample=1"]
    assert rollout.admission.num_in_flight() == 2


def test_an_engine_holding_requests_that_hands_none_back_within_the_timeout_is_restarted():
    rollout = Rollout(num_engines=2, request_timeout_s=0.05)
    for g in range(2):
        rollout.admission.add_group(g, group_requests(g, n=2))
    rollout.supervisor.check()
    assert rollout.restarted == []
    rollout.engines[1].finish("step=0/group=1/sample=0")
    time.sleep(0.03)
    rollout.engines[1].finish("step=0/group=1/sample=1")  # engine1 makes progress, engine0 does not
    time.sleep(0.03)
    rollout.supervisor.check()
    assert [e.name for e in rollout.restarted] == ["engine0-restart1"]
    assert "rollout.request_timeout_s=0.05" in rollout.spans.spans[0][1]["reason"]


def test_an_idle_engine_never_times_out():
    rollout = Rollout(num_engines=1, request_timeout_s=0.01)
    time.sleep(0.03)
    rollout.supervisor.check()
    assert rollout.restarted == []


def test_past_max_engine_failures_the_run_stops_naming_the_engine_and_its_log():
    rollout = Rollout(num_engines=2, max_failures=1)
    rollout.engines[1].error = RuntimeError("boom")
    rollout.supervisor.check()
    rollout.engines[1].error = RuntimeError("boom again")
    with pytest.raises(EngineFailed, match=r"engine engine1-restart1 failed: RuntimeError\('boom again'\).*"
                                           r"failure 2 of engine engine1.*max_engine_failures=1.*/logs/"
                                           r"engine1-restart1.log"):
        rollout.supervisor.check()


def test_max_engine_failures_zero_stops_at_the_first_failure():
    rollout = Rollout(num_engines=2, max_failures=0)
    rollout.engines[0].error = RuntimeError("boom")
    with pytest.raises(EngineFailed, match="engine engine0 failed"):
        rollout.supervisor.check()
    assert rollout.restarted == []


@pytest.mark.parametrize("field,value,message", [
    ("max_engine_failures", -1, "rollout.max_engine_failures=-1 must be >= 0"),
    ("request_timeout_s", 0.0, "rollout.request_timeout_s=0.0 must be > 0"),
])
def test_engine_failure_settings_are_checked_at_the_edge(field, value, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**{field: value})
