"""A memory plan: the estimated peak GPU memory of each trainer rank and each rollout engine, term by term.

    tools/memory_plan.py   prints the plan of a job (the same Hydra config and overrides as launch.py)
    launch/preflight.py    warns at launch (GPU launchers only) when a term pushes a GPU past its memory

Pure arithmetic over the model's shape and the typed Config; nothing here touches a GPU. What is counted:

Trainer rank (all ranks alike: data-parallel replicas, or tensor-parallel shards of equal size)
  weights, gradients, optimizer   per parameter of the rank's shard. Torch backend, bf16: bf16 weights and
                                  gradients, fp32 master weights, fp32 Adam m and v; at the optimizer step a float32
                                  copy of the gradients too; trainer.exact_accumulation: integer bins, 26 B (FSDP: /n).
                                  Megatron: bf16 weights, DDP's fp32 gradients, fp32 master weights, Adam m and v (the
                                  last two / data-parallel size with trainer.megatron.distributed_optimizer, null: on,
                                  a plan is for GPUs). FSDP: ``fsdp_state_terms``, ``fsdp_unsharded_terms``.
  activations                     what a decoder layer keeps for backward, per token (``layer_activation_bytes``,
                                  HF's Qwen3 layer; Megatron's counted alike) x layers x the largest micro-batch's
                                  padded tokens (``micro_batch_size``). ``trainer.recompute``: each layer's input,
                                  plus one layer recomputed in backward.
  attention                       ``fused`` (the torch backend's causal SDPA, Transformer Engine's: assumed for
                                  Megatron on GPU nodes): O(T), in the layer count. ``materialised``: Megatron's local
                                  spec, per score (rows x heads x T^2, the most a token budget allows):
                                  ``materialised_score_bytes``, and a [T, T] bool mask. Held to an H200's peaks
                                  (issue 43): tests/unit/test_memory_plan_gpu.py.
  log-prob chunk                  trainer/logprobs.py: ``logprob_chunk_tokens`` tokens x vocabulary / tp logits.
                                  Forward: float32 logits and exponentials, 8 B per logit; backward: the float32
                                  softmax and its 16-bit gradient (4 + 2 B) beside the head's gradient summed in
                                  float32. The torch backend with 0: the model's own logits, 20 B per logit.
  weight-sync buffers             pipeline.weight_sync=distributed to GPU engines: 2 x a bucket (NCCL send buffers).
Rollout engine (SGLang)
  weights + KV cache              ``rollout.concurrency`` responses of max prompt + max response tokens, K and V
                                  of every layer's key/value heads in the model's dtype, inside SGLang's
                                  --mem-fraction-static; the rest is SGLang's reserve (activations, CUDA graphs).

Validated against CPU trainers' RSS and live tensors (bench/memory_plan_validation.py, memory_plan_tracked.py) and
an H200's peaks (docs/trainer.md). ``fewest_ranks``: the fewest trainer GPUs that fit, where ranks shard the state.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from rolloutpipe.config import Config, WeightSync
from rolloutpipe.launch.model_shapes import (  # noqa: F401 (re-exported: the plan's shapes and micro-batches)
    QWEN3_SHAPES,
    ModelShape,
    layer_activation_bytes,
    materialised_score_bytes,
    micro_batch_rows,
    micro_batch_size,
    model_shape,
    sequence_len,
)
from rolloutpipe.model import DType
from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend

GiB = 1 << 30
DEFAULT_GPU_MEMORY_GIB = 80.0
CUDA_CONTEXT_BYTES = 1 * GiB
"""Assumed per trainer process: the CUDA context, cuBLAS / NCCL workspaces and allocator slack. The other terms are
live tensors, what ``torch.cuda.max_memory_allocated`` counts; the trainer ranks run PyTorch's caching allocator with
expandable segments (launch/node.py), so what it reserves beyond them stays small for micro-batches of every size."""
SGLANG_MEM_FRACTION_STATIC = 0.88
"""Assumed share of the GPU SGLang gives weights + KV cache when rollout.sglang_launch_args has no
--mem-fraction-static (its default on an 80 GB GPU at TP 1 in recent versions; it varies by version and GPU)."""


class AttentionKind(enum.Enum):
    fused = "fused"
    """O(T) memory: SDPA (flash / memory-efficient) or Transformer Engine's fused attention."""
    materialised = "materialised"
    """O(T^2): the softmax probabilities [heads, T, T] are kept for backward (Megatron's local DotProductAttention)."""


