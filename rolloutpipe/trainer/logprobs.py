"""The chosen tokens' log-probs (and the policy's entropy) from final hidden states, without full logits.

A policy's logits are [tokens, vocabulary]: Qwen3's vocabulary is 151,936 entries, 0.3 MB per token in bfloat16 and
0.6 MB again for a float32 log-softmax, so a 10k-token sample would need gigabytes for what is one number per
token. ``chunked_logprobs`` computes, for ``chunk_tokens`` hidden states at a time, the logits of the output layer,
their log-sum-exp, the target's log-prob and the entropy, and keeps only the log-sum-exp (one float per token).
Backward recomputes each chunk's logits and forms the gradient of the log-softmax directly,

    d logp_t / d z_j = [j == target_t] - softmax(z_t)_j,        z = logits / temperature,

and the entropy's, d H_t / d z_j = -softmax(z_t)_j (log softmax(z_t)_j + H_t) (grpo.entropy_coef), from the same
softmax, so peak memory per token does not grow with the vocabulary; the price is one more [chunk, hidden] x [hidden,
vocabulary] matmul per chunk but the last (backward needs its softmax first, right after forward: it is kept). The
arithmetic is the full log-softmax's (float32 at least, the logits in the model's dtype, the gradient cast back to
it before the output layer's matmuls, as autograd does there), so values and gradients equal ``token_logprobs`` on
the full logits up to the order of additions (tests/unit/test_logprobs.py, tests/unit/test_trainer.py).

Vocabulary parallel (Megatron's tensor parallelism): each rank holds rows [vocab_start, vocab_start + V_local) of
the output layer; max, sum of exponentials, the target's logit and the entropy's sum are all-reduced over the
tensor-parallel group per chunk (as Megatron's own vocab-parallel cross entropy does), and so is the hidden states'
gradient (the column-parallel output layer's input is replicated). Rows past the real vocabulary (Megatron pads it
to a multiple of 128 x tp) take no part, as if the logits had been sliced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class VocabShard:
    """This rank's rows of the output layer: [start, start + weight rows), of which ``num_real`` count."""

    start: int = 0
    num_real: int | None = None
    """Rows of this shard inside the real vocabulary (None: all)."""
    group: object = None
    """The tensor-parallel process group (None: the whole vocabulary is here)."""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p of ``targets`` [B, T] from ``logits`` [B, T, V], in float32 at least (a bfloat16 log-softmax over the
    vocabulary is off by ~1e-2, the scale of a policy ratio's clip range)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float, *, grad: bool = False) -> torch.Tensor:
    """The entropy [B, T] of softmax(logits / temperature), float32 at least, with gradient if ``grad``."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
        return -(logp.exp() * logp).sum(-1)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     *, temperature: float, chunk_tokens: int,
                     shard: VocabShard = VocabShard()) -> tuple[torch.Tensor, torch.Tensor]:
    """log p of ``targets`` [N] and the entropy [N] (both with gradient) from ``hidden`` [N, H] and the output layer
    ``weight`` [V_local, H] (``bias`` [V_local] or None); both float32 at least."""
    return _ChunkedLogprobs.apply(hidden, weight, bias, targets, _Spec(temperature, chunk_tokens, shard))


@dataclass(frozen=True, slots=True)
class _Spec:
    temperature: float
    chunk_tokens: int
    shard: VocabShard

    def real_rows(self, weight: torch.Tensor) -> int:
        rows = weight.shape[0]
        return rows if self.shard.num_real is None else max(0, min(rows, self.shard.num_real))

    def scaled_logits(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """z = logits / temperature [c, real rows], float32 at least (a fresh tensor the caller may overwrite)."""
        rows = self.real_rows(weight)
        logits = torch.nn.functional.linear(h, weight[:rows], None if bias is None else bias[:rows])
        wide = torch.promote_types(logits.dtype, torch.float32)
        return logits.to(wide).div_(self.temperature)  # in place: no third [c, rows] tensor at once

    def all_reduce(self, values: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        if self.shard.group is not None:
            dist.all_reduce(values, op=op, group=self.shard.group)

    def local_targets(self, t: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Targets as this shard's column indices (0 where not here), and where they are here."""
        local = t - self.shard.start
        here = (local >= 0) & (local < rows)
        return torch.where(here, local, 0), here


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: _Spec):
        n, wide = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logp, entropy, lse = (torch.empty(n, dtype=wide, device=hidden.device) for _ in range(3))
        rows = spec.real_rows(weight)
        # backward starts with the last chunk, right after forward: its softmax is kept rather than recomputed (its
        # buffer would be allocated then anyway), which saves a matmul per micro-batch, all of it for one chunk
        ctx.last_softmax = None
        keep_last = any(ctx.needs_input_grad[:3])
        for start in range(0, n, spec.chunk_tokens):
            end = min(start + spec.chunk_tokens, n)
            z = spec.scaled_logits(hidden[start:end], weight, bias)  # [c, rows]
            top = z.amax(-1) if rows else torch.full((end - start,), -torch.inf, dtype=wide, device=z.device)
            spec.all_reduce(top, op=dist.ReduceOp.MAX)
            z.sub_(top[:, None])
            local, here = spec.local_targets(targets[start:end], rows)
            picked = torch.zeros_like(top)
            if rows:
                picked = torch.where(here, z.gather(-1, local[:, None]).squeeze(-1), picked)
            p = z.exp()
            weighted = (p[:, None, :] @ z[:, :, None]).view(-1)  # sum exp * z, row by row, p kept
            sums = torch.stack([picked, p.sum(-1), weighted])  # target logit, sum exp, sum exp * z
            spec.all_reduce(sums)
            picked, total, weighted = sums
            log_total = total.log()
            logp[start:end] = picked - log_total
            entropy[start:end] = log_total - weighted / total
            lse[start:end] = top + log_total
            if keep_last and end == n and rows:
                ctx.last_softmax = p.div_(total[:, None])
            del z, p  # before the next chunk's logits exist: one chunk's [c, rows] tensors at a time
        ctx.spec = spec
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.set_materialize_grads(False)  # an unused entropy gets None: no entropy term in backward
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        spec: _Spec = ctx.spec
        rows = spec.real_rows(weight)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # summed over chunks in float32 at least: one bfloat16 rounding per chunk, not per running sum
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        n, last, ctx.last_softmax = hidden.shape[0], ctx.last_softmax, None
        for start in reversed(range(0, n, spec.chunk_tokens)):  # the last chunk first: its softmax is freed first
            end = min(start + spec.chunk_tokens, n)
            if not rows:
                continue
            h, g = hidden[start:end], grad_logp[start:end]
            if end == n and last is not None:
                softmax, last = last, None
            else:
                softmax = spec.scaled_logits(h, weight, bias).sub_(lse[start:end, None]).exp_()
            if grad_entropy is not None:  # -g_H p (log p + H), before softmax becomes the log-prob's gradient
                entropy_term = (torch.xlogy(softmax, softmax) + softmax * entropy[start:end, None]).mul_(
                    -grad_entropy[start:end, None])
            grad_z = softmax.mul_(-g[:, None])  # -g * softmax
            if grad_entropy is not None:
                grad_z.add_(entropy_term)
                del entropy_term
            local, here = spec.local_targets(targets[start:end], rows)
            grad_z.scatter_add_(-1, local[:, None], torch.where(here, g, 0.0)[:, None])
            grad_logits = grad_z.div_(spec.temperature).to(hidden.dtype)
            if grad_h is not None:
                grad_h[start:end] = grad_logits @ weight[:rows]
            if grad_w is not None:
                if grad_w.dtype == h.dtype:
                    grad_w[:rows].addmm_(grad_logits.T, h)
                else:
                    grad_w[:rows] += grad_logits.T @ h
            if grad_b is not None:
                grad_b[:rows] += grad_logits.sum(0)
            del softmax, grad_z, grad_logits  # as in forward
        if grad_h is not None:
            spec.all_reduce(grad_h)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), grad_b, None, None
