"""The loss variants (trainer/grpo.py) against transcriptions of their reference formulas, and the property that makes
each exact under CGP: the whole batch's gradient equals the sum of its micro-batches' in any split and order, scaled
once by the batch normaliser.

References, transcribed from the formulas (not the code) in float64 with one loop per sample:
- slime, THUDM/slime: ``slime/utils/ppo_utils.py`` at 06787cf5798525d9af068135ade88dc795d75821 (compute_approx_kl,
  compute_gspo_kl, compute_policy_loss), ``compute_cispo_loss`` of a later ppo_utils.py (MiniMax-M1, Eq. 4-5), and
  ``slime/backends/megatron_utils/loss.py`` at 00c2d6db0f23a4900be6e80a8eb81eebf9e1ebff (vanilla_tis_function,
  icepop_function, policy_loss_function: pg - entropy_coef * entropy + kl_coef * kl, each by the same reducer).
- verl, volcengine/verl: ``verl/trainer/ppo/core_algos.py`` (compute_policy_loss_gspo: the straight-through
  sequence ratio) and ``verl/trainer/ppo/rollout_corr_helper.py`` at e1904109a3a83d7c911baaf8998b9188b4cf7874
  (compute_rollout_correction_weights: sequence-level IS = exp(sum_t log rho_t) truncated at the threshold;
  rejection sampling removes tokens from the response mask, hence from the normaliser).
Differences that are the project's choice (grpo.py's docstring): an empty response counts as a sample of the
seq_mean_token_mean normaliser (verl drops it and adds 1e-8 to each length); MIS weighs the kept tokens by rho as
slime's icepop does and drops the others from the normaliser as verl's rejection sampling does.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rolloutpipe.trainer.config import GRPOConfig, KLLossType, LossAggregation, PolicyLoss, RolloutCorrection
from rolloutpipe.trainer.grpo import BatchTotals, normaliser, policy_loss_sums
from tests.conftest import needs_extra

B, T = 8, 6
LENGTHS = [6, 3, 0, 1, 5, 6, 2, 4]
"""One empty response (its row is all padding)."""


def batch(seed: int = 0):
    """Leaves (logprobs, entropy) with grad, and old / reference / engine log-probs, advantages, mask; float64.
    Ratios land on both sides of the clip range, two tokens sit exactly on its edges (ties), one advantage is 0."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    logprobs = (-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3) * mask
    old = (logprobs + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3) * mask
    old[0, 0] = logprobs[0, 0] - math.log(1.2)  # ratio exactly 1 + eps_clip_high (up to rounding of log)
    old[0, 1] = logprobs[0, 1]  # ratio 1
    ref = (logprobs + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.2) * mask
    engine = (old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3) * mask
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 * mask
    advantages = torch.randn(B, generator=gen, dtype=torch.float64)
    advantages[3] = 0.0
    return {"logprobs": logprobs.requires_grad_(), "entropy": entropy.requires_grad_(), "old": old, "ref": ref,
            "engine": engine, "advantages": advantages, "mask": mask}


# -- transcriptions ----------------------------------------------------------------------------------------------
def slime_policy_loss(ppo_kl, adv, eps, eps_high):
    ratio = (-ppo_kl).exp()
    losses1, losses2 = -ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv
    return torch.maximum(losses1, losses2), (losses2 > losses1)


def slime_cispo_loss(ppo_kl, logp, adv, eps, eps_high):
    ratio = (-ppo_kl).exp()
    truncated = ratio.clamp(1 - eps, 1 + eps_high)
    return -truncated.detach() * adv * logp, (truncated != ratio)


def verl_gspo_loss(logp, old, adv, n, eps, eps_high):
    """verl: log s_{i,t} = sg[mean_t(logp - old)] + logp - sg[logp]."""
    seq = (logp - old).sum() / max(n, 1)
    s = torch.exp(seq.detach() + logp - logp.detach())
    return torch.maximum(-adv * s, -adv * s.clamp(1 - eps, 1 + eps_high))


def slime_kl(logp, ref, kind):
    log_ratio = logp - ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio**2 / 2.0
    log_ratio = -log_ratio
    kl = log_ratio.exp() - 1 - log_ratio
    return kl.clamp(-10, 10) if kind == "low_var_kl" else kl


