"""The control plane: groups cross a real TCPStore as signed handles; anything altered or stray is refused."""

import json
import os
import threading
import time

import pytest

from rolloutpipe.control.liveness import Liveness
from rolloutpipe.control.transport import PeerLost, StoreAddress, Transport
from tests.fakes import make_group


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


class InThread:
    """Runs ``fn`` on a thread: a waiter that must still be waiting after a forged value, and return later."""

    def __init__(self, fn):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            self.error = err

    def join(self, timeout_s=10.0):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the waiter never returned"
        if self.error is not None:
            raise self.error
        return self.result


def waiting_client(host: Transport, **kwargs) -> Transport:
    waiter = client(host, **kwargs)
    waiter.poll_s = 0.05
    return waiter


def test_tampered_handle_is_refused_and_the_genuine_one_waited_for(transport, caplog):
    trainer = waiting_client(transport)
    genuine = transport.publish(make_group(), seq=0, inline_max_bytes=1 << 20)
    _tamper(transport, transport.key("step=0", "handle", "seq=0"), group=5)
    waiting = InThread(lambda: trainer.wait_handle(step=0, seq=0, policy_version=0))
    time.sleep(0.5)
    assert waiting.thread.is_alive(), "a tampered handle must not be taken"
    assert "bad signature" in caplog.text and "refused a store record" in caplog.text
    transport.publish(make_group(), seq=0, inline_max_bytes=1 << 20)  # the publisher's (re)write
    handle = waiting.join()
    assert (handle.group, handle.digest) == (genuine.group, genuine.digest)


def test_handle_signed_with_another_secret_is_refused(transport, caplog):
    forger = client(transport, secret=b"x" * 32)
    forger.publish(make_group(group=1), seq=0, inline_max_bytes=1 << 20)
    waiting = InThread(lambda: waiting_client(transport).wait_handle(step=0, seq=0, policy_version=0))
    time.sleep(0.5)
    assert waiting.thread.is_alive() and "bad signature" in caplog.text
    transport.publish(make_group(group=3), seq=0, inline_max_bytes=1 << 20)
    assert waiting.join().group == 3


def test_sealed_record_round_trips_and_a_forged_or_moved_one_is_refused(transport, caplog):
    key = transport.key("weights", "policy_version=2")
    transport.put_record(key, {"path": "weights/policy_v2.safetensors", "policy_version": 2})
    assert client(transport).read_record(key) == {"path": "weights/policy_v2.safetensors", "policy_version": 2}
    # a genuine record copied to another key (a replay of policy 2 as policy 3), and records without the seal
    other = transport.key("weights", "policy_version=3")
    transport.set(other, transport.get(key))
    assert client(transport).read_record(other) is None
    for forged in (json.dumps({"path": "/etc/passwd", "policy_version": 3}),
                   client(transport, secret=b"x" * 32).seal(other, {"path": "/tmp/evil", "policy_version": 3}),
                   b"\xff not json"):
        transport.set(other, forged)
        waiting = InThread(lambda: waiting_client(transport).wait_record(other, what="policy 3"))
        time.sleep(0.3)
        assert waiting.thread.is_alive(), f"{forged!r} must not be taken"
        transport.put_record(other, {"path": "weights/policy_v3.safetensors", "policy_version": 3})
        assert waiting.join() == {"path": "weights/policy_v3.safetensors", "policy_version": 3}
    assert caplog.text.count("not sealed with this run's secret") == 4


def test_the_store_listens_on_its_host_address_only(transport):
    from tests.conftest import listening_addresses

    assert listening_addresses(os.getpid()) and all(a.startswith("127.") for a in listening_addresses(os.getpid()))


