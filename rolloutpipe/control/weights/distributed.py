"""Weight sync by broadcast (``pipeline.weight_sync=distributed``; HTTP engines: ``rollout.engine=embedded_http`` or
``sglang``).

SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed``: trainer rank 0 is rank 0 of a
torch process group whose other members are the engines (one rank per engine, or per tensor-parallel rank of
a multi-GPU SGLang engine), and broadcasts the HF-named tensors to them; nothing touches the disk.

    startup  trainer rank 0: pick a port, publish ``weight_sync/group`` (address, port, world size, name,
             backend) and join as rank 0 (this rendezvous hosts its own TCPStore, as SGLang expects)
             rollout node: read it, POST /init_weights_update_group to every engine at once (rank_offset 1, 2,
             ...); each call returns once the whole group is formed
    step k   trainer rank 0: plan buckets of at most ``pipeline.weight_sync_bucket_mb`` (names, dtypes,
             shapes), publish the plan as ``weights/policy_version=<k+1>``; then per bucket: digest it, publish
             its MAC as ``weights/policy_version=<k+1>/attempt=0/bucket=<i>``, broadcast it as one flat tensor
             (buckets.py ``pack``: one broadcast per bucket, SGLang's ``flattened_bucket``); then wait for the
             rollout node's ``weight_sync/outcome/policy_version=<k+1>/attempt=0``
             rollout node (at the step boundary): per engine, in parallel: pause -> begin_weight_update ->
             one /update_weights_from_distributed per bucket, with the bucket's MAC (the last one carries
             ``weight_version``) -> end_weight_update -> flush -> continue, then /model_info must report the new
             version; then it writes the outcome (received) and ``serving/policy_version=<k+1>``

Who calls the engines: the rollout node, not the trainer. It alone knows when no request is in flight, and it
already owns the engine list, the weight-update session and the version check. The trainer's broadcast just
blocks until the engines join it. Backend (group.py ``weight_sync_backend``): nccl when SGLang engines on GPUs meet a
trainer on GPUs (untested here: no GPU), gloo otherwise (the embedded engine; a CPU trainer).

A lost engine. A group's membership is fixed when it forms: a failed member cannot receive, and its replacement
cannot join. So the rollout node says before each policy who receives it, and the group is re-formed when that
changed:

    step k   rollout node: an engine fails; its requests go to the others (supervisor.py), its replacement starts
             and waits out of service (it holds policy 0, not k). On another rollout node the replacement starts on
             its host, and waits once the host has registered it; a lost host's engines wait until it beats again.
    k -> k+1 rollout node (``prepare``, before it waits for the weights record): asks every engine in service
             whether its server is still there (one that died idle is found now, not by the broadcast), then writes
             ``weight_sync/members/policy_version=<k+1>``: the engine ranks of a new group (those in service and
             the replacements waiting), or none when no member failed and no replacement waits
             trainer rank 0 (``publish``): waits for that record; for a new group, leaves the old one, publishes the
             plan ``weight_sync/plan/policy_version=<k+1>/attempt=0`` with it (new port, new name) and joins it
             rollout node: reads the plan; the engines in service and the replacements join the new group, in slot
             order; then policy k+1 is broadcast to all of them
    step k   the last engine in service fails: nobody is left to generate the step's samples until k+1, so the
             rollout node asks for policy k again (``send_again``): a record ``weight_sync/again/step=<k>/request=<i>``
             (the attempt, the replacements' engine ranks) that the dispatcher's thread writes between two group
             handles, before the step's first optimizer step can have come, or the run stops. Every trainer rank
             reads it before the next handle (trainer/node.py ``send_again_before``): rank 0 forms a new group for
             that attempt and broadcasts policy k again, the others joining its gathers, as above; the digest must be
             the first send's. The replacements join, receive it, and take requests.
    k -> k+1 an engine dies during the broadcast: the collective cannot end for anyone (a gloo or NCCL collective
             cannot be cancelled; the others would wait for the group's timeout)
             rank 0: its broadcast fails (the dead peer's connection closed), or the outcome record below says so
             rollout node (supervisor.py ``load_weights_distributed``): the dead engine's call fails; the others are
             told to leave the group (/destroy_weights_update_group: the embedded engine's server gives the receive
             up at once and serves nothing until a whole policy loads; one that has not given it up within
             ``LEAVE_GRACE_S``, an SGLang scheduler stuck in the collective, is replaced too); the dead one is
             replaced; the outcome of attempt a is ``{"received": false, "num_engine_ranks": n}``
             rank 0: leaves the group (the step's deferred update and a sharded gather finish the bucket in hand),
             forms a new one of n engine ranks, publishes it as the plan of attempt a+1, and broadcasts the whole
             policy again, with fresh MAC records (``attempt=<a+1>``): the same bytes, as the update is applied to
             each parameter once (grpo_trainer.py ``_update``). It goes on until an attempt is received; each one
             costs a failure of a slot, so ``rollout.max_engine_failures`` bounds them. Any other failure of the
             broadcast (a refused bucket) stops the run, saying so; it resumes from the step's checkpoint.

Authentication. Nobody outside the run may put bytes into an engine, and a process group authenticates nothing: its
rendezvous store is SGLang's and takes no seal, and anyone who reaches it or a member's port can pose as a member
(gloo relays a broadcast through members, so a member can change what reaches the next). So each bucket is a message
of its own under the weights MAC (mac.py): trainer rank 0 gives it a fresh salt and GMAC tags over its tensors, and
seals them in the store (``BucketMacs``: a record per bucket, written before the bucket is sent, as the deferred
update and a sharded gather only make its bytes final then). The rollout node reads each record, derives that
bucket's GMAC key from the attempt's key and the salt, and passes key and tags with the bucket's call
(buckets.py ``BucketMac``). The embedded engine receives the bucket, checks it, and loads nothing of a bucket that
does not match (it then serves nothing until a whole policy loads), so the rollout node stops the run. SGLang's
route has no field for a MAC: SGLang engines take the buckets unchecked (no MAC is made for them), so a run with
SGLang engines and this way keeps the group's ports within the run's nodes (docs/faults-and-security.md), or uses
``pipeline.weight_sync=disk``, whose file the rollout node checks whatever the engine.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from rolloutpipe.control.env import free_port, node_address
from rolloutpipe.control.transport import Transport
from rolloutpipe.control.weights import EngineGroup, PolicyWeights, WeightSyncSettings, weights_record_key
from rolloutpipe.control.weights.buckets import GROUP_NAME, Bucket, BucketMac, WeightGroup
from rolloutpipe.control.weights.digest import Digest, cores_beside_one, tensor_bytes, tensor_hash
from rolloutpipe.control.weights.group import BroadcastBroken, Broadcaster, weight_sync_backend
from rolloutpipe.control.weights.mac import SALT_BYTES, ChunkMac, gmac_key, weights_key

log = logging.getLogger(__name__)

GROUP_RECORD = ("weight_sync", "group")
"""The first group (``open``)."""


def plan_key(transport: Transport, version: int, attempt: int) -> str:
    """Which group policy ``version``'s ``attempt`` (0, then 1 after a member died during the broadcast, ...) is
    broadcast on (trainer rank 0 writes it before it sends)."""
    return transport.key("weight_sync", f"plan/policy_version={version}/attempt={attempt}")


def bucket_mac_key(transport: Transport, version: int, attempt: int, index: int) -> str:
    """Bucket ``index`` of policy ``version``'s salt and tags in broadcast ``attempt`` (trainer rank 0 writes it before
    it sends the bucket)."""
    return transport.key("weights", f"policy_version={version}", f"attempt={attempt}/bucket={index}")


def outcome_key(transport: Transport, version: int, attempt: int) -> str:
    """How broadcast ``attempt`` of policy ``version`` ended, by the rollout node: ``{"received": true}``, or
    ``{"received": false, "num_engine_ranks": n}`` when a member died during it (the next attempt's group size)."""
    return transport.key("weight_sync", f"outcome/policy_version={version}/attempt={attempt}")


def again_key(transport: Transport, step: int, index: int) -> str:
    """The rollout node's ``index``-th request of ``step`` to send the current policy again (``Receiver.send_again``),
    which every trainer rank reads before the group handle it names (trainer/node.py ``send_again_before``)."""
    return transport.key("weight_sync", f"again/step={step}/request={index}")


def members_key(transport: Transport, version: int) -> str:
    """Who receives policy ``version``: the rollout node's record (module docstring), which trainer rank 0 waits for."""
    return transport.key("weight_sync", f"members/policy_version={version}")


def mac_record(tensors: Iterable[memoryview], key: bytes) -> dict:
    """A bucket's sealed record: a fresh salt, and the GMAC tags of its ``tensors``' bytes (in the plan's order) under
    the weights ``key`` and that salt."""
    salt = os.urandom(SALT_BYTES)
    return {"salt": salt.hex(), "tags": [tag.hex() for tag in ChunkMac(gmac_key(key, salt)).tags(tensors)]}


def authenticated(buckets: list[Bucket], tensors: Iterable[Mapping[str, torch.Tensor]], key: bytes, digest: Digest,
                  publish: Callable[[int, dict], None] | None) -> Iterator[tuple[Bucket, Mapping[str, torch.Tensor]]]:
    """Each bucket of ``tensors`` (in turn, as the policy yields them), once its MAC record is published
    (``publish(index, record)``, on this thread; None: no MAC, for engines that cannot check one). The same host
    bytes (one copy off the device) go into the policy's ``digest`` (BLAKE3) on a second thread, one bucket behind:
    it overlaps the bucket's send and the next bucket's MAC, and holds at most two buckets' host copies. ``digest``
    is complete when the generator is."""

    threads = cores_beside_one()  # (the send has the other)

    def add(state: Mapping[str, torch.Tensor], data: dict[str, memoryview]) -> None:
        for name, view in data.items():
            digest.add(name, state[name], tensor_hash(view, max_threads=threads))

    with ThreadPoolExecutor(1, thread_name_prefix="weights-digest") as pool:
        hashing = None
        for index, (bucket, state) in enumerate(zip(buckets, tensors, strict=True)):
            data = {name: tensor_bytes(state[name]) for name in bucket.names}
            if publish is not None:
                publish(index, mac_record(data.values(), key))
            if hashing is not None:
                hashing.result()
            hashing = pool.submit(add, state, data)
            yield bucket, state
        if hashing is not None:
            hashing.result()


def bucket_mac(record: dict, key: bytes) -> BucketMac:
    """What an engine checks a bucket against: its GMAC key (the weights ``key`` and the record's salt) and tags."""
    return BucketMac(key=gmac_key(key, bytes.fromhex(record["salt"])), tags=[bytes.fromhex(t) for t in record["tags"]])


def check_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], mac: BucketMac) -> bool:
    """Whether a received bucket's ``tensors`` are the bytes trainer rank 0 authenticated (an engine's side)."""
    return mac.matches(tensor_bytes(tensors[name]) for name in bucket.names)


