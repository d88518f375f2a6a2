"""Batch-invariant forward passes for the embedded engine: a row's logits do not depend on its batch-mates.

Measured on CPU torch 2.13 (bench/batch_invariance.py prints the check), what made a request's logits depend on the
batch it shared, at rounding level in float32 and bfloat16:

- **Attention over padded columns.** The engine's cache is left padded, so a row's real keys sit at a
  batch-dependent offset; torch's CPU flash-attention kernel sums exp(scores) in vector lanes with a scalar tail and
  splits keys into 512-column blocks, so the same keys at another offset (or with another width) sum in another
  order. Fix: ``row_attention_forward`` runs scaled_dot_product_attention once per row over that row's own keys,
  unpadded: exactly the call a request running alone makes.
- **float32 matmuls with another number of rows.** MKL's sgemm works on blocks of 4 rows; below 12 rows, the 1 to 3
  rows left over after the last full block take other kernels (M = 1 is a gemv) and round differently, while a row
  in a full block gives the same bits at every M and position measured (every row up to M = 40; M up to 1100).
  Fix: every matmul gets a multiple of ``ROW_BLOCK`` rows: a decode batch takes dummy rows (no keys, output
  discarded), a prefill is a multiple of it wide and keeps that many positions' logits. bfloat16 matmuls (oneDNN)
  agreed at every M and row. That is MKL's AVX2 path: on an AVX-512 CPU (a Sapphire Rapids VM, 2026-12-05) its
  default path takes other kernels by M (with K >= 128, a row of M = 4 differs from the same row at M >= 8), so the
  package pins MKL to the AVX2 path (``MKL_CBWR=AVX2,STRICT`` unless set: rolloutpipe/__init__.py), which gave every
  row the same bits at every multiple of 4 rows there too.

Everything else in the model (embeddings, RMSNorm, RoPE, MLP activations, the seeded sampler) is per row already.

Cost: one attention call per row and layer instead of one per layer. bench/batch_invariance.py (tiny model, one
thread, 32 requests x 48 tokens) measured invariant / padded throughput 1.03, 0.86 and 0.63 at concurrency 8, 32 and
64 in float32, and 0.92, 0.81 and 0.78 in bfloat16. One padded call per layer over keys gathered left-aligned into
64-column buckets was also invariant (the flash kernel's sums do not change with trailing masked columns) and no
cheaper within the noise (0.78 / 0.72 at 64), so the per-row call, invariant by construction, stayed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_ATTENTION = "rolloutpipe_row_attention"
"""The transformers attention implementation name the engine sets on its model when batch invariant."""

ROW_BLOCK = 4
"""Every matmul of the forward gets a multiple of this many rows: MKL's float32 row block (module docstring)."""


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


def pad_rows(kv: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Appends ``num_rows`` zero rows to every layer's keys and values [B, H_kv, W, D] (dummy decode rows)."""
    return [tuple(torch.cat([t, t.new_zeros(num_rows, *t.shape[1:])]) for t in layer) for layer in kv]
