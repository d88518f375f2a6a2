"""The weights digest: one short hash of a policy, logged every step as ``train/weights_digest``.

Two runs whose step k logs the same digest hold bit-identical policies after step k, whatever made them: the
backend (torch, fsdp, megatron), the weight-sync way (a file or a broadcast), the number of trainer ranks, a
resume. So ``tools/report.py --first-difference`` finds the first step where two runs part.

Definition. For the policy under HF names (tied lm_head left out, as weight sync sends it), in the model's dtype:

    sha256 over the tensors in sorted name order (Python's ``sorted`` on the str names), each as
        json.dumps([name, dtype, shape]) encoded as UTF-8, then b"\\n", then the 32-byte BLAKE3 of the tensor's
        elements in row-major order as raw little-endian bytes (numel * itemsize of them)
    dtype is torch's name without ``torch.`` (``bfloat16``, ``float32``); shape is a list of ints ([] for a scalar)
    the metric is the first DIGEST_CHARS hex digits; weights_digest returns all 64

The JSON header cannot contain a newline and is followed by exactly 32 bytes, so the stream parses one way: a
name, a dtype or a shape change the digest as an element does. Dict and file header order do not. Each tensor is
hashed on its own, so a policy that arrives in buckets (a sharded one, gathered bucket by bucket) is digested as it
streams past (``Digest``), holding 32 bytes per tensor. BLAKE3 (not sha256) hashes the bytes: it runs at memory
speed on one core and spreads a large tensor over all of them (``tensor_hash``), and the disk way reuses each
tensor's hash to authenticate the file it writes (disk.py), so every byte of a policy is hashed once per side.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

if TYPE_CHECKING:
    import torch

DIGEST_CHARS = 16
"""Hex digits of ``train/weights_digest`` (64 bits: two different policies collide with probability 2^-64)."""

THREADED_BYTES = 4 << 20
"""Tensors from this size are hashed on every core (BLAKE3 splits them; smaller ones are not worth the hand-off)."""


class Digest:
    """The digest of tensors added in any order, in any number of calls."""

    def __init__(self) -> None:
        self._tensors: dict[str, bytes] = {}

    def update(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.add(name, tensor, tensor_hash(tensor_bytes(tensor)))

    def add(self, name: str, tensor: torch.Tensor, hashed: bytes) -> None:
        """``tensor`` (only its dtype and shape are read) whose bytes' ``tensor_hash`` is ``hashed``."""
        header = json.dumps([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]).encode()
        self._tensors[name] = header + b"\n" + hashed

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self._tensors):
            h.update(self._tensors[name])
        return h.hexdigest()


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The sha256 hex digest of ``tensors`` as the module docstring defines it (64 hex digits)."""
    digest = Digest()
    digest.update(tensors)
    return digest.hexdigest()


def file_weights_digest(path: Path) -> str:
    """``weights_digest`` of the tensors of the safetensors file ``path``, read one at a time by name (the file's
    header order does not matter; host memory holds one tensor)."""
    from safetensors import safe_open

    digest = Digest()
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - a safe_open handle is no dict
            digest.update({name: f.get_tensor(name)})
    return digest.hexdigest()


def short(digest: str) -> str:
    """The metric's form of a digest."""
    return digest[:DIGEST_CHARS]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements in row-major order as raw bytes, without a copy where it is a contiguous CPU tensor.
    (x86 and arm hosts are little-endian: the in-memory bytes are the defined ones.)"""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def tensor_hash(data: memoryview | bytes, *, max_threads: int = blake3.blake3.AUTO) -> bytes:
    """The 32-byte BLAKE3 of ``data``, on every core from THREADED_BYTES, or on ``max_threads`` (it releases the
    GIL meanwhile)."""
    threads = max_threads if len(data) >= THREADED_BYTES else 1
    return blake3.blake3(data, max_threads=threads).digest()


def cores_beside_one() -> int:
    """The cores this process may run on, less one: what a hash may take beside a thread that moves the bytes (on 2
    cores, a hash on both took the writer's: bench/weight_sync.py's write + MAC was 1.38 x the write, 1.14 on one)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)
