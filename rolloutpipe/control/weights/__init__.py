"""Weight sync: how policy_version k+1 reaches the engines between steps. One module per way, both sides in it.

    disk.py         trainer rank 0 writes a safetensors file under run_dir/weights (/dev/shm on one node), hashing
                    it as it writes, and publishes its MAC; every engine loads it while the rollout node checks it
                    (any engine kind; engines of the rollout node's own process in one read, checked as it goes)
    distributed.py  trainer rank 0 broadcasts the HF-named tensors to the engines, which joined its process group,
                    a flat buffer per bucket (SGLang's /update_weights_from_distributed; HTTP engines only)
    buckets.py      the distributed way's wire shapes (the group's address, the bucket plan, the flat layout),
                    which the engines' HTTP side reads too
    digest.py       the weights digest of a policy (``train/weights_digest``), the same whichever way sent it

Every way keeps the on-policy invariant the same way: the rollout node makes every engine call, and only between
steps, when no request is in flight (rollout/node.py ``load_weights``). Each module defines ``Sender`` (trainer
rank 0's side, ``WeightSender``) and ``Receiver`` (the rollout node's side, ``WeightReceiver``); ``pipeline.
weight_sync`` names the module, and ``sender`` / ``receiver`` below are the one place a way is chosen. A new way
is one new module here plus one member of ``WeightSync``.

The store carries, per policy, one sealed record ``weights/policy_version=<k>`` that only the chosen way reads (the
distributed way adds one per bucket under it), and the rollout node's acknowledgement ``serving/policy_version=<k>``
once every engine serves k. Both ways authenticate what an engine loads with the weights MAC (mac.py).

May import: types, model, control/.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rolloutpipe.control.transport import Transport
    from rolloutpipe.control.weights.buckets import Bucket, BucketMac, WeightGroup


class WeightSync(enum.Enum):
    """``pipeline.weight_sync``: each value names its module in this package (null: ``choose`` picks one)."""

    disk = "disk"
    distributed = "distributed"


def choose(*, sglang_started: bool, attached: bool, overlapped: bool) -> tuple[WeightSync, str]:
    """The way of ``pipeline.weight_sync=null`` (the GPU presets), and why; config.py resolves it at load, so
    config.yaml records the way the run used. A broadcast moves a policy at the network's speed (gloo from trainer
    rank 0's host memory today: distributed.py ``weight_sync_backend``), a file at the shared file system's, hashed
    on both sides: broadcast wherever the engines are SGLang servers the run starts on GPU nodes. A file where the
    engines are CPU ones (embedded: the in-process engine cannot join a group), attached servers
    (``rollout.engine_urls``: nobody here knows that they reach trainer rank 0), or the rollout runs ahead of
    training (async_one_step: a broadcast would wait for the rollout's step boundary)."""
    if overlapped:
        return WeightSync.disk, "pipeline.mode=async_one_step runs the rollout a step ahead; a broadcast would stall it"
    if attached:
        return WeightSync.disk, "rollout.engine_urls attaches servers that may not reach trainer rank 0's group"
    if not sglang_started:
        return WeightSync.disk, "the engines run on CPU (rollout.engine is not sglang)"
    return WeightSync.distributed, ("SGLang engines on GPU nodes: trainer rank 0 broadcasts to them, no file; a "
                                    "failed engine's replacement joins a new group at the next step boundary. SGLang "
                                    "cannot check a bucket's MAC: keep the weight-update group's ports within the "
                                    "run's nodes, or set pipeline.weight_sync=disk")


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncSettings:
    """What both sides of every way read, taken from the config once (config.py ``Config.weight_sync``)."""

    way: WeightSync
    bucket_bytes: int
    """distributed: tensors per /update_weights_from_distributed call, up to this size."""
    visible_timeout_s: float
    """disk: how long the rollout node waits for the trainer's file to show up complete on its side."""
    join_timeout_s: float
    """distributed: how long the process group may take to form."""
    num_engine_ranks: int
    """distributed: the engines' ranks in the process group (engines x ranks per engine)."""
    ranks_per_engine: int
    engines_on_gpus: bool
    engines_check_buckets: bool = True
    """distributed: whether the engines check each bucket's MAC (the embedded engine's server does; SGLang's route
    has no field for one), and so whether trainer rank 0 makes them."""


class PolicyWeights(Protocol):
    """What a sender reads the new policy from: the trainer backend on rank 0."""

    def hf_state(self) -> dict[str, torch.Tensor]: ...

    def hf_buckets(self) -> tuple[list[Bucket], Iterator[dict[str, torch.Tensor]]]:
        """The bucket plan, and each bucket's tensors in turn (a sharded policy: gathered one bucket at a time). A
        bucket's tensors may be reused for the third bucket after it (Megatron's buffers): a reader holds at most the
        two before the one it asks for."""

    def hf_on_gpu(self) -> bool: ...


class EngineGroup(Protocol):
    """What a receiver drives: every engine of the rollout node at once (rollout/engines/supervisor.py)."""

    def load_weights(self, path: str, policy_version: int) -> None: ...

    def weights_in_place(self, path: str,
                         policy_version: int) -> AbstractContextManager[list[dict[str, torch.Tensor]] | None]:
        """Where every engine runs in this process: their state dicts, to be filled from the file at ``path`` in one
        read (disk.py ``copy_checked``); they serve ``policy_version`` once the block ends without an error. None
        where they do not: each engine then reads the file itself (``load_weights``)."""

    def join_weight_group(self, group: WeightGroup, ranks_per_engine: int) -> None: ...

    def rejoin_weight_group(self, group: WeightGroup, ranks_per_engine: int, policy_version: int | None = None
                            ) -> None:
        """The engines in service and the replacements of failed ones join a new group (distributed.py), to receive
        the next policy; mid-step, with ``policy_version``: the replacements alone, to receive it again."""

    def next_group_size(self) -> int | None:
        """Before a policy is broadcast: how many engines a new weight-update group needs (those in service and the
        replacements waiting), having checked every engine's server; None if the current group serves."""

    def load_weights_distributed(self, buckets: list[Bucket], policy_version: int,
                                 macs: Callable[[int], BucketMac] | None) -> bool:
        """Every engine receives the broadcast ``buckets``, each with its MAC (``macs(i)``: distributed.py; None
        where the engines cannot check one). False when an engine died during the broadcast: it is replaced, the
        others left the group, and the policy must go again to a new one (``next_group_size``)."""


class WeightSender(Protocol):
    """Trainer rank 0's side: ``open`` once before the first step, ``publish`` after each step's last optimizer
    step, ``retire`` once no engine can still need a policy. (distributed.py's also has ``send_again``: the current
    policy again mid-step, to the replacements of the last engines in service.)"""

    def open(self) -> None: ...

    def publish(self, version: int, *, serves: bool) -> str:
        """Send policy ``version``; ``serves`` is False for the last one, which only goes to the final checkpoint.
        Returns once the policy is on its way (a broadcast returns once the engines have received it), with its
        weights digest (digest.py), taken from what was sent: the file, or the broadcast tensors."""

    def retire(self, version: int) -> None: ...


class WeightReceiver(Protocol):
    """The rollout node's side: ``open`` once before the first step, ``prepare`` then ``load`` between steps.
    (distributed.py's also has ``send_again``, for the rollout node that lost its last engine in service mid-step.)"""

    def open(self) -> None: ...

    def prepare(self, version: int) -> None:
        """Before the trainer's record of policy ``version`` is awaited: what must happen first (distributed.py: the
        engines join a re-formed group, without which the trainer does not send)."""

    def load(self, record: dict, version: int) -> None:
        """Make every engine serve policy ``version``, described by the trainer's sealed ``record``."""


def _module(way: WeightSync):
    return importlib.import_module(f"{__name__}.{way.value}")


def sender(settings: WeightSyncSettings, *, transport: Transport, run_dir: Path,
           policy: PolicyWeights) -> WeightSender:
    return _module(settings.way).Sender(settings, transport=transport, run_dir=run_dir, policy=policy)


def receiver(settings: WeightSyncSettings, *, transport: Transport, run_dir: Path, engines: EngineGroup,
             check: Callable[[str], None]) -> WeightReceiver:
    """``check(what)`` runs while the receiver waits, and raises when the run should stop (a lost peer)."""
    return _module(settings.way).Receiver(settings, transport=transport, run_dir=run_dir, engines=engines,
                                          check=check)


def weights_record_key(transport: Transport, version: int) -> str:
    return transport.key("weights", f"policy_version={version}")