def correction_weight(old, engine, level, low, high):
    """slime's TIS (clamp) and icepop (rho inside the band, else 0) per token; verl's sequence level per sequence.
    Returns the weight and whether the token stays in the loss."""
    if level == "none":
        return torch.ones_like(old), torch.ones_like(old, dtype=torch.bool)
    rho = torch.exp(old - engine) if level.startswith("token") else torch.exp((old - engine).sum()).expand_as(old)
    if level.endswith("tis"):
        return rho.clamp(low, high), torch.ones_like(old, dtype=torch.bool)
    inside = (rho >= low) & (rho <= high)
    return torch.where(inside, rho, torch.zeros_like(rho)), inside


def reference_loss(d, cfg: GRPOConfig, policy: str):
    """The batch's loss, normalised, sample by sample: reducer(w * pg) + kl_coef reducer(kl) - ent_coef reducer(H)."""
    per_sample, kept_tokens, kept_samples = [], 0, 0
    for i, n in enumerate(LENGTHS):
        logp, old, ref, eng, ent = (d[k][i, :n] for k in ("logprobs", "old", "ref", "engine", "entropy"))
        adv = d["advantages"][i]
        if policy == "gspo":
            ppo_kl = (((old - logp).sum() / max(n, 1)).expand_as(logp))  # slime's compute_gspo_kl
            pg, _ = slime_policy_loss(ppo_kl, adv, cfg.eps_clip, cfg.eps_clip_high)
        elif policy == "gspo_verl":
            pg = verl_gspo_loss(logp, old, adv, n, cfg.eps_clip, cfg.eps_clip_high)
        elif policy == "cispo":
            pg, _ = slime_cispo_loss(old - logp, logp, adv, cfg.eps_clip, cfg.eps_clip_high)
        else:
            pg, _ = slime_policy_loss(old - logp, adv, cfg.eps_clip, cfg.eps_clip_high)
        weight, keep = correction_weight(old, eng, cfg.rollout_correction.value, cfg.tis_clip_low, cfg.tis_clip)
        token = weight * pg
        if cfg.kl_loss_coef:
            token = token + cfg.kl_loss_coef * slime_kl(logp, ref, cfg.kl_loss_type.value)
        if cfg.entropy_coef:
            token = token - cfg.entropy_coef * ent
        token = token[keep]
        kept_tokens += len(token)
        if n == 0 or len(token):
            kept_samples += 1
        per_sample.append(token.sum() if cfg.loss_agg is LossAggregation.token_mean
                          else token.sum() / max(len(token), 1))
    total = sum(per_sample)
    return total / (kept_tokens if cfg.loss_agg is LossAggregation.token_mean else kept_samples)


def ours(d, cfg: GRPOConfig, rows=None):
    rows = torch.arange(B) if rows is None else torch.tensor(rows)
    return policy_loss_sums(d["logprobs"][rows], d["old"][rows], d["advantages"][rows], d["mask"][rows], cfg,
                            entropy=d["entropy"][rows], ref_logprobs=d["ref"][rows],
                            trainer_old_logprobs=d["old"][rows], engine_logprobs=d["engine"][rows])


def value_and_grads(loss, d):
    grads = torch.autograd.grad(loss, [d["logprobs"], d["entropy"]], allow_unused=True)
    return float(loss.detach()), [torch.zeros(B, T, dtype=torch.float64) if g is None else g for g in grads]


