"""The seeded sampler (rolloutpipe/rollout/engines/sampler.py): SGLang's hash, noise keyed by token id, the nucleus,
the distribution it samples and the log-prob it reports. The real-SGLang tier checks it against SGLang's own
``multinomial_with_seed`` (tests/sglang_real/test_sglang_real.py)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from rolloutpipe.rollout.engines.sampler import gumbel_noise, murmur_hash32, sample_tokens


def reference_murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 as published (Appleby), one 4-byte little-endian block at a time, in plain Python."""
    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * 0x1B873593) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def sample(logits, *, temperature=1.0, top_p=1.0, seeds=None, positions=None, top_k=None):
    n = logits.shape[0]
    seeds = torch.arange(n) if seeds is None else seeds
    positions = torch.zeros(n, dtype=torch.int64) if positions is None else positions
    top_ks = None if top_k is None else torch.full((n,), top_k)
    return sample_tokens(logits, torch.full((n,), float(temperature), dtype=torch.float64),
                         torch.full((n,), float(top_p), dtype=torch.float64), seeds, positions, top_ks)


def test_the_hash_is_murmur3_of_seed_position_and_token_id():
    """SGLang's murmur_hash32_kernel: MurmurHash3 (seed 0) of the 16 bytes seed (as uint64), position (uint32) and
    column, little endian. Checked against the published algorithm, negative seeds and large positions included."""
    seeds = torch.tensor([0, 7, 2**40 + 3, 2**63 - 1, -1, -(2**63)])
    positions = torch.tensor([0, 5, 77, 4095, 2**32 + 9, 123456])
    hashed = murmur_hash32(seeds, positions, 300)
    for row, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for column in (0, 1, 44, 299):
            data = struct.pack("<QII", seed % 2**64, position % 2**32, column)
            assert hashed[row, column].item() == reference_murmur3_32(data), (seed, position, column)


def test_the_noise_is_float64_gumbel_of_the_hash():
    """multinomial_with_seed's noise: -log(-log(hash / (2**32 - 1))), in float64 (float32 would be off by ~1e-8)."""
    seeds, positions = torch.tensor([3, -(2**40)]), torch.tensor([0, 9999])
    hashed, noise = murmur_hash32(seeds, positions, 45), gumbel_noise(seeds, positions, 45)
    assert noise.dtype == torch.float64
    for row in range(2):
        for column in range(45):
            expected = -math.log(-math.log(hashed[row, column].item() / (2**32 - 1)))
            assert noise[row, column].item() == pytest.approx(expected, rel=1e-13, abs=1e-13)


def test_same_seed_and_position_give_the_same_token_alone_or_in_a_batch():
    logits = torch.randn(64, 45, generator=torch.Generator().manual_seed(0))
    seeds, positions = torch.arange(64) * 1_000_003, torch.arange(64) % 7
    tokens, _ = sample(logits, seeds=seeds, positions=positions)
    again, _ = sample(logits, seeds=seeds, positions=positions)
    assert torch.equal(tokens, again)
    for row in (0, 17, 63):
        alone, _ = sample(logits[row : row + 1], seeds=seeds[row : row + 1], positions=positions[row : row + 1])
        assert alone.item() == tokens[row].item()
    # The position and the seed are both in the key: either one changed gives other tokens in many rows.
    assert (sample(logits, seeds=seeds, positions=positions + 1)[0] != tokens).sum() > 20
    assert (sample(logits, seeds=seeds + 1, positions=positions)[0] != tokens).sum() > 20


def test_noise_is_keyed_by_token_id_so_reordering_near_ties_keeps_the_winner():
    """Nudging every other token's logit by under 1e-7 reorders the near-tied tokens around the winner (what a tiny
    policy update does) but moves no key by more than that: with the noise keyed by token id the winner stays. A
    sampler keyed by probability rank (an inverse CDF over the sorted nucleus, or noise added after sorting) gives
    the winner another rank, hence other noise, and picks an unrelated token. (Permuting the others' logits would
    not tell the two apart: it keeps every rank's value.)"""
    g = torch.Generator().manual_seed(1)
    num_rows, vocab = 400, 45
    logits = torch.rand(num_rows, vocab, generator=g, dtype=torch.float64) * 1e-7
    logits[:, :5] = torch.tensor([2.0, 1.0, 0.5, 0.2, 0.1], dtype=torch.float64)  # a few clear tokens
    seeds = torch.arange(num_rows) + 11
    tokens, _ = sample(logits, seeds=seeds)
    nudged = logits + (torch.rand(num_rows, vocab, generator=g, dtype=torch.float64) - 0.5) * 1e-7
    nudged.scatter_(-1, tokens[:, None], logits.gather(-1, tokens[:, None]))  # the winner's own logit unchanged
    again, _ = sample(nudged, seeds=seeds)
    assert (tokens >= 5).sum() > 100, "the near-tied tokens must win often for this test to mean anything"
    assert torch.equal(again, tokens)