class Sender:
    """Trainer rank 0's side: ``open`` publishes the group and joins it as rank 0 (returns once every engine has
    joined); ``publish`` plans the buckets, announces them, and broadcasts them while the rollout node has the
    engines receive them."""

    def __init__(self, settings: WeightSyncSettings, *, transport: Transport, run_dir: Path,
                 policy: PolicyWeights) -> None:
        self.settings = settings
        self.transport = transport
        self.policy = policy
        self.broadcaster: Broadcaster | None = None
        self.generation = 0
        """Groups formed so far (a new one each time an engine was replaced)."""
        self._num_buckets: dict[int, list[int]] = {}
        """Per policy sent: its bucket records in each attempt, deleted by ``retire``."""
        self._digests: dict[int, str] = {}
        """Per policy sent: its digest, which a policy sent again mid-step must have (``send_again``)."""

    def open(self) -> None:
        group = self._new_group(1 + self.settings.num_engine_ranks)
        self.transport.put_record(self.transport.key(*GROUP_RECORD), group.to_json())
        self.broadcaster = self._join(group)

    def _new_group(self, world_size: int) -> WeightGroup:
        """Each group gets its own port and name, so an engine may sit in an old one still."""
        self.generation += 1
        return WeightGroup(master_address=node_address(self.transport.address.host), master_port=free_port(),
                           world_size=world_size, group_name=f"{GROUP_NAME}-{self.generation}",
                           backend=weight_sync_backend(self.settings.engines_on_gpus, self.policy.hf_on_gpu()))

    def _join(self, group: WeightGroup) -> Broadcaster:
        """Rank 0 of ``group``; returns once every engine has joined."""
        return Broadcaster(group=group, bucket_bytes=self.settings.bucket_bytes, timeout_s=self.settings.join_timeout_s,
                           check=lambda what: self.transport.liveness.check(waiting_for=what))

    def publish(self, version: int, *, serves: bool) -> str:
        """Each bucket is digested, authenticated and broadcast as the policy yields it (a sharded one gathers it
        then; the step's deferred update makes it final then); the last policy only goes to the final checkpoint: its
        buckets are digested, not sent. Before sending, the group is re-formed if the engines that receive it changed;
        if a member dies during the broadcast, the policy goes again, whole, to a group without it (module
        docstring)."""
        assert self.broadcaster is not None, "open() first"
        if not serves:
            digest = Digest()
            for state in self.policy.hf_buckets()[1]:
                digest.update(state)
            return digest.hexdigest()
        members = self.transport.wait_record(members_key(self.transport, version),
                                             what=f"the rollout node's engines for policy_version {version}")
        self._num_buckets[version] = []
        self._digests[version] = self._deliver(version, 0, members["num_engine_ranks"])
        return self._digests[version]

    def send_again(self, request: dict) -> None:
        """Mid-step, the rollout node lost its last engine in service (``Receiver.send_again``): the current policy
        goes again, whole, to a new group of the replacements. Every trainer rank reads the request before the same
        group handle, before the step's first optimizer step, so the policy is still the one sent; its digest must
        say so, or the run stops."""
        version, attempt = request["policy_version"], request["attempt"]
        if version not in self._digests or attempt != len(self._num_buckets[version]):
            raise RuntimeError(f"the rollout node asks for policy_version {version} again (attempt {attempt}), "
                               "which trainer rank 0 has not sent in as many attempts; refusing it.")
        log.warning("policy_version %d: the rollout node lost its last engine in service mid-step; sending the "
                    "policy again to %d engine ranks of its replacements", version, request["num_engine_ranks"])
        if (digest := self._deliver(version, attempt, request["num_engine_ranks"])) != self._digests[version]:
            raise RuntimeError(f"policy_version {version} sent again mid-step is not the policy sent first (weights "
                               f"digest {digest[:12]}, not {self._digests[version][:12]}): trainer rank 0 updated it "
                               "before the rollout node's request; stopping the run.")

    def _deliver(self, version: int, first_attempt: int, num_engine_ranks: int | None) -> str:
        """Broadcast attempts of policy ``version`` from ``first_attempt`` on until the rollout node says the engines
        received one; its digest."""
        for attempt in itertools.count(first_attempt):
            self._regroup(version, attempt, num_engine_ranks)
            digest = Digest()
            sent = self._send(version, attempt, digest)
            outcome = self.transport.wait_record(outcome_key(self.transport, version, attempt),
                                                 what=f"the engines to receive policy_version {version}")
            if outcome["received"]:
                if not sent:
                    raise RuntimeError(f"the rollout node says every engine received policy_version {version}, but "
                                       "trainer rank 0's broadcast of it failed; refusing to go on.")
                return digest.hexdigest()
            num_engine_ranks = outcome["num_engine_ranks"]
            log.warning("policy_version %d: an engine died during its broadcast (attempt %d); sending it again to "
                        "a new weight-update group of %d engine ranks", version, attempt, num_engine_ranks)

    def _regroup(self, version: int, attempt: int, num_engine_ranks: int | None) -> None:
        """Publish the group of ``attempt`` (a new one of ``num_engine_ranks`` engine ranks, or None: the current
        one) and join it."""
        group = None if num_engine_ranks is None else self._new_group(1 + num_engine_ranks)
        self.transport.put_record(plan_key(self.transport, version, attempt),
                                  {"group": None if group is None else group.to_json()})
        if group is not None:
            self.broadcaster.leave()
            self.broadcaster = self._join(group)

    def _send(self, version: int, attempt: int, digest: Digest) -> bool:
        """One broadcast of the policy to the current group; False if it broke (the group is then left)."""
        buckets, tensors = self.policy.hf_buckets()
        key = weights_key(self.transport.secret)

        def publish_mac(index: int, record: dict) -> None:
            self.transport.put_record(bucket_mac_key(self.transport, version, attempt, index), record)

        def broken() -> None:  # the rollout node found a member dead before this rank's broadcast failed
            outcome = self.transport.read_record(outcome_key(self.transport, version, attempt))
            if outcome is not None and not outcome["received"]:
                raise BroadcastBroken("the rollout node says an engine died during the broadcast")

        if attempt == 0:
            self.transport.put_record(weights_record_key(self.transport, version),
                                      {"policy_version": version, "buckets": [asdict(b) for b in buckets]})
        checked = self.settings.engines_check_buckets
        self._num_buckets[version].append(len(buckets) if checked else 0)
        sending = authenticated(buckets, tensors, key, digest, publish_mac if checked else None)
        try:
            self.broadcaster.stream(sending, version, broken)
            return True
        except BroadcastBroken as err:
            log.warning("policy_version %d: the broadcast broke: %s", version, err)
            sending.close()  # the bucket in hand is finished (a sharded gather is a collective of every rank)
            if hasattr(tensors, "close"):
                tensors.close()
            self.broadcaster.leave()
            return False

    def retire(self, version: int) -> None:
        self._digests.pop(version, None)
        for attempt, num_buckets in enumerate(self._num_buckets.pop(version, [])):
            for index in range(num_buckets):
                self.transport.delete(bucket_mac_key(self.transport, version, attempt, index))


