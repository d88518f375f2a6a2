"""The PyTorch trainer: micro-batch forward/backward as groups arrive, one optimizer step per training batch.

Gradient accumulation works on loss *sums* (see ``grpo``): each micro-batch backpropagates the sum of
its samples' losses; when a training batch is complete, ``finish_batch`` all-reduces the gradients
and the token and sample counts over the data-parallel ranks (gloo on CPU), divides the gradients by
the batch normaliser, clips and steps. Which rank trained which group, and in what order, changes
only the order of floating-point additions.

Old log-probs. With one optimizer step per rollout the weights at training time are the rollout's
policy_version k, so the old log-probs are the current ones, detached (ratio = 1, exact). With
``num_steps_per_rollout > 1`` the trainer keeps a copy of version k's parameters taken at the start of
the step and recomputes old log-probs with it, so batches trained after the first optimizer step
still clip against version k. ``old_logprobs=engine`` uses the engine's log-probs instead (cheaper on
large models; differs from the trainer's by the numerics of the two implementations). The trainer's
own recomputation is the default because it is exact: the ratio is 1 to the last bit on the first
batch, so the clipped objective sees no engine/trainer mismatch. ``async_one_step`` always uses the
engine's log-probs, the only record of the stale policy that generated its samples.

Precision. Token counts come from the response mask's non-zeros (exact integers in every dtype); log-probs,
the loss and its sums are float32 at least, whatever the model's dtype. A bfloat16 (or float16) model runs
forward and backward in its dtype while AdamW steps float32 master copies of its parameters, which are copied
back rounded after each step: AdamW on bfloat16 weights would round most updates of a small learning rate away.
(A resumed run rebuilds the master copies from the checkpoint's bfloat16 weights, so in bfloat16 a resumed run
is close to, not bit-equal with, an uninterrupted one.)

Device. On a machine with CUDA the model, its master copies and the optimizer state live on the rank's GPU
(control/env.py binds each rank to its node-local GPU; gradients all-reduce over NCCL); ``hf_state`` hands out CPU
copies, which is what the engines' weight files, broadcasts and checkpoints take. Without CUDA, the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rolloutpipe.trainer.config import OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.grpo import BatchTotals, GRPOConfig, LossSums, normaliser, policy_loss_sums
from rolloutpipe.trainer.logprobs import chunked_logprobs, token_entropy, token_logprobs
from rolloutpipe.types import CompleteGroup


@dataclass(kw_only=True, slots=True)
class TrainSample:
    """One sample as the trainer sees it."""

    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    advantage: float


def sequence_len(sample: TrainSample) -> int:
    """Its row's length in ``pack`` before padding: prompt + response tokens."""
    return len(sample.prompt_ids) + len(sample.response_ids)


def train_samples(group: CompleteGroup) -> list[TrainSample]:
    return [
        TrainSample(prompt_ids=group.prompt_ids, response_ids=s.response_ids, engine_logprobs=s.logprobs,
                    advantage=a)
        for s, a in zip(group.samples, group.advantages, strict=True)
    ]


@dataclass(kw_only=True, slots=True)
class BatchResult:
    loss: float
    grad_norm: float
    num_tokens: int
    num_clipped_tokens: int
    entropy_sum: float = 0.0
    """Sum over the batch's response tokens of the policy's entropy (train/entropy is its mean)."""


