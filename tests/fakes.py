"""The shared fakes of the pure tests, one per seam: ``FakeEngine`` stands in for an engine
(rolloutpipe/rollout/engines/base.py, ``Engine``) behind Admission, the supervisor and Evaluation."""

from __future__ import annotations

from collections.abc import Callable

from rolloutpipe.types import FinishReason, GenerationResult


class FakeEngine:
    """Holds what it is given and hands a result back only when the test calls ``finish``.

    ``submitted``: every request, in order. ``running``: those not handed back yet (a test may also take one out by
    hand); with ``running_ids`` it lists their request ids instead. ``aborted``: the ids ``abort`` was called with
    (the request stays running: the test decides what comes back). ``error``: set it to fail the engine, as its
    thread or server would. ``on_result``: where ``finish`` hands the result; output_ids is the request's sampling
    seed, so a test sees which seed a retried request kept.
    """

    def __init__(self, name: str, on_result: Callable[[GenerationResult], None] | None = None, *,
                 running_ids: bool = False) -> None:
        self.name = name
        self.on_result = on_result
        self.running_ids = running_ids
        self.error: BaseException | None = None
        self.submitted: list = []
        self.running: list = []
        self.aborted: list[str] = []
        self.weights: tuple[str, int] | None = None
        self.shut_down = False

    def submit(self, request) -> None:
        self.submitted.append(request)
        self.running.append(request.request_id if self.running_ids else request)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def num_in_flight(self) -> int:
        return len(self.running)

    def update_weights_from_disk(self, path: str, policy_version: int) -> None:
        self.weights = (path, policy_version)

    def shutdown(self) -> None:
        self.shut_down = True

    def finish(self, request_id: str) -> None:
        request = next(r for r in reversed(self.submitted) if r.request_id == request_id)
        self.running.remove(request_id if self.running_ids else request)
        self.on_result(GenerationResult(
            request_id=request_id, output_ids=[request.sampling_seed], output_logprobs=[0.0],
            finish_reason=FinishReason.STOP, policy_version=0, submitted_s=0.0, started_s=0.0, finished_s=0.0,
            engine=self.name))