def test_an_overwritten_payload_is_refused_until_its_writer_writes_it_back(transport, caplog):
    """An outsider copies another group's payload over this one's: the reader refuses it (the handle's digest) and
    waits, without stopping the run; the writer's kept values (control/kept.py: each heart-beat heals them) put the
    genuine payload back."""
    transport.publish(make_group(), seq=0, inline_max_bytes=1 << 20)
    transport.publish(make_group(group=4), seq=1, inline_max_bytes=1 << 20)
    key = transport.key("step=0", "payload", "seq=0")
    transport.store.set(key, transport.get(transport.key("step=0", "payload", "seq=1")))  # (an outsider's write)
    trainer = waiting_client(transport)
    waiting = InThread(lambda: trainer.load_group(trainer.wait_handle(step=0, seq=0, policy_version=0)))
    time.sleep(0.5)
    assert waiting.thread.is_alive() and "does not match the handle's digest" in caplog.text
    assert transport.kept.heal(transport.store) == 1
    assert waiting.join().group == make_group().group


def test_a_genuine_handle_replayed_to_another_step_or_run_is_refused_and_waited_past(transport, caplog):
    """A genuine handle copied to another step's or run's key: signed, but not that key's; an outsider's replay,
    refused like a forged one (it must not stop the run). The genuine handle, once written, is taken."""
    transport.publish(make_group(step=0), seq=0, inline_max_bytes=1 << 20)
    raw = transport.get(transport.key("step=0", "handle", "seq=0"))
    transport.store.set(transport.key("step=1", "handle", "seq=0"), raw)
    waiting = InThread(lambda: waiting_client(transport).wait_handle(step=1, seq=0, policy_version=1))
    time.sleep(0.5)
    assert waiting.thread.is_alive() and "step=0, expected 1" in caplog.text
    transport.publish(make_group(step=1, group=6), seq=0, inline_max_bytes=1 << 20)
    assert waiting.join().group == 6
    other_run = waiting_client(transport, run_id="run-b")
    other_run.store.set(other_run.key("step=0", "handle", "seq=0"), raw)
    waiting = InThread(lambda: other_run.wait_handle(step=0, seq=0, policy_version=0))
    time.sleep(0.5)
    assert waiting.thread.is_alive() and "run_id='run-a', expected 'run-b'" in caplog.text
    other_run.publish(make_group(step=0, group=7), seq=0, inline_max_bytes=1 << 20)
    assert waiting.join().group == 7  # no waiter left polling the store: one inside a store call at exit aborts


def test_kept_values_come_back_after_an_outsiders_overwrite_and_deleted_ones_stay_deleted(transport):
    record, handle_key = transport.key("step=0", "rollout_stats"), transport.key("step=0", "handle", "seq=0")
    transport.put_record(record, {"step": 0})
    transport.publish(make_group(), seq=0, inline_max_bytes=1 << 20)
    genuine, handle = transport.get(record), transport.get(handle_key)
    transport.store.set(record, b"garbage")  # an outsider's writes
    transport.store.set(handle_key, genuine)
    assert transport.kept.heal(transport.store) == 2 and transport.kept.heal(transport.store) == 0
    assert transport.get(record) == genuine and transport.get(handle_key) == handle
    client(transport).forget_step(0, num_groups=1)  # the trainer deletes what it consumed, the rollout's keys too
    transport.kept.heal(transport.store)
    assert not transport.has(record) and not transport.has(handle_key)
    assert transport.kept._values == {}  # nor kept any more


class DeletedMeanwhile:
    """A store client through which ``key`` is deleted by another process right after the first call about it: the
    trainer forgetting a consumed handle of the rollout's while the rollout's heart-beat heals its kept values."""

    def __init__(self, store, key: str, other) -> None:
        self.store, self.key, self.other, self.deleted = store, key, other, False

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            if not self.deleted and self.key in repr(args):
                self.deleted = True
                self.other.delete_key(self.key)
            return out

        return call


