"""The embedded engine served over HTTP: the model served, its key, requests, results, the in-process reference."""

from __future__ import annotations

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.types import GenerationRequest, GenerationResult
from tests.helpers import embedded
from tests.helpers.embedded import run_all

VOCAB_SIZE = len(build_tiny_tokenizer())
MODEL = ModelConfig(dtype=DType.float64)
CONCURRENCY = 4
API_KEY = "k" * 64


class Results(embedded.Results):
    """The in-process collector, waiting 30 s by default: a served engine's results come within it or it is broken."""

    def wait_for(self, n: int, timeout_s: float = 30.0) -> dict[str, GenerationResult]:
        return super().wait_for(n, timeout_s)


def request(i: int, *, max_new_tokens: int = 12, stop_token_ids=(), **kw) -> GenerationRequest:
    fields = {"request_id": f"step=0/group={i}/sample=0", "input_ids": [4 + (i * 7 + j * 3) % 40 for j in range(3 + i)],
              "max_new_tokens": max_new_tokens, "temperature": 0.7 + 0.1 * i, "top_p": 0.95, "sampling_seed": 77 + i,
              "stop_token_ids": list(stop_token_ids)}
    return GenerationRequest(**(fields | kw))


def in_process(model_cfg: ModelConfig, requests: list[GenerationRequest], policy_version: int = 0):
    return run_all(load_model(model_cfg, VOCAB_SIZE), requests, concurrency=CONCURRENCY,
                   policy_version=policy_version)
