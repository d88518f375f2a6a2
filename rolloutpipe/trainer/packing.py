"""Micro-batches without padding (``trainer.pack_sequences``): a micro-batch's sequences as one row, each attending
only to itself.

A right-padded micro-batch computes every layer over rows x longest token slots; on the GPU check's batch a third of
them were padding (issue 43). Packed, the row holds each sequence's prompt and response tokens back to back, the
positions restart at 0 for each (RoPE sees what it sees padded), and attention runs once per sequence on its own
slice: PyTorch's SDPA, purely causal, its flash kernel on a GPU (no [T, T] mask, grouped key/value heads as they
are), so no token attends across a boundary. HF's decoder takes the packed row through an attention function
registered under ``PACKED_ATTENTION``; a call without sequence bounds is its usual SDPA call.

The token a sequence's last position predicts is the next sequence's first: the response mask is 0 there, as it is
at a padded row's last token, so nothing is trained on it. The response tokens come out in the same order as from
the padded rows (sequence by sequence, position by position), so the log-probs go back into the [B, L-1] layout the
loss reads with one masked scatter: the loss, its sums and the update are the padded micro-batch's, up to the order
of floating-point additions inside the matmuls (tests/unit/test_packing.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

PACKED_ATTENTION = "rolloutpipe_packed"
"""The name of the packed attention function in HF's AttentionInterface (``use_packed_attention``)."""


@dataclass(frozen=True, slots=True)
class PackedRow:
    """A padded micro-batch's sequences back to back (sequences without a response token left out: nothing of them
    is trained)."""

    input_ids: torch.Tensor
    """[1, N] the tokens of every sequence."""
    position_ids: torch.Tensor
    """[1, N] each token's position in its own sequence."""
    response: torch.Tensor
    """[1, N-1] bool: position j predicts a response token (j + 1 in the same sequence)."""
    bounds: list[int]
    """Where each sequence starts in the row, and N at the end."""


def packed_row(input_ids: torch.Tensor, mask: torch.Tensor) -> PackedRow:
    """``input_ids`` [B, L] right-padded and the response mask [B, L-1] of GRPOTrainer's ``pack``: a row ends two
    past its last response position (position j predicts token j + 1)."""
    has_response = (mask > 0).any(dim=1)
    last = (mask.shape[1] - 1) - (mask > 0).flip(dims=[1]).int().argmax(dim=1)
    lengths = [int(n) for n in (last + 2)[has_response].tolist()]  # (one device-to-host copy per micro-batch)
    rows = has_response.nonzero().flatten().tolist()
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    ids = torch.cat([input_ids[b, :n] for b, n in zip(rows, lengths)])
    positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])
    padded_mask = torch.nn.functional.pad(mask, (0, 1))  # [B, L]: a full-length row's last position predicts nothing
    response = torch.cat([padded_mask[b, :n] for b, n in zip(rows, lengths)])[:-1] > 0
    return PackedRow(input_ids=ids[None], position_ids=positions[None], response=response[None], bounds=bounds)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Give ``model`` (an HF model) the packed attention function; its calls without sequence bounds stay SDPA's."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    model.config._attn_implementation = PACKED_ATTENTION


def _packed_attention(module, query, key, value, attention_mask, *, dropout: float = 0.0, scaling=None,
                      rp_sequence_bounds: list[int] | None = None, **kwargs):
    """HF's attention interface: query [1, heads, N, head_dim], key and value [1, kv heads, N, head_dim]; returns
    [1, N, heads, head_dim]. Each sequence of ``rp_sequence_bounds`` attends causally to itself alone."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if rp_sequence_bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    parts = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], dropout_p=dropout, is_causal=True,
        scale=scaling, enable_gqa=gqa) for start, end in itertools.pairwise(rp_sequence_bounds)]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None
