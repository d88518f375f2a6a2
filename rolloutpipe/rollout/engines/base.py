"""The seam between the rollout manager and whatever generates tokens.

An engine takes one request at a time and hands each back, finished, to the completion callback
given at construction, from its own thread. It runs at most ``concurrency`` requests at once; the
others wait inside the engine in submission order (what an SGLang server does with its waiting
queue). Weights change only between steps, when the rollout manager calls
``update_weights_from_disk`` (or, for engines behind SGLang's HTTP API, ``update_weights_from_distributed``:
``JoinsWeightGroup``) with no request in flight.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from rolloutpipe.types import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    import torch

    from rolloutpipe.control.weights.buckets import Bucket, BucketMac, WeightGroup

OnResult = Callable[[GenerationResult], None]


class Engine(Protocol):
    name: str
    concurrency: int
    error: BaseException | None
    """Why the engine stopped serving (its thread raised, its server exited, a call failed); None while healthy.
    rolloutpipe/rollout/engines/supervisor.py then retries its requests elsewhere and replaces it."""
    request_error: BaseException | None
    """The first request the engine refused (a server's HTTP 4xx: the request or the run's configuration is wrong,
    not the engine); None while none was. The rollout node stops the run with it: any engine would refuse it too."""

    @property
    def policy_version(self) -> int: ...

    def submit(self, request: GenerationRequest) -> None:
        """Queue one request; its result reaches the completion callback exactly once."""

    def abort(self, request_id: str) -> None:
        """Finish a queued or running request now with FinishReason.ABORT (no-op if it already finished)."""

    def update_weights_from_disk(self, path: str, policy_version: int) -> None:
        """Load a safetensors file (HF parameter names) and serve ``policy_version`` from now on."""

    def num_in_flight(self) -> int:
        """Requests submitted and not yet handed back."""

    def shutdown(self) -> None:
        """Stop the engine thread; requests still queued are aborted."""


@runtime_checkable
class HoldsWeightsInProcess(Protocol):
    """An engine whose weights live in the rollout node's process (the embedded engine): the node fills them in
    place from a weights file, every such engine in one read (control/weights/disk.py ``copy_checked``)."""

    def weights_in_place(self, policy_version: int) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """The engine's state dict, to be overwritten in place; only between steps. The engine serves
        ``policy_version`` once the block ends without an error."""


class JoinsWeightGroup(Engine, Protocol):
    """An engine that receives weights from trainer rank 0's broadcasts (rolloutpipe/control/weights/distributed.py):
    ``http_client.SGLangEngine``, for SGLang servers and the embedded engine's server."""

    def init_weights_update_group(self, group: WeightGroup, rank_offset: int) -> None:
        """Join ``group`` as ranks ``rank_offset`` ..; returns once every member has joined."""

    def probe(self) -> None:
        """Ask the server whether it is still there; if not, the engine fails (``error``). Before a broadcast: a
        member that died while idle would otherwise be found by the broadcast itself."""

    def update_weights_from_distributed(self, buckets: list[Bucket], group_name: str, policy_version: int,
                                        macs: Callable[[int], BucketMac] | None) -> None:
        """Receive the broadcast ``buckets`` (every engine of the group at once) and serve ``policy_version``; bucket
        i goes with its MAC ``macs(i)`` (None: no MAC) for the engine to check before it loads the bucket."""

    def leave_weight_group(self, group_name: str) -> None:
        """Give up the broadcast in progress on ``group_name`` (another member died during it: it can never end) and
        leave the group; the pending ``update_weights_from_distributed`` then fails. Best effort: returns at once."""