class Phase(enum.Enum):
    always = "always"
    """Held for the whole run (weights, optimizer state)."""
    forward_backward = "fwd/bwd"
    """Held at once at the peak of one micro-batch's forward and backward (its activations alive)."""
    end_of_backward = "bwd end"
    """Held at the end of backward, the activations freed: the embedding's gradient being summed."""
    optimizer_step = "step"
    """Held during the optimizer step only (after the micro-batches' activations are gone)."""


@dataclass(kw_only=True, slots=True)
class Term:
    name: str
    num_bytes: int
    phase: Phase
    how: str
    """How it was counted, in a few words."""
    knob: str = ""
    """What lowers it (config keys), empty where nothing does."""


@dataclass(kw_only=True, slots=True)
class Estimate:
    """One GPU's worth: a trainer rank or a rollout engine (``count`` of them alike)."""

    who: str
    count: int
    terms: list[Term]
    capacity_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """What is always held, plus the largest of the other phases' transients (they never overlap)."""
        return self.phase_bytes(Phase.always) + max(self.phase_bytes(p) for p in Phase if p is not Phase.always)

    def phase_bytes(self, phase: Phase) -> int:
        return sum(t.num_bytes for t in self.terms if t.phase is phase)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes


@dataclass(kw_only=True, slots=True)
class MemoryPlan:
    trainer: Estimate
    engine: Estimate | None
    """None when the engines do not run on GPUs (rollout.engine=embedded or embedded_http)."""
    fix: list[str] | None = None
    """Overrides with which the trainer fits (None: it fits as is, or nothing tried makes it fit)."""
    fewest_ranks: tuple[int, list[str]] | None = None
    """The fewest trainer GPUs with which each rank fits, and the overrides that say so (``fewest_ranks``); None
    where the backend keeps the whole training state on every rank, or nothing up to 128 GPUs fits."""
    sharded: bool = False
    """More trainer ranks lower each rank's training state (``shards_by_ranks``)."""

    @property
    def estimates(self) -> list[Estimate]:
        return [self.trainer] + ([self.engine] if self.engine else [])


def dtype_bytes(dtype: DType) -> int:
    return {DType.float32: 4, DType.float64: 8, DType.bfloat16: 2}[dtype]