CONFIGS = {
    "grpo": GRPOConfig(),
    "grpo-clip-higher-seq-mean": GRPOConfig(eps_clip_high=0.28, loss_agg=LossAggregation.seq_mean_token_mean),
    "gspo": GRPOConfig(policy_loss=PolicyLoss.gspo, eps_clip=0.1, eps_clip_high=0.15),
    "gspo-seq-mean": GRPOConfig(policy_loss=PolicyLoss.gspo, loss_agg=LossAggregation.seq_mean_token_mean),
    "cispo": GRPOConfig(policy_loss=PolicyLoss.cispo, eps_clip=0.2, eps_clip_high=0.28),
    "token-tis": GRPOConfig(rollout_correction=RolloutCorrection.token_tis, tis_clip=1.2, tis_clip_low=0.9),
    "seq-tis": GRPOConfig(rollout_correction=RolloutCorrection.seq_tis, tis_clip=2.0,
                          loss_agg=LossAggregation.seq_mean_token_mean),
    "token-mis": GRPOConfig(rollout_correction=RolloutCorrection.token_mis, tis_clip=1.3, tis_clip_low=0.8),
    "seq-mis-seq-mean": GRPOConfig(rollout_correction=RolloutCorrection.seq_mis, tis_clip=1.5, tis_clip_low=0.5,
                                   loss_agg=LossAggregation.seq_mean_token_mean),
    **{f"kl-{k.value}": GRPOConfig(kl_loss_coef=0.3, kl_loss_type=k) for k in KLLossType},
    "entropy": GRPOConfig(entropy_coef=0.05),
    "everything": GRPOConfig(policy_loss=PolicyLoss.gspo, rollout_correction=RolloutCorrection.token_mis,
                             tis_clip=1.3, tis_clip_low=0.8, kl_loss_coef=0.1, kl_loss_type=KLLossType.low_var_kl,
                             entropy_coef=0.01, loss_agg=LossAggregation.seq_mean_token_mean),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_loss_equals_its_reference_transcription_to_1e_12(name):
    cfg, d = CONFIGS[name], batch()
    sums = ours(d, cfg)
    value, grads = value_and_grads(sums.loss / normaliser(cfg, num_tokens=sums.num_loss_tokens,
                                                          num_samples=sums.num_loss_samples), d)
    policies = [cfg.policy_loss.value]
    if cfg.policy_loss is PolicyLoss.gspo and cfg.rollout_correction in (RolloutCorrection.none,
                                                                          RolloutCorrection.seq_tis):
        policies.append("gspo_verl")  # the same gradient where a sequence's tokens weigh the same (grpo.py)
    for policy in policies:  # GSPO: slime's broadcast sequence ratio, and verl's straight-through one
        ref_value, ref_grads = value_and_grads(reference_loss(d, cfg, policy), d)
        assert value == pytest.approx(ref_value, rel=1e-12, abs=1e-12), policy
        for ours_grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_the_workload_exercises_clipping_on_both_sides_truncation_and_masking():
    """So the transcription test could fail: both clip edges hit, TIS truncates, MIS drops tokens and a sample."""
    d = batch()
    ratio = torch.exp(d["logprobs"] - d["old"])[d["mask"] > 0].detach()
    assert (ratio < 0.8).any() and (ratio > 1.28).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    tis = ours(d, CONFIGS["token-tis"])
    assert 0 < tis.num_tis_clipped_tokens < tis.num_tokens
    mis = ours(d, CONFIGS["seq-mis-seq-mean"])
    assert mis.num_loss_tokens < mis.num_tokens and mis.num_loss_samples < mis.num_samples
    token_mis = ours(d, CONFIGS["token-mis"])
    assert 0 < token_mis.num_loss_tokens < token_mis.num_tokens


def test_tis_statistics_are_the_ratio_of_trainer_to_engine_and_the_log_prob_gap():
    d, cfg = batch(), CONFIGS["token-tis"]
    sums = ours(d, cfg)
    response = d["mask"] > 0
    rho = torch.exp(d["old"] - d["engine"])[response]
    assert sums.tis_sum == pytest.approx(float(rho.sum()), rel=1e-12)
    assert sums.tis_max == float(rho.max())
    assert sums.num_tis_clipped_tokens == int(((rho > cfg.tis_clip) | (rho < cfg.tis_clip_low)).sum())
    assert sums.logprob_gap_sum == pytest.approx(float((d["old"] - d["engine"]).abs()[response].sum()), rel=1e-12)


SPLITS = [[[5, 1], [0, 6, 2], [4], [3, 7]], [[7, 6, 5, 4, 3, 2, 1, 0]], [[2], [3], [0, 1, 4, 5, 6, 7]],
          [[4, 0], [7, 2, 1], [6, 3, 5]]]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_micro_batch_sums_in_any_split_and_order_scaled_once_equal_the_whole_batch(name):
    """The exactness property: each variant's loss and statistics, summed over micro-batches (any split, any order,
    as CGP trains them) and normalised once by the batch's counts, equal the whole batch's."""
    cfg, d = CONFIGS[name], batch(seed=1)
    whole = ours(d, cfg)
    expected_value, expected = value_and_grads(
        whole.loss / normaliser(cfg, num_tokens=whole.num_loss_tokens, num_samples=whole.num_loss_samples), d)
    for split in SPLITS:
        totals, loss = BatchTotals(), 0.0
        for rows in split:
            part = ours(d, cfg, rows)
            totals.add(part)
            loss = loss + part.loss
        total = totals.reduce()
        scale = 1.0 / normaliser(cfg, num_tokens=total.num_loss_tokens, num_samples=total.num_loss_samples)
        value, grads = value_and_grads(loss * scale, d)
        assert value == pytest.approx(expected_value, rel=1e-12, abs=1e-14)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        for key in ("num_tokens", "num_loss_tokens", "num_loss_samples", "num_clipped_tokens",
                    "num_tis_clipped_tokens", "tis_max"):
            assert getattr(total, key) == getattr(whole, key), key
        for key in ("kl_sum", "tis_sum", "logprob_gap_sum"):
            assert getattr(total, key) == pytest.approx(getattr(whole, key), rel=1e-12, abs=1e-14), key


def test_a_normaliser_taken_per_micro_batch_is_not_the_batch_update():
    """What the exactness rests on, broken once: MIS's kept-token count divided per micro-batch moves the update."""
    cfg, d = CONFIGS["token-mis"], batch(seed=1)
    whole = ours(d, cfg)
    _, expected = value_and_grads(whole.loss / whole.num_loss_tokens, d)
    parts = [ours(d, cfg, rows) for rows in SPLITS[0]]
    per_micro_batch = sum(p.loss / max(p.num_loss_tokens, 1) for p in parts) / len(parts)
    _, grads = value_and_grads(per_micro_batch, d)
    assert (grads[0] - expected[0]).abs().max() > 1e-3


def test_empty_responses_contribute_nothing_but_their_count():
    d = batch()
    for cfg in CONFIGS.values():
        empty = ours(d, cfg, [2])
        assert empty.num_tokens == 0 and float(empty.loss.detach()) == 0.0
        assert empty.num_loss_samples == 1 and empty.tis_max == 0.0


@pytest.mark.parametrize("overrides,key", [
    ({"tis_clip": 0.5, "tis_clip_low": 0.8}, "grpo.tis_clip_low"),
    ({"tis_clip_low": -0.1}, "grpo.tis_clip_low"),
    ({"kl_loss_coef": -1.0}, "grpo.kl_loss_coef"),
    ({"entropy_coef": -0.01}, "grpo.entropy_coef"),
])
def test_bad_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        GRPOConfig(**overrides)


def test_every_combination_of_the_switches_builds():
    for policy, correction, kl in itertools.product(PolicyLoss, RolloutCorrection, KLLossType):
        GRPOConfig(policy_loss=policy, rollout_correction=correction, kl_loss_type=kl, kl_loss_coef=0.1)


def trainer_with(grpo: GRPOConfig, model, reference):
    from rolloutpipe.trainer.config import OldLogprobSource, TrainerConfig
    from rolloutpipe.trainer.torch_backend import PolicyTrainer

    trainer = PolicyTrainer(model=model, cfg=TrainerConfig(lr=1e-2, logprob_chunk_tokens=5), grpo=grpo,
                            temperature=0.8, pad_id=0, multi_step=True, process_group_active=False,
                            old_logprobs=OldLogprobSource.trainer)
    trainer.load_reference(reference)
    return trainer


def test_the_trainer_gives_the_same_update_from_any_micro_batches_with_every_term_on():
    """The torch trainer with KL to a reference (another model), token MIS on engine log-probs that disagree with
    the trainer's, an entropy bonus through the chunked log-probs, and two optimizer steps of one rollout: micro-batches
    of 1 to 3 samples give the weights one micro-batch per batch gives (float64)."""
    import copy

    from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
    from tests.helpers.trainer import generated_samples

    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.02)
    samples = generated_samples(copy.deepcopy(model), 8)
    gen = torch.Generator().manual_seed(3)
    for s in samples:  # an engine whose numerics differ from the trainer's
        s.engine_logprobs = [lp + 0.2 * float(torch.randn((), generator=gen)) for lp in s.engine_logprobs]
    grpo = GRPOConfig(rollout_correction=RolloutCorrection.token_mis, tis_clip=1.2, tis_clip_low=0.8,
                      kl_loss_coef=0.5, kl_loss_type=KLLossType.k3, entropy_coef=0.1)
    weights, results = [], []
    for micro in ([[[0, 1, 2, 3]], [[4, 5, 6, 7]]], [[[3], [0, 2], [1]], [[6, 4, 7], [5]]]):
        trainer = trainer_with(grpo, copy.deepcopy(model), reference)
        trainer.begin_step()
        step_results = []
        for batch_index, batch_split in enumerate(micro):
            for rows in batch_split:
                trainer.forward_backward([samples[i] for i in rows], first_batch_of_step=batch_index == 0)
            step_results.append(trainer.finish_batch())
        weights.append(trainer.model.state_dict())
        results.append(step_results)
    for whole, split in zip(*results):
        assert 0 < whole.totals.num_loss_tokens < whole.totals.num_tokens, "MIS must drop some tokens"
        assert whole.totals.kl_sum > 0 and whole.totals.logprob_gap_sum > 0
        assert (split.loss, split.grad_norm) == pytest.approx((whole.loss, whole.grad_norm), rel=1e-10)
        assert split.totals.num_loss_tokens == whole.totals.num_loss_tokens  # the same tokens dropped
        assert split.totals.tis_max == pytest.approx(whole.totals.tis_max, rel=1e-12)  # (log-probs to the last bits)
    for k, v in weights[0].items():
        torch.testing.assert_close(weights[1][k], v, rtol=0, atol=1e-12)