class PolicyTrainer:
    def __init__(self, *, model: torch.nn.Module, cfg: TrainerConfig, grpo: GRPOConfig, temperature: float,
                 pad_id: int, multi_step: bool, process_group_active: bool, old_logprobs: OldLogprobSource) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.model = (model if self.device is None else model.to(self.device)).train()
        if cfg.recompute:  # HF's per-layer activation checkpointing; the non-reentrant kind works under no_grad too
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.cfg = cfg
        self.grpo = grpo
        self.temperature = temperature
        self._head = (_HiddenToLogprobs(self.model, cfg.logprob_chunk_tokens, temperature)
                      if cfg.logprob_chunk_tokens and _chunkable(self.model) else None)
        """Log-probs from the hidden states by chunks; None: from the model's full logits."""
        self.pad_id = pad_id
        self.multi_step = multi_step
        self.old_logprobs = old_logprobs
        self.distributed = process_group_active
        self.data_parallel_rank = dist.get_rank() if process_group_active else 0
        self.data_parallel_size = dist.get_world_size() if process_group_active else 1
        self._master: list[torch.Tensor] | None = None
        """float32 copies of a bfloat16/float16 model's parameters: what the optimizer steps (mixed precision)."""
        if next(model.parameters()).dtype in (torch.bfloat16, torch.float16):
            self._master = [p.detach().float().clone() for p in model.parameters()]
        self.optimizer = torch.optim.AdamW(
            self._master or model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
        )
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._totals = BatchTotals()

    def begin_step(self) -> None:
        """Remember policy_version k's parameters when later batches must clip against them."""
        if self.multi_step and self.old_logprobs is OldLogprobSource.trainer:
            # named_parameters lists tied weights once; functional_call re-ties them
            self._snapshot = {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def forward_backward(self, samples: list[TrainSample], *, first_batch_of_step: bool) -> LossSums:
        input_ids, targets, mask = (t if self.device is None else t.to(self.device)
                                    for t in pack(samples, pad_id=self.pad_id))  # [B, L], [B, L-1] x 2
        logprobs, entropy = self._logprobs(input_ids, targets, mask)  # [B, L-1] x 2
        old = self._old_logprobs(samples, input_ids, targets, logprobs, mask, first_batch_of_step)
        advantages = torch.tensor([s.advantage for s in samples], dtype=logprobs.dtype, device=logprobs.device)
        sums = policy_loss_sums(logprobs, old, advantages, mask, self.grpo)
        sums.entropy_sum = float((entropy * mask).sum())
        sums.loss.backward()
        self._totals.add(sums)
        return sums

    def finish_batch(self) -> BatchResult:
        """All-reduce, normalise once, clip and step: the batch's one optimizer update.

        Mixed precision (a bfloat16/float16 model): the gradients are reduced, scaled and clipped in float32 on the
        float32 master copies, AdamW steps those, and the model gets them back rounded to its dtype.
        """
        model_params = list(self.model.parameters())
        stepped = self._master or model_params
        params = [(p, s) for p, s in zip(model_params, stepped) if p.requires_grad]
        for p, s in params:
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            s.grad = grad.float() if s is not p else grad
        if self.distributed:
            flat = torch.cat([s.grad.reshape(-1) for _, s in params])
            dist.all_reduce(flat)
            offset = 0
            for _, s in params:
                s.grad.copy_(flat[offset : offset + s.numel()].view_as(s))
                offset += s.numel()
        total = self._totals.reduce(dist.all_reduce if self.distributed else None)
        scale = 1.0 / normaliser(self.grpo, num_tokens=total.num_tokens, num_samples=total.num_samples)
        for _, s in params:
            s.grad.mul_(scale)
        grad_norm = clip_grad_norm([s.grad for _, s in params], self.cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self._master is not None:
            with torch.no_grad():
                for p, s in zip(model_params, self._master):
                    p.copy_(s)
                    p.grad = None
        self._totals = BatchTotals()
        return BatchResult(loss=total.loss * scale, grad_norm=grad_norm, num_tokens=total.num_tokens,
                           num_clipped_tokens=total.num_clipped_tokens, entropy_sum=total.entropy_sum)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy under HF names on the CPU (tied lm_head left out, as save_pretrained does)."""
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return state

    def save_weights(self, path: Path) -> float:
        """Write the policy as one safetensors file (HF names) atomically; returns seconds spent."""
        start = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in self.hf_state().items()}, str(tmp), metadata={"format": "pt"})
        tmp.rename(path)
        return time.time() - start

    def hf_model(self) -> torch.nn.Module:
        """The policy as an HF model (for save_pretrained): the trained model itself."""
        return self.model

    # -- helpers ---------------------------------------------------------------------------------
    def _old_logprobs(self, samples, input_ids, targets, logprobs, mask, first_batch_of_step):
        if self.old_logprobs is OldLogprobSource.engine:
            return engine_logprobs(samples, like=logprobs)
        if first_batch_of_step or self._snapshot is None:
            return logprobs.detach()
        with torch.no_grad():
            return self._logprobs(input_ids, targets, mask, params=self._snapshot)[0] * mask

    def _logprobs(self, input_ids, targets, mask, params=None) -> tuple[torch.Tensor, ...]:
        """log p of ``targets`` and the entropy [B, L-1] under the model (or under ``params``, policy_version k's
        snapshot): from the final hidden states of the response tokens (``mask``), ``trainer.logprob_chunk_tokens``
        at a time, when the model allows it (zeros elsewhere); else from the model's full logits.

        No attention mask: padding is on the right, so under the causal mask no real token sees one, and a purely
        causal SDPA call can take the flash / memory-efficient kernels (no [B, 1, L, L] mask is built)."""
        if self._head is not None:
            args = (input_ids, targets, mask)
            if params is None:
                return self._head(*args)
            return torch.func.functional_call(self._head, {f"lm.{k}": v for k, v in params.items()}, args)
        kwargs = {"input_ids": input_ids}
        logits = (self.model(**kwargs) if params is None
                  else torch.func.functional_call(self.model, params, (), kwargs)).logits[:, :-1]
        return token_logprobs(logits, targets, self.temperature), token_entropy(logits, self.temperature)


def pack(samples: list[TrainSample], *, pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded token ids [B, L], next-token targets [B, L-1], and the response-token mask [B, L-1].

    The mask is float32 whatever the model's dtype: it only multiplies the loss, and token counts come from its
    non-zeros (grpo.policy_loss_sums), so they are exact integers in bfloat16 too."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    length = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length - 1), dtype=torch.float32)
    for b, (s, seq) in enumerate(zip(samples, seqs)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        # logits at position j predict token j + 1: response tokens are predicted from P - 1 .. P + R - 2
        mask[b, len(s.prompt_ids) - 1 : len(seq) - 1] = 1.0
    return input_ids, input_ids[:, 1:], mask


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> float:
    """The 2-norm of all ``grads``, and the clip ``torch.nn.utils.clip_grad_norm_`` does (coefficient
    max_norm / (norm + 1e-6), applied when below 1). Each tensor's sum of squares is taken in float32 with torch's
    cascade sum and the sums are added in float64: about 2e-8 relative at 50M elements, where clip_grad_norm_'s
    float32 vector_norm is 3.9e-3 off (measured on CPU), enough to move a clipped update."""
    total = sum((sum_of_squares(g) for g in grads), torch.zeros((), dtype=torch.float64))
    norm = float(total.sqrt())
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
    return norm


def sum_of_squares(grad: torch.Tensor) -> torch.Tensor:
    """In float64; the squares in the gradient's dtype, or float32 for a 16-bit one."""
    wide = grad if grad.dtype in (torch.float32, torch.float64) else grad.float()
    return wide.pow(2).sum().double()


def engine_logprobs(samples: list[TrainSample], *, like: torch.Tensor) -> torch.Tensor:
    """The engine's log-probs of the response tokens, laid out like the trainer's [B, L-1]."""
    old = torch.zeros_like(like)
    for b, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        old[b, start : start + len(s.engine_logprobs)] = torch.tensor(s.engine_logprobs, dtype=old.dtype)
    return old


def _chunkable(model) -> bool:
    """An HF causal LM whose logits are just its output embedding of the decoder's last hidden states (Qwen2/3,
    Llama: no logit soft-capping or scaling after the head)."""
    config = getattr(model, "config", None)
    return (hasattr(model, "get_decoder") and model.get_output_embeddings() is not None
            and not getattr(config, "final_logit_softcapping", None) and not getattr(config, "logit_scale", None))


class _HiddenToLogprobs(torch.nn.Module):
    """The response tokens' log-probs and entropy from the decoder's hidden states (trainer/logprobs.py)."""

    def __init__(self, lm: torch.nn.Module, chunk_tokens: int, temperature: float) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.lm.get_decoder()(input_ids=input_ids).last_hidden_state
        response = mask > 0  # [B, L-1]; position j predicts token j + 1
        head = self.lm.get_output_embeddings()
        logp, entropy = chunked_logprobs(hidden[:, :-1][response], head.weight, head.bias, targets[response],
                                         temperature=self.temperature, chunk_tokens=self.chunk_tokens)
        full = torch.zeros(targets.shape, dtype=logp.dtype, device=logp.device)
        return full.masked_scatter(response, logp), full.masked_scatter(response, entropy)