@pytest.mark.timeout(60)
def test_a_kept_key_deleted_by_its_reader_during_a_heal_never_makes_the_heal_wait(transport):
    """TCPStore's get waits for a missing key: a heal that read a key another process deleted since its check would
    wait out the store's deadline and call the store host frozen (a run of the pipeline bench stopped so). Every read
    of a heal answers at once, and the key is dropped."""
    handle_key = transport.key("step=0", "handle", "seq=0")
    transport.publish(make_group(), seq=0, inline_max_bytes=1 << 20)
    transport.store.deadline_s = 2.0
    transport.kept.heal(DeletedMeanwhile(transport.store, handle_key, client(transport).store))
    transport.kept.heal(transport.store)
    assert not transport.has(handle_key) and handle_key not in transport.kept._values
    assert transport.read_record(transport.key("never", "written")) is None  # (one call, no wait either)


def watched_peer(host: Transport, *, heartbeat_s: float, peer_timeout_s: float) -> tuple[Liveness, Transport]:
    """Trainer rank 1 heart-beating, and rollout rank 0 watching it (seen alive once, before the test's events)."""
    beats = Liveness(client(host), role="trainer", rank=1, peers=[], heartbeat_s=heartbeat_s,
                     peer_timeout_s=peer_timeout_s, startup_timeout_s=5).start()
    waiter = waiting_client(host)
    waiter.liveness = Liveness(waiter, role="rollout", rank=0, peers=[("trainer", 1)], heartbeat_s=0.1,
                               peer_timeout_s=peer_timeout_s, startup_timeout_s=5)
    time.sleep(3 * heartbeat_s)
    waiter.liveness.check(waiting_for="nothing")  # alive: no error
    return beats, waiter


def test_waiting_on_a_peer_that_stopped_beating_fails_with_its_name(transport):
    peer_beats, waiter = watched_peer(transport, heartbeat_s=0.1, peer_timeout_s=0.5)
    peer_beats.stop()
    start = time.monotonic()
    with pytest.raises(PeerLost, match="trainer rank 1 stopped heart-beating"):
        waiter.wait_get(waiter.key("never"), what="a key nobody writes")
    assert time.monotonic() - start < 5


def test_a_peer_that_finished_healthy_is_not_reported_lost(transport):
    """A trainer rank done with the run (rank 0 still writing the final checkpoint) stops beating: not a death."""
    beats, waiter = watched_peer(transport, heartbeat_s=0.05, peer_timeout_s=0.3)
    beats.finish()
    for _ in range(8):  # more than twice the peer timeout without a beat, watched all along
        waiter.liveness.check(waiting_for="trainer/done")  # no error
        time.sleep(0.1)
    forger = client(transport, secret=b"x" * 32)  # and only the run's own "finished" counts
    forger.put_record(transport.key("alive", "trainer", 2), {"count": 10**9, "finished": True})
    waiter.liveness.peers.append(("trainer", 2))
    with pytest.raises(PeerLost, match="trainer rank 2 never showed up"):
        waiter.liveness.startup_timeout_s = 0
        waiter.liveness.check(waiting_for="trainer/done")


def test_abort_reason_reaches_every_waiter(transport):
    waiter = client(transport)
    waiter.poll_s = 0.1
    waiter.liveness = Liveness(waiter, role="trainer", rank=0, peers=[], heartbeat_s=0.1, peer_timeout_s=1,
                               startup_timeout_s=5)
    transport.abort("rollout rank 0 failed: engine crashed")
    with pytest.raises(PeerLost, match="engine crashed"):
        waiter.wait_get(waiter.key("never"), what="a handle")


