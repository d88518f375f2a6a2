"""The trainer node group's config (``trainer.*``): backend, ranks, optimizer, where old log-probs come from."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TrainerBackend(enum.Enum):
    """``trainer.backend``; backend.trainer_class names each value's class."""

    torch = "torch"
    """torch_backend.PolicyTrainer: the HF model, torch AdamW, data parallel over gloo."""
    megatron = "megatron"
    """rolloutpipe.trainer.megatron.MegatronTrainer: Megatron-core GPTModel, DDP and optimizer (tensor parallel)."""


class OldLogprobSource(enum.Enum):
    trainer = "trainer"
    engine = "engine"


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    """Parallelism of ``trainer.backend=megatron``; data parallel = num_ranks / (tensor * pipeline)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    backend: TrainerBackend = TrainerBackend.torch
    num_ranks: int = 1
    """Trainer processes (gloo on CPU): data parallel, times Megatron's model parallelism."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0
    old_logprobs: OldLogprobSource = OldLogprobSource.trainer
    num_threads: int | None = None
    """torch intra-op threads per rank; null: the CPUs the launcher gave this rank."""
    logprob_chunk_tokens: int = 1024
    """Torch backend: the chosen tokens' log-probs come from the final hidden states this many tokens at a time,
    each chunk's logits recomputed in backward, so no [tokens, vocabulary] logits tensor outlives its chunk (Qwen3's
    151,936-entry vocabulary: 0.6 MB per token in bf16, and again in float32 for the log-softmax). 0: the whole
    micro-batch at once (the model's own forward)."""
    recompute: bool = False
    """Activation recomputation: keep only each decoder layer's input and recompute the layer in backward (about a
    third more compute; the activations of all but one layer are not kept)."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"trainer.num_ranks={self.num_ranks} must be >= 1.")
        if self.lr <= 0:
            raise ValueError(f"trainer.lr={self.lr} must be > 0.")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"trainer.logprob_chunk_tokens={self.logprob_chunk_tokens} must be >= 0 (0: no chunks).")
        tp, pp = self.megatron.tensor_parallel_size, self.megatron.pipeline_parallel_size
        if self.backend is TrainerBackend.torch and (tp, pp) != (1, 1):
            raise ValueError("trainer.megatron.* parallel sizes need trainer.backend=megatron.")
        if tp < 1 or pp < 1:
            raise ValueError(f"trainer.megatron.tensor_parallel_size={tp} and pipeline_parallel_size={pp} "
                             "must be >= 1.")
        if pp > 1:
            raise ValueError(
                f"trainer.megatron.pipeline_parallel_size={pp} is not supported yet: the trainer trains each "
                "micro-batch as its groups arrive, while Megatron's pipeline schedule needs all of a batch's "
                "micro-batches in one call. Use tensor_parallel_size and data parallel ranks."
            )
        if self.num_ranks % (tp * pp):
            raise ValueError(
                f"trainer.num_ranks={self.num_ranks} must be a multiple of trainer.megatron.tensor_parallel_size"
                f" * pipeline_parallel_size = {tp * pp} (data parallel = num_ranks / (tp * pp))."
            )

    @property
    def data_parallel_size(self) -> int:
        return self.num_ranks // (self.megatron.tensor_parallel_size * self.megatron.pipeline_parallel_size)


class LossAggregation(enum.Enum):
    token_mean = "token_mean"
    seq_mean_token_mean = "seq_mean_token_mean"


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    normalize_advantage_std: bool = True
    eps_clip: float = 0.2
    """Lower clip range: ratio >= 1 - eps_clip."""
    eps_clip_high: float = 0.2
    """Upper clip range: ratio <= 1 + eps_clip_high (0.28 is DAPO's clip-higher)."""
    loss_agg: LossAggregation = LossAggregation.token_mean

    def __post_init__(self) -> None:
        for key in ("eps_clip", "eps_clip_high"):
            if not 0.0 < getattr(self, key) < 1.0:
                raise ValueError(f"grpo.{key}={getattr(self, key)} must be in (0, 1); 0.2 is the usual value.")
