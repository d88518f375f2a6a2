"""The trainer node group's config (``trainer.*``): backend, ranks, optimizer, where old log-probs come from."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TrainerBackend(enum.Enum):
    """``trainer.backend``; backend.trainer_class names each value's class."""

    torch = "torch"
    """torch_backend.PolicyTrainer: the HF model, torch AdamW, data parallel over gloo."""
    fsdp = "fsdp"
    """fsdp_backend.FSDPTrainer: the HF model sharded with FSDP2 (params, grads, AdamW state) over the ranks."""
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
    distributed_optimizer: bool | None = None
    """Megatron's DistributedOptimizer: AdamW state and float32 master weights sharded over the data-parallel ranks.
    null: true on a GPU, false on the CPU (where true runs too, under trainer/megatron/cpu.py's redirection) and for
    float64 (which it refuses). Resolved, and true with float64 refused, by megatron/optimizer.py."""
    ddp_bucket_size: int | None = None
    """Parameters per bucket of Megatron DDP's buffers under the distributed optimizer (Megatron's
    ``--ddp-bucket-size``); null: Megatron's default, max(40M, 1M x data-parallel size). The step's last update is
    stepped and all-gathered one such bucket at a time, as weight sync reaches its parameters (megatron/optimizer.py
    ``ParamSyncByBucket``), so the first weight-sync buckets leave while the last are updated."""


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
    ref_model_path: str | None = None
    """With grpo.kl_loss_coef > 0: the reference model's HF directory; null: model.path (the initial policy)."""
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
    pack_sequences: bool | None = None
    """The torch and FSDP backends: a micro-batch's sequences as one row without padding, each attending only to
    itself (trainer/packing.py), instead of right-padded rows: no compute on padding. null: on a GPU. Needs the
    log-prob chunks (trainer.logprob_chunk_tokens > 0, a model whose logits are its head's output)."""
    exact_accumulation: bool = False
    """Sum each training batch's gradient exactly (int64 bins, exact_sum.py), with micro-batches made of one
    group each: the update is then the same bits in any arrival order and on any number of ranks (sync, cgp, cgp+FGD;
    with rollout.batch_invariant the runs are bit-identical). Costs 26 bytes per parameter (per shard element on
    FSDP) and smaller micro-batches. Every backend (Megatron: over data-parallel ranks at a fixed tensor-parallel
    size, whose own float reductions do not depend on arrival)."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"trainer.num_ranks={self.num_ranks} must be >= 1.")
        if self.lr <= 0:
            raise ValueError(f"trainer.lr={self.lr} must be > 0.")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"trainer.logprob_chunk_tokens={self.logprob_chunk_tokens} must be >= 0 (0: no chunks).")
        tp, pp = self.megatron.tensor_parallel_size, self.megatron.pipeline_parallel_size
        if self.backend is not TrainerBackend.megatron and (tp, pp) != (1, 1):
            raise ValueError("trainer.megatron.* parallel sizes need trainer.backend=megatron.")
        if self.megatron.ddp_bucket_size is not None and self.megatron.ddp_bucket_size < 1:
            raise ValueError(f"trainer.megatron.ddp_bucket_size={self.megatron.ddp_bucket_size} must be >= 1 "
                             "(parameters per bucket), or null for Megatron's default.")
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


class PolicyLoss(enum.Enum):
    """``grpo.policy_loss`` (slime ``--advantage-estimator``, verl ``actor.policy_loss.loss_mode``); grpo.py."""

    grpo = "grpo"
    """PPO's token-level clipped surrogate (verl: vanilla)."""
    gspo = "gspo"
    """The sequence-level ratio exp(mean_t log ratio), clipped per sequence (Zheng et al., 2025)."""
    cispo = "cispo"
    """-sg(clip(ratio)) * A * log p: the clipped ratio weighs the token's log-prob (MiniMax-M1)."""


