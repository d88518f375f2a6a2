"""A policy sent again mid-step: its request's place among the group handles, the same for every trainer rank (the
dispatcher's ``at_position``, the trainer's ``send_again_before``)."""

from types import SimpleNamespace

import pytest

from rolloutpipe.control.run import PipelineMode
from rolloutpipe.rollout.dispatcher import Dispatcher
from tests.fakes import FakeSpans, make_group


class Handles:
    """The store's side: the handles in the order published, and what ran between them."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def publish(self, group, *, seq: int, inline_max_bytes: int):
        self.order.append(f"handle {seq}: group {group.group}")
        return SimpleNamespace(num_bytes=0)


def dispatcher(mode: PipelineMode) -> tuple[Dispatcher, Handles]:
    handles = Handles()
    return Dispatcher(transport=handles, mode=mode, inline_max_bytes=0, spans=FakeSpans()), handles


def test_a_call_at_position_runs_after_the_groups_put_before_it_and_before_those_put_after():
    d, handles = dispatcher(PipelineMode.cgp)
    d.begin_step(0, 4)
    for g in (2, 0):
        d.put(make_group(step=0, group=g))

    def call(transport, seq: int) -> int:
        transport.order.append(f"call at {seq}")
        return seq

    assert d.at_position(0, call, check=lambda: None) == 2
    d.put(make_group(step=0, group=1))
    assert d.at_position(0, call, check=lambda: None) == 3
    d.close()
    assert handles.order == ["handle 0: group 2", "handle 1: group 0", "call at 2", "handle 2: group 1", "call at 3"]


def test_under_sync_the_position_counts_only_what_is_published_and_an_error_reaches_the_caller():
    d, handles = dispatcher(PipelineMode.sync)  # the step's groups are held until all are complete
    d.begin_step(0, 2)
    d.put(make_group(step=0, group=1))
    assert d.at_position(0, lambda transport, seq: seq, check=lambda: None) == 0

    def refuse(transport, seq: int) -> None:
        raise ValueError(f"too late at {seq}")

    with pytest.raises(ValueError, match="too late at 0"):
        d.at_position(0, refuse, check=lambda: None)
    d.put(make_group(step=0, group=0))
    assert d.at_position(0, lambda transport, seq: seq, check=lambda: None) == 2
    d.close()
    assert handles.order == ["handle 0: group 1", "handle 1: group 0"]


def test_every_trainer_rank_serves_each_request_for_the_policy_again_before_the_handle_it_names():
    """trainer/node.py ``send_again_before``: a request placed before handle 1 is served there, not before handle 0,
    and once; the next one (before handle 3) is served there, in the same step; none are served by a backend that
    cannot be asked (disk weight sync)."""
    import contextlib

    from rolloutpipe.control.weights.distributed import again_key
    from rolloutpipe.trainer.node import TrainerNode

    records: dict[str, dict] = {}
    transport = SimpleNamespace(key=lambda *parts: "/".join(map(str, parts)), read_record=records.get)
    sent: list[tuple[int, int]] = []
    node = SimpleNamespace(
        _sends_again=True, _num_again=(0, 0), transport=transport, is_writer=True,
        spans=SimpleNamespace(span=lambda *args, **kwargs: contextlib.nullcontext()),
        trainer=SimpleNamespace(writer_reads=contextlib.nullcontext),
        weights=SimpleNamespace(send_again=lambda request: sent.append((request["before_seq"], request["attempt"]))))
    records[again_key(transport, 1, 0)] = {"policy_version": 1, "attempt": 1, "before_seq": 1}
    records[again_key(transport, 1, 1)] = {"policy_version": 1, "attempt": 2, "before_seq": 3}
    served = []
    for seq in range(4):
        for _ in range(2):  # while it waits for the handle, then once it has it
            TrainerNode.send_again_before(node, 1, seq)
        served.append(list(sent))
    assert served == [[], [(1, 1)], [(1, 1)], [(1, 1), (3, 2)]]
    node._sends_again, sent[:] = False, []
    node._num_again = (0, 0)
    TrainerNode.send_again_before(node, 1, 1)
    assert sent == []


def test_the_rollout_node_asks_before_the_first_training_batch_is_published_and_stops_the_run_after():
    """rollout/node.py ``_policy_again``: the request goes where fewer groups of the step are published than a training
    batch holds (trainer rank 0 has not stepped); past that the run stops to be requeued, saying why."""
    from rolloutpipe.control.attempt import FreshStart
    from rolloutpipe.rollout.node import PolicyGone, RolloutNode

    d, handles = dispatcher(PipelineMode.cgp)
    d.begin_step(1, 4)
    asked: list[int] = []
    weights = SimpleNamespace(send_again=lambda step, version, mark: mark(
        lambda transport, seq: asked.append(seq)))
    back: list[bool] = []
    node = SimpleNamespace(
        cfg=SimpleNamespace(groups_per_batch=2), dispatcher=d, weights=weights, spans=FakeSpans(),
        supervisor=SimpleNamespace(step=1, policy_version=1, back_in_service=lambda: back.append(True)),
        transport=SimpleNamespace(liveness=SimpleNamespace(check=lambda waiting_for: None)))
    d.put(make_group(step=1, group=0))
    RolloutNode._policy_again(node, "engine0")
    assert asked == [1] and back == [True]
    d.put(make_group(step=1, group=1))
    with pytest.raises(PolicyGone, match=r"engine engine0 failed mid-step\. .*may have updated it by now \(2 groups "
                                          r"of step 1 published, a training batch is 2\); stopping the run to be "
                                          r"requeued") as stopped:
        RolloutNode._policy_again(node, "engine0")
    assert isinstance(stopped.value, FreshStart)  # (pipeline.run_node: the abort says requeue)
    d.close()
    assert asked == [1] and back == [True]
