"""The trainer's old log-probs: they describe the policy that generated the samples, for every batch."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.backend import PolicyBackend, ShardedBackend, trainer_class
from rolloutpipe.trainer.config import GRPOConfig, LossAggregation, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.grpo_trainer import TrainSample, pack
from rolloutpipe.trainer.torch_backend import PolicyTrainer
from tests.conftest import needs_extra
from tests.helpers.trainer import TEMPERATURE, full_batch_update, generated_samples, use_float64_hf_norm


def make_trainer(model, *, multi_step: bool) -> PolicyTrainer:
    return PolicyTrainer(model=model, cfg=TrainerConfig(lr=1e-2), grpo=GRPOConfig(), temperature=TEMPERATURE,
                         pad_id=0, multi_step=multi_step, process_group_active=False,
                         old_logprobs=OldLogprobSource.trainer)


def test_engine_and_trainer_agree_on_the_log_probs_of_the_serving_policy():
    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    samples = generated_samples(copy.deepcopy(model), 6)
    trainer = make_trainer(model, multi_step=False)
    input_ids, targets, _ = pack(samples, pad_id=trainer.pad_id)
    logits = model(input_ids=input_ids).logits[:, :-1]
    logprobs = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    for b, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        torch.testing.assert_close(logprobs[b, start:start + len(s.response_ids)],
                                   torch.tensor(s.engine_logprobs, dtype=torch.float64), rtol=0, atol=1e-9)


def test_batches_after_the_first_optimizer_step_clip_against_the_rollout_policy():
    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    rollout_policy = copy.deepcopy(model)
    samples = generated_samples(copy.deepcopy(model), 8)
    trainer = make_trainer(model, multi_step=True)
    trainer.begin_step()
    trainer.forward_backward(samples[:4], first_batch_of_step=True)
    trainer.finish_batch()  # the weights move away from the rollout policy
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), rollout_policy.parameters()))
    assert moved > 1e-4

    second = samples[4:]
    input_ids, targets, mask = pack(second, pad_id=trainer.pad_id)
    current = trainer._old_logprobs(second, input_ids, targets, None, mask, first_batch_of_step=False)
    for b, s in enumerate(second):
        start = len(s.prompt_ids) - 1
        torch.testing.assert_close(current[b, start:start + len(s.response_ids)],
                                   torch.tensor(s.engine_logprobs, dtype=torch.float64), rtol=0, atol=1e-9)


def test_a_bfloat16_model_keeps_updates_smaller_than_its_resolution():
    """AdamW on bfloat16 weights rounds an update of 1e-5 away on a weight of 0.02 (bf16's step there is 1.2e-4);
    the trainer steps float32 master copies instead, so small updates add up and reach the model."""
    model = load_model(ModelConfig(dtype=DType.bfloat16), len(build_tiny_tokenizer()))
    samples = generated_samples(copy.deepcopy(model), 8)
    trainer = PolicyTrainer(model=model, cfg=TrainerConfig(lr=1e-5), grpo=GRPOConfig(), temperature=TEMPERATURE,
                            pad_id=0, multi_step=False, process_group_active=False,
                            old_logprobs=OldLogprobSource.trainer)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    for _ in range(30):
        sums = trainer.forward_backward(samples, first_batch_of_step=True)
        assert sums.num_tokens == sum(len(s.response_ids) for s in samples)
        trainer.finish_batch()
    assert all(v.dtype is torch.bfloat16 for v in model.parameters())
    num_moved = sum(int((init[k] != v).sum()) for k, v in model.named_parameters())
    assert num_moved > 0.5 * sum(v.numel() for v in init.values())  # bf16 AdamW alone: about 16%


def test_the_gradient_norm_is_exact_on_large_tensors_and_clips_like_torch():
    """torch.nn.utils.clip_grad_norm_ is 3.9e-3 off at 50M float32 elements on CPU; ours matches float64."""
    from rolloutpipe.trainer.torch_backend import clip_grad_norm

    torch.manual_seed(0)
    grads = [torch.randn(50_000_000) * 1e-3, torch.randn(1000, 3)]
    exact = float(sum(g.double().pow(2).sum() for g in grads).sqrt())
    assert clip_grad_norm([g.clone() for g in grads], max_norm=1e9) == pytest.approx(exact, rel=1e-7)
    small = [torch.randn(10, 4), torch.randn(7)]
    ours, theirs = [g.clone() for g in small], [torch.nn.Parameter(torch.zeros_like(g)) for g in small]
    for p, g in zip(theirs, small):
        p.grad = g.clone()
    assert clip_grad_norm(ours, max_norm=0.5) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(theirs, 0.5)))
    for g, p in zip(ours, theirs):
        torch.testing.assert_close(g, p.grad)


def test_chunked_log_probs_give_the_full_logits_values_and_gradients():
    """trainer.logprob_chunk_tokens: the same losses, gradients and clip-step updates (float64) as the model's own
    forward over every logit, also for the second batch, whose old log-probs come from the snapshot."""
    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    samples = generated_samples(model, 8)
    results, grads = {}, {}
    for chunk in (0, 5):
        trainer = PolicyTrainer(model=copy.deepcopy(model), cfg=TrainerConfig(lr=1e-2, logprob_chunk_tokens=chunk),
                                grpo=GRPOConfig(), temperature=TEMPERATURE, pad_id=0, multi_step=True,
                                process_group_active=False, old_logprobs=OldLogprobSource.trainer)
        trainer.begin_step()
        sums = [trainer.forward_backward(samples[:4], first_batch_of_step=True)]
        grads[chunk] = [p.grad.clone() for p in trainer.model.parameters()]
        first = trainer.finish_batch()
        sums.append(trainer.forward_backward(samples[4:], first_batch_of_step=False))
        results[chunk] = (sums, first, trainer.finish_batch(), trainer.model.state_dict())
    (full_sums, full_first, full_second, full_state), (sums, first, second, state) = results[0], results[5]
    for a, b in zip(full_sums, sums):
        assert a.num_tokens == b.num_tokens
        assert float(a.loss.detach()) == pytest.approx(float(b.loss.detach()), rel=1e-12)
        assert a.num_clipped_tokens == b.num_clipped_tokens
    for a, b in zip(grads[0], grads[5]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    assert second.num_clipped_tokens == full_second.num_clipped_tokens
    assert (first.grad_norm, second.grad_norm) == pytest.approx((full_first.grad_norm, full_second.grad_norm),
                                                                 rel=1e-10)
    for k in full_state:
        torch.testing.assert_close(state[k], full_state[k], rtol=0, atol=1e-12)


def test_recomputed_activations_give_the_same_update():
    """trainer.recompute: the layers run again in backward; losses, entropy and trained weights as without."""
    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    samples = generated_samples(model, 6)
    out = {}
    for recompute in (False, True):
        trainer = PolicyTrainer(model=copy.deepcopy(model), cfg=TrainerConfig(lr=1e-2, recompute=recompute),
                                grpo=GRPOConfig(), temperature=TEMPERATURE, pad_id=0, multi_step=False,
                                process_group_active=False, old_logprobs=OldLogprobSource.trainer)
        assert trainer.model.is_gradient_checkpointing is recompute  # (the name every supported transformers has)
        sums = trainer.forward_backward(samples, first_batch_of_step=True)
        out[recompute] = (float(sums.loss.detach()), sums.entropy_sum, trainer.finish_batch().grad_norm,
                          trainer.model.state_dict())
    assert out[True][:3] == pytest.approx(out[False][:3], rel=1e-12)
    assert out[False][1] > 0
    for k, v in out[False][3].items():
        torch.testing.assert_close(out[True][3][k], v, rtol=0, atol=1e-13)


def random_samples(num: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    return [TrainSample(prompt_ids=torch.randint(2, 45, (3 + i % 3,), generator=g).tolist(),
                        response_ids=torch.randint(2, 45, (2 + i % 4,), generator=g).tolist(),
                        engine_logprobs=[], advantage=(-1.0) ** i * (0.5 + i / 10)) for i in range(num)]


@pytest.mark.parametrize("loss_agg", list(LossAggregation), ids=lambda a: a.value)
def test_micro_batches_make_the_full_batch_update(monkeypatch, loss_agg):
    """Micro-batches of uneven sizes, their loss sums normalised once by the batch's count: the loss, gradient norm
    and weights of the whole batch's loss stepped at once (float64, a clipped step)."""
    use_float64_hf_norm(monkeypatch)
    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    samples, cfg, grpo = random_samples(7), TrainerConfig(lr=1e-2, max_grad_norm=0.5), GRPOConfig(loss_agg=loss_agg)
    loss, grad_norm, expected = full_batch_update(model, samples, cfg=cfg, grpo=grpo)
    trainer = PolicyTrainer(model=model, cfg=cfg, grpo=grpo, temperature=TEMPERATURE, pad_id=0, multi_step=False,
                            process_group_active=False, old_logprobs=OldLogprobSource.trainer)
    for micro_batch in (samples[:2], samples[2:3], samples[3:]):
        trainer.forward_backward(micro_batch, first_batch_of_step=True)
    result = trainer.finish_batch()
    assert grad_norm > cfg.max_grad_norm
    assert (result.loss, result.grad_norm) == pytest.approx((loss, grad_norm), rel=1e-10)
    for k, v in trainer.model.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=needs_extra("megatron", "megatron.core")) if b is TrainerBackend.megatron else b
    for b in TrainerBackend
], ids=lambda b: b.value)
def test_every_backend_value_names_a_class_the_trainer_node_can_drive(backend):
    """trainer.backend resolves to a class that the node constructs with the same arguments and whose instances
    have every member of PolicyBackend (the calls of trainer/node.py, pipeline.py and weight sync)."""
    calls = {name for name, member in vars(PolicyBackend).items() if inspect.isfunction(member) and name[0] != "_"}
    assert calls == {"begin_step", "forward_backward", "finish_batch", "load_reference", "hf_state",
                     "hf_model", "close", "writer_reads", "sum_exactly", "apply_deferred_update"}
    cls = trainer_class(backend)
    assert not inspect.isabstract(cls)
    expected = inspect.signature(PolicyBackend.__init__).parameters.keys()
    assert inspect.signature(cls.__init__).parameters.keys() == expected
    model = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer()))
    trainer = cls(model=model, cfg=TrainerConfig(backend=backend), grpo=GRPOConfig(), temperature=TEMPERATURE,
                  pad_id=0, multi_step=False, process_group_active=False, old_logprobs=OldLogprobSource.trainer)
    try:
        assert isinstance(trainer, PolicyBackend)
        # (float64: Megatron's replicated optimizer, checkpointed whole; its distributed one is sharded)
        assert trainer.sharded_checkpoint == (backend is TrainerBackend.fsdp)
        assert isinstance(trainer, ShardedBackend) or not trainer.sharded_checkpoint
        assert (trainer.data_parallel_rank, trainer.data_parallel_size) == (0, 1)
    finally:
        trainer.close()
