"""The shared fakes of the tests, one per seam: ``FakeEngine`` stands in for an engine
(rolloutpipe/rollout/engines/base.py, ``Engine``) behind Admission, the supervisor and Evaluation, ``FakeSpans`` for
the span recorder. ``Rollout`` wires them into a rollout node in miniature; ``group_requests`` and ``make_group``
make a group's requests and a complete group."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from rolloutpipe.rollout.admission import Admission, AdmissionPolicy
from rolloutpipe.rollout.engines.supervisor import EngineSupervisor
from rolloutpipe.types import CompleteGroup, FinishReason, GenerationResult, Sample


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
        """(path, version) loaded from disk, or (group name, version) received by broadcast."""
        self.groups: list[tuple[str, int]] = []
        """Weight-update groups joined: (group name, rank)."""
        self.shut_down = False
        self.server_gone = False
        """Its server died with nothing in flight: only ``probe`` finds out."""
        self.receive: Callable[[], None] | None = None
        """What ``update_weights_from_distributed`` does first (a test's: raise, or wait for ``left``)."""
        self.left: list[str] = []
        """Weight-update groups given up (``leave_weight_group``)."""

    def submit(self, request) -> None:
        self.submitted.append(request)
        self.running.append(request.request_id if self.running_ids else request)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def num_in_flight(self) -> int:
        return len(self.running)

    def update_weights_from_disk(self, path: str, policy_version: int) -> None:
        self.weights = (path, policy_version)

    def init_weights_update_group(self, group, rank_offset: int) -> None:
        self.groups.append((group.group_name, rank_offset))

    def probe(self) -> None:
        if self.server_gone and self.error is None:
            self.error = RuntimeError(f"engine {self.name}: its server did not answer /health")

    def update_weights_from_distributed(self, buckets, group_name: str, policy_version: int, macs) -> None:
        if self.receive is not None:
            self.receive()
        self.weights = (group_name, policy_version)

    def leave_weight_group(self, group_name: str) -> None:
        self.left.append(group_name)

    def shutdown(self) -> None:
        self.shut_down = True

    def finish(self, request_id: str) -> None:
        request = next(r for r in reversed(self.submitted) if r.request_id == request_id)
        self.running.remove(request_id if self.running_ids else request)
        self.on_result(GenerationResult(
            request_id=request_id, output_ids=[request.sampling_seed], output_logprobs=[0.0],
            finish_reason=FinishReason.STOP, policy_version=0, submitted_s=0.0, started_s=0.0, finished_s=0.0,
            engine=self.name))


class FakeSpans:
    def __init__(self) -> None:
        self.spans = []

    def add(self, name, **attrs) -> None:
        self.spans.append((name, attrs))


class Rollout:
    """A rollout node in miniature: engines, Admission, the supervisor, and the results that counted."""

    def __init__(self, *, num_engines: int, policy: AdmissionPolicy = AdmissionPolicy.fifo, concurrency: int = 8,
                 max_failures: int = 3, request_timeout_s: float | None = None) -> None:
        self.counted: list[GenerationResult] = []
        self.engines = [FakeEngine(f"engine{i}", self.on_result) for i in range(num_engines)]
        self.restarted: list[FakeEngine] = []
        self.spans = FakeSpans()
        self.admission = Admission(policy=policy, engines=self.engines, concurrency=concurrency)
        self.supervisor = EngineSupervisor(
            engines=self.engines, restart=self.restart, where_to_look=lambda e: f"/logs/{e.name}.log",
            max_failures=max_failures, request_timeout_s=request_timeout_s, spans=self.spans)
        self.supervisor.begin_step(0, self.admission)

    def restart(self, slot: int, name: str, failed) -> FakeEngine:
        engine = FakeEngine(name, self.on_result)
        self.restarted.append(engine)
        return engine

    def on_result(self, result: GenerationResult) -> None:  # what RolloutNode.on_result does
        if self.admission.finished(result.request_id, result.engine):
            self.supervisor.on_result(result)
            self.counted.append(result)


def group_requests(group: int, n: int = 4):
    return [SimpleNamespace(request_id=f"step=0/group={group}/sample={s}", sampling_seed=100 * group + s)
            for s in range(n)]


def make_group(step=0, group=3, num_samples=4, response_len=5) -> CompleteGroup:
    samples = [
        Sample(group=group, index=i, response_ids=list(range(i, i + response_len)),
               logprobs=[-0.5 * (i + 1)] * response_len, response_text=f"text {i}",
               finish_reason=FinishReason.STOP if i % 2 else FinishReason.LENGTH, reward=float(i % 2),
               policy_version=step, reward_error=None if i else "ValueError: boom")
        for i in range(num_samples)
    ]
    return CompleteGroup(step=step, group=group, policy_version=step, prompt_index=42, prompt_ids=[7, 8, 9],
                         samples=samples, advantages=[0.5, -0.5, 0.5, -0.5][:num_samples], completed_s=123.5)