def trainer_estimate(cfg: Config, shape: ModelShape, *, capacity_bytes: int,
                     attention: AttentionKind | None = None) -> Estimate:
    tr = cfg.trainer
    megatron = tr.backend is TrainerBackend.megatron
    tp = tr.megatron.tensor_parallel_size
    d = dtype_bytes(cfg.model.dtype)
    master = max(d, 4)
    params = shape.num_params(tp=tp)
    attention = attention or AttentionKind.fused
    rows, length = micro_batch_rows(cfg), sequence_len(cfg)
    tokens, scores_per_head = micro_batch_size(cfg)
    h, layers = shape.hidden_size, shape.num_layers
    shard = f"{params / 1e9:.2f}B params" + (f" (1/{tp} tensor-parallel shard)" if tp > 1 else "")
    more_tp = ("more trainer.megatron.tensor_parallel_size" if megatron
               else "trainer.backend=fsdp, or megatron with tensor_parallel_size > 1")
    fewer_tokens = (f"max_tokens_per_micro_batch={length} (one sample per micro-batch)" if rows > 1
                    else "shorter data.max_prompt_len / rollout_max_response_len")

    fsdp = tr.backend is TrainerBackend.fsdp
    n = tr.num_ranks if fsdp else 1  # FSDP: each rank keeps 1/n of the weights, gradients and optimizer state
    terms = (fsdp_state_terms(shape, d=d, n=n) if fsdp else
             [Term(name="weights", num_bytes=params * d, phase=Phase.always, how=f"{shard} x {d} B", knob=more_tp)])
    if megatron:
        grad_bytes = 8 if d == 8 else 4
        terms.append(Term(name="gradients", num_bytes=params * grad_bytes, phase=Phase.always,
                          how=f"DDP's gradient buffer, {grad_bytes} B/param", knob=more_tp))
    elif not fsdp:
        terms.append(Term(name="gradients", num_bytes=params * d, phase=Phase.always,
                          how=f"{d} B/param, from the first micro-batch to the optimizer step", knob=more_tp))
    # Megatron's distributed optimizer (null: true on a GPU, which is what the plan is for) shards the float32
    # master weights and Adam's moments over the data-parallel ranks; DDP's weights and gradient buffer stay whole
    dp = tr.data_parallel_size if megatron and tr.megatron.distributed_optimizer is not False else 1
    per_dp = f" / {dp} data-parallel ranks (distributed optimizer)" if dp > 1 else ""
    state_knob = (f"more trainer.num_ranks (data parallel), {more_tp}" if dp > 1 else
                  f"trainer.megatron.distributed_optimizer=true with more trainer.num_ranks, {more_tp}" if megatron
                  else more_tp)
    if d < 4 and not fsdp:
        terms.append(Term(name="master weights", num_bytes=params * 4 // dp, phase=Phase.always,
                          how=f"fp32, 4 B/param{per_dp}", knob=state_knob))
    if not fsdp:
        terms.append(Term(name="optimizer state", num_bytes=params * 2 * master // dp, phase=Phase.always,
                          how=f"Adam m, v: 2 x {master} B/param{per_dp}", knob=state_knob))
    if not megatron and not fsdp and d < 4:
        terms.append(Term(name="fp32 gradients", num_bytes=params * 4, phase=Phase.optimizer_step,
                          how="the gradients in float32 for the master weights", knob=more_tp))
    if tr.exact_accumulation:  # exact_sum.BYTES_PER_ELEMENT, written out (no torch here); FSDP: + a scatter's shard
        summed = params + (fsdp_root_and_layer(shape)[0] if fsdp else 0)  # the root: its largest reduce-scatter
        terms.append(Term(name="exact gradient sum", num_bytes=summed * 26 // n, phase=Phase.always,
                          how="int64 bins, 26 B/param" + (f" / {n} ranks, + the root's shard" if fsdp else ""),
                          knob="trainer.exact_accumulation=false"))
    if cfg.num_steps_per_rollout > 1 and tr.old_logprobs is OldLogprobSource.trainer:
        terms.append(Term(name="policy snapshot", num_bytes=params * master // n if fsdp else params * d,
                          phase=Phase.always, how="version k's weights for old log-probs",
                          knob="trainer.old_logprobs=engine"))
    if cfg.grpo.kl_loss_coef > 0:
        terms.append(Term(name="reference model", num_bytes=params * master // n if fsdp else params * d,
                          phase=Phase.always, how="the frozen reference's weights for the KL term",
                          knob="grpo.kl_loss_coef=0"))
    if (sync := cfg.weight_sync()).way is WeightSync.distributed and sync.engines_on_gpus:  # (rank 0's, for all)
        terms.append(Term(name="weight-sync buffers", num_bytes=2 * sync.bucket_bytes, phase=Phase.always,
                          how="2 flat bucket buffers, double-buffered", knob="lower pipeline.weight_sync_bucket_mb"))

    # GQA's keys and values repeated to every query head: Megatron's local DotProductAttention only (HF's SDPA call
    # without a mask uses enable_gqa; Transformer Engine takes grouped heads)
    expanded = megatron and attention is AttentionKind.materialised
    per_layer = sum(layer_activation_bytes(shape, dtype_bytes=d, tp=tp, expanded_kv=expanded).values())
    final_norm = 4 * h + 2 * d * h
    if tr.recompute:
        act = tokens * (layers * d * h + per_layer + final_norm)
        how = (f"{tokens} tokens x ({layers} layer inputs x {d * h} B + one layer {per_layer / 1024:.0f} KiB + "
               "final norm)")
        knob = fewer_tokens
    else:
        act = tokens * (layers * per_layer + final_norm)
        how = f"{tokens} padded tokens x {layers} layers x {per_layer / 1024:.0f} KiB + final norm"
        knob = f"trainer.recompute=true, {fewer_tokens}"
    terms.append(Term(name="activations", num_bytes=int(act), phase=Phase.forward_backward, how=how, knob=knob))

    head_grad = shape.vocab_size * h // tp * d  # the head weight's gradient in the model's dtype
    chunk = tr.logprob_chunk_tokens
    logit_tokens = min(chunk, tokens) if chunk else tokens
    vocab = shape.vocab_size // tp
    if chunk or megatron:
        low = d if d < 4 else 0  # a 16-bit model's extra copy
        summed = vocab * h * (max(4, d) + low)  # float32 sum, one chunk's part in 16 bits
        lp_bytes = max(8 * logit_tokens * vocab, (4 + low) * logit_tokens * vocab + summed)
        lp_how = (f"{logit_tokens} tokens x {vocab} vocabulary{' (this rank' + chr(39) + 's shard)' if tp > 1 else ''}"
               f": 8 B per logit forward, {4 + low} B beside the head gradient summed in float32 backward")
        lp_knob = "lower trainer.logprob_chunk_tokens" if chunk else "trainer.logprob_chunk_tokens=1024"
    else:
        lp_bytes = 20 * logit_tokens * vocab
        lp_how = f"{logit_tokens} tokens x {vocab} vocabulary x 20 B: the model's own forward over every logit"
        lp_knob = "trainer.logprob_chunk_tokens=1024"
    heads = shape.num_heads // tp
    if attention is AttentionKind.materialised:
        scores = scores_per_head * heads
        held, kept, layer = materialised_score_bytes(d)
        terms.append(Term(name="scores buffer", num_bytes=scores * held, phase=Phase.always,
                          how=f"Megatron's global [b x {heads} heads, T, T] buffer, {held} B per score"))
        # the log-prob chunk's backward comes first, every layer's probabilities kept (none with recompute); the
        # last layer's backward comes after it, the chunk freed: the term is what the larger of the two adds
        first = 0 if tr.recompute else layers * kept * scores
        attn = max(first, ((0 if tr.recompute else layers - 1) * kept + layer) * scores - lp_bytes)
        how = (f"{scores / 1e6:.0f}M scores ({heads} heads x {scores_per_head / 1e6:.0f}M T^2): the larger of "
               f"{0 if tr.recompute else layers} layers x {kept} B at the log-prob chunk's backward and, over the "
               f"chunk, {'one layer' if tr.recompute else f'{layers - 1} x {kept} B + the last layer'} in backward "
               f"({layer} B)")
        knob = f"{'' if tr.recompute else 'trainer.recompute=true, '}{more_tp}, {fewer_tokens}"
    else:
        attn, how, knob = 0, "O(T): output and log-sum-exp, counted in activations", ""
    mask = length * length if megatron else 0  # the torch backend passes no mask (padding is on the right)
    if mask:
        how += f"; [{length}^2] boolean mask"
    terms.append(Term(name=f"attention ({attention.value})", num_bytes=int(attn + mask), phase=Phase.forward_backward,
                      how=how, knob=knob))

    terms.append(Term(name="log-prob chunk", num_bytes=lp_bytes, phase=Phase.forward_backward, how=lp_how,
                      knob=lp_knob))
    if fsdp:
        terms += fsdp_unsharded_terms(shape, d=d, n=n, logprob_bytes=lp_bytes, layer_activations=tokens * per_layer)
    else:
        embedding_grads = 2 if shape.tied_embeddings else 1
        terms.append(Term(name="embedding gradient", num_bytes=embedding_grads * head_grad,
                          phase=Phase.end_of_backward,
                          how=(f"{embedding_grads} x [{shape.vocab_size // tp}, {h}] x {d} B: "
                               + ("the tied weight's gradient from the head and the embedding's, being added"
                                  if shape.tied_embeddings else "the embedding's part before it is added"))))
    terms.append(Term(name="CUDA context", num_bytes=CUDA_CONTEXT_BYTES, phase=Phase.always,
                      how="assumed: context, workspaces, allocator slack"))
    notes = [(f"micro-batch: up to {tokens} padded tokens (max prompt {cfg.data.max_prompt_len} + max response "
             f"{cfg.rollout_max_response_len} = {length} a sample)"),
             f"attention assumed {attention.value}: "
             + ("Megatron's local layer spec (DotProductAttention: CPU, or no Transformer Engine)"
                if attention is AttentionKind.materialised else
                "Transformer Engine's fused attention (trainer/megatron/model.py uses its layer spec when "
                "transformer_engine imports on the GPU nodes; --attention materialised: without it)" if megatron
                else "SDPA's flash / memory-efficient kernels, purely causal")]
    if megatron:
        notes.append("distributed optimizer: " + (
            "off (trainer.megatron.distributed_optimizer=false): each data-parallel rank keeps the whole state"
            if tr.megatron.distributed_optimizer is False else
            f"master weights and Adam state / {tr.data_parallel_size} data-parallel ranks"
            + (" (distributed_optimizer=null counted as true: it is on a GPU launch; the CPU path runs without it)"
               if tr.megatron.distributed_optimizer is None else "")))
    return Estimate(who=f"trainer rank ({tr.backend.value}, tp={tp})", count=tr.num_ranks, terms=terms,
                    capacity_bytes=capacity_bytes, notes=notes)


