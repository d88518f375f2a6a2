"""What a trainer backend is (``PolicyBackend``: every call the trainer node, pipeline.py and weight sync make on
it) and which ones exist (``trainer_class``: the one place that maps ``trainer.backend`` to a class).

A new backend is one module, usually a ``grpo_trainer.GRPOTrainer`` subclass (the GRPO micro-batch body and the
batch's update are written there once), plus one ``case`` below and its value in config.TrainerBackend.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import torch

from rolloutpipe.control.checkpoint import Shard, ShardedState
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.grpo import LossSums
from rolloutpipe.trainer.grpo_trainer import BatchResult, TrainSample


@runtime_checkable
class PolicyBackend(Protocol):
    """One trainer rank's policy, its optimizer and its part of the data-parallel group."""

    data_parallel_rank: int
    """Which share of the groups this rank trains (tensor-parallel peers share one)."""
    data_parallel_size: int
    optimizer: Any
    """Its ``state_dict`` / ``load_state_dict`` are what checkpoints hold (control/checkpoint.py)."""
    collective_micro_batches: bool
    """Every forward/backward is a collective of the data-parallel ranks (FSDP's gathers): the consume loop has
    every rank run as many per training batch, padding with ``forward_backward([])``."""
    bucket_bytes: int
    """pipeline.weight_sync_bucket_mb: a sharded backend gathers the unsharded policy this much at a time."""
    sharded_checkpoint: bool
    """Each rank checkpoints its own shards (a ``ShardedBackend``: FSDP, Megatron's distributed optimizer); else rank 0
    checkpoints the whole ``optimizer.state_dict()``."""

    def __init__(self, *, model: torch.nn.Module, cfg: TrainerConfig, grpo: GRPOConfig, temperature: float,
                 pad_id: int, multi_step: bool, process_group_active: bool,
                 old_logprobs: OldLogprobSource) -> None: ...

    def sum_exactly(self, num_samples_per_batch: int) -> None:
        """trainer.exact_accumulation: sum each batch's micro-batch gradients exactly (exact_sum.py); a backend that
        cannot refuses here, at start."""

    def begin_step(self) -> None:
        """At the start of each RL step, before its first micro-batch."""

    def forward_backward(self, samples: list[TrainSample], *, first_batch_of_step: bool) -> LossSums:
        """One micro-batch: accumulate the gradient of its loss sum; communicates nothing."""

    def finish_batch(self, *, defer_update: bool = False) -> BatchResult:
        """The training batch is complete (on every rank): its one optimizer step. ``defer_update`` (the step's last
        batch, on every rank): applied bucket by bucket as trainer rank 0's ``hf_buckets`` yields, where the backend
        can (grpo_trainer.py: on rank 0, or on every rank where a collective finishes it)."""

    def apply_deferred_update(self) -> None:
        """Apply what ``hf_buckets`` has not of a deferred update (nothing if none)."""

    def load_reference(self, model: torch.nn.Module) -> None:
        """Keep the HF ``model`` frozen as the reference of grpo.kl_loss_coef (GRPOTrainer's, through its hook
        ``_reference_params``); a backend that cannot refuses here, at start."""

    def writer_reads(self) -> contextlib.AbstractContextManager:
        """Every rank enters it around trainer rank 0's reads of the policy (``hf_state``, ``hf_buckets``,
        ``hf_model``, ``optimizer.state_dict``); a sharded backend's other ranks join rank 0's gathers inside it."""

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy under HF names, full tensors on the CPU (what weight sync sends)."""

    def hf_model(self) -> torch.nn.Module:
        """The policy as an HF model with the trained weights (checkpoints, the final policy)."""

    def close(self) -> None:
        """Release what the backend holds beyond its Python objects."""


@runtime_checkable
class ShardedBackend(PolicyBackend, Protocol):
    """A backend with ``sharded_checkpoint``: every rank checkpoints its own rows of the training state."""

    def training_shards(self) -> dict[str, Shard]:
        """This rank's rows of the training state (control/checkpoint.py), as views."""

    def load_training_shards(self, state: ShardedState, param_groups: list[dict]) -> None:
        """A sharded checkpoint, of any number of ranks, into this rank's shards."""


def trainer_class(backend: TrainerBackend) -> type[PolicyBackend]:
    """The class of ``trainer.backend``; each is imported only when chosen (Megatron is heavy, and optional)."""
    match backend:
        case TrainerBackend.torch:
            from rolloutpipe.trainer.torch_backend import PolicyTrainer as chosen
        case TrainerBackend.fsdp:
            from rolloutpipe.trainer.fsdp_backend import FSDPTrainer as chosen
        case TrainerBackend.megatron:
            from rolloutpipe.trainer.megatron.trainer import MegatronTrainer as chosen
    return chosen
