"""Batch-invariant forward passes for the embedded engine: a row's logits do not depend on its batch-mates.

Measured on CPU torch 2.13 (bench/batch_invariance.py prints the check), what made a request's logits depend on the
batch it shared, at rounding level in float32 and bfloat16:

- **Attention over padded columns.** The engine's cache is left padded, so a row's real keys sit at a
  batch-dependent offset; torch's CPU flash-attention kernel sums exp(scores) in vector lanes with a scalar tail and
  splits keys into 512-column blocks, so the same keys at another offset (or with another width) sum in another
  order. Fix: ``row_attention_forward`` runs scaled_dot_product_attention once per row over that row's own keys,
  unpadded: exactly the call a request running alone makes.
- **Matmuls with another number of rows.** How MKL's GEMM rounds a row depends on how many rows the call has, and
  on which CPU: on MKL's AVX2 path (Intel; a Sapphire Rapids VM, 2026-12-05) rows in full blocks of 4 agreed at every
  multiple of 4 rows, the 1 to 3 left over did not (M = 1 is a gemv); on an AMD EPYC (Zen 4, 2026-12-06), where MKL
  runs the package's ``AVX2,STRICT`` as ``AUTO,STRICT`` (rolloutpipe/__init__.py), a float64 row of a 4-row product
  differed from the same row of a 32-row one, and under ``COMPATIBLE`` a float32 row of 4 rows from the same row of
  8. Padding batches to a multiple of 4 rows, as this engine did, held on the first CPU only. Fix: every linear
  layer of the forward runs its rows in calls of exactly ``LINEAR_ROWS`` rows, the last call topped up with zero rows
  (``row_blocks``), so every row takes the same call shape whatever the batch: a row gave the same bits at every
  batch size and position measured, in both MKL settings, for float32 and float64 and calls of 4, 8, 16 and 32 rows
  (M 1 to 100). bfloat16 matmuls (oneDNN) agreed at every M and row already.

Everything else in the model (embeddings, RMSNorm, RoPE, MLP activations, the seeded sampler) is per row already.

Cost: one attention call per row and layer instead of one per layer, and a linear layer's rows in calls of 16.
bench/batch_invariance.py (tiny model, 2 threads, 64 requests x 64 tokens, AMD EPYC, 2026-12-06, medians of 3)
measured invariant / padded throughput 0.76 and 0.51 at concurrency 8 and 32 in float32 (0.75 and 0.59 in float64);
the 4-row padding it replaces gave 0.96 and 0.63 there (0.91 and 0.68), but not the same bits on that CPU. One padded
attention call per layer over keys gathered left-aligned into 64-column buckets was also invariant (the flash
kernel's sums do not change with trailing masked columns) and no cheaper within the noise, so the per-row call,
invariant by construction, stayed.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

ROW_ATTENTION = "rolloutpipe_row_attention"
"""The transformers attention implementation name the engine sets on its model when batch invariant."""

LINEAR_ROWS = 16
"""Rows per BLAS call of a linear layer in the engine's forward (``row_blocks``): the one call shape every row takes."""


def row_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          row_key_lengths: list[int] | None = None, row_decode_queries: list[int] | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """Attention row by row when the engine passes ``row_key_lengths``, else transformers' sdpa unchanged.

    query [B, H, q, D]; key, value [B, H_kv, W, D], left padded: row r's keys are its last ``n = row_key_lengths[r]``
    columns (0: a dummy row). Decoding, q is 1; prefilling, q is W and the row's queries are its last n (causal).
    ``row_decode_queries[r]`` (prefilling a draft: verify.py): the row's last that many queries are each computed as
    a decode step computes its one query, over the keys up to its own, and the others as the prefill of them alone
    would: the same calls, so the same bits, as the run without the draft. Padding queries get zeros. Returns
    [B, q, H, D], as transformers' attention functions do.
    """
    if row_key_lengths is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = query.new_zeros(query.shape)
    q_len, width = query.shape[2], key.shape[2]

    def attend(first_query: int, last_query: int, last_key: int) -> None:
        """Row ``row``'s queries [first_query, last_query) over its keys up to column ``last_key`` (exclusive)."""
        out[row:row + 1, :, first_query:last_query] = F.scaled_dot_product_attention(
            query[row:row + 1, :, first_query:last_query], key[row:row + 1, :, width - n:last_key],
            value[row:row + 1, :, width - n:last_key], is_causal=last_query - first_query > 1, scale=scaling,
            enable_gqa=True)

    for row, n in enumerate(row_key_lengths):
        if not n:
            continue
        num_queries = min(q_len, n)
        singles = row_decode_queries[row] if row_decode_queries is not None else 0
        if num_queries > singles:  # (prefilling a draft: the prompt's queries, as its prefill alone has them)
            attend(q_len - num_queries, q_len - singles, width - singles)
        for i in range(singles, 0, -1):  # each draft position as the decode step that feeds its token
            attend(q_len - i, q_len - i + 1, width - i + 1)
    return out.transpose(1, 2).contiguous(), None


def use_row_attention(model: torch.nn.Module) -> None:
    """Makes ``model`` call ``row_attention_forward``; its masks stay sdpa's, so a caller that passes no
    ``row_key_lengths`` (the trainer's recompute in a test) gets sdpa exactly as before."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ROW_ATTENTION, row_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ROW_ATTENTION, sdpa_mask)
    model.config._attn_implementation = ROW_ATTENTION
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_linear_forward, module)


_blocking = threading.local()
"""``active`` is True on a thread inside ``row_blocks()``: the engine's forward."""


@contextmanager
def row_blocks() -> Iterator[None]:
    """Inside it, on this thread, every linear layer of a model that ``use_row_attention`` set up (projections, MLP,
    LM head: all its matmuls with a reduction) computes its rows ``LINEAR_ROWS`` per call (module docstring)."""
    _blocking.active = True
    try:
        yield
    finally:
        _blocking.active = False


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``; inside ``row_blocks()``, ``LINEAR_ROWS`` rows per call, the last call's rows topped up
    with zeros: every row is computed by the same BLAS call shape, whatever the batch."""
    if not getattr(_blocking, "active", False):
        return F.linear(x, self.weight, self.bias)
    rows = x.reshape(-1, x.shape[-1])  # (a copy, freshly aligned, where x is a strided view)
    num_rows = rows.shape[0]
    if num_rows % LINEAR_ROWS:
        rows = torch.cat([rows, rows.new_zeros(-num_rows % LINEAR_ROWS, rows.shape[1])])
    out = torch.cat([F.linear(rows[i:i + LINEAR_ROWS], self.weight, self.bias)
                     for i in range(0, rows.shape[0], LINEAR_ROWS)])
    return out[:num_rows].reshape(*x.shape[:-1], out.shape[-1])