class RolloutCorrection(enum.Enum):
    """``grpo.rollout_correction``: how the trainer/engine log-prob gap weighs the policy loss (grpo.py)."""

    none = "none"
    token_tis = "token_tis"
    """Per token, min(ratio, tis_clip) (slime ``--use-tis``; verl ``rollout_is=token``)."""
    seq_tis = "seq_tis"
    """Per sequence, min(prod_t ratio, tis_clip) (verl ``rollout_is=sequence``)."""
    token_mis = "token_mis"
    """Per token, the ratio inside [tis_clip_low, tis_clip]; tokens outside leave the loss and its normaliser (slime's
    icepop; verl ``rollout_rs``)."""
    seq_mis = "seq_mis"
    """Per sequence, prod_t ratio inside [tis_clip_low, tis_clip]; sequences outside leave the loss."""


class KLLossType(enum.Enum):
    """``grpo.kl_loss_type`` (slime ``--kl-loss-type``): the per-token estimator of KL(policy || reference)."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"
    low_var_kl = "low_var_kl"
    """k3 clamped to [-10, 10] (verl's default)."""


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    normalize_advantage_std: bool = True
    eps_clip: float = 0.2
    """Lower clip range: ratio >= 1 - eps_clip."""
    eps_clip_high: float = 0.2
    """Upper clip range: ratio <= 1 + eps_clip_high (0.28 is DAPO's clip-higher)."""
    loss_agg: LossAggregation = LossAggregation.token_mean
    policy_loss: PolicyLoss = PolicyLoss.grpo
    """grpo, gspo or cispo (slime ``--advantage-estimator``; verl ``actor.policy_loss.loss_mode``)."""
    rollout_correction: RolloutCorrection = RolloutCorrection.none
    """Weigh (TIS) or mask (MIS) the policy loss by ratio = exp(trainer old log-prob - engine log-prob), so a step
    trains on what the trainer's policy would have sampled (slime ``--use-tis``; verl ``algorithm.rollout_correction``).
    Needs the engine's log-probs of every response token."""
    tis_clip: float = 2.0
    """TIS: the cap of the weight; MIS: the upper edge of the band kept (slime ``--tis-clip``; verl
    ``rollout_is_threshold``)."""
    tis_clip_low: float = 0.0
    """TIS: the floor of the weight; MIS: the lower edge of the band kept (slime ``--tis-clip-low``)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL to the frozen initial policy in the loss; > 0 keeps a reference model on every trainer rank
    (slime ``--use-kl-loss --kl-loss-coef``; verl ``actor.use_kl_loss``, ``actor.kl_loss_coef``)."""
    kl_loss_type: KLLossType = KLLossType.k1
    """The KL estimator (slime ``--kl-loss-type``, default k1; verl ``actor.kl_loss_type``, default low_var_kl)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss gets -entropy_coef x the policy's entropy (slime ``--entropy-coef``; verl
    ``actor.entropy_coeff``)."""

    def __post_init__(self) -> None:
        for key in ("eps_clip", "eps_clip_high"):
            if not 0.0 < getattr(self, key) < 1.0:
                raise ValueError(f"grpo.{key}={getattr(self, key)} must be in (0, 1); 0.2 is the usual value.")
        if not 0.0 <= self.tis_clip_low < self.tis_clip:
            raise ValueError(f"grpo.tis_clip_low={self.tis_clip_low} and grpo.tis_clip={self.tis_clip} must satisfy "
                             "0 <= tis_clip_low < tis_clip; slime's recipes use tis_clip=2.0, tis_clip_low=0.")
        for key in ("kl_loss_coef", "entropy_coef"):
            if getattr(self, key) < 0.0:
                raise ValueError(f"grpo.{key}={getattr(self, key)} must be >= 0 (0 turns the term off).")

    @property
    def corrects_rollout(self) -> bool:
        return self.rollout_correction is not RolloutCorrection.none
