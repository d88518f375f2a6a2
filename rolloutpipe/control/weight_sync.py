"""Weight sync: how policy_version k+1 reaches the engines between steps.

``pipeline.weight_sync`` picks one of two ways; both keep the on-policy invariant, because the rollout node makes
every engine call, and it does so only between steps, when no request is in flight (rollout/node.py load_weights).

disk (default; every engine kind)
    Trainer rank 0 writes ``run_dir/weights/policy_v<k>.safetensors`` and publishes its path and sha256 in the
    store (a sealed record, control/transport.py); the rollout node checks that the path is that file and the
    file has that digest, then calls ``update_weights_from_disk`` on every engine. Needs a file system both node
    groups see.

distributed (HTTP engines: ``rollout.engine=embedded_http`` or ``sglang``)
    SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed``: trainer rank 0 is rank 0 of a
    torch process group whose other members are the engines (one rank per engine, or per tensor-parallel rank of
    a multi-GPU SGLang engine), and broadcasts the HF-named tensors to them; nothing touches the disk.

        startup  trainer rank 0: pick a port, publish ``weight_sync/group`` (address, port, world size, name,
                 backend) and join as rank 0 (this rendezvous hosts its own TCPStore, as SGLang expects)
                 rollout node: read it, POST /init_weights_update_group to every engine at once (rank_offset 1, 2,
                 ...); each call returns once the whole group is formed
        step k   trainer rank 0: plan buckets of at most ``pipeline.weight_sync_bucket_mb`` (names, dtypes,
                 shapes), publish the plan as ``weights/policy_version=<k+1>``, broadcast the tensors bucket by
                 bucket (one broadcast per tensor, from rank 0), then wait for ``serving/policy_version=<k+1>``
                 rollout node (at the step boundary): per engine, in parallel: pause -> begin_weight_update ->
                 one /update_weights_from_distributed per bucket (the last one carries ``weight_version``) ->
                 end_weight_update -> flush -> continue, then /model_info must report the new version

    Who calls the engines: the rollout node, not the trainer. It alone knows when no request is in flight, and it
    already owns the engine list, the weight-update session and the version check. The trainer's broadcast just
    blocks until the engines join it. Backend (``weight_sync_backend``): nccl when SGLang engines on GPUs meet a
    trainer on GPUs (untested here: no GPU), gloo otherwise (the embedded engine; a CPU trainer). The group's
    membership is fixed when it forms, so a failed engine cannot be replaced by a fresh one (it could not join);
    with distributed sync an engine failure stops the run.

The process group is formed the way SGLang 0.5.23 forms it on the engine side (``init_custom_process_group``:
a ``tcp://`` rendezvous whose rank 0 hosts the store, a ``PrefixStore`` named after the group, torch's group
helper), so the embedded engine's server (rollout/engines/http_server.py) and trainer rank 0 use ``join_group``
below and meet a real SGLang server on the same keys.

Both sides' pieces live here (records, buckets, the group, one broadcast and one receive); trainer rank 0's
publisher, which drives them each step, is trainer/weights.py.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class WeightSync(enum.Enum):
    disk = "disk"
    distributed = "distributed"


GROUP_NAME = "rolloutpipe_weights"


def weights_file(version: int) -> str:
    """Where disk sync writes policy ``version``, relative to the run directory."""
    return f"weights/policy_v{version}.safetensors"


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(kw_only=True, slots=True)
class WeightGroup:
    """The process group between trainer rank 0 (rank 0) and the engines (ranks 1 .. world_size - 1)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = GROUP_NAME
    backend: str = "gloo"
    """gloo (CPU engines) or nccl (SGLang on GPUs)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True, slots=True)
class Bucket:
    """Tensors broadcast together: one /update_weights_from_distributed call per engine."""

    names: list[str]
    dtypes: list[str]
    """torch dtype names without ``torch.`` (``bfloat16``), as SGLang's ``getattr(torch, dtype)`` wants them."""
    shapes: list[list[int]]


def plan_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors of ``state``, in its order, grouped up to ``bucket_bytes`` (a larger tensor: alone)."""
    buckets: list[Bucket] = []
    size = bucket_bytes
    for name, tensor in state.items():
        num_bytes = tensor.numel() * tensor.element_size()
        if size + num_bytes > bucket_bytes and size > 0:
            buckets.append(Bucket(names=[], dtypes=[], shapes=[]))
            size = 0
        buckets[-1].names.append(name)
        buckets[-1].dtypes.append(str(tensor.dtype).removeprefix("torch."))
        buckets[-1].shapes.append(list(tensor.shape))
        size += num_bytes
    return buckets


def weight_sync_backend(engines_on_gpus: bool, state: dict[str, torch.Tensor]) -> str:
    """nccl when both ends hold CUDA tensors (SGLang engines, a trainer on GPUs: Megatron with CUDA), else gloo.

    gloo also serves a CPU trainer broadcasting into SGLang's CUDA receive buffers (it copies through host memory);
    nccl cannot start from CPU tensors, nor put two ranks on one GPU (a trainer sharing the engines' GPU).
    """
    on_gpu = next(iter(state.values())).is_cuda
    return "nccl" if engines_on_gpus and on_gpu else "gloo"


def join_group(group: WeightGroup, rank: int, *, timeout_s: float = 1800.0) -> dist.ProcessGroup:
    """Join ``group`` as ``rank``; returns when every member has joined. Keys as SGLang 0.5.23 lays them out.

    Rank 0 (trainer rank 0) hosts the rendezvous store as ``tcp://`` rendezvous would, but on the master
    address only (not every interface); the engines (SGLang's ``init_custom_process_group``, the embedded
    server) connect to it through ``tcp://``. SGLang's side cannot check a seal, so this store is unsealed:
    the README's security table names its port among those to keep to the run's nodes.
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


def broadcast_bucket(pg: dist.ProcessGroup, state: dict[str, torch.Tensor], bucket: Bucket, device: str) -> list:
    """Rank 0's side of one bucket: one broadcast per tensor, in the bucket's order (as the engines receive).
    Returns the pending works (``wait_all``)."""
    return [dist.broadcast(state[name].detach().to(device).contiguous(), src=0, group=pg, async_op=True)
            for name in bucket.names]


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


def receive_bucket(pg: dist.ProcessGroup, bucket: Bucket) -> dict[str, torch.Tensor]:
    """An engine's side of one bucket (the embedded engine's server): the tensors rank 0 broadcasts."""
    received = {name: torch.empty(shape, dtype=getattr(torch, dtype))
                for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=True)}
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in received.values()]
    for handle in handles:
        handle.wait()
    return received


