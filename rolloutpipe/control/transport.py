"""The control plane between the node groups: a torch.distributed TCPStore, sealed records, signed handles.

Store keys all live under ``rp/<run_id>/`` and follow the one id scheme:

    rp/<run>/step=<k>/handle/seq=<i>      signed GroupHandle (JSON), publish order i = 0, 1, ...
    rp/<run>/step=<k>/payload/seq=<i>     the group's payload when it is inline (safetensors bytes)
    rp/<run>/step=<k>/rollout_stats       the rollout's per-step record
    rp/<run>/step=<k>/source_state        the prompt source's state after step k (goes into checkpoints)
    rp/<run>/weights/policy_version=<v>   where the trainer wrote policy v and its digest, or its buckets
    rp/<run>/weight_sync/group            the weight-update process group's address (distributed sync); members/
                                          and plan/policy_version=<k>: who receives policy k, the group it goes on
    rp/<run>/serving/policy_version=<v>   the rollout's acknowledgement that every engine serves v
    rp/<run>/trainer/ready, trainer/done  trainer rank 0's start and end
    rp/<run>/alive/<role>/<rank>          heart-beat count of one process
    rp/<run>/abort                        the first fatal error of any process
    rp/<run>/clock/...                    the store host's clock (control/clock.py)
    rp/<run>/trainer_pg/...               the trainer's gloo process group rendezvous (through ``SealedStore``)

Only the run steers the run: every value a process acts on is sealed with the run's secret (HMAC-SHA256
over the key and the value, so a record copied to another key, step or run is refused too) and checked
before it is used. Group handles carry their own signature; every other record is a sealed JSON record
(``put_record`` / ``wait_record``); the trainer's process-group rendezvous goes through ``SealedStore``;
heart-beats and the abort check are control/liveness.py, the payload codec control/codec.py.
A value that fails the check is refused with a line in the log and the reader goes on waiting for the
genuine one, so a process without the secret can neither stop nor steer the run. It can still delete or
overwrite keys and so stall it: the store's port is for the run's processes only (docs/faults-and-security.md,
"Security").
The store listens on its host's own address only (``listen_socket``: loopback for a local run).

Nothing read from the store is unpickled: records and handles are JSON, payloads are safetensors
(tensors plus a JSON header) whose sha256 digest the handle carries.

A TCPStore client serialises its operations, and a blocking ``wait`` holds it, so every thread that
talks to the store gets a client of its own (``Transport.connect_another``). Every call of a client has a deadline of
its own (control/bounded_store.py), so a store host that froze or dropped off the network ends the waits on it within
``pipeline.peer_timeout_s`` (PeerGone), and a stop signal reaches a process whatever it waits on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import shutil
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Protocol, TypeVar

import torch.distributed as dist

from rolloutpipe.control.bounded_store import BoundedStore, StoreUnresponsive, read_now
from rolloutpipe.control.codec import decode_group, encode_group
from rolloutpipe.control.env import listen_socket
from rolloutpipe.control.kept import Kept
from rolloutpipe.control.seal import Forged, seal, unseal
from rolloutpipe.types import CompleteGroup, GroupHandle

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_MAX_VALUE_BYTES = 8 * 1024 * 1024
"""The libuv TCPStore rejects larger values, so bigger payloads go through the run directory."""


ABORT_S = 2.0
"""The most a process waits to leave its abort record in the store on its way out."""


class TransportError(RuntimeError):
    """The other node group went away, sent something we refuse, or a run was aborted."""


class PeerCheck(Protocol):
    """What a waiter calls every poll: control/liveness.py's Liveness (raises PeerLost for a dead peer or an abort),
    and what it names as the cause when the store goes away (the abort it saw, else the loss)."""

    def check(self, *, waiting_for: str) -> None: ...

    def cause(self, lost: PeerGone) -> TransportError: ...


class HandleRejected(TransportError):
    pass


class PeerLost(TransportError):
    pass


class PeerGone(PeerLost):
    """A peer stopped heart-beating, or the store's host is gone: a process of the run died without a word (killed,
    out of memory, its node lost). A fresh start of the job is the remedy (control/attempt.py: ``requeue``)."""


class RunRequeued(PeerLost):
    """The run stopped at a checkpoint so that its Slurm job can be requeued (an abort record that says so); the
    requeued job resumes from that checkpoint (launch/requeue.py)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class StoreAddress:
    host: str
    port: int
    hosted_by: str
    """Which process hosts the store, for error messages (e.g. ``rollout rank 0``)."""