def planned_allocated_bytes(cfg: Config, shape: ModelShape, *, attention: AttentionKind | None = None) -> int:
    """The trainer rank's peak as ``torch.cuda.max_memory_allocated`` counts it: without the CUDA context."""
    return trainer_estimate(cfg, shape, capacity_bytes=0, attention=attention).peak_bytes - CUDA_CONTEXT_BYTES


def fsdp_root_and_layer(shape: ModelShape) -> tuple[int, int]:
    """Parameters of FSDP's root (embedding, head, final norm: sharded as one) and of one decoder layer."""
    root = shape.vocab_size * shape.hidden_size * (1 if shape.tied_embeddings else 2) + shape.hidden_size
    return root, (shape.num_params() - root) // shape.num_layers


def fsdp_state_terms(shape: ModelShape, *, d: int, n: int) -> list[Term]:
    """trainer.backend=fsdp on ``n`` ranks: the float32 master shards (a 16-bit model; else the model's dtype), their
    gradients (reduced and accumulated in float32) and Adam's moments, each 1/n."""
    params, kept = shape.num_params(), max(d, 4)
    more_ranks = "more trainer.num_ranks (FSDP shards by them)"
    return [
        Term(name="weights", num_bytes=params * kept // n, phase=Phase.always,
             how=f"{params / 1e9:.2f}B params x {kept} B / {n} ranks" + (" (float32 master shards)" if d < 4 else ""),
             knob=more_ranks),
        Term(name="gradients", num_bytes=params * kept // n, phase=Phase.always,
             how=f"{kept} B/param / {n} ranks, reduce-scattered every micro-batch", knob=more_ranks),
        Term(name="optimizer state", num_bytes=params * 2 * kept // n, phase=Phase.always,
             how=f"Adam m, v: 2 x {kept} B/param / {n} ranks", knob=more_ranks),
    ]


