"""The control plane: groups cross a real TCPStore as signed handles; anything altered or stray is refused."""

import json
import time

import pytest

from rolloutpipe.control.transport import HandleRejected, Liveness, PeerLost, StoreAddress, Transport
from rolloutpipe.types import CompleteGroup, FinishReason, Sample


def make_group(step=0, group=3, num_samples=4, response_len=5) -> CompleteGroup:
    samples = [
        Sample(group=group, index=i, response_ids=list(range(i, i + response_len)),
               logprobs=[-0.5 * (i + 1)] * response_len, response_text=f"text {i}",
               finish_reason=FinishReason.STOP if i % 2 else FinishReason.LENGTH, reward=float(i % 2),
               policy_version=step, reward_error=None if i else "ValueError: boom")
        for i in range(num_samples)
    ]
    return CompleteGroup(step=step, group=group, policy_version=step, prompt_index=42, prompt_ids=[7, 8, 9],
                         samples=samples, advantages=[0.5, -0.5, 0.5, -0.5][:num_samples], completed_s=123.5)


@pytest.fixture
def transport(tmp_path):
    host = Transport.open(address=StoreAddress(host="127.0.0.1", port=0, hosted_by="this test"), is_host=True,
                          run_id="run-a", secret=b"s" * 32, run_dir=tmp_path, connect_timeout_s=10)
    host.address.port = host.store.port
    yield host


def client(host: Transport, *, run_id="run-a", secret=b"s" * 32) -> Transport:
    return Transport.open(address=host.address, is_host=False, run_id=run_id, secret=secret, run_dir=host.run_dir,
                          connect_timeout_s=10)


@pytest.mark.parametrize("inline_max_bytes", [1 << 20, 16])
def test_published_group_round_trips_through_the_store(transport, inline_max_bytes):
    group = make_group()
    handle = transport.publish(group, seq=0, inline_max_bytes=inline_max_bytes)
    assert handle.location == ("inline" if inline_max_bytes > 16 else "file:payloads/step=0/seq=0.safetensors")
    trainer = client(transport)
    received = trainer.load_group(trainer.wait_handle(step=0, seq=0, policy_version=0))
    assert received == group


def _tamper(transport: Transport, key: str, **changes) -> None:
    fields = json.loads(transport.get(key))
    fields.update(changes)
    transport.set(key, json.dumps(fields))


def test_tampered_handle_is_rejected(transport):
    transport.publish(make_group(), seq=0, inline_max_bytes=1 << 20)
    _tamper(transport, transport.key("step=0", "handle", "seq=0"), group=5)
    with pytest.raises(HandleRejected, match="bad signature"):
        client(transport).wait_handle(step=0, seq=0, policy_version=0)


def test_handle_signed_with_another_secret_is_rejected(transport):
    forger = client(transport, secret=b"x" * 32)
    forger.publish(make_group(), seq=0, inline_max_bytes=1 << 20)
    with pytest.raises(HandleRejected, match="bad signature"):
        client(transport).wait_handle(step=0, seq=0, policy_version=0)


def test_tampered_payload_is_rejected(transport):
    transport.publish(make_group(), seq=0, inline_max_bytes=1 << 20)
    other = transport.publish(make_group(group=4), seq=1, inline_max_bytes=1 << 20)
    assert other.seq == 1
    key = transport.key("step=0", "payload", "seq=0")
    transport.set(key, transport.get(transport.key("step=0", "payload", "seq=1")))
    trainer = client(transport)
    with pytest.raises(HandleRejected, match="digest"):
        trainer.load_group(trainer.wait_handle(step=0, seq=0, policy_version=0))


def test_replayed_handle_from_another_step_or_run_is_rejected(transport):
    transport.publish(make_group(step=0), seq=0, inline_max_bytes=1 << 20)
    raw = transport.get(transport.key("step=0", "handle", "seq=0"))
    transport.set(transport.key("step=1", "handle", "seq=0"), raw)
    with pytest.raises(HandleRejected, match="step=0, expected 1"):
        client(transport).wait_handle(step=1, seq=0, policy_version=1)
    other_run = client(transport, run_id="run-b")
    other_run.set(other_run.key("step=0", "handle", "seq=0"), raw)
    with pytest.raises(HandleRejected, match="run_id='run-a', expected 'run-b'"):
        other_run.wait_handle(step=0, seq=0, policy_version=0)


def test_waiting_on_a_peer_that_stopped_beating_fails_with_its_name(transport):
    peer = client(transport)
    peer_beats = Liveness(peer, role="trainer", rank=1, peers=[], heartbeat_s=0.1, peer_timeout_s=0.5,
                          startup_timeout_s=5).start()
    waiter = client(transport)
    waiter.poll_s = 0.1
    waiter.liveness = Liveness(waiter, role="rollout", rank=0, peers=[("trainer", 1)], heartbeat_s=0.1,
                               peer_timeout_s=0.5, startup_timeout_s=5)
    time.sleep(0.3)
    waiter.liveness.check(waiting_for="nothing")  # alive: no error
    peer_beats.stop()
    start = time.monotonic()
    with pytest.raises(PeerLost, match="trainer rank 1 stopped heart-beating"):
        waiter.wait_get(waiter.key("never"), what="a key nobody writes")
    assert time.monotonic() - start < 5


def test_abort_reason_reaches_every_waiter(transport):
    waiter = client(transport)
    waiter.poll_s = 0.1
    waiter.liveness = Liveness(waiter, role="trainer", rank=0, peers=[], heartbeat_s=0.1, peer_timeout_s=1,
                               startup_timeout_s=5)
    transport.abort("rollout rank 0 failed: engine crashed")
    with pytest.raises(PeerLost, match="engine crashed"):
        waiter.wait_get(waiter.key("never"), what="a handle")

