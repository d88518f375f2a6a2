"""Stops that wait for processes run side by side (control/lifetime.py ``call_side_by_side``): a rollout node's engines
and its reward calls in progress, and an engine host's servers. One after another, a node of eight SGLang servers
would take eight of their exits, past the margin a job warned of its time limit has to end in (seen on the local
Slurm cluster with one: 6.6 s of 7.5)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from rolloutpipe.control.lifetime import call_side_by_side
from rolloutpipe.rollout.engines.hosts import NodeServers
from rolloutpipe.rollout.node import RolloutNode

MEET_S = 30.0
"""How long each stop waits for the others to be stopping too: called one after another, the first waits alone."""


def meeting(parties: int, done: list[str]):
    """``stop(name)``: returns once ``parties`` stops are in progress at once (else raises BrokenBarrierError)."""
    barrier = threading.Barrier(parties, timeout=MEET_S)

    def stop(name: str):
        def call() -> None:
            barrier.wait()
            done.append(name)
        return call

    return stop


class Closes:
    """What RolloutNode.close closes after the stops that wait (the dispatcher, the spans), recording the order."""

    def __init__(self, done: list[str], name: str) -> None:
        self.done, self.name = done, name

    def close(self) -> None:
        self.done.append(self.name)

    def flush(self) -> None:
        self.done.append(self.name)


def test_a_rollout_node_stops_its_engines_and_its_reward_calls_side_by_side_then_closes_the_rest():
    """The engines' servers, the reward calls in progress and the evaluation's all wait for something else."""
    done: list[str] = []
    stop = meeting(5, done)
    node = SimpleNamespace(engines=[SimpleNamespace(name=f"engine{i}", shutdown=stop(f"engine{i}")) for i in range(3)],
                           rewards=SimpleNamespace(close=stop("rewards"), pool=None), environment=None,
                           evaluation=SimpleNamespace(close=stop("evaluation")), dispatcher=Closes(done, "dispatcher"),
                           spans=Closes(done, "spans"))
    RolloutNode.close(node)
    assert sorted(done[:5]) == ["engine0", "engine1", "engine2", "evaluation", "rewards"]
    assert done[5:] == ["dispatcher", "spans"]


def test_an_engine_host_stops_its_servers_side_by_side():
    done: list[str] = []
    stop = meeting(2, done)
    servers = NodeServers.__new__(NodeServers)
    servers.servers = {name: SimpleNamespace(stop=stop(name)) for name in ("engine1", "engine2")}
    servers.stop_all()
    assert sorted(done) == ["engine1", "engine2"]


def test_servers_that_failed_to_start_are_stopped_side_by_side_and_the_failure_raised():
    done: list[str] = []
    stop = meeting(2, done)

    def server(name: str, ready: bool) -> SimpleNamespace:
        def wait_ready(timeout_s: float) -> None:
            if not ready:
                raise RuntimeError(f"injected: {name} exited with code 3")
        return SimpleNamespace(name=name, start=lambda: None, wait_ready=wait_ready, stop=stop(name))

    servers = NodeServers.__new__(NodeServers)
    servers.cfg = SimpleNamespace(rollout=SimpleNamespace(server_start_timeout_s=1.0))
    servers._server = lambda j, name: server(name, ready=name != "engine2")
    with pytest.raises(RuntimeError, match="injected: engine2"):
        servers.start([(0, "engine1"), (1, "engine2")])
    assert sorted(done) == ["engine1", "engine2"]


def test_a_failed_stop_is_raised_once_every_other_stop_has_returned():
    done: list[str] = []
    stop = meeting(2, done)

    def fails() -> None:
        raise OSError("injected: this server's group could not be signalled")

    with pytest.raises(OSError, match="injected"):
        call_side_by_side({"a": stop("a"), "b": fails, "c": stop("c")})
    assert sorted(done) == ["a", "c"]