class Receiver:
    """The rollout node's side: ``open`` has every engine join trainer rank 0's group (engine i as ranks
    1 + i * ranks_per_engine ...); ``load`` has them receive the announced buckets."""

    def __init__(self, settings: WeightSyncSettings, *, transport: Transport, run_dir: Path, engines: EngineGroup,
                 check: Callable[[str], None]) -> None:
        self.transport = transport
        self.engines = engines
        self.ranks_per_engine = settings.ranks_per_engine
        self.engines_check_buckets = settings.engines_check_buckets
        self._attempts: dict[int, int] = {}
        """Per policy received: the broadcast attempts it took (a policy sent again mid-step takes more)."""
        self._num_again: tuple[int, int] = (-1, 0)
        """The step, and how many times the current policy was asked for again in it (``send_again``)."""

    def open(self) -> None:
        group = self.transport.wait_record(self.transport.key(*GROUP_RECORD),
                                           what="trainer rank 0's weight-update process group")
        self.engines.join_weight_group(WeightGroup(**group), self.ranks_per_engine)

    def prepare(self, version: int) -> None:
        self.transport.put_record(members_key(self.transport, version),
                                  {"num_engine_ranks": self._num_engine_ranks()})
        self._join_planned(version, 0)

    def load(self, record: dict, version: int) -> None:
        """Every engine receives the broadcast; if a member dies during it, the engines left and the replacement join
        a new group and receive the whole policy again (module docstring)."""
        if "buckets" not in record:
            raise RuntimeError(f"the weights record of policy_version {version} has no buckets: the trainer and the "
                               "rollout node disagree on pipeline.weight_sync; refusing it.")
        self._receive([Bucket(**b) for b in record["buckets"]], version, 0, again=False)
        self._attempts = {version: self._attempts[version]}  # (the policies before it are no longer served)

    def send_again(self, step: int, version: int,
                   mark: Callable[[Callable[[Transport, int], None]], None]) -> None:
        """Mid-step, no engine left in service (supervisor.py ``stranded``): trainer rank 0 sends the current policy
        ``version`` again, to a new group of the replacements, and they receive it. The request is one record among
        the step's group handles: ``mark(write)`` calls ``write(transport, seq)`` where ``seq`` handles of the step
        are published and the next is not (the dispatcher's thread, on its connection), and raises if trainer rank
        0 may have taken an optimizer step by then. Every trainer rank reads the request before handle ``seq``."""
        step_asked, num_asked = self._num_again
        index = num_asked if step_asked == step else 0
        self._num_again = (step, index + 1)
        attempt, num_engine_ranks = self._attempts[version] + 1, self._num_engine_ranks()
        mark(lambda transport, seq: transport.put_record(again_key(transport, step, index), {
            "policy_version": version, "attempt": attempt, "num_engine_ranks": num_engine_ranks, "before_seq": seq}))
        record = self.transport.wait_record(weights_record_key(self.transport, version),
                                            what=f"weights of policy_version {version}")
        self._join_planned(version, attempt, again=True)
        self._receive([Bucket(**b) for b in record["buckets"]], version, attempt, again=True)

    def _receive(self, buckets: list[Bucket], version: int, first_attempt: int, *, again: bool) -> None:
        """Broadcast attempts of policy ``version`` from ``first_attempt`` on, until the engines receive one."""
        for attempt in itertools.count(first_attempt):
            macs = BucketMacs(self.transport, version, attempt) if self.engines_check_buckets else None
            if self.engines.load_weights_distributed(buckets, version, macs):
                self.transport.put_record(outcome_key(self.transport, version, attempt), {"received": True})
                self._attempts[version] = attempt
                return
            self.transport.put_record(outcome_key(self.transport, version, attempt),
                                      {"received": False, "num_engine_ranks": self._num_engine_ranks()})
            self._join_planned(version, attempt + 1, again=again)

    def _num_engine_ranks(self) -> int | None:
        """The engine ranks of the next group (None: the current group serves)."""
        num_engines = self.engines.next_group_size()
        return None if num_engines is None else num_engines * self.ranks_per_engine

    def _join_planned(self, version: int, attempt: int, *, again: bool = False) -> None:
        """Have the engines join the group trainer rank 0 planned for ``attempt``, if it is a new one (``again``: the
        replacements alone, mid-step, to receive the current policy ``version``)."""
        plan = self.transport.wait_record(plan_key(self.transport, version, attempt),
                                          what=f"trainer rank 0's plan for policy_version {version}")
        if plan["group"] is not None:
            group = WeightGroup(**plan["group"])
            log.warning("policy_version %d goes to a new weight-update group of %d engine ranks (%s): engines failed "
                        "or came back since the last one", version, group.world_size - 1, group.group_name)
            self.engines.rejoin_weight_group(group, self.ranks_per_engine, version if again else None)


class BucketMacs:
    """The rollout node's side of the buckets' MACs: bucket ``index``'s, read from trainer rank 0's sealed record
    once, by whichever engine's thread asks first (each asks before its call for the bucket)."""

    def __init__(self, transport: Transport, version: int, attempt: int) -> None:
        self.transport = transport
        self.version = version
        self.attempt = attempt
        self._key = weights_key(transport.secret)
        self._macs: dict[int, BucketMac] = {}
        self._lock = threading.Lock()

    def __call__(self, index: int) -> BucketMac:
        with self._lock:
            if index not in self._macs:
                record = self.transport.wait_record(
                    bucket_mac_key(self.transport, self.version, self.attempt, index),
                    what=f"trainer rank 0's MAC of bucket {index} of policy_version {self.version}")
                self._macs[index] = bucket_mac(record, self._key)
            return self._macs[index]
