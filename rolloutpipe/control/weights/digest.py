"""The weights digest: one short hash of a policy, logged every step as ``train/weights_digest``.

Two runs whose step k logs the same digest hold bit-identical policies after step k, whatever made them: the
backend (torch, fsdp, megatron), the weight-sync way (a file or a broadcast), the number of trainer ranks, a
resume. So ``tools/report.py --first-difference`` finds the first step where two runs part.

Definition. For the policy under HF names (tied lm_head left out, as weight sync sends it), in the model's dtype:

    sha256 over the tensors in sorted name order (Python's ``sorted`` on the str names), each as
        json.dumps([name, dtype, shape]) encoded as UTF-8, then b"\\n", then the 32-byte sha256 of the tensor's
        elements in row-major order as raw little-endian bytes (numel * itemsize of them)
    dtype is torch's name without ``torch.`` (``bfloat16``, ``float32``); shape is a list of ints ([] for a scalar)
    the metric is the first DIGEST_CHARS hex digits; weights_digest returns all 64

The JSON header cannot contain a newline and is followed by exactly 32 bytes, so the stream parses one way: a
name, a dtype or a shape change the digest as an element does. Dict and file header order do not. Each tensor is
hashed on its own, so a policy that arrives in buckets (a sharded one, gathered bucket by bucket) is digested as it
streams past (``Digest``), holding 32 bytes per tensor.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DIGEST_CHARS = 16
"""Hex digits of ``train/weights_digest`` (64 bits: two different policies collide with probability 2^-64)."""


class Digest:
    """The digest of tensors added in any order, in any number of calls."""

    def __init__(self) -> None:
        self._tensors: dict[str, bytes] = {}

    def update(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self._tensors[name] = _tensor_line(name, tensor)

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


def _tensor_line(name: str, tensor: torch.Tensor) -> bytes:
    """One tensor's part of the digest: its JSON header, a newline, the sha256 of its bytes."""
    import torch

    header = json.dumps([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]).encode() + b"\n"
    # (x86 and arm hosts are little-endian: the in-memory bytes are the defined ones)
    return header + hashlib.sha256(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).digest()