@pytest.mark.timeout(60)
def test_a_peer_that_leaves_after_an_abort_between_two_beats_is_not_waited_for(transport):
    """After an abort the store host keeps the store up until every peer's beat says it saw it (``wait_seen``). A
    peer that leaves before its next beat (trainer rank 0 right after its own abort, which ends a step) says so in a
    last beat: the host does not wait ``peer_timeout_s`` for its beats to go stale (a Slurm job then missed the margin
    its tasks have to stop in before the time limit)."""
    beats, waiter = watched_peer(transport, heartbeat_s=0.1, peer_timeout_s=600)
    beats.heartbeat_s = 600  # (from its next wait on: no beat after the abort)
    time.sleep(0.3)
    transport.abort("trainer rank 0 stopped the run")
    beats.stop(aborted=True)
    assert waiter.read_record(transport.key("alive", "trainer", 1))["aborted"] is True
    waiter.liveness.wait_seen(timeout_s=600)  # returns: seen (pytest's timeout fails it otherwise)


def test_a_forged_abort_is_refused_and_a_genuine_one_still_stops_the_run(transport, caplog):
    waiter = waiting_client(transport)
    waiter.liveness = Liveness(waiter, role="trainer", rank=0, peers=[], heartbeat_s=0.1, peer_timeout_s=1,
                               startup_timeout_s=5)
    transport.set(transport.key("abort"), json.dumps({"reason": "forged: stop now"}))
    # TCPStore's set does not wait for the server, and the check reads through another connection: a round trip on
    # the writer's own connection makes sure the store holds the record first (under load the check came first)
    transport.get(transport.key("abort"))
    waiter.liveness.check(waiting_for="a handle")  # refused: no error
    assert "refused a store record" in caplog.text
    transport.abort("rollout rank 0 failed: engine crashed")  # overwrites the forged record
    with pytest.raises(PeerLost, match="engine crashed"):
        waiter.wait_get(waiter.key("never"), what="a handle")


def test_forged_or_replayed_heart_beats_never_read_as_missing_ones(transport):
    """An outsider writing garbage and replayed old beats over a live peer's key, for many peer timeouts, does not
    make it look dead; once the peer is dead and nobody writes its key, it is found lost."""
    beats, waiter = watched_peer(transport, heartbeat_s=0.05, peer_timeout_s=0.5)
    key = transport.key("alive", "trainer", 1)
    old = transport.get(key)
    forger = client(transport, secret=b"x" * 32)
    for _ in range(150):  # writes over the peer's own for at least 150 x 20 ms: 6 peer timeouts
        forger.put_record(key, {"count": 10**9}, keep=False)
        waiter.liveness.check(waiting_for="nothing")  # no error
        transport.store.set(key, old)
        waiter.liveness.check(waiting_for="nothing")
        time.sleep(0.02)
    beats.stop()
    with pytest.raises(PeerLost, match="trainer rank 1 stopped heart-beating"):
        for _ in range(100):  # (10 peer timeouts at least)
            waiter.liveness.check(waiting_for="nothing")
            time.sleep(0.05)


def test_a_consumed_step_is_forgotten_keys_and_payload_files(transport):
    for seq in range(3):
        transport.publish(make_group(step=4, group=seq), seq=seq, inline_max_bytes=16 if seq == 2 else 1 << 20)
    transport.put_record(transport.key("step=4", "rollout_stats"), {"step": 4})
    transport.put_record(transport.key("step=4", "source_state"), {"epoch": 0})
    transport.publish(make_group(step=5), seq=0, inline_max_bytes=16)
    keys_before = transport.store.num_keys()
    assert (transport.run_dir / "payloads" / "step=4" / "seq=2.safetensors").exists()
    transport.forget_step(4, num_groups=3)
    for name in ("handle/seq=0", "payload/seq=0", "handle/seq=2", "rollout_stats", "source_state"):
        assert not transport.has(transport.key("step=4", *name.split("/"))), name
    assert transport.store.num_keys() == keys_before - 7  # 3 handles, 2 inline payloads, 2 records
    assert not (transport.run_dir / "payloads" / "step=4").exists()
    assert transport.has(transport.key("step=5", "handle", "seq=0"))  # the next step is untouched
    assert (transport.run_dir / "payloads" / "step=5" / "seq=0.safetensors").exists()
