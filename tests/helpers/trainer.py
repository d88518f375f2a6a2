"""The trainer's references: samples from the embedded engine, a batch's update written out plainly, a float64 norm."""

from __future__ import annotations

import copy

import torch

from rolloutpipe.trainer.config import GRPOConfig, LossAggregation, TrainerConfig
from rolloutpipe.trainer.grpo_trainer import TrainSample
from tests.helpers.embedded import request, run_all

TEMPERATURE = 0.8


def generated_samples(model, num: int) -> list[TrainSample]:
    """Samples from the embedded engine at the model's current weights, with the engine's log-probs."""
    requests = [request(i, prompt_len=3 + i % 4, max_new_tokens=6, temperature=TEMPERATURE) for i in range(num)]
    results = run_all(model, requests, concurrency=4)
    return [
        TrainSample(prompt_ids=r.input_ids, response_ids=results[r.request_id].output_ids,
                    engine_logprobs=results[r.request_id].output_logprobs, advantage=(-1.0) ** i)
        for i, r in enumerate(requests)
    ]


def use_float64_hf_norm(monkeypatch) -> None:
    """HF's Qwen3RMSNorm computes in float32 even for a float64 model (~1e-7 relative, enough to tell a padded batch
    from one sample at a time): swap in a float64 norm where a test compares tightly."""
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", forward)


def full_batch_update(model, samples: list[TrainSample], *, cfg: TrainerConfig, grpo: GRPOConfig):
    """A training batch's update written out plainly, for a backend's micro-batches to match: one sample at a time,
    no padding, the whole batch's loss divided by its normaliser, one backward, torch's clip_grad_norm_ and AdamW.
    The first batch of a step: the old log-probs are the current ones (ratio 1). Returns (loss, grad norm, weights)."""
    model = copy.deepcopy(model)
    losses = []
    for s in samples:
        logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1:-1]
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)[torch.arange(len(s.response_ids)), s.response_ids]
        ratio = torch.exp(logp - logp.detach())
        token = torch.maximum(-s.advantage * ratio,
                              -s.advantage * ratio.clamp(1 - grpo.eps_clip, 1 + grpo.eps_clip_high))
        losses.append(token.sum() if grpo.loss_agg is LossAggregation.token_mean else token.mean())
    by = sum(len(s.response_ids) for s in samples) if grpo.loss_agg is LossAggregation.token_mean else len(samples)
    loss = sum(losses) / by
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                      weight_decay=cfg.weight_decay).step()
    return float(loss), float(grad_norm), {k: v.detach() for k, v in model.state_dict().items()}
