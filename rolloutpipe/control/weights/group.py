"""The weight-update process group (distributed.py's transport): formed as SGLang forms it, trainer rank 0's side
(``Broadcaster``) and an engine's (``receive_bucket``).

The process group is formed the way SGLang 0.5.23 forms it on the engine side (``init_custom_process_group``:
a ``tcp://`` rendezvous whose rank 0 hosts the store, a ``PrefixStore`` named after the group, torch's group
helper), so the embedded engine's server (rollout/engines/http_server.py) and trainer rank 0 use ``join_group``
below and meet a real SGLang server on the same keys.

Rank 0 sends at the transport's own floor: a broadcast per tensor pays a collective's fixed cost hundreds of times,
so each bucket goes as one flat buffer, and two buffers alternate so that bucket i+1 is gathered, digested and
packed while bucket i is on the wire (``Broadcaster.stream``). The bucket size trades those costs against memory
(two buffers on rank 0's device); bench/weight_sync.py measures it against one raw broadcast of the same bytes.

A member that dies during a broadcast leaves the others in a collective that cannot end (neither gloo's nor NCCL's
can be cancelled: the others would wait for the group's timeout). Both sides therefore wait on their works in
``wait_all``, which checks a condition of the caller's between polls and raises ``BroadcastBroken`` when a work
fails; the group is then left, and distributed.py sends the policy again to a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rolloutpipe.control.weights.buckets import Bucket, BufferRing, WeightGroup, pack, packed, plan_buckets, unpack

log = logging.getLogger(__name__)


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


SETTLE_S = 5.0
"""How long ``Broadcaster.leave`` waits for a broadcast still in flight to end (fail) before it leaves the group
undestroyed. Left undestroyed, a real SGLang survivor stays in the broken broadcast until supervisor.py replaces it
(tests/sglang_real's mid-broadcast test with ``leave`` made to skip the destruction: the survivor was replaced too)."""


class BroadcastBroken(RuntimeError):
    """A broadcast of the weight-update group failed (a member died during it): the group cannot be used again."""


def wait_all(works: list, check: Callable[[], None], poll_s: float = 0.02, check_every_s: float = 0.5) -> None:
    """Wait for collective ``works``, calling ``check`` (which raises when a peer is gone) every ``check_every_s``.
    A collective that fails raises ``BroadcastBroken``."""
    next_check_s = time.monotonic() + check_every_s
    for work in works:
        while not work.is_completed():
            if time.monotonic() >= next_check_s:
                check()
                next_check_s = time.monotonic() + check_every_s
            time.sleep(poll_s)
        try:
            work.wait()  # raises if the collective failed
        except RuntimeError as err:
            raise BroadcastBroken(str(err)) from err


def receive_bucket(pg: dist.ProcessGroup, bucket: Bucket, buffer: torch.Tensor | None = None, *,
                   abandoned: threading.Event | None = None) -> dict[str, torch.Tensor]:
    """An engine's side of one bucket (the embedded engine's server): one flat tensor from rank 0, unpacked into
    views of ``buffer`` (uint8, at least the bucket's size; views valid until it is reused) or of a fresh one.
    Raises ``BroadcastBroken`` when the broadcast fails, or once ``abandoned`` is set: a member that died leaves the
    others waiting until the group's timeout (a gloo collective cannot be cancelled; it ends then, unread)."""
    flat = (torch.empty(bucket.num_bytes, dtype=torch.uint8) if buffer is None else buffer)[:bucket.num_bytes]
    work = dist.broadcast(flat, src=0, group=pg, async_op=True)

    def check() -> None:
        if abandoned is not None and abandoned.is_set():
            raise BroadcastBroken("the broadcast was given up: a member of the weight-update group died during it")

    wait_all([work], check, poll_s=0.001, check_every_s=0.0)
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
        self._pg: dist.ProcessGroup | None = joined["pg"]
        self._in_flight: list = [None, None]
        """(the broadcast, the flat tensor it sends) from each buffer slot (``stream``)."""

    def leave(self) -> None:
        """Leave the group (it is replaced by a new one): a member that died cannot hold this rank up.

        Destroying the group closes this rank's connections, and that is what frees the surviving members: an SGLang
        scheduler waiting in the broken broadcast for this rank's bytes gives it up only when its receive fails
        (otherwise supervisor.py replaces it after ``LEAVE_GRACE_S``). The other buffer's broadcast may still be in
        flight when the first one fails; it fails too once the dead member's connection is seen closed, so ``leave``
        waits up to ``SETTLE_S`` for it. A broadcast still in flight then (a member stopped receiving) would hold up
        the group's destruction until its timeout, so such a group is left as it is, registered with torch (which
        keeps it alive): its broadcast ends then."""
        if self._pg is None:
            return
        works = [sent[0] for sent in self._in_flight if sent is not None]
        settled_by = time.monotonic() + SETTLE_S
        while not all(work.is_completed() for work in works) and time.monotonic() < settled_by:
            time.sleep(0.01)
        if all(work.is_completed() for work in works):
            dist.destroy_process_group(self._pg)
        else:
            log.warning("left the weight-update group %s with a broadcast in flight; it ends on the group's timeout",
                        self.group.group_name)
        self._pg, self._in_flight = None, [None, None]

    def plan(self, state: dict[str, torch.Tensor]) -> list[Bucket]:
        return plan_buckets(state, self.bucket_bytes)

    def send(self, state: Mapping[str, torch.Tensor], buckets: list[Bucket], policy_version: int) -> None:
        self.stream(((bucket, state) for bucket in buckets), policy_version)

    def stream(self, buckets: Iterable[tuple[Bucket, Mapping[str, torch.Tensor]]], policy_version: int,
               broken: Callable[[], None] = lambda: None) -> None:
        """Broadcast each bucket as one flat tensor, in order. Two buffers alternate: a bucket is packed while the
        one before it is on the wire, so whatever ``buckets`` does between yields (gather, digest) overlaps too. A
        bucket whose tensors lie back to back in memory already goes from there, uncopied (buckets.py ``packed``).
        Returns once every engine has received the last one. Raises ``BroadcastBroken`` when a broadcast fails, or
        when ``broken`` (called while this waits) raises it: the rollout node says a member died."""
        what = f"the engines to receive policy_version {policy_version}"

        def check() -> None:
            self._check(what)
            broken()

        in_flight = self._in_flight
        for i, (bucket, state) in enumerate(buckets):
            slot = i % 2
            if in_flight[slot] is not None:
                wait_all([in_flight[slot][0]], check)
            flat = packed(bucket, state)
            if flat is None or flat.device.type != self.device:
                flat = pack(bucket, state, self._buffers(slot, bucket.num_bytes))
            try:
                in_flight[slot] = (dist.broadcast(flat, src=0, group=self._pg, async_op=True), flat)
            except RuntimeError as err:
                raise BroadcastBroken(str(err)) from err
        wait_all([sent[0] for sent in in_flight if sent is not None], check)
        self._in_flight = [None, None]  # (holds no bucket's tensors between policies)
