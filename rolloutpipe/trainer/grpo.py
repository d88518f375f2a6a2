"""GRPO advantages and the clipped policy-gradient loss: pure torch, no process or store.

Variant. Advantages are per group (Shao et al., 2024): A_i = r_i - mean(r), divided by the group's
unbiased standard deviation (+ 1e-6) when ``normalize_advantage_std`` (Dr. GRPO turns it off); the group's
assembler computes them (``group_advantages``, kept in rollout/admission.py with it, pure Python). There is
no KL term and no reference model (as in DAPO and Slime's GRPO default). The token loss is PPO's
clipped surrogate with separate lower and upper clip ranges (DAPO's clip-higher when they differ):
    loss_t = max(-A * ratio_t, -A * clip(ratio_t, 1 - eps_low, 1 + eps_high)),
    ratio_t = exp(logp_t - old_logp_t).

Normalisation. ``token_mean`` divides the sum of token losses over the whole training batch by the
batch's token count; ``seq_mean_token_mean`` averages tokens within each sample, then divides by the
batch's sample count. Either way the micro-batches backpropagate raw *sums* and the trainer scales
the accumulated gradient once, by ``1 / normaliser``, right before the optimizer step. The
normaliser is a property of the whole batch, so it is only needed once the batch is complete: that
is why a pipelined update (micro-batches as groups arrive, in any order) equals the synchronous one
up to the order of floating-point accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rolloutpipe.trainer.config import GRPOConfig, LossAggregation


@dataclass(kw_only=True, slots=True)
class LossSums:
    """What one micro-batch contributes to its training batch, as sums (see module docstring)."""

    loss: torch.Tensor
    """Scalar with grad: sum of the aggregated losses, to be divided by the batch normaliser."""
    num_tokens: int
    num_samples: int
    num_clipped_tokens: int
    ratio_sum: float
    entropy_sum: float = 0.0
    """Sum of the policy's entropy over the response tokens (no gradient; the trainer fills it in)."""


class BatchTotals:
    """One rank's running sums over a training batch's micro-batches, until its optimizer step.

    ``reduce`` sums them over the data-parallel ranks (one all-reduce of one float64 tensor), so every rank
    divides by the same normaliser (``normaliser``) once the batch is complete.
    """

    def __init__(self) -> None:
        self.loss = 0.0
        self.num_tokens = 0
        self.num_samples = 0
        self.num_clipped_tokens = 0
        self.entropy_sum = 0.0

    def add(self, sums: LossSums) -> None:
        self.loss += float(sums.loss.detach())
        self.num_tokens += sums.num_tokens
        self.num_samples += sums.num_samples
        self.num_clipped_tokens += sums.num_clipped_tokens
        self.entropy_sum += sums.entropy_sum

    def reduce(self, all_reduce=None) -> BatchTotals:
        """The batch's totals over the ranks (``all_reduce``: an in-place sum over the group, or None alone)."""
        values = torch.tensor([self.loss, self.num_tokens, self.num_samples, self.num_clipped_tokens,
                               self.entropy_sum], dtype=torch.float64)
        if all_reduce is not None:
            all_reduce(values)
        total = BatchTotals()
        total.loss = float(values[0])
        total.num_tokens, total.num_samples, total.num_clipped_tokens = (int(v) for v in values[1:4].tolist())
        total.entropy_sum = float(values[4])
        return total


def policy_loss_sums(
    logprobs: torch.Tensor,  # [B, T] log p of response tokens under the current weights
    old_logprobs: torch.Tensor,  # [B, T] under policy_version k (the weights that generated them)
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1.0 on response tokens, 0.0 on padding; counts come from its non-zeros
    cfg: GRPOConfig,
) -> LossSums:
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high)
    token_loss = torch.maximum(unclipped, clipped) * mask
    response = mask > 0
    lengths = response.sum(dim=1)  # [B] int64: exact in every dtype
    if cfg.loss_agg is LossAggregation.token_mean:
        loss = token_loss.sum()
    else:
        loss = (token_loss.sum(dim=1) / lengths.clamp(min=1).to(token_loss.dtype)).sum()
    with torch.no_grad():
        num_clipped = int((clipped > unclipped)[response].sum())
        ratio_sum = float((ratio * mask).sum())
    return LossSums(
        loss=loss,
        num_tokens=int(lengths.sum()),
        num_samples=int(mask.shape[0]),
        num_clipped_tokens=num_clipped,
        ratio_sum=ratio_sum,
    )


def normaliser(cfg: GRPOConfig, *, num_tokens: int, num_samples: int) -> int:
    """The divisor of a whole training batch's loss sum (known once the batch is complete)."""
    return max(num_tokens if cfg.loss_agg is LossAggregation.token_mean else num_samples, 1)
