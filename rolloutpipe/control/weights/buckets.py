"""The distributed way's wire shapes: the weight-update process group's address and the bucket plan.

Trainer rank 0 publishes both (distributed.py); the engines' HTTP side (rollout/engines: SGLang's API and the
embedded server) reads them, so they live apart from the torch.distributed code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GROUP_NAME = "rolloutpipe_weights"


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
