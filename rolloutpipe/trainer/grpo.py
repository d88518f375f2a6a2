"""GRPO advantages and the policy-gradient loss with its variants: pure torch, no process or store.

Advantages are per group (Shao et al., 2024): A_i = r_i - mean(r), divided by the group's unbiased standard
deviation (+ 1e-6) when ``normalize_advantage_std`` (Dr. GRPO turns it off); the group's assembler computes them
(``group_advantages``, in rollout/advantages.py, pure Python).

The per-token loss, with r_t = exp(logp_t - old_logp_t) and the clip range [1 - eps_low, 1 + eps_high] (DAPO's
clip-higher when they differ), is

    loss_t = w_t * pg_t + kl_loss_coef * kl_t - entropy_coef * H_t,       over the tokens the loss keeps,

- ``policy_loss=grpo``: pg_t = max(-A r_t, -A clip(r_t)), PPO's clipped surrogate.
- ``gspo`` (Zheng et al., 2025): the ratio is the sequence's, s_i = exp(mean_t (logp_t - old_logp_t)) over its
  response tokens, clipped per sequence: pg_t = max(-A s_i, -A clip(s_i)) on each of its tokens. This is slime's
  form (the sequence's log ratio broadcast to its tokens); verl's straight-through form sg(s_i) pi_t / sg(pi_t) has the
  same values, and the same gradient under either aggregation as long as all of a sequence's tokens weigh the same
  (not under token-level TIS or MIS, where slime's form lets a token's weight reach its sequence-mates through
  s_i). verl also caps the log ratio at 10; we do not (neither does slime).
- ``cispo`` (MiniMax-M1): pg_t = -sg(clip(r_t)) A logp_t; the clipped ratio only weighs the token's gradient.
- Rollout correction (``rollout_correction``) uses rho_t = exp(trainer_old_logp_t - engine_logp_t), the ratio of the
  trainer's policy k to what the engine that sampled the token reported for it. TIS weighs pg_t by w_t = clip(rho_t,
  tis_clip_low, tis_clip) per token (slime ``--use-tis``), or by w_i = clip(prod_t rho_t, ...) per sequence (verl
  ``rollout_is=sequence``), detached. MIS (IcePop) weighs pg_t by rho where rho lies in [tis_clip_low, tis_clip],
  as slime's ``icepop_function`` does, and drops the tokens (sequences) outside from the loss altogether, KL and
  entropy terms included, and from the normaliser, as verl's rejection sampling (``rollout_rs``) does by editing the
  response mask; slime's icepop keeps them in the normaliser with weight 0. Our choice follows verl's there. rho is
  computed from the log ratio clamped to [-20, 20] (verl's safety bound), which changes no weight for a cap below
  e^20.
- kl_t, the KL estimator of the current policy against the frozen reference, per slime's ``compute_approx_kl``, with
  d = logp - ref_logp: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d, low_var_kl = k3 clamped to [-10, 10].
- H_t, the policy's entropy at the token (at the sampling temperature), with its gradient.

Normalisation. ``token_mean`` divides the sum of token losses over the whole training batch by the batch's count of
tokens in the loss; ``seq_mean_token_mean`` averages the loss tokens within each sample, then divides by the
batch's count of samples (a sample MIS dropped entirely does not count; an empty response counts, as before). The
micro-batches backpropagate raw *sums* and the trainer scales the accumulated gradient once, by ``1 / normaliser``,
right before the optimizer step. The normaliser is a property of the whole batch, so it is only needed once the batch
is complete: that is why a pipelined update (micro-batches as groups arrive, in any order) equals the synchronous
one up to the order of floating-point accumulation.

Why each variant stays exact under CGP. Everything above except the normaliser is a function of one token or one
sample: r_t, s_i (a mean over the sample's own tokens), rho_t and prod_t rho_t, the TIS weight and the MIS decision,
kl_t, H_t. A sample lies whole inside one micro-batch, so these are the same whichever micro-batch, rank or order
it is trained in. What spans the batch is only the normaliser's two integer counts (MIS changes which tokens they
count, not that they are sums), added over micro-batches and ranks and applied once at the step; and the
statistics (sums, and a maximum, which is exact in any order). A term computed per micro-batch from its own tokens
(a per-micro-batch token count, a batch-mean of the IS weights) would not be exact, so there is none. verl's
``rollout_is_batch_normalize`` (the IS weights divided by their batch mean) is left out: it could be applied once at
the step only by scaling the policy term's gradient apart from the KL and entropy terms', which one accumulated
gradient does not allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rolloutpipe.trainer.config import GRPOConfig, KLLossType, LossAggregation, PolicyLoss, RolloutCorrection

LOG_RATIO_BOUND = 20.0
"""|log rho| is clamped to this before exp (verl's SAFETY_BOUND): no overflow, and no weight changes for a cap below
e^20."""


@dataclass(kw_only=True, slots=True)
class LossSums:
    """What one micro-batch contributes to its training batch, as sums (see module docstring)."""

    loss: torch.Tensor
    """Scalar with grad: sum of the aggregated losses, to be divided by the batch normaliser."""
    num_tokens: int
    """Response tokens of the micro-batch."""
    num_samples: int
    num_clipped_tokens: int
    ratio_sum: float
    entropy_sum: float = 0.0
    """Sum of the policy's entropy over the response tokens (no gradient; the trainer fills it in)."""
    num_loss_tokens: int = -1
    """Response tokens in the loss: num_tokens less what MIS drops (-1: num_tokens)."""
    num_loss_samples: int = -1
    """Samples in the seq_mean_token_mean normaliser: num_samples less those MIS drops entirely (-1: num_samples)."""
    kl_sum: float = 0.0
    """Sum of kl_t over the loss tokens (kl_loss_coef > 0)."""
    tis_sum: float = 0.0
    """Rollout correction: sum over the response tokens of rho (the sequence's rho on each token at sequence level)."""
    tis_max: float = 0.0
    num_tis_clipped_tokens: int = 0
    """Tokens whose weight is not rho: truncated (TIS) or dropped (MIS)."""
    logprob_gap_sum: float = 0.0
    """Sum over the response tokens of |trainer old log-prob - engine log-prob|."""

    def __post_init__(self) -> None:
        if self.num_loss_tokens < 0:
            self.num_loss_tokens = self.num_tokens
        if self.num_loss_samples < 0:
            self.num_loss_samples = self.num_samples


_SUMMED = ("loss", "num_tokens", "num_samples", "num_clipped_tokens", "entropy_sum", "num_loss_tokens",
           "num_loss_samples", "kl_sum", "tis_sum", "num_tis_clipped_tokens", "logprob_gap_sum")
_COUNTS = {"num_tokens", "num_samples", "num_clipped_tokens", "num_loss_tokens", "num_loss_samples",
           "num_tis_clipped_tokens"}


class BatchTotals:
    """One rank's running sums over a training batch's micro-batches, until its optimizer step.

    ``reduce`` sums them over the data-parallel ranks (one all-reduce of one float64 tensor; with rollout
    correction, one more for the maximum), so every rank divides by the same normaliser once the batch is complete.
    """

    def __init__(self) -> None:
        for name in _SUMMED:
            setattr(self, name, 0 if name in _COUNTS else 0.0)
        self.tis_max = 0.0

    def add(self, sums: LossSums) -> None:
        for name in _SUMMED:
            value = getattr(sums, name)
            setattr(self, name, getattr(self, name) + (float(value.detach()) if name == "loss" else value))
        self.tis_max = max(self.tis_max, sums.tis_max)

    def reduce(self, all_reduce=None, *, with_max: bool = False) -> BatchTotals:
        """The batch's totals over the ranks (``all_reduce``: an in-place sum over the group, taking ``op=`` for the
        maximum, or None alone; ``with_max``: reduce ``tis_max`` too)."""
        values = torch.tensor([getattr(self, name) for name in _SUMMED], dtype=torch.float64)
        maximum = torch.tensor([self.tis_max], dtype=torch.float64)
        if all_reduce is not None:
            all_reduce(values)
            if with_max:
                all_reduce(maximum, op=dist.ReduceOp.MAX)
        total = BatchTotals()
        for name, value in zip(_SUMMED, values.tolist()):
            setattr(total, name, int(value) if name in _COUNTS else value)
        total.tis_max = float(maximum[0])
        return total


def policy_loss_sums(
    logprobs: torch.Tensor,  # [B, T] log p of response tokens under the current weights
    old_logprobs: torch.Tensor,  # [B, T] under policy_version k (the weights that generated them)
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1.0 on response tokens, 0.0 on padding; counts come from its non-zeros
    cfg: GRPOConfig,
    *,
    entropy: torch.Tensor | None = None,  # [B, T] the policy's entropy, with grad (entropy_coef > 0)
    ref_logprobs: torch.Tensor | None = None,  # [B, T] under the frozen reference (kl_loss_coef > 0)
    trainer_old_logprobs: torch.Tensor | None = None,  # [B, T] the trainer's policy k (rollout correction)
    engine_logprobs: torch.Tensor | None = None,  # [B, T] what the engine reported (rollout correction)
) -> LossSums:
    response = mask > 0
    lengths = response.sum(dim=1)  # [B] int64: exact in every dtype
    adv = advantages[:, None]
    log_ratio = logprobs - old_logprobs
    if cfg.policy_loss is PolicyLoss.gspo:  # the sequence's mean log ratio on each of its tokens
        seq = (log_ratio * mask).sum(dim=1) / lengths.clamp(min=1).to(log_ratio.dtype)
        log_ratio = seq[:, None].expand_as(logprobs)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high)
    if cfg.policy_loss is PolicyLoss.cispo:
        pg = -clipped_ratio.detach() * adv * logprobs
        clipped = clipped_ratio != ratio
    else:
        unclipped, clipped_loss = -adv * ratio, -adv * clipped_ratio
        pg = torch.maximum(unclipped, clipped_loss)
        clipped = clipped_loss > unclipped
    keep = mask
    stats = {}
    if cfg.corrects_rollout:
        weight, keep, stats = rollout_correction(trainer_old_logprobs, engine_logprobs, mask, cfg)
        pg = pg * weight
    token_loss = pg
    kl = None
    if cfg.kl_loss_coef > 0:
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_loss_type)
        token_loss = token_loss + cfg.kl_loss_coef * kl
    if cfg.entropy_coef > 0:
        token_loss = token_loss - cfg.entropy_coef * entropy
    token_loss = token_loss * keep
    kept = keep > 0
    kept_lengths = kept.sum(dim=1)
    if cfg.loss_agg is LossAggregation.token_mean:
        loss = token_loss.sum()
    else:
        loss = (token_loss.sum(dim=1) / kept_lengths.clamp(min=1).to(token_loss.dtype)).sum()
    with torch.no_grad():
        num_clipped = int(clipped[response].sum())
        ratio_sum = float((ratio * mask).sum())
        kl_sum = 0.0 if kl is None else float((kl * keep).sum())
    return LossSums(
        loss=loss,
        num_tokens=int(lengths.sum()),
        num_samples=int(mask.shape[0]),
        num_clipped_tokens=num_clipped,
        ratio_sum=ratio_sum,
        num_loss_tokens=int(kept_lengths.sum()),
        num_loss_samples=int(mask.shape[0]) - int(((lengths > 0) & (kept_lengths == 0)).sum()),
        kl_sum=kl_sum,
        **stats,
    )


