"""The FSDP2 trainer backend (``trainer.backend=fsdp``): any HF causal LM, its parameters, gradients and AdamW state
sharded over the data-parallel ranks with ``torch.distributed.fsdp.fully_shard`` (gloo on CPU, NCCL on GPU).

Sharding. One ``fully_shard`` per decoder layer (the classes HF names in ``_no_split_modules``), then the root
(embeddings, final norm, head). Each rank keeps 1/N of every parameter, of its gradient and of AdamW's moments; a
layer's full parameters exist only while it runs (all-gathered in forward, again in backward). A bfloat16/float16
model is trained as float32 master weights with ``MixedPrecisionPolicy(param_dtype=<model dtype>,
reduce_dtype=float32)``: compute in the model's dtype, gradients reduced and accumulated in float32, AdamW on the
float32 shards. A float32/float64 model is sharded as it is (float64 stays exact: the parity tests).

The GRPO update is ``grpo_trainer.GRPOTrainer``'s, as for the torch backend. Accumulation: every micro-batch's
backward reduce-scatters its gradient (summed, not averaged: divide factor 1) into the float32 gradient shards,
which accumulate over the batch's micro-batches. The alternative, ``set_requires_gradient_sync(False)`` until the
last micro-batch, would keep every rank's whole *unsharded* gradient between micro-batches (N times the sharded
gradient: what FSDP is here to remove), and needs to know the last micro-batch before its backward, which CGP does
not (a batch is complete only when its last group arrives). The reduce-scatter moves as many bytes as the layer's
all-gather that every micro-batch does anyway. ``finish_batch`` then divides the summed shards by the batch
normaliser once, clips by the global norm (each rank's sum of squares in float64, one all-reduce) and steps AdamW.
The order of additions differs from the torch backend's one flat all-reduce; nothing else. With
trainer.exact_accumulation the ranks reduce-scatter and sum integers instead, in no order (fsdp_exact.py).

Lockstep. Every forward/backward all-gathers (and reduce-scatters) over the ranks, so every rank must run as many
per training batch. ``collective_micro_batches`` tells the consume loop (pipeline.train_step) to follow every
rank's micro-batches and, when a batch is complete, to pad a rank that trained fewer with empty ones
(``forward_backward([])``: a one-token pass whose loss is multiplied by 0, so it adds exact zeros).

Reads by trainer rank 0 (weight sync, the restore point, the final policy). Full tensors are gathered one bucket
at a time (``pipeline.weight_sync_bucket_mb``, ``buckets.plan_buckets``): every rank all-gathers the bucket's
parameters (``DTensor.full_tensor``), rank 0 takes a CPU copy, and the bucket is freed before the next one; so no
rank holds more than one bucket of the unsharded model on its device. The other ranks join those gathers inside
``writer_reads`` (trainer/node.py, pipeline.py), answering rank 0's requests until rank 0 leaves it. Weight sync
takes the buckets as they are gathered (``hf_buckets``), into one safetensors file (disk) or one broadcast each
(distributed), each gathered into one of four host buffers that rank 0 reuses (buckets.py ``BUCKETS_HELD``, and one
for the bucket the step's last update gathers ahead; page-locked on a GPU): a fresh buffer's pages would be faulted
in on every step. The restore point and the final policy still take the whole policy, in the model's dtype, on rank
0's host (``hf_model``).

KL to a reference (``grpo.kl_loss_coef``): the reference is kept as this rank's shards (``_reference_params``),
swapped into the policy's shards for its no-grad pass; 1/N of the model per rank.

Checkpoints are sharded (control/checkpoint.py): each rank writes its own rows of the float32 master weights and
of AdamW's state (``training_shards``, copied every step into its restore point: 1/N of the state, nothing
gathered), rank 0 the policy in the HF layout (gathered by buckets) beside them. A resumed run on any number of
ranks reads back the rows its shards need (``load_training_shards``); a checkpoint of the torch backend's format
(the whole AdamW state by parameter index) loads too, each rank keeping its shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rolloutpipe.control.checkpoint import Shard, ShardedState
from rolloutpipe.control.weights.buckets import BUCKETS_HELD, Bucket, BufferRing, plan_buckets, unpack
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.fsdp_exact import ShardedExactSum, clip_gathered_grad_norm
from rolloutpipe.trainer.grpo import LossSums
from rolloutpipe.trainer.grpo_trainer import GRPOTrainer, TrainSample, pack
from rolloutpipe.trainer.lead import LeadReads, led
from rolloutpipe.trainer.logprobs import token_entropy, token_logprobs
from rolloutpipe.trainer.torch_backend import MASTER, clip_grad_norm, enable_recompute, logprob_head, step_only

_GATHER = 1
"""Rank 0's request to the other ranks inside ``writer_reads`` (lead.py)."""


