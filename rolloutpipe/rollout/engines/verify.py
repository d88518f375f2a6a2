"""Draft verification for the embedded engine (rollout.speculative, issue 32), and the KV row surgery it needs.

A request may arrive with ``draft_ids``: tokens drafted for it under the previous policy with its own seed
(rolloutpipe/rollout/drafts.py). The engine prefills prompt + draft in one forward pass and samples, with the
request's seed, at every draft position and one past it: at draft position j the noise position is
``len(prompt) + j - 1``, the one a plain decode gives output token j (sampler.py). Tokens are taken in order while
they equal the draft; the first that differs (or the one past the draft) is the policy's own next token, and decoding
goes on from there. So every output token is the one the serving policy samples at its position with the request's
seed: a draft decides only how many tokens one forward pass yields, never which.

The logits of a draft position are the bits a decode step gives, in every dtype, when the engine is batch invariant
(what rollout.speculative runs): the prefill's attention is split as the run without the draft computes it
(row_attention.py ``row_decode_queries``: the prompt's queries over the prompt alone, as its own prefill, then each
draft position as the decode step that feeds its token, one query over the keys up to its own), and the rest of the
model is per row. One causal attention over prompt + draft instead gave other bits: other log-probs in float32, other
tokens in bfloat16 (tests/unit/test_drafts.py). The padded engine verifies with one attention call, equal to
decoding up to rounding (float64); the config refuses speculation with it.
"""

from __future__ import annotations

import torch

from rolloutpipe.rollout.engines.sampler import sample_tokens
from rolloutpipe.types import GenerationRequest

KV = list[tuple[torch.Tensor, torch.Tensor]]


def sample_draft_positions(logits: torch.Tensor, requests: list[GenerationRequest], drafts: list[list[int]],
                           num_outputs: list[int]) -> list[list[tuple[int, float]]]:
    """Row r's samples at its ``len(drafts[r])`` draft positions and one past them: [(token, logprob)] each.

    logits [B, K, V]: the last K positions of each row (its fed tokens end at column K - 1). ``num_outputs[r]``: the
    row's output tokens before these (0 after a prefill). A row without a draft gets its one next token.
    """
    rows, columns, positions = [], [], []
    for r, (request, draft, done) in enumerate(zip(requests, drafts, num_outputs)):
        num = len(draft) + 1
        rows += [r] * num
        columns += range(logits.shape[1] - num, logits.shape[1])
        positions += range(len(request.input_ids) + done - 1, len(request.input_ids) + done - 1 + num)
    picked = logits[torch.tensor(rows), torch.tensor(columns)]
    index = torch.tensor(rows)
    tokens, logprobs = sample_tokens(
        picked,
        torch.tensor([r.temperature for r in requests], dtype=torch.float64)[index],
        torch.tensor([r.top_p for r in requests], dtype=torch.float64)[index],
        torch.tensor([r.sampling_seed for r in requests], dtype=torch.int64)[index],
        torch.tensor(positions),
    )
    out: list[list[tuple[int, float]]] = [[] for _ in requests]
    for r, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
        out[r].append((token, logprob))
    return out


def pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, n, D] -> [B, H, width, D] with zero columns in front (masked out, so only finiteness matters)."""
    missing = width - t.shape[2]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3]), t], dim=2)


def drop_last_columns(kv: KV, cuts: list[int]) -> KV:
    """Row r loses its last ``cuts[r]`` columns (draft tokens verification rejected); what remains of it moves right
    by as many, so every row's keys still end at the last column, behind zero padding."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        width = t.shape[2]
        return torch.stack([row if c == 0 else pad_left(row[None, :, : width - c], width)[0]
                            for row, c in zip(t, cuts)])

    return [(cut(k), cut(v)) for k, v in kv]
