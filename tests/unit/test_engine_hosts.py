"""Engines on several rollout nodes (rollout/engines/hosts.py), as the supervisor and Admission see them: pure logic
with fake engines, no processes. Engine i is on host i // 2 (two engines per node)."""

import pytest

from rolloutpipe.control.weights.buckets import WeightGroup
from rolloutpipe.rollout.admission import Admission, AdmissionPolicy
from rolloutpipe.rollout.engines.hosts import HostLost
from rolloutpipe.rollout.engines.supervisor import EngineFailed, EngineSupervisor
from tests.fakes import FakeEngine, FakeSpans, group_requests

WEIGHTS = ("/run/weights/policy_v2.safetensors", 2)


class FakeRestart:
    """A restart requested from an engine host: ``poll`` is None until the host ``registers`` or is ``lost``."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.ready = False
        self.lost: str | None = None

    def poll(self):
        if self.lost is not None:
            raise HostLost(self.lost)
        return self.engine if self.ready else None


class TwoHosts:
    """Four engines on two hosts; every engine of host 1 is restarted by its host (a FakeRestart)."""

    def __init__(self, *, policy=AdmissionPolicy.fifo, concurrency=8, min_engines=1) -> None:
        self.engines = [FakeEngine(f"engine{i}", self.on_result) for i in range(4)]
        self.restarts: dict[str, FakeRestart] = {}
        self.spans = FakeSpans()
        self.counted = []
        self.supervisor = EngineSupervisor(
            engines=self.engines, restart=self.restart, where_to_look=lambda e: f"/logs/{e.name}.log", max_failures=3,
            request_timeout_s=None, spans=self.spans, min_engines=min_engines)
        self.supervisor.load_weights(*WEIGHTS)
        self.policy, self.concurrency = policy, concurrency
        self.begin_step(0)

    def begin_step(self, step: int) -> None:  # what RolloutNode.begin_step does
        self.admission = Admission(policy=self.policy, engines=self.engines, concurrency=self.concurrency)
        self.supervisor.begin_step(step, self.admission)

    def restart(self, slot: int, name: str, failed):
        replacement = FakeEngine(name, self.on_result)
        if slot // 2 == 0:  # host 0
            return replacement
        self.restarts[failed.name] = FakeRestart(replacement)
        return self.restarts[failed.name]

    def on_result(self, result) -> None:
        if self.admission.finished(result.request_id, result.engine):
            self.counted.append(result)

    def names(self) -> list[str]:
        return [e.name for e in self.engines]

    def lose_host_1(self) -> None:
        """Its engines fail (their calls do), their restarts are requested, then its heart-beat is found silent."""
        for engine in self.engines[2:]:
            engine.error = RuntimeError("cannot reach the engine server")
        self.supervisor.check()
        for restart in self.restarts.values():
            restart.lost = "its engine host (rollout rank 1) is lost: it stopped heart-beating"
        self.supervisor.check()


def test_an_engine_restarting_on_its_node_is_out_of_service_until_its_host_registers_it():
    hosts = TwoHosts()
    e2 = hosts.engines[2]
    for g in range(4):  # FIFO: a group to an engine, round robin; one request on each engine
        hosts.admission.add_group(g, group_requests(g, n=1))
    e2.error = RuntimeError("server exited with code -9")
    hosts.supervisor.check()
    assert hosts.names() == ["engine0", "engine1", "engine3"], "out of service while its host restarts it"
    assert sorted(r.request_id for e in hosts.engines for r in e.running) == [
        f"step=0/group={g}/sample=0" for g in range(4)], "its request went to an engine in service"
    hosts.supervisor.check()  # the host has not registered it yet: nothing changes, nothing blocks
    assert hosts.names() == ["engine0", "engine1", "engine3"]

    hosts.restarts["engine2"].ready = True
    hosts.supervisor.check()
    replacement = hosts.engines[-1]
    assert replacement.name == "engine2-restart1" and replacement.weights == WEIGHTS, "back, on the current weights"
    for g in range(4, 8):
        hosts.admission.add_group(g, group_requests(g, n=1))
    assert len(replacement.running) == 1, "and in service"
    (name, span), = hosts.spans.spans
    assert name == "rollout/engine_restart" and span["replacement"] == "engine2-restart1" and span["num_retried"] == 1


def test_an_engine_still_restarting_at_a_step_boundary_joins_the_next_step_when_it_is_back():
    hosts = TwoHosts()
    hosts.engines[3].error = RuntimeError("boom")
    hosts.supervisor.check()
    hosts.begin_step(1)  # a new Admission over the engines in service
    hosts.supervisor.load_weights("/run/weights/policy_v3.safetensors", 3)
    hosts.restarts["engine3"].ready = True
    hosts.supervisor.check()
    assert hosts.engines[-1].weights == ("/run/weights/policy_v3.safetensors", 3)
    for g in range(4):
        hosts.admission.add_group(g, group_requests(g, n=1))
    assert [len(e.running) for e in hosts.engines] == [1, 1, 1, 1]


def test_a_lost_engine_host_retires_its_engines_and_the_run_goes_on_with_the_others():
    hosts = TwoHosts()
    for g in range(8):
        hosts.admission.add_group(g, group_requests(g, n=1))
    hosts.lose_host_1()
    assert hosts.names() == ["engine0", "engine1"] and hosts.supervisor.retired == ["engine2", "engine3"]
    lost = [s for name, s in hosts.spans.spans if name == "rollout/engine_lost"]
    assert [s["engine"] for s in lost] == ["engine2", "engine3"] and "rollout rank 1" in lost[0]["reason"]
    for engine in hosts.engines:
        for request in list(engine.running):
            engine.finish(request.request_id)
    assert sorted(r.request_id for r in hosts.counted) == [f"step=0/group={g}/sample=0" for g in range(8)]
    hosts.begin_step(1)
    for g in range(4):
        hosts.admission.add_group(g, group_requests(g, n=1))
    assert [len(e.running) for e in hosts.engines] == [2, 2], "the next step runs on the engines that remain"


def test_a_host_that_beats_again_gets_its_retired_engines_back_on_the_current_weights():
    """A host whose heart-beat stalled (a paused node, a healed partition) is declared lost, then beats again, picks
    up the restart requests it missed and registers the fresh engines: they come back into service, with the policy
    the others serve by then."""
    hosts = TwoHosts()
    hosts.lose_host_1()
    assert hosts.names() == ["engine0", "engine1"] and hosts.supervisor.retired == ["engine2", "engine3"]
    hosts.supervisor.check()  # still lost: nothing changes, and the loss is reported once
    assert len([name for name, _ in hosts.spans.spans if name == "rollout/engine_lost"]) == 2

    hosts.begin_step(1)
    hosts.supervisor.load_weights("/run/weights/policy_v3.safetensors", 3)
    for restart in hosts.restarts.values():  # it beats again, and has registered engine2/3-restart1
        restart.lost, restart.ready = None, True
    hosts.supervisor.check()
    assert hosts.names() == ["engine0", "engine1", "engine2-restart1", "engine3-restart1"]
    assert hosts.supervisor.retired == []
    assert {e.weights for e in hosts.engines} == {("/run/weights/policy_v3.safetensors", 3)}
    for g in range(4):
        hosts.admission.add_group(g, group_requests(g, n=1))
    assert [len(e.running) for e in hosts.engines] == [1, 1, 1, 1], "all four in service"


def test_below_rollout_min_engines_a_lost_host_stops_the_run():
    hosts = TwoHosts(min_engines=3)
    for engine in hosts.engines[2:]:
        engine.error = RuntimeError("cannot reach the engine server")
    hosts.supervisor.check()  # both restarting: 4 engines in service or on their way back
    hosts.restarts["engine2"].lost = "its engine host (rollout rank 1) is lost"
    hosts.supervisor.check()  # engine3 may still come back: 3 remain, enough
    hosts.restarts["engine3"].lost = "its engine host (rollout rank 1) is lost"
    with pytest.raises(EngineFailed, match=r"engine engine3 is lost: its engine host \(rollout rank 1\) is lost; 2 "
                                           r"engines remain, fewer than rollout.min_engines=3: stopping the run"):
        hosts.supervisor.check()




def broadcasting(hosts: TwoHosts) -> None:
    """pipeline.weight_sync=distributed: the four engines in group g-1 (ranks 1-4), serving policy 3."""
    hosts.supervisor.join_weight_group(group("g-1", 5), 1)
    hosts.supervisor.load_weights_distributed([], 3, macs=None)


def group(name: str, world_size: int) -> WeightGroup:
    return WeightGroup(master_address="h", master_port=1, world_size=world_size, group_name=name)


def test_under_broadcast_weight_sync_an_engine_on_another_node_leaves_the_group_and_its_replacement_joins_later():
    """Its failed member cannot receive the next policy: the next group is formed without it while its host restarts
    it; the replacement, once registered, waits out of service and joins the group after that, in its slot."""
    hosts = TwoHosts()
    broadcasting(hosts)
    e0, e1, e2, e3 = hosts.engines
    e2.error = RuntimeError("server exited with code -9")
    hosts.supervisor.check()
    assert hosts.names() == ["engine0", "engine1", "engine3"]
    assert hosts.supervisor.next_group_size() == 3, "the next policy goes to a group without it"
    hosts.supervisor.rejoin_weight_group(group("g-2", 4), 1)
    assert [e.groups[-1] for e in (e0, e1, e3)] == [("g-2", 1), ("g-2", 2), ("g-2", 3)], "no gap in the ranks"
    hosts.supervisor.load_weights_distributed([], 4, macs=None)
    assert hosts.supervisor.next_group_size() is None, "still restarting: the group serves policy 5 too"

    hosts.restarts["engine2"].ready = True
    hosts.supervisor.check()
    replacement = hosts.restarts["engine2"].engine
    assert hosts.supervisor.replacements_waiting() == ["engine2-restart1"] and replacement.groups == []
    assert hosts.names() == ["engine0", "engine1", "engine3"], "out of service until it joins a group"
    assert hosts.supervisor.next_group_size() == 4
    hosts.supervisor.rejoin_weight_group(group("g-3", 5), 1)
    assert replacement.groups == [("g-3", 3)] and e3.groups[-1] == ("g-3", 4), "in slot order"
    hosts.supervisor.load_weights_distributed([], 5, macs=None)
    assert {e.weights for e in hosts.engines} == {("g-3", 5)} and len(hosts.engines) == 4
    (name, span), = hosts.spans.spans
    assert name == "rollout/engine_restart" and span["replacement"] == "engine2-restart1"


def test_under_broadcast_weight_sync_a_server_that_died_idle_is_found_before_the_broadcast():
    """Nothing was in flight on it, so no call failed: the probe before the policy finds it."""
    hosts = TwoHosts()
    broadcasting(hosts)
    hosts.engines[3].server_gone = True
    hosts.supervisor.check()
    assert hosts.names() == ["engine0", "engine1", "engine2", "engine3"], "nothing noticed it yet"
    assert hosts.supervisor.next_group_size() == 3
    assert hosts.names() == ["engine0", "engine1", "engine2"] and "engine3" in hosts.restarts


def test_under_broadcast_weight_sync_a_lost_host_leaves_the_group_and_comes_back_when_it_beats_again():
    hosts = TwoHosts()
    broadcasting(hosts)
    hosts.lose_host_1()
    assert hosts.supervisor.retired == ["engine2", "engine3"]
    assert hosts.supervisor.next_group_size() == 2
    hosts.supervisor.rejoin_weight_group(group("g-2", 3), 1)
    hosts.supervisor.load_weights_distributed([], 4, macs=None)
    for restart in hosts.restarts.values():
        restart.lost, restart.ready = None, True
    hosts.supervisor.check()
    assert hosts.supervisor.retired == [] and hosts.supervisor.next_group_size() == 4
    hosts.supervisor.rejoin_weight_group(group("g-3", 5), 1)
    hosts.supervisor.load_weights_distributed([], 5, macs=None)
    assert hosts.names() == ["engine0", "engine1", "engine2-restart1", "engine3-restart1"]
    assert {e.weights for e in hosts.engines} == {("g-3", 5)}

def test_fgd_sends_the_frontier_first_to_whichever_host_has_a_free_slot():
    hosts = TwoHosts(policy=AdmissionPolicy.fgd, concurrency=2)
    for g in range(8):
        hosts.admission.add_group(g, group_requests(g, n=2))
    hosts.admission.pump(lambda: [0, 1, 2, 3])
    held = {e.name: sorted({int(r.request_id.split("/")[1][6:]) for r in e.running}) for e in hosts.engines}
    assert held == {"engine0": [0], "engine1": [1], "engine2": [2], "engine3": [3]}
    engine3 = hosts.engines[3]  # on host 1: it frees its slots first
    for request in list(engine3.running):
        engine3.finish(request.request_id)
    hosts.admission.pump(lambda: [6, 4])  # the frontier moved (e.g. groups 4 and 5 were dropped)
    assert sorted({r.request_id for r in engine3.running}) == ["step=0/group=6/sample=0", "step=0/group=6/sample=1"]