def fsdp_unsharded_terms(shape: ModelShape, *, d: int, n: int, logprob_bytes: int,
                         layer_activations: float) -> list[Term]:
    """What FSDP unshards during a micro-batch, beyond the replicated backends' tensors, at the larger of two moments
    (the activations are alive at both). The root's parameters (compute dtype) at both: FSDP2 keeps the root unsharded
    between forward and backward. (1) The log-prob chunk's backward, which comes first: the last layer's parameters
    already all-gathered for its backward (prefetched; on one rank FSDP2 does not all-gather and nothing is there
    yet). (2) The last layer's backward, the chunk freed: that layer and the next one prefetched (one on one rank);
    the head's unsharded gradient, held until the root's reduce-scatter; and, once the layer's gradient is complete
    with its float32 reduce-scatter input (FSDP2's copy-in), that layer's activations freed. The term is the root plus
    what the larger moment adds over the log-prob chunk (bench/memory_plan_validation.py measures both regimes). At
    the end of backward: the root's unsharded gradients (the head's, and the embedding's unless tied) and their
    float32 reduce-scatter input, the root's parameters resharded just before."""
    root, layer = fsdp_root_and_layer(shape)
    reduce = max(d, 4)
    head_grad = shape.vocab_size * shape.hidden_size * d
    prefetched = layer * d if n > 1 else 0
    layer_backward = layer * d + prefetched + head_grad + max(0, int(layer * (d + reduce) - layer_activations))
    extra = max(prefetched, layer_backward - logprob_bytes)
    root_grads = head_grad * (1 if shape.tied_embeddings else 2)
    return [
        Term(name="unsharded in flight", num_bytes=root * d + extra, phase=Phase.forward_backward,
             how=(f"root {root / 1e6:.0f}M params x {d} B + the larger of the last layer prefetched beside the "
                  f"log-prob chunk and its backward ({1 + (n > 1)} x {layer / 1e6:.0f}M params, the head's gradient, "
                  f"its gradient + {reduce} B reduce-scatter copy less its activations) over the chunk"),
             knob=""),
        Term(name="root gradient", num_bytes=root_grads + root * reduce, phase=Phase.end_of_backward,
             how=(f"{root_grads // head_grad} x [{shape.vocab_size}, {shape.hidden_size}] x {d} B unsharded + "
                  f"{root / 1e6:.0f}M x {reduce} B reduce-scatter input")),
    ]


