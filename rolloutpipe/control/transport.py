"""The control plane between the node groups: a torch.distributed TCPStore, signed handles, heart-beats.

Store keys all live under ``rp/<run_id>/`` and follow the one id scheme:

    rp/<run>/step=<k>/handle/seq=<i>      signed GroupHandle (JSON), publish order i = 0, 1, ...
    rp/<run>/step=<k>/payload/seq=<i>     the group's payload when it is inline (safetensors bytes)
    rp/<run>/step=<k>/rollout_stats       the rollout's per-step record (JSON)
    rp/<run>/weights/policy_version=<v>   where the trainer wrote policy v (JSON)
    rp/<run>/serving/policy_version=<v>   the rollout's acknowledgement that every engine serves v
    rp/<run>/alive/<role>/<rank>          heart-beat counter of one process
    rp/<run>/abort                        the first fatal error of any process (text)
    rp/<run>/trainer_pg/...               the trainer's gloo process group rendezvous

Nothing read from the store is unpickled: handles are JSON checked against an HMAC-SHA256 signature
made with a per-run secret that the launcher hands to both node groups, and payloads are safetensors
(tensors plus a JSON header) whose sha256 digest the handle carries.

A TCPStore client serialises its operations, and a blocking ``wait`` holds it, so every thread that
talks to the store gets a client of its own (``Transport.connect_another``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rolloutpipe.types import CompleteGroup, FinishReason, GroupHandle, Sample

STORE_MAX_VALUE_BYTES = 8 * 1024 * 1024
"""The libuv TCPStore rejects larger values, so bigger payloads go through the run directory."""


class TransportError(RuntimeError):
    """The other node group went away, sent something we refuse, or a run was aborted."""


class HandleRejected(TransportError):
    pass


class PeerLost(TransportError):
    pass


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
        store: dist.TCPStore,
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
        self.liveness: Liveness | None = None

    @classmethod
    def open(
        cls, *, address: StoreAddress, is_host: bool, run_id: str, secret: bytes, run_dir: Path, connect_timeout_s: float
    ) -> Transport:
        try:
            store = dist.TCPStore(
                address.host,
                address.port,
                is_master=is_host,
                wait_for_workers=False,
                timeout=timedelta(seconds=connect_timeout_s),
            )
        except RuntimeError as err:
            if is_host:
                raise TransportError(f"could not host the TCPStore on {address.host}:{address.port}: {err}") from err
            raise TransportError(
                f"could not reach the TCPStore at {address.host}:{address.port} (hosted by {address.hosted_by}) "
                f"within {connect_timeout_s:.0f} s: that component never showed up or died at start; see its log. "
                "Raise pipeline.connect_timeout_s if it is only slow to start."
            ) from err
        return cls(store=store, address=address, run_id=run_id, secret=secret, run_dir=run_dir, is_host=is_host)

    def connect_another(self) -> Transport:
        """A second client of the same store, for another thread."""
        other = Transport.open(
            address=self.address, is_host=False, run_id=self.run_id, secret=self.secret, run_dir=self.run_dir,
            connect_timeout_s=30.0,
        )
        other.liveness = self.liveness
        return other

    # -- keys ------------------------------------------------------------------------------------
    def key(self, *parts: object) -> str:
        return "/".join(["rp", self.run_id, *map(str, parts)])

    # -- guarded store access ---------------------------------------------------------------------
    def _lost(self, err: Exception) -> TransportError:
        return PeerLost(
            f"lost the TCPStore at {self.address.host}:{self.address.port} (hosted by {self.address.hosted_by}): "
            f"that process has probably died; see its log. ({err})"
        )

    def set(self, key: str, value: bytes | str) -> None:
        try:
            self.store.set(key, value)
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

    def wait_get(self, key: str, *, what: str) -> bytes:
        """Block until ``key`` exists, checking every ``poll_s`` that the peers are alive; return its value."""
        while True:
            try:
                self.store.wait([key], timedelta(seconds=self.poll_s))
                return self.get(key)
            except dist.DistStoreError as err:
                if "timeout" not in str(err).lower():
                    raise self._lost(err) from err
            except RuntimeError as err:
                raise self._lost(err) from err
            if self.liveness is not None:
                self.liveness.check(waiting_for=what)

    def abort(self, reason: str) -> None:
        """Tell every process of the run to stop; the first reason wins. Best effort: the store may be gone."""
        try:
            if not self.store.check([self.key("abort")]):
                self.store.set(self.key("abort"), reason)
        except RuntimeError:
            pass

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
            self.set(self.key(step_key, "payload", f"seq={seq}"), payload)
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
        self.set(self.key(step_key, "handle", f"seq={seq}"), json.dumps(dataclasses.asdict(handle)))
        return handle

    def wait_handle(self, *, step: int, seq: int, policy_version: int) -> GroupHandle:
        """Wait for the handle published ``seq``-th in ``step`` and verify it (signature, run, step, version)."""
        key = self.key(f"step={step}", "handle", f"seq={seq}")
        raw = self.wait_get(key, what=f"group handle step={step}/seq={seq}")
        return self._verified_handle(raw, key=key, step=step, seq=seq, policy_version=policy_version)

    def load_group(self, handle: GroupHandle) -> CompleteGroup:
        """Fetch a verified handle's payload, check its digest and decode it."""
        where = f"step={handle.step}/seq={handle.seq}"
        if handle.location == "inline":
            payload = self.get(self.key(f"step={handle.step}", "payload", f"seq={handle.seq}"))
        else:
            payload = (self.run_dir / handle.location.removeprefix("file:")).read_bytes()
        if hashlib.sha256(payload).hexdigest() != handle.digest:
            raise HandleRejected(f"{where}: the payload does not match the handle's digest; refusing it.")
        group = decode_group(payload)
        if (group.step, group.group, group.batch, group.policy_version) != (
            handle.step, handle.group, handle.batch, handle.policy_version
        ):
            raise HandleRejected(f"{where}: the payload names another group than its handle; refusing it.")
        return group

    def _verified_handle(self, raw: bytes, *, key: str, step: int, seq: int, policy_version: int) -> GroupHandle:
        try:
            fields = json.loads(raw)
            handle = GroupHandle(**fields)
        except (ValueError, TypeError) as err:
            raise HandleRejected(f"{key}: not a group handle ({err}); refusing it.") from err
        if not hmac.compare_digest(handle.signature, self._sign(handle)):
            raise HandleRejected(
                f"{key}: bad signature; the handle was altered or written by a process without this run's secret."
            )
        expected = {"run_id": self.run_id, "step": step, "seq": seq, "policy_version": policy_version}
        for name, value in expected.items():
            if getattr(handle, name) != value:
                raise HandleRejected(
                    f"{key}: handle has {name}={getattr(handle, name)!r}, expected {value!r} (a replayed or stray "
                    "handle); refusing it."
                )
        if handle.location != "inline" and not handle.location.startswith("file:payloads/"):
            raise HandleRejected(f"{key}: payload location {handle.location!r} is outside the run directory.")
        return handle

    # -- small JSON records ------------------------------------------------------------------------
    def put_json(self, key: str, record: dict) -> None:
        self.set(key, json.dumps(record))

    def wait_json(self, key: str, *, what: str) -> dict:
        return json.loads(self.wait_get(key, what=what))


