"""The embedded engine served over HTTP: the model served, its key, requests, results, the in-process reference."""

from __future__ import annotations

import threading

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.types import GenerationRequest, GenerationResult
from tests.helpers.embedded import run_all

VOCAB_SIZE = len(build_tiny_tokenizer())
MODEL = ModelConfig(dtype=DType.float64)
CONCURRENCY = 4
API_KEY = "k" * 64


class Results:
    def __init__(self) -> None:
        self.by_id: dict[str, GenerationResult] = {}
        self.order: list[str] = []
        """Request ids in the order their results came."""
        self._changed = threading.Condition()

    def __call__(self, result: GenerationResult) -> None:
        with self._changed:
            assert result.request_id not in self.by_id, f"{result.request_id} reported twice"
            self.by_id[result.request_id] = result
            self.order.append(result.request_id)
            self._changed.notify_all()

    def wait_for(self, n: int, timeout_s: float = 30.0) -> dict[str, GenerationResult]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.by_id) >= n, timeout_s), f"{len(self.by_id)}/{n} results"
        return self.by_id


def request(i: int, *, max_new_tokens: int = 12, stop_token_ids=(), **kw) -> GenerationRequest:
    fields = {"request_id": f"step=0/group={i}/sample=0", "input_ids": [4 + (i * 7 + j * 3) % 40 for j in range(3 + i)],
              "max_new_tokens": max_new_tokens, "temperature": 0.7 + 0.1 * i, "top_p": 0.95, "sampling_seed": 77 + i,
              "stop_token_ids": list(stop_token_ids)}
    return GenerationRequest(**(fields | kw))


def in_process(model_cfg: ModelConfig, requests: list[GenerationRequest], policy_version: int = 0):
    return run_all(load_model(model_cfg, VOCAB_SIZE), requests, concurrency=CONCURRENCY,
                   policy_version=policy_version)