def mem_fraction_static(cfg: Config) -> float:
    args = cfg.rollout.sglang_launch_args
    for i, arg in enumerate(args):
        if arg.startswith("--mem-fraction-static"):
            return float(arg.split("=", 1)[1] if "=" in arg else args[i + 1])
    return SGLANG_MEM_FRACTION_STATIC


def engine_estimate(cfg: Config, shape: ModelShape, *, capacity_bytes: int) -> Estimate | None:
    if not cfg.rollout.engines_on_gpus:
        return None
    tp = cfg.rollout.sglang_gpus_per_engine
    d = dtype_bytes(cfg.model.dtype)
    params = shape.num_params(tp=tp)
    length = sequence_len(cfg)
    kv_heads = max(1, shape.num_kv_heads // tp)
    per_token = 2 * shape.num_layers * kv_heads * shape.head_dim * d
    fraction = mem_fraction_static(cfg)
    reserve = int(capacity_bytes * (1 - fraction))
    room = capacity_bytes * fraction - params * d
    most = max(0, int(room // (per_token * length)))
    terms = [
        Term(name="weights", num_bytes=params * d, phase=Phase.always, how=f"{params / 1e9:.2f}B params x {d} B",
             knob="more rollout.sglang_gpus_per_engine"),
        Term(name="KV cache", num_bytes=cfg.rollout.concurrency * length * per_token, phase=Phase.always,
             how=f"{cfg.rollout.concurrency} requests x {length} tokens x {per_token // 1024} KiB",
             knob=f"rollout.concurrency={most} (the most that fit), or more rollout.sglang_gpus_per_engine"),
        Term(name="SGLang reserve", num_bytes=reserve, phase=Phase.always,
             how=f"(1 - mem_fraction_static {fraction}) x GPU: activations, CUDA graphs",
             knob="--mem-fraction-static in rollout.sglang_launch_args"),
    ]
    notes = [("worst case: every running request at max prompt + max response; past it SGLang queues or retracts "
             "requests rather than failing")]
    return Estimate(who=f"rollout engine (SGLang, tp={tp})", count=cfg.rollout.num_engines, terms=terms,
                    capacity_bytes=capacity_bytes, notes=notes)


TRAINER_RANK_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
"""The trainer GPU counts the plan tries: within one 8-GPU node, then whole nodes."""


def shards_by_ranks(cfg: Config) -> bool:
    """Whether more trainer ranks lower each rank's training state: FSDP, Megatron with its distributed optimizer."""
    tr = cfg.trainer
    return tr.backend is TrainerBackend.fsdp or (tr.backend is TrainerBackend.megatron
                                                 and tr.megatron.distributed_optimizer is not False)


def with_ranks(cfg: Config, num_ranks: int) -> Config:
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, num_ranks=num_ranks))


def fewest_ranks(cfg: Config, shape: ModelShape, *, capacity_bytes: int,
                 attention: AttentionKind | None = None) -> tuple[int, list[str]] | None:
    """The smallest trainer.num_ranks (TRAINER_RANK_COUNTS, multiples of Megatron's tensor x pipeline parallel
    size, kept) with which each rank fits, over the config as it is and the ladder's micro-batch and recompute rungs
    (``fix_candidates``): the fewest GPUs first, then the fewest changes. None where ranks shard nothing."""
    if not shards_by_ranks(cfg):
        return None
    model_parallel = cfg.trainer.megatron.tensor_parallel_size * cfg.trainer.megatron.pipeline_parallel_size
    rungs = [([], cfg)] + [(o, c) for o, c in fix_candidates(cfg, shape)
                           if not any(x.startswith(("trainer.num_ranks", "trainer.megatron.")) for x in o)]
    best: tuple[int, list[str]] | None = None
    for overrides, rung in rungs:
        for n in TRAINER_RANK_COUNTS:
            if n % model_parallel == 0 and (best is None or n < best[0]) and trainer_estimate(
                    with_ranks(rung, n), shape, capacity_bytes=capacity_bytes, attention=attention).fits:
                best = (n, [*overrides, f"trainer.num_ranks={n}"])
                break
    return best


def fix_candidates(cfg: Config, shape: ModelShape) -> list[tuple[list[str], Config]]:
    """A ladder of changes, each adding to the one before: one sample per micro-batch, recomputation, then tensor
    parallelism (Megatron; 2, 4, 8 ranks where they divide the key/value heads and trainer.num_ranks)."""
    out: list[tuple[list[str], Config]] = []
    overrides: list[str] = []
    if micro_batch_rows(cfg) > 1:
        overrides = [f"max_tokens_per_micro_batch={sequence_len(cfg)}"]
        cfg = dataclasses.replace(cfg, max_tokens_per_micro_batch=sequence_len(cfg))
        out.append((overrides, cfg))
    if not cfg.trainer.recompute:
        overrides = [*overrides, "trainer.recompute=true"]
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, recompute=True))
        out.append((overrides, cfg))
    if cfg.trainer.backend is TrainerBackend.fsdp:  # the fewest ranks that fit come first
        for num_ranks in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128):
            if num_ranks > cfg.trainer.num_ranks:
                out.append(([*overrides, f"trainer.num_ranks={num_ranks}"], with_ranks(cfg, num_ranks)))
    if cfg.trainer.backend is TrainerBackend.megatron:
        for tp in (2, 4, 8):
            if (tp > cfg.trainer.megatron.tensor_parallel_size and shape.num_kv_heads % tp == 0
                    and cfg.trainer.num_ranks % tp == 0):
                megatron = dataclasses.replace(cfg.trainer.megatron, tensor_parallel_size=tp)
                tp_cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, megatron=megatron))
                out.append(([*overrides, f"trainer.megatron.tensor_parallel_size={tp}"], tp_cfg))
    return out