class Transport:
    """One process's view of the store: keys, handles, payloads, waiting with liveness checks."""

    def __init__(
        self,
        *,
        store: BoundedStore,
        address: StoreAddress,
        run_id: str,
        secret: bytes,
        run_dir: Path,
        is_host: bool,
        poll_s: float = 1.0,
    ) -> None:
        self.store = store
        self.address = address
        self.run_id = run_id
        self.secret = secret
        self.run_dir = run_dir
        self.is_host = is_host
        self.poll_s = poll_s
        self.liveness: PeerCheck | None = None
        """This process's heart-beats and peer check (control/liveness.py), set by pipeline.open_transport."""
        self.kept = Kept()
        """What this process wrote and a reader may still need, written back if changed (control/kept.py)."""
        self._refused: set[tuple[str, str]] = set()

    @classmethod
    def open(
        cls, *, address: StoreAddress, is_host: bool, run_id: str, secret: bytes, run_dir: Path,
        connect_timeout_s: float, deadline_s: float = 30.0,
    ) -> Transport:
        """Host the store (on ``address.host``'s own address only; port 0 takes a free one) or connect to it.
        ``deadline_s``: the most any call may go unanswered beyond its own wait (pipeline.peer_timeout_s, whose
        default it is)."""
        try:
            listen_fd = listen_socket(address.host, address.port).detach() if is_host else None
            store = dist.TCPStore(address.host, address.port, is_master=is_host, wait_for_workers=False,
                                  timeout=timedelta(seconds=connect_timeout_s), master_listen_fd=listen_fd)
        except (RuntimeError, OSError) as err:
            if is_host:
                raise TransportError(f"could not host the TCPStore on {address.host}:{address.port}: {err}") from err
            raise TransportError(
                f"could not reach the TCPStore at {address.host}:{address.port} (hosted by {address.hosted_by}) "
                f"within {connect_timeout_s:.0f} s: that component never showed up or died at start; see its log. "
                "Raise pipeline.connect_timeout_s if it is only slow to start."
            ) from err
        bounded = BoundedStore(store, deadline_s=deadline_s,
                               where=f"{address.host}:{address.port} (hosted by {address.hosted_by})")
        return cls(store=bounded, address=address, run_id=run_id, secret=secret, run_dir=run_dir, is_host=is_host)

    def connect_another(self) -> Transport:
        """A second client of the same store, for another thread."""
        other = Transport.open(
            address=self.address, is_host=False, run_id=self.run_id, secret=self.secret, run_dir=self.run_dir,
            connect_timeout_s=30.0, deadline_s=self.store.deadline_s,
        )
        other.kept = self.kept
        other.liveness = self.liveness
        return other

    # -- keys ------------------------------------------------------------------------------------
    def key(self, *parts: object) -> str:
        return "/".join(["rp", self.run_id, *map(str, parts)])

    # -- guarded store access ---------------------------------------------------------------------
    def _lost(self, err: Exception) -> TransportError:
        """The store is gone (or its host frozen): PeerGone, a lost node, unless this process saw the run's abort
        first, whose consequence that is (control/liveness.py, ``cause``)."""
        if isinstance(err, TransportError):
            return err
        if isinstance(err, StoreUnresponsive):
            lost = PeerGone(f"{err}; see that process's node (this process stops waiting on it)")
        else:
            lost = PeerGone(
                f"lost the TCPStore at {self.address.host}:{self.address.port} (hosted by {self.address.hosted_by}): "
                f"that process has probably died; see its log. ({err})")
        return lost if self.liveness is None else self.liveness.cause(lost)

    def set(self, key: str, value: bytes | str, *, keep: bool = False) -> None:
        """``keep``: a value a reader may still need, written back if an outsider changes it (control/kept.py)."""
        try:
            with self.kept.lock:
                self.store.set(key, value)
                if keep:
                    self.kept.keep(key, value)
        except RuntimeError as err:
            raise self._lost(err) from err

    def get(self, key: str) -> bytes:
        try:
            return self.store.get(key)
        except RuntimeError as err:
            raise self._lost(err) from err

    def add(self, key: str, amount: int) -> int:
        try:
            return self.store.add(key, amount)
        except RuntimeError as err:
            raise self._lost(err) from err

    def has(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except RuntimeError as err:
            raise self._lost(err) from err

    def get_now(self, key: str) -> bytes | None:
        """``key``'s value or None, never waiting for it (BoundedStore.get_now)."""
        try:
            return self.store.get_now(key)
        except RuntimeError as err:
            raise self._lost(err) from err

    def wait_get(self, key: str, *, what: str, on_poll: Callable | None = None) -> bytes:
        """Block until ``key`` exists, checking every ``poll_s`` that the peers are alive, then ``on_poll()``."""
        while True:
            try:
                self.store.wait([key], timedelta(seconds=self.poll_s))
                return self.get(key)
            except dist.DistStoreError as err:
                if "timeout" not in str(err).lower():
                    raise self._lost(err) from err
            except RuntimeError as err:
                raise self._lost(err) from err
            self.check_peers(what)
            if on_poll is not None:
                on_poll()

    def check_peers(self, waiting_for: str) -> None:
        if self.liveness is not None:
            self.liveness.check(waiting_for=waiting_for)

    def abort(self, reason: str, *, requeue: bool = False) -> None:
        """Tell every process of the run to stop; the first genuine reason wins (a forged one is overwritten).
        ``requeue``: it stops to be requeued (waiters raise RunRequeued). Best effort, within ``ABORT_S``: the store
        may be gone or frozen, and what this process does next (its checkpoint) must not wait on it."""
        key = self.key("abort")

        def write(raw) -> None:
            if (current := read_now(raw, key)) is not None:
                try:
                    self.unseal(key, current)
                    return  # a genuine reason is there first
                except Forged:
                    pass
            raw.set(key, self.seal(key, {"reason": reason, "requeue": requeue}))

        try:
            self.store.run(write, what="the abort", within_s=ABORT_S)
        except RuntimeError:
            pass

    def delete(self, key: str) -> None:
        try:
            with self.kept.lock:
                self.kept.drop(key)
                self.store.delete_key(key)
        except RuntimeError as err:
            raise self._lost(err) from err

    def forget_step(self, step: int, num_groups: int) -> None:
        """Delete step ``step``'s handles, payloads (inline and files) and records once every trainer rank has
        consumed them, so the store host's memory and the run directory stay flat over a long run. Resume never
        reads them: it redoes the step after the last checkpoint from scratch, on a fresh store."""
        prefix = f"step={step}"
        for seq in range(num_groups):
            self.delete(self.key(prefix, "handle", f"seq={seq}"))
            self.delete(self.key(prefix, "payload", f"seq={seq}"))
        self.delete(self.key(prefix, "rollout_stats"))
        self.delete(self.key(prefix, "eval"))
        self.delete(self.key(prefix, "source_state"))
        shutil.rmtree(self.run_dir / "payloads" / prefix, ignore_errors=True)

    def forget_policy(self, version: int) -> None:
        """Delete policy ``version``'s records (weights, serving, weight-group plan) once no engine needs them."""
        for part in ("weights/", "serving/", "weight_sync/plan/", "weight_sync/members/"):
            self.delete(self.key(f"{part}policy_version={version}"))

    # -- sealed records ----------------------------------------------------------------------------
    def seal(self, key: str, record: dict) -> str:
        return seal(self.secret, key, record)

    def unseal(self, key: str, raw: bytes) -> dict:
        return unseal(self.secret, key, raw)

    def refuse(self, key: str, raw: bytes, why: str) -> None:
        """Log, once per distinct value, that a value at ``key`` was refused."""
        seen = (key, hashlib.sha256(raw).hexdigest())
        if seen not in self._refused:
            self._refused.add(seen)
            log.warning("refused a store record: %s; ignoring it and waiting for the run's own.", why)

    def put_record(self, key: str, record: dict, *, keep: bool = True) -> None:
        """A sealed record, kept (written back if an outsider changes it) unless ``keep`` is False: a value its
        writer replaces on its own, as a heart-beat."""
        self.set(key, self.seal(key, record), keep=keep)

    def read_record(self, key: str) -> dict | None:
        """``key``'s record if it exists and is genuine (a forged one is refused, in the log), else None."""
        if (raw := self.get_now(key)) is None:
            return None
        try:
            return self.unseal(key, raw)
        except Forged as err:
            self.refuse(key, raw, str(err))
            return None

    def wait_record(self, key: str, *, what: str) -> dict:
        """Block until ``key`` holds a genuine record and return it; forged values are refused and waited past."""
        return self._wait_genuine(key, what=what, read=lambda raw: self.unseal(key, raw))

    def _wait_genuine(self, key: str, *, what: str, read: Callable[[bytes], T], on_poll: Callable | None = None) -> T:
        """``read`` of ``key``'s value once it exists and ``read`` does not raise Forged; a forged value is refused
        (logged once) and re-read every ``poll_s``, with the peers checked, until the genuine writer replaces it."""
        raw = self.wait_get(key, what=what, on_poll=on_poll)
        while True:
            try:
                return read(raw)
            except Forged as err:
                self.refuse(key, raw, str(err))
            time.sleep(self.poll_s)
            self.check_peers(what)
            raw = self.get(key)

    # -- handles and payloads -------------------------------------------------------------------------
    def _sign(self, handle: GroupHandle) -> str:
        fields = dataclasses.asdict(handle)
        fields.pop("signature")
        body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.secret, body, hashlib.sha256).hexdigest()

    def publish(self, group: CompleteGroup, *, seq: int, inline_max_bytes: int) -> GroupHandle:
        payload = encode_group(group)
        step_key = f"step={group.step}"
        if len(payload) <= min(inline_max_bytes, STORE_MAX_VALUE_BYTES):
            location = "inline"
            self.set(self.key(step_key, "payload", f"seq={seq}"), payload, keep=True)
        else:
            relative = Path("payloads") / step_key / f"seq={seq}.safetensors"
            path = self.run_dir / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(payload)
            tmp.rename(path)
            location = f"file:{relative.as_posix()}"
        handle = GroupHandle(
            run_id=self.run_id,
            step=group.step,
            seq=seq,
            group=group.group,
            batch=group.batch,
            policy_version=group.policy_version,
            location=location,
            num_bytes=len(payload),
            digest=hashlib.sha256(payload).hexdigest(),
            published_s=time.time(),
        )
        handle.signature = self._sign(handle)
        self.set(self.key(step_key, "handle", f"seq={seq}"), json.dumps(dataclasses.asdict(handle)), keep=True)
        return handle

    def wait_handle(self, *, step: int, seq: int, policy_version: int, on_poll: Callable | None = None) -> GroupHandle:
        """Wait for the handle published ``seq``-th in ``step`` (``on_poll``: ``wait_get``'s) and verify it (signature,
        run, step, version).

        A handle without this run's signature, or a genuine one copied from another key (another step, seq or
        version: a replay), is refused (logged) and waited past; its writer writes the genuine one back
        (control/kept.py). A signed handle with a payload outside the run directory stops the run (HandleRejected:
        only a bug of the run's own writes one).
        """
        key = self.key(f"step={step}", "handle", f"seq={seq}")
        return self._wait_genuine(key, what=f"group handle step={step}/seq={seq}", on_poll=on_poll, read=lambda raw: (
            self._verified_handle(raw, key=key, step=step, seq=seq, policy_version=policy_version)))

    def load_group(self, handle: GroupHandle) -> CompleteGroup:
        """Fetch a verified handle's payload, check its digest and decode it. An inline payload that does not match
        the digest (an outsider's write into the store) is refused and waited past, as a forged record is; a file
        that does not (the run directory is the run's own) stops the run."""
        where = f"step={handle.step}/seq={handle.seq}"

        def verified(payload: bytes) -> bytes:
            if hashlib.sha256(payload).hexdigest() != handle.digest:
                raise Forged(f"{where}: the payload does not match the handle's digest")
            return payload

        if handle.location == "inline":
            key = self.key(f"step={handle.step}", "payload", f"seq={handle.seq}")
            payload = self._wait_genuine(key, what=f"the payload of {where}", read=verified)
        else:
            payload = (self.run_dir / handle.location.removeprefix("file:")).read_bytes()
            try:
                verified(payload)
            except Forged as err:
                raise HandleRejected(f"{err}; refusing it.") from None
        group = decode_group(payload)
        if (group.step, group.group, group.batch, group.policy_version) != (
            handle.step, handle.group, handle.batch, handle.policy_version
        ):
            raise HandleRejected(f"{where}: the payload names another group than its handle; refusing it.")
        return group

    def _verified_handle(self, raw: bytes, *, key: str, step: int, seq: int, policy_version: int) -> GroupHandle:
        try:
            handle = GroupHandle(**json.loads(raw))
            genuine = isinstance(handle.signature, str) and hmac.compare_digest(handle.signature, self._sign(handle))
        except (ValueError, TypeError) as err:
            raise Forged(f"{key}: not a group handle ({err})") from err
        if not genuine:
            raise Forged(f"{key}: bad signature; the handle was altered or written by a process without this run's "
                         "secret")
        expected = {"run_id": self.run_id, "step": step, "seq": seq, "policy_version": policy_version}
        for name, value in expected.items():
            if getattr(handle, name) != value:
                raise Forged(f"{key}: a genuine handle of another key ({name}={getattr(handle, name)!r}, expected "
                             f"{value!r}): replayed by a process outside the run")
        if handle.location != "inline" and not _is_payload_file(handle.location):
            raise HandleRejected(f"{key}: payload location {handle.location!r} is outside the run directory.")
        return handle