def rollout_correction(trainer_old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor,
                       cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The policy term's weight [B, T] (detached), the mask of the tokens the loss keeps [B, T], and the
    LossSums fields of its statistics (over every response token, before MIS drops any)."""
    with torch.no_grad():
        response = mask > 0
        delta = (trainer_old - engine) * mask
        level = cfg.rollout_correction
        if level in (RolloutCorrection.seq_tis, RolloutCorrection.seq_mis):
            delta_seq = delta.sum(dim=1, keepdim=True).expand_as(delta)
        else:
            delta_seq = delta
        rho = torch.exp(delta_seq.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if level in (RolloutCorrection.token_tis, RolloutCorrection.seq_tis):
            weight = rho.clamp(cfg.tis_clip_low, cfg.tis_clip)
            keep = mask
            changed = weight != rho
        else:
            inside = (rho >= cfg.tis_clip_low) & (rho <= cfg.tis_clip)
            weight = torch.where(inside, rho, 0.0)
            keep = mask * inside.to(mask.dtype)
            changed = ~inside
        stats = {
            "tis_sum": float(rho[response].sum()),
            "tis_max": float(rho[response].max()) if bool(response.any()) else 0.0,
            "num_tis_clipped_tokens": int(changed[response].sum()),
            "logprob_gap_sum": float(delta.abs().sum()),
        }
    return weight, keep, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLLossType) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs (Schulman's k1, k2, k3)."""
    d = logprobs - ref_logprobs
    if kind is KLLossType.k1:
        return d
    if kind is KLLossType.k2:
        return d.square() / 2
    k3 = torch.exp(-d) - 1 + d
    return k3.clamp(-10.0, 10.0) if kind is KLLossType.low_var_kl else k3


def normaliser(cfg: GRPOConfig, *, num_tokens: int, num_samples: int) -> int:
    """The divisor of a whole training batch's loss sum (known once the batch is complete): its loss tokens or its
    samples (``LossSums.num_loss_tokens`` / ``num_loss_samples`` summed over the batch)."""
    return max(num_tokens if cfg.loss_agg is LossAggregation.token_mean else num_samples, 1)