class Liveness:
    """Heart-beats of this process, and the check that every peer still beats.

    Heart-beat thread: produces a counter increment under ``alive/<role>/<rank>`` every ``heartbeat_s``
    on a store client of its own; waits for nothing else; stops when ``stop()`` is called or when the
    store goes away (then ``check`` reports the store as lost). Counters, not timestamps, so clocks of
    different nodes never need to agree.

    ``check`` (called by whoever waits) raises PeerLost when the run was aborted, when a peer that was
    seen once has not beaten for ``peer_timeout_s``, or when a peer never showed up within
    ``startup_timeout_s``.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        role: str,
        rank: int,
        peers: list[tuple[str, int]],
        heartbeat_s: float,
        peer_timeout_s: float,
        startup_timeout_s: float,
    ) -> None:
        self.transport = transport
        self.me = (role, rank)
        self.peers = peers
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._beat_client = transport.connect_another()
        self._check_client = transport.connect_another()
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._started_s = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{role}{rank}", daemon=True)
        self._check_lock = threading.Lock()

    def start(self) -> Liveness:
        self._beat_client.add(self._key(self.me), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _key(self, who: tuple[str, int]) -> str:
        return self.transport.key("alive", who[0], who[1])

    def _beat(self) -> None:
        key = self._key(self.me)
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat_client.add(key, 1)
            except TransportError:
                return

    def check(self, *, waiting_for: str) -> None:
        with self._check_lock:
            client = self._check_client
            abort_key = client.key("abort")
            if client.has(abort_key):
                raise PeerLost(f"run aborted while waiting for {waiting_for}: {client.get(abort_key).decode()}")
            now = time.monotonic()
            for peer in self.peers:
                count = client.add(self._key(peer), 0)
                last = self._seen.get(peer)
                if last is None or count != last[0]:
                    if count > 0:
                        self._seen[peer] = (count, now)
                    elif now - self._started_s > self.startup_timeout_s:
                        raise PeerLost(
                            f"{peer[0]} rank {peer[1]} never showed up within {self.startup_timeout_s:.0f} s "
                            f"(waiting for {waiting_for}); check that its component started and see its log. "
                            "Raise pipeline.connect_timeout_s if it is only slow to start."
                        )
                elif now - last[1] > self.peer_timeout_s:
                    raise PeerLost(
                        f"{peer[0]} rank {peer[1]} stopped heart-beating {now - last[1]:.0f} s ago (limit "
                        f"pipeline.peer_timeout_s={self.peer_timeout_s:.0f}) while this process waited for "
                        f"{waiting_for}: it has probably died; see its log."
                    )


# -- payload codec: safetensors, never pickle -------------------------------------------------------
def encode_group(group: CompleteGroup) -> bytes:
    samples = group.samples
    tensors = {
        "prompt_ids": torch.tensor(group.prompt_ids, dtype=torch.int64),
        "response_ids": torch.tensor([t for s in samples for t in s.response_ids], dtype=torch.int64),
        "response_lens": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.int64),
        "logprobs": torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float64),
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float64),
        "policy_versions": torch.tensor([s.policy_version for s in samples], dtype=torch.int64),
        "advantages": torch.tensor(group.advantages, dtype=torch.float64),
    }
    header = {
        "step": group.step,
        "group": group.group,
        "batch": group.batch,
        "policy_version": group.policy_version,
        "prompt_index": group.prompt_index,
        "completed_s": group.completed_s,
        "samples": [
            {"text": s.response_text, "finish_reason": s.finish_reason.value, "reward_error": s.reward_error,
             "reward_timed_out": s.reward_timed_out}
            for s in samples
        ],
    }
    return save_safetensors(tensors, metadata={"group": json.dumps(header)})


def decode_group(payload: bytes) -> CompleteGroup:
    tensors = load_safetensors(payload)
    header = json.loads(_safetensors_metadata(payload)["group"])
    lens = tensors["response_lens"].tolist()
    ids = tensors["response_ids"].split(lens)
    logprobs = tensors["logprobs"].split(lens)
    rewards = tensors["rewards"].tolist()
    versions = tensors["policy_versions"].tolist()
    samples = [
        Sample(
            group=header["group"],
            index=i,
            response_ids=ids[i].tolist(),
            logprobs=logprobs[i].tolist(),
            response_text=meta["text"],
            finish_reason=FinishReason(meta["finish_reason"]),
            reward=rewards[i],
            policy_version=versions[i],
            reward_error=meta["reward_error"],
            reward_timed_out=meta["reward_timed_out"],
        )
        for i, meta in enumerate(header["samples"])
    ]
    return CompleteGroup(
        step=header["step"],
        group=header["group"],
        policy_version=header["policy_version"],
        prompt_index=header["prompt_index"],
        prompt_ids=tensors["prompt_ids"].tolist(),
        samples=samples,
        advantages=tensors["advantages"].tolist(),
        completed_s=header["completed_s"],
        batch=header["batch"],
    )


def _safetensors_metadata(payload: bytes) -> dict[str, str]:
    header_len = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8 : 8 + header_len]).get("__metadata__", {})
