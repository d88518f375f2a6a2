"""The memory plan's FSDP "unsharded in flight" term on bench/memory_plan_validation.py's hidden-512 case, counted by
hand. The torch profiler's live tensors at the steady micro-batch's peak differ between the FSDP and the replicated
backend by exactly these figures (64.0 MiB at 1 rank, 76.0 at 2), which the bench's RSS confirms once measured over
the RSS just before that micro-batch (glibc's heap kept of the first micro-batch's freed blocks is no tensor)."""

from __future__ import annotations

import pytest

from rolloutpipe.config import load_config
from rolloutpipe.launch.memory_plan import ModelShape, trainer_estimate

# hidden 512, 4 layers, vocabulary 32768, tied, 8 heads / 4 key-value heads of 64, intermediate 1536
SHAPE = ModelShape(hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
                   vocab_size=32768, tied_embeddings=True)
ROOT = 32768 * 512 + 512  # the tied embedding / head and the final norm
LAYER = 512 * (512 + 2 * 256) + 512 * 512 + 3 * 512 * 1536 + 2 * 512 + 2 * 64  # q, k, v, o, MLP, 2 norms, q/k norms
HEAD_GRAD = 32768 * 512 * 4
TOKENS = 2 * (32 + 512)  # two samples of 32 prompt + 512 response tokens


def in_flight(num_ranks: int, chunk: int) -> int:
    cfg = load_config({"micro_batch_size": 2, "rollout_max_response_len": 512, "data": {"max_prompt_len": 32},
                       "model": {"dtype": "float32"},
                       "trainer": {"backend": "fsdp", "num_ranks": num_ranks, "logprob_chunk_tokens": chunk}})
    estimate = trainer_estimate(cfg, SHAPE, capacity_bytes=0)
    return next(t.num_bytes for t in estimate.terms if t.name == "unsharded in flight")


def test_the_shape_splits_into_the_root_and_four_layers():
    assert SHAPE.num_params() == ROOT + 4 * LAYER == 16_777_728 + 4 * 3_146_880


@pytest.mark.parametrize("num_ranks,expected", [(1, ROOT * 4), (2, (ROOT + LAYER) * 4), (4, (ROOT + LAYER) * 4)])
def test_beside_the_log_prob_chunk_the_root_and_on_several_ranks_the_prefetched_layer(num_ranks, expected):
    """Chunk 256: the chunk's backward (256 x 32768 float32 logits + the head's 64 MiB float32 gradient sum = 96 MiB)
    outweighs the last layer's backward (its parameters, one prefetched, the head's gradient: 88 MiB; its gradient and
    reduce-scatter copy, 24 MiB, fit in its 51 MiB of freed activations), so the term is the root (64 MiB), plus the
    last layer prefetched beside the chunk where there is an all-gather (12 MiB)."""
    assert in_flight(num_ranks, 256) == expected
    assert round(expected / 2**20, 1) == (64.0 if num_ranks == 1 else 76.0)  # what the profiler measured


def test_with_a_small_chunk_the_last_layers_backward_is_the_peak():
    """Chunk 64: the chunk's backward is 8 MiB of logits + 64 MiB, less than the last layer's backward on 2 ranks
    (2 layers + the head's gradient), which then adds its excess over the chunk to the root."""
    chunk_backward = 4 * 64 * 32768 + HEAD_GRAD
    layer_backward = 2 * LAYER * 4 + HEAD_GRAD
    assert 49184 * TOKENS > LAYER * 8  # the layer's activations (49,184 B/token) outweigh its gradient + copy
    assert in_flight(2, 64) == ROOT * 4 + layer_backward - chunk_backward
    assert in_flight(1, 64) == ROOT * 4 + LAYER * 4 + HEAD_GRAD - chunk_backward  # nothing prefetched on one rank
