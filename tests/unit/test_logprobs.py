"""Chunked, vocabulary-parallel log-probs: the full log-softmax's values, entropy and gradients, without its logits."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rolloutpipe.control.env import free_port
from rolloutpipe.trainer.logprobs import VocabShard, chunked_logprobs, token_entropy, token_logprobs

TEMPERATURE = 0.7


def problem(dtype: torch.dtype, *, vocab: int = 37, padded: int = 48, tokens: int = 11, hidden: int = 8):
    """Hidden states, an output layer padded past the real vocabulary, its bias, targets and an upstream gradient."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(padded, hidden, generator=gen, dtype=torch.float64)
    b = torch.randn(padded, generator=gen, dtype=torch.float64)
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    g = torch.randn(tokens, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (h, w, b)] + [t, g]


def full_reference(h, w, b, t, g, vocab):
    logits = torch.nn.functional.linear(h, w[:vocab], b[:vocab])
    logp = token_logprobs(logits[None], t[None], TEMPERATURE)[0]
    (logp * g.to(logp.dtype)).sum().backward()
    return logp.detach(), token_entropy(logits[None], TEMPERATURE)[0], [x.grad.clone() for x in (h, w, b)]


def chunked(h, w, b, t, g, vocab, chunk):
    logp, entropy = chunked_logprobs(h, w, b, t, temperature=TEMPERATURE, chunk_tokens=chunk,
                                     shard=VocabShard(num_real=vocab))
    (logp * g.to(logp.dtype)).sum().backward()
    return logp.detach(), entropy.detach(), [x.grad.clone() for x in (h, w, b)]


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_log_probs_equal_the_full_log_softmax_in_float64(chunk):
    full = full_reference(*problem(torch.float64), vocab=37)
    ours = chunked(*problem(torch.float64), vocab=37, chunk=chunk)
    torch.testing.assert_close(ours[0], full[0], rtol=0, atol=1e-13)
    torch.testing.assert_close(ours[1], full[1], rtol=0, atol=1e-13)
    for a, b in zip(ours[2], full[2]):  # hidden, weight (its padding rows get none), bias
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    assert ours[2][1][37:].abs().max() == 0


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_entropy_has_the_full_entropys_gradient_in_float64(chunk):
    """grpo.entropy_coef backpropagates the entropy: through the chunks, its gradient is the full softmax's."""
    grads = []
    for way in ("full", "chunked"):
        h, w, b, t, g = problem(torch.float64)
        g_entropy = g.flip(0)
        if way == "full":
            logits = torch.nn.functional.linear(h, w[:37], b[:37])
            logp = token_logprobs(logits[None], t[None], TEMPERATURE)[0]
            entropy = token_entropy(logits[None], TEMPERATURE, grad=True)[0]
        else:
            logp, entropy = chunked_logprobs(h, w, b, t, temperature=TEMPERATURE, chunk_tokens=chunk,
                                             shard=VocabShard(num_real=37))
        ((logp * g).sum() + (entropy * g_entropy).sum()).backward()
        grads.append([x.grad.clone() for x in (h, w, b)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_chunked_log_probs_in_bfloat16_are_as_close_to_float64_as_the_full_ones():
    """bfloat16 logits, float32 log-softmax, gradient cast back to bfloat16 before the output layer's matmuls."""
    exact = full_reference(*problem(torch.float64), vocab=37)
    full = full_reference(*problem(torch.bfloat16), vocab=37)
    ours = chunked(*problem(torch.bfloat16), vocab=37, chunk=4)
    assert ours[0].dtype is torch.float32 and ours[2][1].dtype is torch.bfloat16
    for i in range(2):
        ours_error = (ours[i].double() - exact[i]).abs().max()
        assert ours_error <= 1.5 * (full[i].double() - exact[i]).abs().max() + 1e-6
    for a, b, e in zip(ours[2], full[2], exact[2]):
        assert (a.double() - e).abs().max() <= 1.5 * (b.double() - e).abs().max() + 1e-6


def _vocab_parallel_rank(rank: int, world: int, port: int, chunk: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        h, w, b, t, g = problem(torch.float64, vocab=37, padded=48)
        rows = 48 // world
        mine = [x.detach()[rank * rows:(rank + 1) * rows].clone().requires_grad_() for x in (w, b)]
        logp, entropy = chunked_logprobs(h, *mine, t, temperature=TEMPERATURE, chunk_tokens=chunk,
                                         shard=VocabShard(start=rank * rows, num_real=37 - rank * rows,
                                                          group=dist.group.WORLD))
        (logp * g).sum().backward()
        out[rank] = [logp.detach(), entropy.detach(), h.grad, mine[0].grad, mine[1].grad]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "tp4-with-a-padding-only-shard"])
def test_vocab_parallel_log_probs_equal_the_full_log_softmax(world):
    """Each rank holds 48 / world rows of a 37-entry vocabulary (with 4 ranks the last shard is padding only)."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_vocab_parallel_rank, args=(world, free_port(), 3, out), nprocs=world)
        results = dict(out)
    full = full_reference(*problem(torch.float64), vocab=37)
    for rank in range(world):
        logp, entropy, grad_h, grad_w, grad_b = results[rank]
        torch.testing.assert_close(logp, full[0], rtol=0, atol=1e-13)
        torch.testing.assert_close(entropy, full[1], rtol=0, atol=1e-13)
        torch.testing.assert_close(grad_h, full[2][0], rtol=0, atol=1e-13)
    grad_w = torch.cat([results[r][3] for r in range(world)])
    grad_b = torch.cat([results[r][4] for r in range(world)])
    torch.testing.assert_close(grad_w, full[2][1], rtol=0, atol=1e-13)
    torch.testing.assert_close(grad_b, full[2][2], rtol=0, atol=1e-13)
