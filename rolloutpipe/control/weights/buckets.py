"""The distributed way's wire shapes: the weight-update process group's address, the bucket plan, a bucket's flat
layout, and a bucket's MAC.

Trainer rank 0 publishes the first two (distributed.py); the engines' HTTP side (rollout/engines: SGLang's API and the
embedded server) reads them, so they live apart from the torch.distributed code. A bucket travels as one flat uint8
tensor: its tensors' bytes back to back in the plan's order, no padding (SGLang's ``FlattenedTensorBucket``, which
``/update_weights_from_distributed`` receives with ``load_format="flattened_bucket"``). The disk way writes its file
by the same plan. A bucket's MAC (``BucketMac``) goes to the engine with the call that receives the bucket, in the
MAC_HEADER header: the embedded engine checks it before it loads a byte; SGLang has no way to (distributed.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rolloutpipe.control.weights.mac import ChunkMac

if TYPE_CHECKING:
    import torch

GROUP_NAME = "rolloutpipe_weights"

MAC_HEADER = "X-RolloutPipe-Bucket-MAC"
"""The HTTP header of /update_weights_from_distributed that carries the bucket's ``BucketMac`` (ours, not SGLang's)."""


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

    @property
    def sizes(self) -> list[int]:
        """Each tensor's bytes."""
        import torch

        return [torch.Size(shape).numel() * getattr(torch, dtype).itemsize
                for dtype, shape in zip(self.dtypes, self.shapes, strict=True)]

    @property
    def num_bytes(self) -> int:
        return sum(self.sizes)


def plan_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors of ``state``, in its order, grouped up to ``bucket_bytes`` (a larger tensor: alone). A
    tensor whose offset in the flat bucket would not be a multiple of its element size starts a new bucket (SGLang
    refuses an unaligned one; a model in one dtype never has one)."""
    buckets: list[Bucket] = []
    size = bucket_bytes
    for name, tensor in state.items():
        num_bytes = tensor.numel() * tensor.element_size()
        if (size + num_bytes > bucket_bytes or size % tensor.element_size()) and size > 0:
            buckets.append(Bucket(names=[], dtypes=[], shapes=[]))
            size = 0
        buckets[-1].names.append(name)
        buckets[-1].dtypes.append(str(tensor.dtype).removeprefix("torch."))
        buckets[-1].shapes.append(list(tensor.shape))
        size += num_bytes
    return buckets


def pack(bucket: Bucket, state: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """``bucket``'s tensors of ``state`` copied into the uint8 ``buffer`` (at least ``bucket.num_bytes`` long, on any
    device), back to back; returns the filled part."""
    import torch

    offset = 0
    for name, size in zip(bucket.names, bucket.sizes, strict=True):
        buffer[offset:offset + size].copy_(state[name].detach().contiguous().reshape(-1).view(torch.uint8))
        offset += size
    return buffer[:offset]


def packed(bucket: Bucket, state: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """``bucket``'s bytes as one uint8 view of the memory its tensors share, where they lie back to back in one
    storage in the plan's order (the torch backend's parameters, laid out so; a gather into one buffer); else None.
    Sending the view sends the tensors' own bytes: no copy."""
    import torch

    first = state[bucket.names[0]]
    storage = first.untyped_storage()
    start = offset = first.storage_offset() * first.element_size()
    for name, size in zip(bucket.names, bucket.sizes, strict=True):
        tensor = state[name]
        if (not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != storage.data_ptr()
                or tensor.storage_offset() * tensor.element_size() != offset):
            return None
        offset += size
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (offset - start,))


BUCKETS_HELD = 3
"""Buckets a reader of ``PolicyWeights.hf_buckets`` holds at most: the broadcast's two in flight and the digest's
one behind (distributed.py). A backend that maps the buckets into reused buffers keeps this many, and one more where
the weights-ahead thread maps a bucket before it is asked for (grpo_trainer.py: the step's last update by bucket)."""


class BufferRing:
    """``count`` flat uint8 buffers on ``device`` that buckets take in turn (bucket ``index`` takes buffer
    ``index % count``), each grown to the largest bucket it has held and kept: a fresh buffer's pages would be faulted
    in on every policy (bench/weight_sync.py). A bucket's buffer is reused ``count`` buckets later. ``pinned``: host
    buffers in page-locked memory, which a copy off a GPU fills directly (pageable memory takes it through a staging
    buffer); only where CUDA is available."""

    def __init__(self, count: int, device: str = "cpu", *, pinned: bool = False) -> None:
        import torch

        self._device = device
        self._pinned = pinned and device == "cpu" and torch.cuda.is_available()
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(count)]

    def __call__(self, index: int, num_bytes: int) -> torch.Tensor:
        import torch

        slot = index % len(self._buffers)
        if self._buffers[slot].numel() < num_bytes:
            self._buffers[slot] = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one comes
            self._buffers[slot] = torch.empty(num_bytes, dtype=torch.uint8, device=self._device,
                                              pin_memory=self._pinned)
        return self._buffers[slot]


def unpack(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a packed ``bucket``: views into ``flat``, with the plan's names, dtypes and shapes."""
    import torch

    tensors, offset = {}, 0
    for name, dtype, shape, size in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.sizes, strict=True):
        tensors[name] = flat[offset:offset + size].view(getattr(torch, dtype)).reshape(shape)
        offset += size
    return tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketMac:
    """What an engine checks one bucket's bytes against (mac.py): the GMAC key of this bucket alone, which the rollout
    node derives from the attempt's key and the bucket's salt, and its chunks' tags, from trainer rank 0's sealed
    record of the bucket. The key authenticates nothing else, so handing it to the engine gives nothing away."""

    key: bytes
    tags: list[bytes]

    def header(self) -> str:
        """The MAC_HEADER value: the key and the tags in hex, ``key:tag,tag,..``."""
        return f"{self.key.hex()}:{','.join(tag.hex() for tag in self.tags)}"

    @classmethod
    def parse(cls, value: str) -> BucketMac:
        """The inverse of ``header``; ValueError if ``value`` is not one."""
        key, _, tags = value.partition(":")
        mac = cls(key=bytes.fromhex(key), tags=[bytes.fromhex(tag) for tag in tags.split(",")])
        if len(mac.key) != 32 or any(len(tag) != 16 for tag in mac.tags):
            raise ValueError("a bucket MAC is a 32-byte key and 16-byte tags")
        return mac

    def matches(self, tensors: Iterable[memoryview]) -> bool:
        """Whether ``tensors`` (the bucket's, in the plan's order, as raw bytes) are the ones the tags authenticate."""
        tags = ChunkMac(self.key).tags(tensors)
        return len(tags) == len(self.tags) and hmac.compare_digest(b"".join(tags), b"".join(self.tags))