class FSDPTrainer(GRPOTrainer):
    collective_micro_batches = True
    sharded_checkpoint = True
    updates_by_bucket = True

    def __init__(self, *, model: torch.nn.Module, cfg: TrainerConfig, grpo: GRPOConfig, temperature: float,
                 pad_id: int, multi_step: bool, process_group_active: bool, old_logprobs: OldLogprobSource) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__(cfg=cfg, grpo=grpo, temperature=temperature, pad_id=pad_id, multi_step=multi_step,
                         old_logprobs=old_logprobs)
        self._created_world = not process_group_active
        if self._created_world:  # fully_shard needs a process group, even of one rank
            dist.init_process_group("nccl" if self.device is not None else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1)
        self.data_parallel_rank = dist.get_rank()
        self.data_parallel_size = dist.get_world_size()
        self.all_reduce = dist.all_reduce if self.data_parallel_size > 1 else None
        self.dtype = next(model.parameters()).dtype
        """The model's dtype: what the engines and checkpoints get."""
        self.config = model.config
        mixed = self.dtype in (torch.bfloat16, torch.float16)
        if mixed:  # float32 master weights; compute in the model's dtype
            model.float()
        if self.device is not None:
            model.to(self.device)
        if cfg.recompute:  # each recomputed layer all-gathers again
            enable_recompute(model)
        self.model = model.train()
        self._head = logprob_head(model, cfg, temperature, cuda=self.device is not None)
        self.root: torch.nn.Module = self._head if self._head is not None else model
        """The module whose forward is called: sharding it as the root unshards the embedding, the final norm and
        the head around the chunked log-probs too."""
        mesh = init_device_mesh("cuda" if self.device is not None else "cpu", (self.data_parallel_size,))
        policy = (MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32) if mixed
                  else MixedPrecisionPolicy())
        self._sharded = [*decoder_layers(model), self.root]
        for module in self._sharded:
            fully_shard(module, mesh=mesh, mp_policy=policy)
        for module in self._sharded:
            module.set_gradient_divide_factor(1.0)  # gradients are sums of loss sums (grpo.py), not means
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM(1)
        self._names = hf_names(self.model)
        """HF name -> the (sharded) tensor, tied lm_head left out: what the engines and checkpoints get."""
        self.optimizer = _FullStateOptimizer(torch.optim.AdamW(
            self.root.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay), self)
        self._lead = LeadReads(backend="trainer.backend=fsdp", device=self.device)
        self._cpu_model: torch.nn.Module | None = None
        self._bucket_buffers = BufferRing(BUCKETS_HELD + 1, pinned=self.device is not None)
        """Rank 0's host buffers weight sync's buckets are gathered into, in turn (``_hf_buckets``), kept between
        steps; page-locked on a GPU. One more than a reader holds: the step's last update gathers a bucket ahead."""

    # -- the micro-batch ------------------------------------------------------------------------------
    def forward_backward(self, samples: list[TrainSample], *, first_batch_of_step: bool) -> LossSums:
        """A micro-batch; with no samples, a padding pass: the same collectives, a gradient of exact zeros."""
        if samples:
            return super().forward_backward(samples, first_batch_of_step=first_batch_of_step)
        dummy = [TrainSample(prompt_ids=[self.pad_id], response_ids=[self.pad_id], engine_logprobs=[0.0],
                             advantage=0.0)]
        input_ids, targets, mask = (t if self.device is None else t.to(self.device)
                                    for t in pack(dummy, pad_id=self.pad_id))
        logprobs, _ = self._logprobs(input_ids, targets, mask)
        with torch.no_grad():  # the gathers of the passes a real micro-batch makes under other weights, too
            self._old_logprobs(dummy, input_ids, targets, logprobs, mask, first_batch_of_step)
            if self.grpo.kl_loss_coef > 0:
                self._logprobs(input_ids, targets, mask, params=self._reference)
        (logprobs.sum() * 0.0).backward()
        zero = torch.zeros((), dtype=logprobs.dtype)
        return LossSums(loss=zero, num_tokens=0, num_samples=0, num_clipped_tokens=0, ratio_sum=0.0)

    # -- GRPOTrainer's hooks ---------------------------------------------------------------------------
    def _policy(self) -> torch.nn.Module:
        return self.root

    def _logprobs(self, input_ids, targets, mask, params=None) -> tuple[torch.Tensor, torch.Tensor]:
        """As the torch backend's; ``params`` (policy_version k's shards) are swapped into the shards for the call
        (functional_call does not go through FSDP's gathers)."""
        if params is not None:
            with _swapped(self.root, params):
                return self._logprobs(input_ids, targets, mask)
        if self._head is not None:
            return self._head(input_ids, targets, mask)
        logits = self.root(input_ids=input_ids).logits[:, :-1]
        return (token_logprobs(logits, targets, self.temperature),
                token_entropy(logits, self.temperature, grad=self.grpo.entropy_coef > 0))

    def _reference_params(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The reference's weights as this rank's shards of the policy's parameters (each rank loaded the whole
        model; it keeps the chunk FSDP keeps of the policy): a frozen sharded copy, swapped in for its passes."""
        prefix = "lm." if self._head is not None else ""
        full = dict(model.named_parameters())
        shards = {}
        for name, own in self.root.named_parameters():
            value = full[name.removeprefix(prefix)].detach()
            local = _local(own)
            chunks = value.chunk(self.data_parallel_size, dim=0)
            shard = chunks[self.data_parallel_rank] if self.data_parallel_rank < len(chunks) else value[:0]
            assert shard.shape == local.shape, (name, shard.shape, local.shape)
            shards[name] = shard.to(local.device, local.dtype, copy=True)
        return shards

    def sum_exactly(self, num_samples_per_batch: int) -> None:
        """Integer reduce-scatters and sums of the shards (fsdp_exact.py)."""
        self._exact = ShardedExactSum([p for p in self.root.parameters() if p.requires_grad], self._sharded,
                                      num_samples_per_batch=num_samples_per_batch,
                                      world_size=self.data_parallel_size)

    def _optimizer_step(self, scale: float) -> float:
        """The gradient shards are sums over the ranks already (reduce-scattered in each backward): scale them
        once, clip by the global norm, step AdamW on the shards. trainer.exact_accumulation: the shards come from
        the integer sums, and the norm from the whole gradients (fsdp_exact.py)."""
        if self._exact is not None:
            self._exact.take_into_grads(next(self.root.parameters()).dtype, scale=scale)
            params = [p for p in self.root.parameters() if p.grad is not None]
            grad_norm = clip_gathered_grad_norm(params, self.cfg.max_grad_norm)
            self._update_unless_deferred()
            return grad_norm
        grads = [p.grad for p in self.root.parameters() if p.grad is not None]
        for g in grads:
            g.mul_(scale)
        grad_norm = clip_sharded_grad_norm(grads, self.cfg.max_grad_norm)
        self._update_unless_deferred()
        return grad_norm

    def _update(self, names: list[str] | None) -> None:
        """AdamW on this rank's shards of the parameters of ``names`` (None: all) still holding a gradient."""
        step_only(self.optimizer.optimizer, None if names is None else [self._names[n] for n in names])

    # -- sharded checkpoints ----------------------------------------------------------------------------
    def training_shards(self) -> dict[str, Shard]:
        """This rank's rows of the training state, by parameter index (the order of the full format): the master
        weights ``<i>.param`` and AdamW's ``<i>.exp_avg``, ``<i>.exp_avg_sq``, ``<i>.step``. Views, not copies."""
        shards: dict[str, Shard] = {}
        for index, param in enumerate(self.root.parameters()):
            offset, rows = self._rows(param)
            shards[f"{index}.param"] = Shard(_local(param).detach(), offset, rows)
            for name, value in self.optimizer.optimizer.state.get(param, {}).items():
                shards[f"{index}.{name}"] = (Shard(_local(value), offset, rows) if isinstance(value, DTensor)
                                             else Shard(value))
        return shards

    def load_training_shards(self, state: ShardedState, param_groups: list[dict]) -> None:
        """A sharded checkpoint of any number of ranks into this rank's shards: master weights, AdamW's state and
        hyper-parameters."""
        params = list(self.root.parameters())
        with torch.no_grad():
            for key in state.names():
                index, name = key.split(".", 1)
                param = params[int(index)]
                offset, _ = self._rows(param)
                local = _local(param)
                if state.whole(key):  # the step count
                    self.optimizer.optimizer.state[param][name] = state.rows(key).clone()
                    continue
                rows = state.rows(key, offset, offset + local.shape[0])
                if name == "param":
                    local.copy_(rows)
                else:
                    moment = self.optimizer.optimizer.state[param][name] = torch.zeros_like(param)
                    _local(moment).copy_(rows)
        for group, saved in zip(self.optimizer.optimizer.param_groups, param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _rows(self, param: torch.Tensor) -> tuple[int, int]:
        """The rows [offset, offset + local) of dimension 0 this rank holds of ``param`` (FSDP2's ``Shard(0)``:
        ``torch.chunk``'s split), and the full tensor's rows."""
        rows = param.shape[0]
        chunk = -(-rows // self.data_parallel_size)
        offset = min(self.data_parallel_rank * chunk, rows)
        assert _local(param).shape[0] == min(chunk, rows - offset), (param.shape, _local(param).shape)
        return offset, rows

    # -- reads by trainer rank 0 ------------------------------------------------------------------------
    @contextlib.contextmanager
    def writer_reads(self) -> Iterator[None]:
        """Every rank enters it around trainer rank 0's reads of the policy; the others join rank 0's gathers
        (lead.py) until rank 0 leaves."""
        with self._lead.session(self._serve):
            yield

    def _serve(self, request: int) -> None:
        assert request == _GATHER, request
        for _ in self._gathered_buckets():
            pass

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The whole policy under HF names on rank 0's host (gathered bucket by bucket)."""
        state: dict[str, torch.Tensor] = {}
        for bucket in self._lead_gather():
            state |= bucket
        return state

    def _hf_buckets(self) -> tuple[list[Bucket], Iterator[dict[str, torch.Tensor]]]:
        """The policy by buckets, each gathered only when its turn comes, on rank 0 into reused buffers: a bucket's
        tensors hold until the third bucket after it is asked for (the weights-ahead thread gathers one ahead)."""
        return self._plan(), self._lead_gather(self._bucket_buffers)

    def hf_on_gpu(self) -> bool:
        return False  # rank 0 takes CPU copies of the gathered buckets

    def hf_model(self) -> torch.nn.Module:
        """An HF model on rank 0's host holding the trained weights (for save_pretrained and the restore point),
        filled bucket by bucket; built once, on the meta device first."""
        if self._cpu_model is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
            self._cpu_model = model.to_empty(device="cpu").eval()
            self._cpu_model.tie_weights()
        with torch.no_grad():
            for bucket in self._lead_gather():
                unexpected = self._cpu_model.load_state_dict(bucket, strict=False).unexpected_keys
                assert not unexpected, unexpected
        return self._cpu_model

    def close(self) -> None:
        if self._created_world:
            dist.destroy_process_group()

    def _plan(self) -> list[Bucket]:
        """The buckets every rank gathers by (the same on every rank: names, shapes and the model's dtype)."""
        metas = {k: torch.empty(v.shape, dtype=self.dtype, device="meta") for k, v in self._names.items()}
        return plan_buckets(metas, self.bucket_bytes)

    def _lead_gather(self, buffers: BufferRing | None = None) -> Iterator[dict[str, torch.Tensor]]:
        self._lead.ask(_GATHER, reads="the sharded policy")
        return led(self._gathered_buckets(buffers))

    def _gathered_buckets(self, buffers: BufferRing | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Every rank: the full tensors, one ``plan_buckets`` bucket at a time (a collective per tensor); rank 0
        gets CPU copies in the model's dtype, back to back in one buffer per bucket (what a broadcast sends as it
        lies: buckets.py ``packed``): ``buffers`` in turn, or a new one for each (what ``hf_state`` keeps), the
        others empty dicts."""
        for index, bucket in enumerate(self._plan()):
            out: dict[str, torch.Tensor] = {}
            if self.data_parallel_rank == 0:
                flat = (torch.empty(bucket.num_bytes, dtype=torch.uint8) if buffers is None
                        else buffers(index, bucket.num_bytes))
                out = unpack(bucket, flat)
            with torch.no_grad():
                for name in bucket.names:
                    tensor = self._names[name]
                    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                    if self.data_parallel_rank == 0:
                        out[name].copy_(full)
                    del full
            yield out


class _FullStateOptimizer:
    """The AdamW over the shards. Its ``state_dict`` gives only the param groups (by parameter index, as the torch
    backend's): the state itself is checkpointed by each rank (``training_shards``). ``load_state_dict`` takes the
    torch backend's whole state (control/checkpoint.py ``load_optimizer``) on every rank, each keeping its shard."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: FSDPTrainer) -> None:
        self.optimizer = optimizer
        self.trainer = trainer
        self.step = optimizer.step
        self.zero_grad = optimizer.zero_grad

    def state_dict(self) -> dict:
        first = 0
        groups = []
        for group in self.optimizer.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(first, first + len(group["params"])))})
            first += len(group["params"])
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [n for n, _ in self.trainer.root.named_parameters()]
        groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
        # a 16-bit torch-backend run keeps its float32 master weights in the optimizer state: they are the shards
        masters = {names[int(i)]: moments.pop(MASTER) for i, moments in state["state"].items() if MASTER in moments}
        full = {"state": {names[int(i)]: moments for i, moments in state["state"].items()}, "param_groups": groups}
        set_optimizer_state_dict(self.trainer.root, self.optimizer, full,
                                 options=StateDictOptions(full_state_dict=True))
        params = dict(self.trainer.root.named_parameters())
        with torch.no_grad():
            for name, master in masters.items():
                offset, _ = self.trainer._rows(params[name])
                local = _local(params[name])
                local.copy_(master[offset : offset + local.shape[0]])


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules of the classes HF keeps whole (``_no_split_modules``)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(f"trainer.backend=fsdp: {type(model).__name__} names no decoder-layer class in "
                         "_no_split_modules, so it cannot be sharded layer by layer.")
    return layers


