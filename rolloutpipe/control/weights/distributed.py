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
             its MAC as ``weights/policy_version=<k+1>/bucket=<i>``, broadcast it as one flat tensor
             (buckets.py ``pack``: one broadcast per bucket, SGLang's ``flattened_bucket``); then wait for
             ``serving/policy_version=<k+1>``
             rollout node (at the step boundary): per engine, in parallel: pause -> begin_weight_update ->
             one /update_weights_from_distributed per bucket, with the bucket's MAC (the last one carries
             ``weight_version``) -> end_weight_update -> flush -> continue, then /model_info must report the new
             version

Rank 0 sends at the transport's own floor: a broadcast per tensor pays a collective's fixed cost hundreds of times,
so each bucket goes as one flat buffer, and two buffers alternate so that bucket i+1 is gathered, digested and
packed while bucket i is on the wire (``Broadcaster.stream``). The bucket size trades those costs against memory
(two buffers on rank 0's device); bench/weight_sync.py measures it against one raw broadcast of the same bytes.

Who calls the engines: the rollout node, not the trainer. It alone knows when no request is in flight, and it
already owns the engine list, the weight-update session and the version check. The trainer's broadcast just
blocks until the engines join it. Backend (``weight_sync_backend``): nccl when SGLang engines on GPUs meet a
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
             plan ``weight_sync/plan/policy_version=<k+1>`` with it (new port, new name) and joins it as rank 0
             rollout node: reads the plan; the engines in service and the replacements join the new group, in slot
             order; then policy k+1 is broadcast to all of them
    An engine that fails after the members record (during the broadcast) stops the run, saying so; it resumes from
    the step's checkpoint.

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

The process group is formed the way SGLang 0.5.23 forms it on the engine side (``init_custom_process_group``:
a ``tcp://`` rendezvous whose rank 0 hosts the store, a ``PrefixStore`` named after the group, torch's group
helper), so the embedded engine's server (rollout/engines/http_server.py) and trainer rank 0 use ``join_group``
below and meet a real SGLang server on the same keys.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rolloutpipe.control.env import free_port, node_address
from rolloutpipe.control.transport import Transport
from rolloutpipe.control.weights import EngineGroup, PolicyWeights, WeightSyncSettings, weights_record_key
from rolloutpipe.control.weights.buckets import (
    GROUP_NAME,
    Bucket,
    BucketMac,
    BufferRing,
    WeightGroup,
    pack,
    packed,
    plan_buckets,
    unpack,
)
from rolloutpipe.control.weights.digest import Digest, cores_beside_one, tensor_bytes, tensor_hash
from rolloutpipe.control.weights.mac import SALT_BYTES, ChunkMac, gmac_key, weights_key

log = logging.getLogger(__name__)

GROUP_RECORD = ("weight_sync", "group")
"""The first group (``open``)."""


def plan_key(transport: Transport, version: int) -> str:
    """Which group policy ``version`` is broadcast on (trainer rank 0 writes it before it sends)."""
    return transport.key("weight_sync", f"plan/policy_version={version}")


def bucket_mac_key(transport: Transport, version: int, index: int) -> str:
    """Bucket ``index`` of policy ``version``'s salt and tags (trainer rank 0 writes it before it sends the bucket)."""
    return transport.key("weights", f"policy_version={version}", f"bucket={index}")


def members_key(transport: Transport, version: int) -> str:
    """Who receives policy ``version``: the rollout node's record (module docstring), which trainer rank 0 waits for."""
    return transport.key("weight_sync", f"members/policy_version={version}")


def weight_sync_backend(engines_on_gpus: bool, on_gpu: bool) -> str:
    """nccl when both ends hold CUDA tensors (SGLang engines on GPUs, a trainer whose ``hf_on_gpu`` says so: no
    backend's does yet, each hands host copies), else gloo.

    gloo also serves a CPU trainer broadcasting into SGLang's CUDA receive buffers (it copies through host memory);
    nccl cannot start from CPU tensors, nor put two ranks on one GPU (a trainer sharing the engines' GPU).
    """
    return "nccl" if engines_on_gpus and on_gpu else "gloo"


def join_group(group: WeightGroup, rank: int, *, timeout_s: float = 1800.0) -> dist.ProcessGroup:
    """Join ``group`` as ``rank``; returns when every member has joined. Keys as SGLang 0.5.23 lays them out.

    Rank 0 (trainer rank 0) hosts the rendezvous store as ``tcp://`` rendezvous would, but on the master
    address only (not every interface); the engines (SGLang's ``init_custom_process_group``, the embedded
    server) connect to it through ``tcp://``. SGLang's side cannot check a seal, so this store is unsealed:
    the security table of docs/faults-and-security.md names its port among those to keep to the run's nodes.
    """
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    from rolloutpipe.control.env import listen_socket

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(group.master_address, group.master_port, group.world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listen_socket(group.master_address, group.master_port).detach())
        world_size = group.world_size
    else:
        host = f"[{group.master_address}]" if ":" in group.master_address else group.master_address
        store, rank, world_size = next(dist.rendezvous(f"tcp://{host}:{group.master_port}", rank, group.world_size,
                                                       timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(group.backend),
                                      dist.PrefixStore(group.group_name, store), group_name=group.group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # so collectives may name ranks (src=0)
    return pg


def wait_all(works: list, check: Callable[[], None], poll_s: float = 0.02, check_every_s: float = 0.5) -> None:
    """Wait for collective ``works``, calling ``check`` (which raises when a peer is gone) every ``check_every_s``."""
    next_check_s = time.monotonic() + check_every_s
    for work in works:
        while not work.is_completed():
            if time.monotonic() >= next_check_s:
                check()
                next_check_s = time.monotonic() + check_every_s
            time.sleep(poll_s)
        work.wait()  # raises if the collective failed


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


def receive_bucket(pg: dist.ProcessGroup, bucket: Bucket,
                   buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """An engine's side of one bucket (the embedded engine's server): one flat tensor from rank 0, unpacked into
    views of ``buffer`` (uint8, at least the bucket's size; views valid until it is reused) or of a fresh one."""
    flat = (torch.empty(bucket.num_bytes, dtype=torch.uint8) if buffer is None else buffer)[:bucket.num_bytes]
    dist.broadcast(flat, src=0, group=pg)
    return unpack(bucket, flat)


class Broadcaster:
    """Trainer rank 0's side: rank 0 of ``group`` (joined here, blocking until the engines have joined too), then
    one ``send`` per policy version while the rollout node has the engines receive it.

    ``check(what)`` runs every half second while this waits for the engines, and raises when the run is aborted or
    the rollout node stopped heart-beating (transport.Liveness.check), so a lost peer is not a silent hang.
    """

    def __init__(self, *, group: WeightGroup, bucket_bytes: int, timeout_s: float,
                 check: Callable[[str], None]) -> None:
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.device = "cuda" if group.backend == "nccl" else "cpu"
        self._check = check
        self._buffers = BufferRing(2, self.device)
        """The two send buffers (none grown if nothing is packed), kept between policies."""
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["pg"] = join_group(group, 0, timeout_s=timeout_s)
            except BaseException as err:  # noqa: BLE001 - re-raised below, on the caller's thread
                joined["error"] = err

        thread = threading.Thread(target=join, name="weight-group-join", daemon=True)
        thread.start()
        while thread.is_alive():
            self._check(f"the engines to join the weight-update group at {group.master_address}:{group.master_port}")
            thread.join(timeout=0.5)
        if "error" in joined:
            raise joined["error"]
        self._pg = joined["pg"]

    def leave(self) -> None:
        """Leave the group (it is replaced by a new one): a member that died cannot hold this rank up."""
        dist.destroy_process_group(self._pg)

    def plan(self, state: dict[str, torch.Tensor]) -> list[Bucket]:
        return plan_buckets(state, self.bucket_bytes)

    def send(self, state: Mapping[str, torch.Tensor], buckets: list[Bucket], policy_version: int) -> None:
        self.stream(((bucket, state) for bucket in buckets), policy_version)

    def stream(self, buckets: Iterable[tuple[Bucket, Mapping[str, torch.Tensor]]], policy_version: int) -> None:
        """Broadcast each bucket as one flat tensor, in order. Two buffers alternate: a bucket is packed while the
        one before it is on the wire, so whatever ``buckets`` does between yields (gather, digest) overlaps too. A
        bucket whose tensors lie back to back in memory already goes from there, uncopied (buckets.py ``packed``).
        Returns once every engine has received the last one."""
        what = f"the engines to receive policy_version {policy_version}"
        in_flight: list = [None, None]  # (the broadcast, the flat tensor it sends) from each slot
        for i, (bucket, state) in enumerate(buckets):
            slot = i % 2
            if in_flight[slot] is not None:
                wait_all([in_flight[slot][0]], lambda: self._check(what))
            flat = packed(bucket, state)
            if flat is None or flat.device.type != self.device:
                flat = pack(bucket, state, self._buffers(slot, bucket.num_bytes))
            in_flight[slot] = (dist.broadcast(flat, src=0, group=self._pg, async_op=True), flat)
        wait_all([sent[0] for sent in in_flight if sent is not None], lambda: self._check(what))


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
        self._num_buckets: dict[int, int] = {}
        """Per policy sent: its bucket records, deleted by ``retire``."""

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
        buckets are digested, not sent. Before sending, the group is re-formed if the engines that receive it changed
        (module docstring)."""
        assert self.broadcaster is not None, "open() first"
        if serves:
            members = self.transport.wait_record(members_key(self.transport, version),
                                                 what=f"the rollout node's engines for policy_version {version}")
            group = None if members["num_engine_ranks"] is None else self._new_group(1 + members["num_engine_ranks"])
            self.transport.put_record(plan_key(self.transport, version),
                                      {"group": None if group is None else group.to_json()})
            if group is not None:
                self.broadcaster.leave()
                self.broadcaster = self._join(group)
        buckets, tensors = self.policy.hf_buckets()
        digest, key = Digest(), weights_key(self.transport.secret)
        if not serves:
            for state in tensors:
                digest.update(state)
            return digest.hexdigest()

        def publish_mac(index: int, record: dict) -> None:
            self.transport.put_record(bucket_mac_key(self.transport, version, index), record)

        self.transport.put_record(weights_record_key(self.transport, version),
                                  {"policy_version": version, "buckets": [asdict(b) for b in buckets]})
        checked = self.settings.engines_check_buckets
        self._num_buckets[version] = len(buckets) if checked else 0
        self.broadcaster.stream(authenticated(buckets, tensors, key, digest, publish_mac if checked else None), version)
        return digest.hexdigest()

    def retire(self, version: int) -> None:
        for index in range(self._num_buckets.pop(version, 0)):
            self.transport.delete(bucket_mac_key(self.transport, version, index))


class Receiver:
    """The rollout node's side: ``open`` has every engine join trainer rank 0's group (engine i as ranks
    1 + i * ranks_per_engine ...); ``load`` has them receive the announced buckets."""

    def __init__(self, settings: WeightSyncSettings, *, transport: Transport, run_dir: Path, engines: EngineGroup,
                 check: Callable[[str], None]) -> None:
        self.transport = transport
        self.engines = engines
        self.ranks_per_engine = settings.ranks_per_engine
        self.engines_check_buckets = settings.engines_check_buckets

    def open(self) -> None:
        group = self.transport.wait_record(self.transport.key(*GROUP_RECORD),
                                           what="trainer rank 0's weight-update process group")
        self.engines.join_weight_group(WeightGroup(**group), self.ranks_per_engine)

    def prepare(self, version: int) -> None:
        num_engines = self.engines.next_group_size()
        self.transport.put_record(members_key(self.transport, version), {
            "num_engine_ranks": None if num_engines is None else num_engines * self.ranks_per_engine})
        plan = self.transport.wait_record(plan_key(self.transport, version),
                                          what=f"trainer rank 0's plan for policy_version {version}")
        if plan["group"] is not None:
            group = WeightGroup(**plan["group"])
            log.warning("policy_version %d goes to a new weight-update group of %d engine ranks (%s): engines failed "
                        "or came back since the last one", version, group.world_size - 1, group.group_name)
            self.engines.rejoin_weight_group(group, self.ranks_per_engine)

    def load(self, record: dict, version: int) -> None:
        if "buckets" not in record:
            raise RuntimeError(f"the weights record of policy_version {version} has no buckets: the trainer and the "
                               "rollout node disagree on pipeline.weight_sync; refusing it.")
        macs = BucketMacs(self.transport, version) if self.engines_check_buckets else None
        self.engines.load_weights_distributed([Bucket(**b) for b in record["buckets"]], version, macs)


class BucketMacs:
    """The rollout node's side of the buckets' MACs: bucket ``index``'s, read from trainer rank 0's sealed record
    once, by whichever engine's thread asks first (each asks before its call for the bucket)."""

    def __init__(self, transport: Transport, version: int) -> None:
        self.transport = transport
        self.version = version
        self._key = weights_key(transport.secret)
        self._macs: dict[int, BucketMac] = {}
        self._lock = threading.Lock()

    def __call__(self, index: int) -> BucketMac:
        with self._lock:
            if index not in self._macs:
                record = self.transport.wait_record(
                    bucket_mac_key(self.transport, self.version, index),
                    what=f"trainer rank 0's MAC of bucket {index} of policy_version {self.version}")
                self._macs[index] = bucket_mac(record, self._key)
            return self._macs[index]
