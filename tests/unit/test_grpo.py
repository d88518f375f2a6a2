"""GRPO maths: per-group advantages and a loss whose accumulation does not depend on how it is split."""

import pytest
import torch

from rolloutpipe.rollout.advantages import group_advantages
from rolloutpipe.trainer.config import GRPOConfig, LossAggregation
from rolloutpipe.trainer.grpo import normaliser, policy_loss_sums


def test_advantages_use_only_the_groups_own_rewards():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=False)
    assert adv == pytest.approx([0.5, -0.5, -0.5, 0.5])
    adv_std = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True)
    assert adv_std == pytest.approx([0.5 / 0.57735, -0.5 / 0.57735, -0.5 / 0.57735, 0.5 / 0.57735], rel=1e-4)


def test_zero_variance_group_has_zero_advantages():
    assert group_advantages([0.7] * 8, normalize_std=True) == [0.0] * 8


@pytest.mark.parametrize("agg", list(LossAggregation))
def test_micro_batch_sums_scaled_once_equal_the_whole_batch_gradient(agg):
    torch.manual_seed(0)
    cfg = GRPOConfig(loss_agg=agg)
    weight = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    features = torch.randn(7, 5, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5, 2])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).double()
    advantages = torch.randn(7, dtype=torch.float64)
    old = torch.randn(7, 5, dtype=torch.float64) * 0.1

    def loss_of(rows):
        logprobs = (weight[rows] * features[rows]).tanh()
        return policy_loss_sums(logprobs, old[rows], advantages[rows], mask[rows], cfg)

    whole = loss_of(torch.arange(7))
    (whole.loss / normaliser(cfg, num_tokens=whole.num_tokens, num_samples=whole.num_samples)).backward()
    expected = weight.grad.clone()
    weight.grad = None

    parts = [loss_of(torch.tensor(rows)) for rows in ([5, 1], [0, 6, 2], [4], [3])]  # any order, any split
    for p in parts:
        p.loss.backward()
    num_tokens = sum(p.num_tokens for p in parts)
    num_samples = sum(p.num_samples for p in parts)
    accumulated = weight.grad / normaliser(cfg, num_tokens=num_tokens, num_samples=num_samples)
    torch.testing.assert_close(accumulated, expected, rtol=1e-12, atol=1e-14)


def test_ratio_outside_the_clip_range_gives_no_gradient():
    cfg = GRPOConfig(eps_clip=0.2, eps_clip_high=0.2)
    logprobs = torch.tensor([[0.5]], dtype=torch.float64, requires_grad=True)
    sums = policy_loss_sums(logprobs, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64),
                            torch.ones(1, 1, dtype=torch.float64), cfg)
    sums.loss.backward()
    assert sums.num_clipped_tokens == 1
    assert logprobs.grad.item() == 0.0