class SealedStore(dist.Store):
    """A store for torch's process-group rendezvous (the trainer's gloo group) whose values are sealed.

    torch's rendezvous exchanges each rank's address through ``set``/``get``/``wait`` (gloo uses only those):
    through this store every value carries an HMAC over its key and bytes, and a ``get`` of a value without
    the run's seal waits for the genuine one (the refusal is logged), so no outsider can point a rank at
    another peer. Counters (``add``) pass through unsealed: at worst they stall the rendezvous.
    """

    def __init__(self, transport: Transport, prefix: str) -> None:
        super().__init__()
        self._transport = transport
        self._store = transport.store
        self._prefix = prefix

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._transport.secret, key.encode() + b"\n" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._store.set(self._key(key), self._mac(self._key(key), value) + value)

    def get(self, key: str) -> bytes:
        full = self._key(key)
        while True:
            raw = self._store.get(full)
            mac, value = raw[:32], raw[32:]
            if hmac.compare_digest(mac, self._mac(full, value)):
                return value
            self._transport.refuse(full, raw, f"{full}: a process-group rendezvous value not sealed with this "
                                              "run's secret")
            time.sleep(self._transport.poll_s)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self._key(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        full = [self._key(k) for k in keys]
        if timeout is None:
            self._store.wait(full)
        else:
            self._store.wait(full, timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)


def _is_payload_file(location: str) -> bool:
    """``file:payloads/step=<k>/seq=<i>.safetensors``, nothing that climbs out of the run directory."""
    parts = Path(location.removeprefix("file:")).parts
    return (location.startswith("file:") and len(parts) == 3 and parts[0] == "payloads"
            and parts[1].startswith("step=") and parts[2].endswith(".safetensors") and ".." not in parts)
