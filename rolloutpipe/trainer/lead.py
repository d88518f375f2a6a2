"""Reads that trainer rank 0 leads and the other ranks join.

Some of what rank 0 reads is spread over the ranks: FSDP's policy, and Megatron's with tensor parallelism (each
gathered bucket by bucket). Each gather is a collective, so while rank 0 reads inside ``writer_reads`` (trainer
node, pipeline.py), the other ranks wait there for its requests and join each one, until rank 0 leaves. A request is
one int64 broadcast from rank 0; ``DONE`` ends the wait. Megatron's distributed optimizer joins them too while the
step's last update is deferred: its ranks all-gather each bucket group's updated shards as rank 0's reads reach it.

A reader may stop early: trainer rank 0's broadcast breaks when an engine dies, and it closes the buckets it was
reading. The other ranks still wait in the gathers left, so rank 0 makes them too (``led``), their results dropped,
before anything else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

DONE = 0

T = TypeVar("T")


class LeadReads:
    """One backend's side of it: ``session`` is its ``writer_reads``, ``ask`` comes before each gather rank 0 makes."""

    def __init__(self, *, backend: str, device: torch.device | None) -> None:
        self.backend = backend
        """Named in the error of a read outside ``session``, e.g. ``trainer.backend=fsdp``."""
        self.device = device
        self._leading = False

    @contextlib.contextmanager
    def session(self, serve: Callable[[int], None]) -> Iterator[None]:
        """Every rank: the others call ``serve`` for each of rank 0's requests until rank 0 leaves the block (then
        their body runs, which reads nothing)."""
        if not _several_ranks():
            yield
            return
        if dist.get_rank() != 0:
            while (request := self._broadcast()) != DONE:
                serve(request)
            yield
            return
        self._leading = True
        try:
            yield
        finally:
            self._leading = False
            self._broadcast(DONE)

    def ask(self, request: int, *, reads: str) -> None:
        """Rank 0, before a gather: the other ranks join it through ``serve``."""
        if not _several_ranks():
            return
        if not self._leading:
            raise RuntimeError(f"{self.backend}: rank 0 read {reads} outside writer_reads(); the other ranks would "
                               "never join its gather")
        self._broadcast(request)

    def _broadcast(self, request: int | None = None) -> int:
        """Rank 0 sends ``request``; the others receive it."""
        message = torch.tensor([-1 if request is None else request], dtype=torch.int64, device=self.device)
        dist.broadcast(message, src=0)
        return int(message.item())


def led(gathers: Iterable[T]) -> Iterator[T]:
    """Rank 0's side of the gathers it asked for: closed before the end, it still makes the gathers left (module
    docstring). (Not ``yield from``: closing this must not close ``gathers``.)"""
    gathers = iter(gathers)
    try:
        for item in gathers:
            yield item
    finally:
        for _ in gathers:
            pass


def _several_ranks() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1