def test_rollout_correction_refuses_samples_without_the_engines_log_probs():
    from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
    from rolloutpipe.trainer.grpo_trainer import TrainSample

    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    trainer = trainer_with(GRPOConfig(rollout_correction=RolloutCorrection.token_tis), model, model)
    sample = TrainSample(prompt_ids=[5, 6, 7], response_ids=[8, 9], engine_logprobs=[], advantage=1.0)
    with pytest.raises(ValueError, match="set grpo.rollout_correction=none"):
        trainer.forward_backward([sample], first_batch_of_step=True)


@needs_extra("megatron", "megatron.core")
def test_megatron_keeps_the_reference_mapped_as_its_policy_and_gives_the_torch_backends_kl():
    """The KL term's reference through each backend's hook (torch: the HF weights; Megatron: mapped to its
    GPTModel's parameters): the same KL, loss and gradient norm (float64; HF's RMSNorm computes in float32)."""
    import copy

    from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend, TrainerConfig
    from rolloutpipe.trainer.grpo_trainer import TrainSample

    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.02)
    samples = [TrainSample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], engine_logprobs=[], advantage=1.0),
               TrainSample(prompt_ids=[5, 6], response_ids=[11, 12], engine_logprobs=[], advantage=-1.0)]
    grpo = GRPOConfig(kl_loss_coef=0.5, kl_loss_type=KLLossType.k1, entropy_coef=0.1)
    results = []
    for backend in (TrainerBackend.torch, TrainerBackend.megatron):
        trainer = trainer_class(backend)(model=copy.deepcopy(model), cfg=TrainerConfig(backend=backend), grpo=grpo,
                                         temperature=0.8, pad_id=0, multi_step=False, process_group_active=False,
                                         old_logprobs=OldLogprobSource.trainer)
        try:
            trainer.load_reference(reference)
            trainer.forward_backward(samples, first_batch_of_step=True)
            result = trainer.finish_batch()
            results.append((result.totals.kl_sum, result.loss, result.grad_norm))
        finally:
            trainer.close()
    assert results[0][0] > 0.1
    assert results[1] == pytest.approx(results[0], rel=1e-6)