@pytest.mark.parametrize(("top_p", "top_k"), [(0.75, None), (1.0, 3), (0.9, 2)])
def test_top_p_and_top_k_keep_the_pick_in_the_nucleus_and_only_remove_competitors(top_p, top_k):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2000, 45, generator=g) * 2
    seeds, positions = torch.randint(0, 2**62, (2000,), generator=g), torch.randint(0, 512, (2000,), generator=g)
    unmasked, _ = sample(logits, seeds=seeds, positions=positions)
    masked, _ = sample(logits, top_p=top_p, top_k=top_k, seeds=seeds, positions=positions)
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    in_nucleus = (probs.cumsum(-1) - probs) <= top_p
    if top_k is not None:
        in_nucleus &= torch.arange(45) < top_k
    nucleus = torch.zeros_like(in_nucleus).scatter_(-1, order, in_nucleus)
    assert nucleus.gather(-1, masked[:, None]).all(), "a token outside the nucleus was picked"
    # Masking drops competitors and nothing else: where the unmasked pick is in the nucleus, it is the masked pick.
    kept = nucleus.gather(-1, unmasked[:, None]).squeeze(-1)
    assert kept.sum() > 1000 and (~kept).sum() > 100
    assert torch.equal(masked[kept], unmasked[kept])


def test_the_nucleus_is_sglangs_the_top_token_always_stays():
    """probs 0.5, 0.3, 0.15, 0.05 at top_p 0.75: mass ranked before token 1 is 0.5 <= 0.75, before token 2 0.8."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 400, dtype=torch.float64))
    tokens, _ = sample(logits, top_p=0.75)
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = sample(logits, top_p=1e-9)
    assert set(tokens.tolist()) == {0}


@pytest.mark.parametrize(("temperature", "top_p", "vary"), [(1.0, 1.0, "seed"), (0.7, 1.0, "position"),
                                                            (1.3, 0.8, "seed")])
def test_frequencies_match_the_tempered_nucleus_distribution(temperature, top_p, vary):
    """20000 draws of one distribution, over seeds or over positions of one seed: every token's frequency is within
    5 standard errors of softmax(logits / temperature) renormalised over the nucleus."""
    num_draws = 20000
    logits = torch.tensor([1.5, 1.0, 0.9, 0.2, -0.5, -1.0, -3.0, -8.0], dtype=torch.float64)
    index = torch.arange(num_draws)
    seeds, positions = (index, torch.full((num_draws,), 9)) if vary == "seed" else (torch.full((num_draws,), 9), index)
    tokens, _ = sample(logits.expand(num_draws, -1), temperature=temperature, top_p=top_p, seeds=seeds,
                       positions=positions)
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[order[(sorted_probs.cumsum(0) - sorted_probs) <= top_p]] = True
    expected = torch.where(keep, probs, 0.0)
    expected = expected / expected.sum()
    freq = torch.bincount(tokens, minlength=8).double() / num_draws
    bound = 5 * torch.sqrt(expected * (1 - expected) / num_draws) + 1e-12
    assert ((freq - expected).abs() <= bound).all(), (freq.tolist(), expected.tolist())
    assert (freq[~keep] == 0).all()


def test_the_reported_logprob_is_the_tempered_log_softmax_before_any_mask():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 45, generator=g)
    temperatures = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.0, 0.5], dtype=torch.float64)
    top_ps = torch.tensor([1.0, 0.8, 1.0, 0.5, 0.3, 1.0], dtype=torch.float64)
    tokens, logprobs = sample_tokens(logits, temperatures, top_ps, torch.arange(6), torch.arange(6))
    for row in range(6):
        temperature = temperatures[row].item() or 1.0
        expected = (logits[row].double() / temperature).log_softmax(-1)[tokens[row]].item()
        assert logprobs[row].item() == pytest.approx(expected, abs=1e-12)
        if temperatures[row] == 0:
            assert tokens[row].item() == logits[row].argmax().item()
    assert logprobs.dtype == torch.float64 and tokens.dtype == torch.int64
    assert math.isfinite(logprobs.sum().item())
