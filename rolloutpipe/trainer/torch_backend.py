"""The PyTorch trainer backend: the HF model, torch AdamW, data parallel over gloo (NCCL on GPU).

The GRPO update itself (micro-batches as groups arrive, old log-probs, the loss sums, the batch's one optimizer
step) is ``grpo_trainer.GRPOTrainer``'s; this module supplies the log-probs of an HF model and the optimizer step.
``finish_batch`` all-reduces the gradients as one flat tensor over the data-parallel ranks, divides them by the
batch normaliser, clips them (``clip_grad_norm``: the norm summed in float64) and steps AdamW.

Precision. A bfloat16 (or float16) model runs forward and backward in its dtype while AdamW steps float32 master
copies of its parameters, which are copied back rounded after each step: AdamW on bfloat16 weights would round most
updates of a small learning rate away. The master copies are optimizer state (``MASTER``), so checkpoints keep them
and a resumed bfloat16 run steps from the same float32 weights as an uninterrupted one: the same bits after.

Device. On a machine with CUDA the model, its master copies and the optimizer state live on the rank's GPU
(control/env.py binds each rank to its node-local GPU; gradients all-reduce over NCCL); ``hf_state`` hands out CPU
copies, which is what the engines' weight files, broadcasts and checkpoints take. Without CUDA, the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from rolloutpipe.control.weights.buckets import Bucket, packed, plan_buckets, unpack
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.exact_sum import ExactGradientSum, all_reduce_flat
from rolloutpipe.trainer.grpo_trainer import GRPOTrainer
from rolloutpipe.trainer.logprobs import chunked_logprobs, token_entropy, token_logprobs
from rolloutpipe.trainer.packing import packed_row, use_packed_attention

MASTER = "master"
"""A 16-bit model's float32 master copy of a parameter, under this key of the optimizer's state for it: checkpoints
(``optimizer.state_dict``) keep it beside the moments, and loading them back adopts it (``_adopt_masters``)."""


class PolicyTrainer(GRPOTrainer):
    updates_by_bucket = True

    def __init__(self, *, model: torch.nn.Module, cfg: TrainerConfig, grpo: GRPOConfig, temperature: float,
                 pad_id: int, multi_step: bool, process_group_active: bool, old_logprobs: OldLogprobSource) -> None:
        super().__init__(cfg=cfg, grpo=grpo, temperature=temperature, pad_id=pad_id, multi_step=multi_step,
                         old_logprobs=old_logprobs)
        self.model = (model if self.device is None else model.to(self.device)).train()
        lay_out_flat(self.model, list(self._hf_tensors()))
        if cfg.recompute:
            enable_recompute(model)
        self._head = logprob_head(self.model, cfg, temperature, cuda=self.device is not None)
        """Log-probs from the hidden states by chunks; None: from the model's full logits."""
        self.all_reduce = dist.all_reduce if process_group_active else None
        self.data_parallel_rank = dist.get_rank() if process_group_active else 0
        self.data_parallel_size = dist.get_world_size() if process_group_active else 1
        self._master: list[torch.Tensor] | None = None
        """float32 copies of a bfloat16/float16 model's parameters: what the optimizer steps (mixed precision)."""
        if next(model.parameters()).dtype in (torch.bfloat16, torch.float16):
            self._master = [p.detach().float().clone() for p in model.parameters()]
        self.optimizer = torch.optim.AdamW(  # on a GPU one fused kernel: no temporaries the size of the state
            self._master or model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay, fused=self.device is not None,
        )
        if self._master is not None:  # a checkpoint's float32 masters, as its state is loaded (resume)
            self.optimizer.register_load_state_dict_post_hook(_adopt_masters)
        named = list(model.named_parameters())
        self._pairs = list(zip([p for _, p in named], self._master or [p for _, p in named], strict=True))
        """(model parameter, the tensor AdamW steps: the parameter, or its float32 master)."""
        self._pairs_by_name = {name: pair for (name, _), pair in zip(named, self._pairs, strict=True)}

    def sum_exactly(self, num_samples_per_batch: int) -> None:
        self._exact = ExactGradientSum([p for p in self.model.parameters() if p.requires_grad],
                                       num_samples_per_batch=num_samples_per_batch)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy under HF names on the CPU (tied lm_head left out, as save_pretrained does)."""
        return {k: v.cpu() for k, v in self._hf_tensors().items()}

    def _hf_tensors(self) -> dict[str, torch.Tensor]:
        """The policy under HF names where it lives (views of the parameters: no copy)."""
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return state

    def _hf_buckets(self) -> tuple[list[Bucket], Iterator[dict[str, torch.Tensor]]]:
        """Each bucket's CPU tensors taken when it is asked for (after its parameters' deferred update): on the CPU
        the parameters themselves, one range of memory (``lay_out_flat``); from a GPU, one copy of that range."""
        state = self._hf_tensors()
        buckets = plan_buckets(state, self.bucket_bytes)

        def on_host(bucket: Bucket) -> dict[str, torch.Tensor]:
            flat = packed(bucket, state)
            if flat is None:
                return {name: state[name].cpu() for name in bucket.names}
            return unpack(bucket, flat.cpu())

        return buckets, (on_host(bucket) for bucket in buckets)

    def hf_model(self) -> torch.nn.Module:
        """The policy as an HF model (for save_pretrained): the trained model itself."""
        return self.model

    # -- GRPOTrainer's hooks ---------------------------------------------------------------------
    def _policy(self) -> torch.nn.Module:
        return self.model

    def _optimizer_step(self, scale: float) -> float:
        """All-reduce, scale, clip and step. Mixed precision (a bfloat16/float16 model): the gradients are reduced,
        scaled and clipped in float32 on the float32 master copies, AdamW steps those, and the model gets them back
        rounded to its dtype."""
        model_params = list(self.model.parameters())
        stepped = self._master or model_params
        params = [(p, s) for p, s in zip(model_params, stepped) if p.requires_grad]
        if self._exact is not None:  # reduced as integers, scaled in float64, then one rounding to the copies' dtype
            self._exact.reduce(self.all_reduce)
            for (_, s), grad in zip(params, self._exact.take(stepped[0].dtype, scale=scale), strict=True):
                s.grad = grad
        else:
            self._reduce_float_grads(params)
            for _, s in params:
                s.grad.mul_(scale)
        grad_norm = clip_grad_norm([s.grad for _, s in params], self.cfg.max_grad_norm)
        self._update_unless_deferred()
        return grad_norm

    def _update(self, names: list[str] | None) -> None:
        """AdamW on the parameters of ``names`` (None: all) still holding a gradient. Mixed precision: it steps
        their float32 masters, and the model gets them back rounded to its dtype."""
        pairs = (self._pairs if names is None
                 else [self._pairs_by_name[n] for n in names if n in self._pairs_by_name])
        stepped = {id(s) for s in step_only(self.optimizer, None if names is None else [s for _, s in pairs])}
        if self._master is None:
            return
        with torch.no_grad():
            for p, s in pairs:
                if id(s) in stepped:  # (after the step: AdamW initialises a state it finds empty)
                    self.optimizer.state[s][MASTER] = s
                    p.copy_(s)
                    p.grad = None

    def _reduce_float_grads(self, params: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each (model parameter, stepped copy): the accumulated gradient onto the copy, all-reduced as one flat
        tensor (float32 for a 16-bit model)."""
        for p, s in params:
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            s.grad = grad.float() if s is not p else grad
        all_reduce_flat([s.grad for _, s in params], self.all_reduce)

    def _logprobs(self, input_ids, targets, mask, params=None) -> tuple[torch.Tensor, torch.Tensor]:
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
        return (token_logprobs(logits, targets, self.temperature),
                token_entropy(logits, self.temperature, grad=self.grpo.entropy_coef > 0))

    def _reference_params(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The reference's parameters as they are: the same HF architecture as the policy, so the same names."""
        return {k: v.detach() if self.device is None else v.detach().to(self.device)
                for k, v in model.named_parameters()}


def _adopt_masters(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: each parameter's checkpointed float32 master (``MASTER``) replaces the copy rebuilt
    from the rounded 16-bit model, and stays its state's ``MASTER`` from then on."""
    with torch.no_grad():
        for param, state in optimizer.state.items():
            kept = state.get(MASTER)
            if kept is not None and kept is not param:
                param.copy_(kept)
                state[MASTER] = param



def lay_out_flat(model: torch.nn.Module, names: list[str]) -> None:
    """Move the parameters under HF ``names`` into one tensor, in that order, where they share a dtype and device:
    a weight-sync bucket (consecutive names) is then one range of memory, which the broadcast sends as it lies
    (buckets.py ``packed``) and a GPU copies off in one transfer. Values, ``Parameter`` objects and what holds them
    (optimizer, hooks) stay as they are. Left alone where a name is not a parameter, or they differ in dtype."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    params = [by_name.get(name) for name in names]
    if (any(p is None for p in params) or len({id(p) for p in params}) != len(params)
            or len({(p.dtype, p.device) for p in params}) != 1):
        return
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    with torch.no_grad():
        for param in params:
            view = flat[offset:offset + param.numel()].view(param.shape)
            view.copy_(param)
            param.data = view
            offset += param.numel()


def enable_recompute(model: torch.nn.Module) -> None:
    """HF's per-layer activation checkpointing, the non-reentrant kind (it works under no_grad too). transformers 5.2x
    calls it ``activation_checkpointing_enable`` and keeps ``gradient_checkpointing_enable`` as a deprecated alias
    (to go in v6); earlier releases, the declared floor and the 5.17 of issue 43's H200 among them, have only that."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def step_only(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Step ``optimizer`` on those of ``tensors`` (None: all its parameters) holding a gradient, and drop their
    gradients; the others keep theirs for a later call. Returns the stepped ones. AdamW skips a parameter without a
    gradient and is elementwise, so the parameters stepped in parts, each once, get the update one step of all gives,
    to the bit."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    chosen = None if tensors is None else {id(t) for t in tensors}
    stepped = [p for p in params if p.grad is not None and (chosen is None or id(p) in chosen)]
    held = [(p, p.grad) for p in params if p.grad is not None and chosen is not None and id(p) not in chosen]
    for p, _ in held:
        p.grad = None
    try:
        if stepped:
            optimizer.step()
    finally:
        for p, grad in held:
            p.grad = grad
    for p in stepped:
        p.grad = None
    return stepped


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, *, all_reduce: bool = False) -> float:
    """The 2-norm of all ``grads``, and the clip ``torch.nn.utils.clip_grad_norm_`` does (coefficient
    max_norm / (norm + 1e-6), applied when below 1). Each tensor's sum of squares is taken in float32 with torch's
    cascade sum and the sums are added in float64: about 2e-8 relative at 50M elements, where clip_grad_norm_'s
    float32 vector_norm is 3.9e-3 off (measured on CPU), enough to move a clipped update. ``all_reduce``: ``grads``
    are this rank's shards of the gradients (fsdp_backend), and the float64 sum is all-reduced over the ranks first,
    so every rank clips by the same coefficient."""
    total = sum((sum_of_squares(g) for g in grads), torch.zeros((), dtype=torch.float64, device=grads[0].device))
    if all_reduce and dist.get_world_size() > 1:
        dist.all_reduce(total)
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


def logprob_head(model: torch.nn.Module, cfg: TrainerConfig, temperature: float, *,
                 cuda: bool) -> _HiddenToLogprobs | None:
    """The chunked log-probs over ``model``'s hidden states (trainer.logprob_chunk_tokens; None: the model's own
    logits), on packed micro-batches with trainer.pack_sequences (null: on a GPU; packing.py)."""
    if not (cfg.logprob_chunk_tokens and _chunkable(model)):
        if cfg.pack_sequences:
            raise ValueError("trainer.pack_sequences=true takes the log-prob chunks over the decoder's hidden states: "
                             "set trainer.logprob_chunk_tokens > 0 (a model whose logits are its head's output, as "
                             "Qwen and Llama), or trainer.pack_sequences=false.")
        return None
    packed = cfg.pack_sequences if cfg.pack_sequences is not None else cuda
    if packed:
        use_packed_attention(model)
    return _HiddenToLogprobs(model, cfg.logprob_chunk_tokens, temperature, packed=packed)


def _chunkable(model) -> bool:
    """An HF causal LM whose logits are just its output embedding of the decoder's last hidden states (Qwen2/3,
    Llama: no logit soft-capping or scaling after the head)."""
    config = getattr(model, "config", None)
    return (hasattr(model, "get_decoder") and model.get_output_embeddings() is not None
            and not getattr(config, "final_logit_softcapping", None) and not getattr(config, "logit_scale", None))


class _HiddenToLogprobs(torch.nn.Module):
    """The response tokens' log-probs and entropy from the decoder's hidden states (trainer/logprobs.py)."""

    def __init__(self, lm: torch.nn.Module, chunk_tokens: int, temperature: float, *, packed: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature
        self.packed = packed
        """The micro-batch's sequences as one row without padding (packing.py)."""

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        response = mask > 0  # [B, L-1]; position j predicts token j + 1
        if self.packed:  # the response tokens in the padded rows' order: the same scatter back
            row = packed_row(input_ids, mask)
            hidden = self.lm.get_decoder()(input_ids=row.input_ids, position_ids=row.position_ids,
                                           rp_sequence_bounds=row.bounds).last_hidden_state
            rows, picked = hidden[:, :-1][row.response], row.input_ids[:, 1:][row.response]
        else:
            hidden = self.lm.get_decoder()(input_ids=input_ids).last_hidden_state
            rows, picked = hidden[:, :-1][response], targets[response]
        head = self.lm.get_output_embeddings()
        logp, entropy = chunked_logprobs(rows, head.weight, head.bias, picked, temperature=self.temperature,
                                         chunk_tokens=self.chunk_tokens)
        full = torch.zeros(targets.shape, dtype=logp.dtype, device=logp.device)
        return full.masked_scatter(response, logp), full.masked_scatter(response, entropy)
