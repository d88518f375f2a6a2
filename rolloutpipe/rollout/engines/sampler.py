"""The seeded sampler: SGLang 0.5.23's deterministic sampler, reproduced in torch on any device.

What it reproduces: ``multinomial_with_seed`` in ``sglang/srt/layers/sampler.py`` as SGLang reaches it with a
per-request ``sampling_seed`` (servers started with ``--enable-deterministic-inference``, which selects the pytorch
sampling backend and fills ``SamplingBatchInfo.sampling_seed``), and what ``Sampler.forward`` does before it:

1. ``logits / temperature``, the temperature a float32 (``SamplingBatchInfo.temperatures``), in the logits' dtype;
   ``probs = torch.softmax(...)``; the sampling key is ``torch.log(probs)``, in that dtype (float32 logits on SGLang).
2. Noise: ``murmur_hash32(seed, position, column)`` (MurmurHash3, 32 bit, of the 16 bytes seed low, seed high,
   position, column; ``sglang/kernels/ops/sampling/murmur_hash.py``), ``u = hash / (2**32 - 1)`` in float64, Gumbel
   noise ``-log(-log(u))`` with ``log(u)`` clamped to ``[finfo.min, -2**-32]``; the token is
   ``argmax(key + noise)``, the first column on a tie. The column is the token id.
3. The position is that of the last token fed: ``len(prompt) + len(output so far) - 1`` (``ModelRunner.sample``
   passes ``forward_batch.positions`` when decoding and ``seq_lens - 1`` after a prefill).

Greedy rows (temperature 0) take ``argmax(logits)``, as SGLang does for temperature below 1e-6 (it turns them into
top_k = 1).

Where it departs from SGLang on purpose: top-p and top-k. Their masks are SGLang's (sort by probability; a token is
dropped when its rank is >= top_k or the mass ranked before it exceeds top_p), but a dropped token's key becomes
-inf in place, so the noise stays keyed by token id. SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch`` keys it
by rank in the sorted order instead: a tiny update that reorders near-tied tokens then changes the pick, and a
draft made under policy k could not be verified under policy k+1 (issue 32). So the two agree token for token when
every request of SGLang's batch has top_p = 1, top_k = -1 (always sent) and temperature > 0: one row with top_p < 1
or temperature 0 sends SGLang's whole batch down its rank-keyed path (``need_top_p_sampling`` and
``need_top_k_sampling`` are batch-wide).

Log-probs are not SGLang's float32 ones: each row reports log softmax(logits / temperature) of its token in float64
(temperature 1 when greedy), over the full vocabulary and before any top-p / top-k mask, as the trainer recomputes it.
"""

from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
_UINT32_MAX = float(MASK32)  # torch.iinfo(torch.uint32).max, SGLang's divisor


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK32


def _scramble(k: torch.Tensor) -> torch.Tensor:
    """The key half of MurmurHash3's block mix. In int64 every product is taken mod 2**64 and masked to its low 32
    bits, which is uint32 arithmetic."""
    k = _rotl32((k * 0xCC9E2D51) & MASK32, 15)
    return (k * 0x1B873593) & MASK32


def _mix(h: torch.Tensor, scrambled: torch.Tensor) -> torch.Tensor:
    h = _rotl32(h ^ scrambled, 13)
    return (h * 5 + 0xE6546B64) & MASK32


@functools.lru_cache(maxsize=4)
def _scrambled_columns(num_columns: int) -> torch.Tensor:
    """The column block of every token id, scrambled once per vocabulary size: [1, V] int64."""
    return _scramble(torch.arange(num_columns, dtype=torch.int64))[None, :]


def murmur_hash32(seeds: torch.Tensor, positions: torch.Tensor, num_columns: int) -> torch.Tensor:
    """SGLang's ``murmur_hash32(seed, positions, arange(num_columns))``: [B, V] int64 holding values in [0, 2**32).

    seeds [B] int64 (any sign: their two's complement bits, as SGLang's ``seed.to(torch.uint64)``), positions [B].
    """
    seeds = seeds.to(torch.int64)[:, None]
    h = _mix(torch.zeros_like(seeds), _scramble(seeds & MASK32))
    h = _mix(h, _scramble((seeds >> 32) & MASK32))
    h = _mix(h, _scramble(positions.to(torch.int64)[:, None] & MASK32))  # [B, 1]: all but the column block
    # The column block and the finalizer on [B, V], in place: this is where the time goes.
    x = _scrambled_columns(num_columns).to(seeds.device) ^ h
    x = ((x << 13) & MASK32).bitwise_or_(x >> 19)
    x.mul_(5).add_(0xE6546B64).bitwise_and_(MASK32).bitwise_xor_(16)
    x.bitwise_xor_(x >> 16).mul_(0x85EBCA6B).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 13).mul_(0xC2B2AE35).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, num_columns: int) -> torch.Tensor:
    """Gumbel noise [B, V] float64, one value per (row's seed, row's position, token id), as multinomial_with_seed."""
    u = murmur_hash32(seeds, positions, num_columns).to(torch.float64) / _UINT32_MAX
    return u.log_().clamp_(min=torch.finfo(torch.float64).min, max=-(2.0**-32)).neg_().log_().neg_()


def nucleus_mask(probs: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor | None) -> torch.Tensor:
    """[B, V] bool, True for the tokens SGLang's top-k / top-p filter keeps, in token-id order.

    probs [B, V]; top_ps [B]; top_ks [B] int (None: the whole vocabulary). The top token always stays.
    """
    probs_sort, order = probs.sort(dim=-1, descending=True)
    mass_before = probs_sort.cumsum(-1) - probs_sort
    keep_sorted = mass_before <= top_ps.to(probs.dtype)[:, None]
    if top_ks is not None:
        keep_sorted &= torch.arange(probs.shape[-1], device=probs.device)[None, :] < top_ks[:, None]
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_ks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, and its log-probability under softmax(logits / temperature) (module docstring).

    logits [B, V] (float32 as SGLang's, or the model's dtype); temperatures, top_ps [B]; seeds, positions [B] int64;
    top_ks [B] int or None (no top-k). Returns tokens [B] int64 and logprobs [B] float64. Rows never interact, so a
    row's token does not depend on its batch-mates.
    """
    greedy = temperatures == 0
    temperatures_32 = torch.where(greedy, 1.0, temperatures).to(torch.float32)
    probs = torch.softmax(logits / temperatures_32[:, None], dim=-1)
    key = torch.log(probs)
    if bool((top_ps < 1).any()) or top_ks is not None:
        key = key.masked_fill(~nucleus_mask(probs, top_ps, top_ks), -torch.inf)
    noisy = gumbel_noise(seeds, positions, logits.shape[-1]).add_(key.to(torch.float64))
    tokens = torch.where(greedy, logits.argmax(-1), noisy.argmax(-1))
    scaled = logits.double() / torch.where(greedy, 1.0, temperatures.double())[:, None]
    # The chosen token's log_softmax, without a [B, V] log_softmax (on a small CPU batch it costs more than the rest).
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - scaled.logsumexp(-1)