def hf_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> tensor (a DTensor shard once sharded), tied lm_head left out as save_pretrained does."""
    state = dict(model.state_dict(keep_vars=True))
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def clip_sharded_grad_norm(grads: list[torch.Tensor], max_norm: float) -> float:
    """torch_backend.clip_grad_norm over gradient shards: each rank's sum of squares of its shards in float64, one
    all-reduce, the same clip coefficient on every rank."""
    return clip_grad_norm([g.to_local() if isinstance(g, DTensor) else g for g in grads], max_norm, all_reduce=True)


@contextlib.contextmanager
def _swapped(root: torch.nn.Module, params: dict[str, torch.Tensor]) -> Iterator[None]:
    """The shards of ``params`` in place of ``root``'s own for the block, the own ones back after it.

    The root keeps its parameters unsharded after its forward (for backward), so it is resharded first (they are
    the shards again) and after the block (so that backward all-gathers the own shards anew)."""
    root.reshard()
    own = dict(root.named_parameters())
    saved = {k: own[k].detach().to_local().clone() if isinstance(own[k], DTensor) else own[k].detach().clone()
             for k in params}
    with torch.no_grad():
        for k, v in params.items():
            _local(own[k]).copy_(_local(v))
    try:
        yield
    finally:
        root.reshard()
        with torch.no_grad():
            for k, v in saved.items():
                _local(own[k]).copy_(v)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
