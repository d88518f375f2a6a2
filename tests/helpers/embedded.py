"""The embedded engine in this process on the tiny model: its requests, a result collector, and whole runs."""

from __future__ import annotations

import threading

import torch

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.rollout.engines.embedded import EmbeddedEngine
from rolloutpipe.types import GenerationRequest, GenerationResult

VOCAB_SIZE = len(build_tiny_tokenizer())


class Results:
    """Collects results from the engine thread; fails the test if one request is reported twice."""

    def __init__(self, on_result=None) -> None:
        self.by_id: dict[str, GenerationResult] = {}
        self.order: list[str] = []
        self._changed = threading.Condition()
        self._then = on_result

    def __call__(self, result: GenerationResult) -> None:
        with self._changed:
            assert result.request_id not in self.by_id, f"{result.request_id} reported twice"
            self.by_id[result.request_id] = result
            self.order.append(result.request_id)
            self._changed.notify_all()
        if self._then is not None:
            self._then(result)

    def wait_for(self, n: int, timeout_s: float = 60.0) -> dict[str, GenerationResult]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.by_id) >= n, timeout_s), f"{len(self.by_id)}/{n} results"
        return self.by_id


def tiny_model(dtype: DType = DType.float32, init_seed: int = 0) -> torch.nn.Module:
    return load_model(ModelConfig(dtype=dtype, init_seed=init_seed), vocab_size=VOCAB_SIZE)


def request(i: int, *, prompt_len: int = 6, max_new_tokens: int = 16, temperature: float = 1.0, **kw):
    prompt = [4 + (i * 7 + j * 3) % (VOCAB_SIZE - 4) for j in range(prompt_len)]
    fields = dict(
        request_id=f"step=0/group={i}/sample=0",
        input_ids=prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        sampling_seed=1000 + i,
        stop_token_ids=[],
    )
    return GenerationRequest(**(fields | kw))


def run_all(model, requests, *, concurrency: int, on_result=None, policy_version: int = 0, ignore_eos: bool = False,
            batch_invariant: bool = True, timeout_s: float = 60.0) -> dict[str, GenerationResult]:
    """With ``ignore_eos`` every request runs to max_new_tokens (the tiny model samples its EOS id about 2% of the
    time, so a long request would otherwise end wherever its seed happens to pick it)."""
    results = Results(on_result)
    engine = EmbeddedEngine(name="test", model=model, concurrency=concurrency, on_result=results,
                            policy_version=policy_version, batch_invariant=batch_invariant)
    try:
        for r in requests:
            engine.submit(r, ignore_eos=ignore_eos)
        return results.wait_for(len(requests), timeout_s)
    finally:
        engine.shutdown()