def plan(cfg: Config, shape: ModelShape, *, gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
         attention: AttentionKind | None = None) -> MemoryPlan:
    capacity = int(gpu_memory_gib * GiB)
    trainer = trainer_estimate(cfg, shape, capacity_bytes=capacity, attention=attention)
    result = MemoryPlan(trainer=trainer, engine=engine_estimate(cfg, shape, capacity_bytes=capacity))
    if not trainer.fits:
        for overrides, candidate in fix_candidates(cfg, shape):
            if trainer_estimate(candidate, shape, capacity_bytes=capacity, attention=attention).fits:
                result.fix = overrides
                break
    result.sharded = shards_by_ranks(cfg)
    result.fewest_ranks = fewest_ranks(cfg, shape, capacity_bytes=capacity, attention=attention)
    return result


def warnings(result: MemoryPlan) -> list[str]:
    """One line per estimate that does not fit, naming its largest terms and their knobs."""
    lines = []
    for est in result.estimates:
        if est.fits:
            continue
        over = sorted((t for t in est.terms if t.knob and t.num_bytes >= est.peak_bytes / 20),
                      key=lambda t: -t.num_bytes)[:3]
        terms = "; ".join(f"{t.name} {t.num_bytes / GiB:.1f} GiB (lower it: {t.knob})" for t in over)
        line = (f"memory plan: each {est.who} needs about {est.peak_bytes / GiB:.1f} GiB, over the "
                f"{est.capacity_bytes / GiB:.0f} GiB of its GPU. Largest: {terms}.")
        if est is result.trainer:
            line += (f" Fits with: {' '.join(result.fix)}." if result.fix
                     else " Nothing the plan tries makes it fit (see tools/memory_plan.py).")
        lines.append(line)
    return lines


def format_plan(result: MemoryPlan) -> str:
    out = []
    for est in result.estimates:
        out.append(f"each {est.who} ({est.count} alike)")
        width = max(len(t.name) for t in est.terms)
        for t in est.terms:
            out.append(f"  {t.name:<{width}}  {t.num_bytes / GiB:>8.2f} GiB  {t.phase.value:<7}  {t.how}")
        out.append(f"  {'peak':<{width}}  {est.peak_bytes / GiB:>8.2f} GiB  of {est.capacity_bytes / GiB:.0f} GiB: "
                   f"{'fits' if est.fits else 'DOES NOT FIT'}")
        out += [f"  ({note})" for note in est.notes]
        out.append("")
    if result.engine is None:
        out.append("rollout engines: not on GPUs (rollout.engine is embedded), not planned")
    if result.fewest_ranks:
        n, overrides = result.fewest_ranks
        out.append(f"fewest trainer GPUs that fit: {n} ({' '.join(overrides)}); this config: {result.trainer.count}")
    elif result.sharded:
        out.append(f"fewest trainer GPUs that fit: none up to {TRAINER_RANK_COUNTS[-1]}")
    out += warnings(result) or ["every estimate fits"]
    return "\n".join(out)
