"""MegatronTrainer: the GRPO update of ``grpo_trainer.GRPOTrainer`` over Megatron-core.

Same micro-batch body, loss and consume loop as the torch backend (grpo_trainer.py): every micro-batch
backpropagates the *sum* of its samples' losses into Megatron DDP's gradient buffers (no
communication), and ``finish_batch`` makes the batch's one update: Megatron's finalize_model_grads
sums the buffers over the data-parallel group (``calculate_per_token_loss`` makes DDP sum rather than
average), the gradients are scaled once by 1 / normaliser, and Megatron's optimizer (fp32 Adam,
decoupled weight decay on every parameter, as the torch backend's AdamW) clips by the global norm and
steps. Which data-parallel rank trained which group changes only the order of additions, so the
pipelined update equals the synchronous one here as well. With ``trainer.megatron.distributed_optimizer``
(null: on a GPU) the optimizer is Megatron's DistributedOptimizer: finalize_model_grads reduce-scatters the
buffers instead, each rank steps its 1/N of the master weights and moments, and the step all-gathers the
parameters (optimizer.py); checkpoints are then sharded as FSDP's are (``sharded_checkpoint``: every rank copies and
writes its own shards, nothing gathered). With ``trainer.exact_accumulation`` each
micro-batch's gradient is taken from DDP's buffers into an exact integer sum (exact_sum.py), and the reduced sum goes
back into data-parallel rank 0's buffers before finalize_model_grads (``_optimizer_step``).

Parallelism. Trainer ranks form tensor-parallel groups of ``trainer.megatron.tensor_parallel_size``
consecutive ranks; the consume loop deals groups by data-parallel rank, so the ranks of one
tensor-parallel group train the same samples. Log-probs come from the final hidden states, by chunks of
``trainer.logprob_chunk_tokens`` tokens, over each rank's shard of the vocabulary (trainer/logprobs.py: no
logits are gathered, none outlive their chunk). Megatron's
forward_backward schedules are not used: they need a batch's micro-batches up front and sync
gradients at the end of every call, while groups here arrive one by one and ranks may train different
numbers of micro-batches. That is also why pipeline parallelism is refused (TrainerConfig).

Weights out. The engines and checkpoints take HF tensors, which trainer rank 0 maps from Megatron's parameters
bucket by bucket (``pipeline.weight_sync_bucket_mb``) when the policy is read (``hf_buckets``, ``hf_model``,
``hf_state``), straight into where they go (convert.py ``write_hf``: each byte copied once, no HF state dict in
between). Without tensor parallelism it reads its own parameters where they lie (on its GPU). With it, the ranks of
its tensor-parallel group join its reads inside ``writer_reads`` (lead.py, as FSDP's ranks do) and all-gather each
bucket's parameters as its turn comes: rank 0's host holds one bucket of them, never the policy. Weight sync's
buckets are mapped into reused flat buffers (buckets.py ``BUCKETS_HELD``, page-locked on a GPU), so mapping the next
bucket overlaps sending this one and a broadcast sends each as it lies (buckets.py ``packed``); ``hf_model`` maps
into the HF model's own parameters.
Only trainer rank 0 keeps the HF model; the other ranks drop it once it is mapped.

The step's last update by bucket (grpo_trainer.py). With the replicated optimizer, rank 0's last optimizer step of
a rollout step runs Megatron's ``step`` up to its inner step (gradients prepared, their global norm taken and
clipped), and ``_update`` applies the rest to each bucket's Megatron parameters before that bucket is mapped
(optimizer.py ``ReplicatedState.step_only``: torch's Adam on them, the float32 masters copied into 16-bit
parameters), so the first buckets leave while the last are updated. With the distributed optimizer every
data-parallel rank defers it (``deferred_on_every_rank``): each DDP bucket group (``trainer.megatron.ddp_bucket_size``
parameters) is stepped on every rank's shards and all-gathered when rank 0's reads first reach one of its parameters
(optimizer.py ``ParamSyncByBucket``); the other ranks make the same all-gathers in the same order inside
``writer_reads`` (``_walk``).

CPU. Without CUDA every Megatron call runs inside ``cpu.cuda_calls_on_cpu()``, which redirects
Megatron's CUDA-only calls: every dtype and both optimizers (the bf16 one and the distributed one included) run
there on gloo, which is how the tests run the GPU path's optimizer code. With CUDA it is Megatron's own code,
untouched (tools/gpu_check.py runs it on a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from rolloutpipe.control.checkpoint import Shard, ShardedState
from rolloutpipe.control.weights.buckets import BUCKETS_HELD, Bucket, BufferRing
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.exact_sum import ExactGradientSum
from rolloutpipe.trainer.grpo_trainer import GRPOTrainer
from rolloutpipe.trainer.lead import LeadReads, led
from rolloutpipe.trainer.logprobs import VocabShard, chunked_logprobs
from rolloutpipe.trainer.megatron import cpu
from rolloutpipe.trainer.megatron.convert import (
    Layout,
    bucket_sources,
    hf_plan,
    hf_sources,
    hf_to_megatron,
    local_names,
    map_bucket,
    transformer_engine_names,
    write_hf,
)
from rolloutpipe.trainer.megatron.model import (
    build_gpt_model,
    check_supported,
    destroy_parallel_state,
    init_parallel_state,
    uses_transformer_engine,
)
from rolloutpipe.trainer.megatron.optimizer import (
    DistributedShards,
    ParamSyncByBucket,
    ReplicatedState,
    megatron_optimizer_configs,
    resolve_distributed_optimizer,
    without_overlap,
)

_GATHER = 1
"""Rank 0's request to the other ranks inside ``writer_reads`` (lead.py): join the gathers of the policy's buckets."""


class MegatronTrainer(GRPOTrainer):
    def __init__(self, *, model: torch.nn.Module, cfg: TrainerConfig, grpo: GRPOConfig, temperature: float,
                 pad_id: int, multi_step: bool, process_group_active: bool, old_logprobs: OldLogprobSource) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer

        super().__init__(cfg=cfg, grpo=grpo, temperature=temperature, pad_id=pad_id, multi_step=multi_step,
                         old_logprobs=old_logprobs)
        self._hf = model
        """The HF model the weights came from; ``hf_model`` loads the trained weights back into it."""
        self.dtype = next(model.parameters()).dtype
        tp, pp = cfg.megatron.tensor_parallel_size, cfg.megatron.pipeline_parallel_size
        self.distributed_optimizer = resolve_distributed_optimizer(
            cfg.megatron.distributed_optimizer, cuda=self.device is not None, dtype=str(self.dtype).split(".")[-1])
        """Megatron's DistributedOptimizer (optimizer.py); resolved before anything is built."""
        check_supported(model.config, tp_size=tp)
        self.layout = Layout.from_hf(model.config, tp_size=tp)
        with cpu.cuda_calls_on_cpu():
            self._created_world = init_parallel_state(tp_size=tp, pp_size=pp)
            self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            self.dp_group = parallel_state.get_data_parallel_group()
            self.data_parallel_rank = parallel_state.get_data_parallel_rank()
            self.data_parallel_size = parallel_state.get_data_parallel_world_size()
            self.all_reduce = functools.partial(dist.all_reduce, group=self.dp_group)
            self.transformer_engine = uses_transformer_engine()
            self.gpt = build_gpt_model(model.config, dtype=self.dtype, tp_size=tp, pp_size=pp,
                                       recompute=cfg.recompute, transformer_engine=self.transformer_engine)
            self._load_hf(model.state_dict())
            if self.device is not None:
                self.gpt.to(self.device)
            padding_idx = model.get_input_embeddings().padding_idx
            if padding_idx is not None:
                self.gpt.embedding.word_embeddings.register_forward_hook(_no_gradient_through(padding_idx))
            ddp_config, optimizer_config = megatron_optimizer_configs(cfg, dtype=self.dtype,
                                                                      distributed=self.distributed_optimizer)
            self.ddp = DistributedDataParallel(config=self.gpt.config, module=self.gpt, ddp_config=ddp_config)
            self.megatron_optimizer = get_megatron_optimizer(optimizer_config, [self.ddp])
        self._param_sync = None
        """The distributed optimizer's deferred update, by DDP bucket group (optimizer.py)."""
        if self.distributed_optimizer:
            without_overlap(self.ddp)
            self._param_sync = ParamSyncByBucket(self.megatron_optimizer, self.ddp)
        self.optimizer = (DistributedShards(self.megatron_optimizer, params=list(self.gpt.parameters()),
                                            tp_rank=self.tp_rank, data_parallel_size=self.data_parallel_size,
                                            tensor_parallel_size=tp)
                          if self.distributed_optimizer else ReplicatedState(self.megatron_optimizer))
        """What checkpoints read and load (optimizer.py); ``megatron_optimizer`` steps."""
        self.updates_by_bucket = (self._param_sync or self.optimizer).steps_in_parts()
        """The replicated optimizer steps a bucket's parameters at a time (``_update``); the distributed one a DDP
        bucket group's, on every rank (``_walk``)."""
        self.deferred_on_every_rank = self.distributed_optimizer
        self.sharded_checkpoint = self.distributed_optimizer
        """The distributed optimizer: every rank checkpoints its own shards (``training_shards``)."""
        self._writer = dist.get_rank() == 0
        if not self._writer:  # only trainer rank 0 reads the policy (hf_state, hf_model): the host copy goes
            self._hf = None
        self._head = _HiddenToLogprobs(self.gpt, self.layout, tp_rank=self.tp_rank, tp_group=self.tp_group,
                                       chunk_tokens=cfg.logprob_chunk_tokens, temperature=temperature)
        self._sources = hf_sources(self.layout)
        self._shapes = [{k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in self._params().items()}
                        for _ in range(tp)]
        """Every tensor-parallel rank's parameters, as meta tensors: what the bucket plan is made from."""
        self._lead = LeadReads(backend="trainer.backend=megatron", device=self.device)
        self._bucket_buffers = BufferRing(BUCKETS_HELD + self.updates_by_bucket, pinned=self.device is not None)
        """The host buffers ``hf_buckets`` maps the buckets into, in turn (one more where the weights-ahead thread
        maps a bucket ahead of the one asked for); page-locked on a GPU, as the parameters are copied off it."""
        self._local_params = local_names(dict(self.gpt.named_parameters()))
        """The parameters under the local spec's names (``Source.name``), themselves: what ``_update`` steps."""

    def sum_exactly(self, num_samples_per_batch: int) -> None:
        self._exact = _BufferSum([p for p in self.gpt.parameters() if p.requires_grad],
                                 num_samples_per_batch=num_samples_per_batch)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy under HF names, new full tensors on the host (trainer rank 0; tied lm_head left out)."""
        state: dict[str, torch.Tensor] = {}
        for bucket, shards in self._read(self._plan()):
            state |= map_bucket(shards, self.layout, bucket, torch.empty(bucket.num_bytes, dtype=torch.uint8),
                                self._sources)
        return state

    def writer_reads(self) -> contextlib.AbstractContextManager:
        """With tensor parallelism or the distributed optimizer, every rank enters it around trainer rank 0's reads of
        the policy and joins its gathers (lead.py, ``_walk``) until rank 0 leaves."""
        if self.layout.tp_size == 1 and self._param_sync is None:
            return contextlib.nullcontext()
        return self._lead.session(self._serve)

    def hf_on_gpu(self) -> bool:
        return False  # rank 0 maps the policy into host buffers

    def _hf_buckets(self) -> tuple[list[Bucket], Iterator[dict[str, torch.Tensor]]]:
        """The policy by buckets, each read and mapped into a flat host buffer only when it is asked for.
        ``BUCKETS_HELD`` buffers (or one more) take the buckets in turn: a bucket's tensors hold until the third
        bucket after it is asked for."""
        buckets = self._plan()
        return buckets, (map_bucket(shards, self.layout, bucket, self._bucket_buffers(index, bucket.num_bytes),
                                    self._sources)
                         for index, (bucket, shards) in enumerate(self._read(buckets)))

    def hf_model(self) -> torch.nn.Module:
        """The HF model with the trained weights (for save_pretrained), mapped into its own parameters; on trainer
        rank 0."""
        state = self._hf.state_dict()  # views of the parameters
        assert self._sources.keys() <= state.keys() and set(state) - set(self._sources) <= {"lm_head.weight"}, (
            sorted(state.keys() ^ self._sources.keys()))
        with torch.no_grad():
            for bucket, shards in self._read(self._plan()):
                for name in bucket.names:
                    write_hf(shards, self.layout, self._sources[name], state[name])
        return self._hf

    def close(self) -> None:
        """Release Megatron's process groups (and the one-rank world group if this trainer made it), and the training
        state: Megatron's DDP hooks and optimizer refer back to the parameters, reference cycles that would keep the
        weights, gradient buffers, master weights and Adam's moments allocated (on the GPU too) until the garbage
        collector's next full pass. (Issue 43's H200 check measured its later trainers with the first one's state
        still there.)"""
        destroy_parallel_state(created_world=self._created_world)
        self.gpt = self.ddp = self.megatron_optimizer = self.optimizer = self._head = self._exact = None
        self._param_sync = self._local_params = None
        self._bucket_buffers = None
        gc.collect()

    def training_shards(self) -> dict[str, Shard]:
        """The distributed optimizer: this rank's ranges of the float32 master weights and Adam's moments (views)."""
        return self.optimizer.shards()

    def load_training_shards(self, state: ShardedState, param_groups: list[dict]) -> None:
        """A sharded checkpoint of any data-parallel size (the same tensor-parallel size) into this rank's ranges."""
        self.optimizer.load_shards(state, param_groups)

    # -- GRPOTrainer's hooks ---------------------------------------------------------------------
    def _policy(self) -> torch.nn.Module:
        return self.gpt

    def _optimizer_step(self, scale: float) -> float:
        """Megatron's finalize_model_grads sums DDP's buffers over the data-parallel group, they are scaled once, and
        Megatron's optimizer clips by the global norm and steps; then the tensor-parallel shards are gathered.

        trainer.exact_accumulation: the buffers are already zero (``_BufferSum`` took each micro-batch's gradient).
        The integer sums are all-reduced, scaled and rounded once, and put in data-parallel rank 0's buffers only,
        so finalize_model_grads' float sum over the ranks adds exact zeros to them: the same bits on any number of
        ranks (an integer 0 scales to +0.0, never -0.0). Its tensor-parallel sums (Qwen3's q/k norms) then see the
        same inputs in every run of a tensor-parallel size."""
        from megatron.core.distributed import finalize_model_grads

        if self._exact is not None:
            self._exact.reduce(self.all_reduce)
            if self.data_parallel_rank == 0:
                grads = self._exact.take(self._exact.params[0].main_grad.dtype, scale=scale)
                for p, grad in zip(self._exact.params, grads, strict=True):
                    p.main_grad.copy_(grad)
            else:
                self._exact.clear()
        finalize_model_grads([self.ddp])
        if self._exact is None:
            self.ddp.scale_gradients(scale)
        if self._deferred:  # summed, scaled and clipped; ``_update`` (``_walk``) steps it, bucket by bucket
            with _inner_step_left_out(self.megatron_optimizer):
                _, grad_norm, _ = self.megatron_optimizer.step()
            if self._param_sync is not None:
                self._param_sync.defer()
            return float(grad_norm)
        _, grad_norm, _ = self.megatron_optimizer.step()
        self._zero_grads()
        return float(grad_norm)

    def _update(self, names: list[str] | None) -> None:
        """The deferred step (replicated optimizer) on the Megatron parameters that the HF tensors ``names`` are
        mapped from (None: every one left); the gradient buffers are zeroed once all are stepped."""
        if self._param_sync is not None:  # the distributed optimizer's groups: ``_walk`` finishes them in step
            if names is None:
                self._param_sync.finish(None)
                self._zero_grads()
            return
        if names is None:
            self.optimizer.step_only(None)
            self._zero_grads()
            return
        self.optimizer.step_only([self._local_params[name] for name in bucket_sources(names, self._sources)])

    def _zero_grads(self) -> None:
        self.ddp.zero_grad_buffer()
        self.megatron_optimizer.zero_grad()

    def _framework_calls(self):
        return cpu.cuda_calls_on_cpu()

    def _logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                  params: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of ``targets`` and the entropy [B, L-1] at the response tokens (zeros elsewhere), under the
        current weights or ``params`` (policy_version k's snapshot); vocabulary parallel (trainer/logprobs.py)."""
        if params is None:
            return self._head(input_ids, targets, mask)
        return torch.func.functional_call(self._head, {f"gpt.{k}": v for k, v in params.items()},
                                          (input_ids, targets, mask))

    def _reference_params(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The reference's weights mapped as the policy's were at start: this rank's tensor-parallel shard."""
        own = dict(self.gpt.named_parameters())
        mapped = self._mapped(model.state_dict())
        return {k: v.detach().to(device=own[k].device, dtype=own[k].dtype) for k, v in mapped.items()}

    # -- helpers ---------------------------------------------------------------------------------
    def _mapped(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF tensors as this rank's GPTModel parameters (its tensor-parallel shard), under their names."""
        own = dict(self.gpt.named_parameters())
        mapped = hf_to_megatron(hf_state, self.layout, tp_rank=self.tp_rank)
        if self.transformer_engine:
            mapped = transformer_engine_names(mapped)
        assert mapped.keys() == own.keys(), sorted(mapped.keys() ^ own.keys())
        return mapped

    def _load_hf(self, hf_state: dict[str, torch.Tensor]) -> None:
        own = dict(self.gpt.named_parameters())
        mapped = self._mapped(hf_state)
        with torch.no_grad():
            for name, value in mapped.items():
                own[name].copy_(value)

    def _params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the local spec's names, detached: where they lie."""
        local = {k: v.detach() for k, v in self.gpt.named_parameters()}
        return local_names(local) if self.transformer_engine else local

    def _plan(self) -> list[Bucket]:
        """The policy's HF buckets (the same on every rank: shapes, dtypes and ``bucket_bytes``)."""
        return hf_plan(self._shapes, self.layout, self.bucket_bytes)

    def _read(self, buckets: list[Bucket]) -> Iterable[tuple[Bucket, list[dict[str, torch.Tensor]]]]:
        """Trainer rank 0: each bucket with the parameters of every tensor-parallel rank it maps from, in turn: its
        own where they lie, or those its group gathers for it (inside ``writer_reads``)."""
        if self.layout.tp_size == 1 and not (self._param_sync and self._param_sync.left):
            params = [self._params()]
            return ((bucket, params) for bucket in buckets)
        self._lead.ask(_GATHER, reads="the policy")
        return led(self._walk(buckets))

    def _serve(self, request: int) -> None:
        assert request == _GATHER, request
        for _ in self._walk(self._plan()):
            pass

    def _walk(self, buckets: list[Bucket]) -> Iterator[tuple[Bucket, list[dict[str, torch.Tensor]] | None]]:
        """Every rank, in step with rank 0's reads, bucket by bucket: the deferred update of the DDP bucket groups
        the bucket reads finished (stepped and all-gathered over the data-parallel ranks), then with tensor
        parallelism the bucket's parameters all-gathered onto the host in rank 0's tensor-parallel group (rank 0
        gets every rank's, the others None); at the end, any group left finished."""
        params, tp = self._params(), self.layout.tp_size
        gathers = tp > 1 and self.data_parallel_rank == 0  # rank 0's tensor-parallel group
        for bucket in buckets:
            names = bucket_sources(bucket.names, self._sources)
            if self._param_sync is not None:
                self._param_sync.finish([self._local_params[name] for name in names])
            shards: list[dict[str, torch.Tensor]] = [params] if tp == 1 else [{} for _ in range(tp)]
            for name in names if gathers else ():
                value = params[name].to("cpu")
                parts = [torch.empty_like(value) for _ in range(tp)]
                dist.all_gather(parts, value, group=self.tp_group)
                for shard, part in zip(shards, parts, strict=True):
                    shard[name] = part
            yield bucket, shards if self.tp_rank == 0 and self.data_parallel_rank == 0 else None
        if self._param_sync is not None:
            self._param_sync.finish(None)

@contextlib.contextmanager
def _inner_step_left_out(optimizer) -> Iterator[None]:
    """Megatron's ``step`` without its last part, ``step_with_ready_grads`` (the inner optimizer's step and the
    masters copied into the parameters): the gradients are prepared, their norm taken and clipped, as Megatron does
    them, and left for ``ReplicatedState.step_only``."""
    optimizer.step_with_ready_grads = lambda: True
    try:
        yield
    finally:
        del optimizer.step_with_ready_grads


class _BufferSum(ExactGradientSum):
    """Megatron DDP adds each micro-batch's gradient into the parameter's ``main_grad`` (a view of its gradient
    buffer), not ``.grad``: the exact sum folds it from there and clears the buffer."""

    def add(self) -> None:
        for i, p in enumerate(self.params):
            self.fold(i, p.main_grad)
            p.main_grad.zero_()
        self.num_micro_batches += 1


def _no_gradient_through(padding_idx: int):
    """HF's nn.Embedding(padding_idx=...): looking up the padding token sends no gradient to its row.

    Megatron's embedding has no padding_idx. The row matters when a sampled response contains the
    padding token: the HF row is zeros, and RMSNorm's gradient at zero is 1 / sqrt(eps).
    """

    def hook(module, inputs, output):
        is_padding = (inputs[0] == padding_idx).unsqueeze(-1)  # [B, L, 1]; output is [B, L, H]
        return torch.where(is_padding, output.detach(), output)

    return hook


class _HiddenToLogprobs(torch.nn.Module):
    """GPTModel's final hidden states (its post_process switched off for the call: no logits) into the response
    tokens' log-probs and entropy, by chunks of tokens, over this rank's vocabulary shard."""

    def __init__(self, gpt: torch.nn.Module, layout: Layout, *, tp_rank: int, tp_group, chunk_tokens: int,
                 temperature: float) -> None:
        super().__init__()
        self.gpt = gpt
        rows = layout.padded_vocab_size // layout.tp_size
        self.shard = VocabShard(start=tp_rank * rows, num_real=layout.vocab_size - tp_rank * rows,
                                group=tp_group if layout.tp_size > 1 else None)
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gpt, (batch, length) = self.gpt, input_ids.shape
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
        gpt.post_process = False
        try:
            hidden = gpt(
                input_ids=input_ids,
                position_ids=torch.arange(length, device=input_ids.device).expand(batch, length),
                # True above the diagonal: masked (Megatron's convention); padding is on the right, so needs none
                attention_mask=causal,
            )  # [L, B, H], after the final norm
        finally:
            gpt.post_process = True
        response = mask > 0  # [B, L-1]; position j predicts token j + 1
        rows = hidden.transpose(0, 1)[:, :-1][response]
        weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
                  else gpt.output_layer.weight)
        chunk = self.chunk_tokens or max(rows.shape[0], 1)
        logp, entropy = chunked_logprobs(rows, weight, None, targets[response], temperature=self.temperature,
                                         chunk_tokens=chunk, shard=self.shard)
        full = torch.zeros(targets.shape, dtype=logp.dtype, device=logp.device)
        return full.masked_scatter(response, logp), full.masked_scatter(response, entropy)
