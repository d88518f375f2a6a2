"""The shapes a memory plan needs: what memory depends on in a Qwen2/Qwen3-style decoder, read from an HF
config.json, the embedded tiny model, or the Qwen3 family's published numbers (``--model-shape``), what one
decoder layer of a shape keeps for backward per token (and, in Megatron's local attention, per score), and the
largest micro-batch a config trains.

Pure arithmetic; launch/memory_plan.py adds up a trainer rank's and an engine's terms from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rolloutpipe.config import Config
from rolloutpipe.model import TINY_CHARS, TINY_SPECIAL_TOKENS


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    """What memory depends on in a Qwen2/Qwen3-style decoder (HF config.json names in the docstrings)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    """num_hidden_layers"""
    num_heads: int
    """num_attention_heads"""
    num_kv_heads: int
    """num_key_value_heads"""
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    """tie_word_embeddings: the output head is the input embedding."""
    qk_norm: bool = True
    """Qwen3's per-head RMSNorm of q and k (Qwen2 has none)."""
    qkv_bias: bool = False
    """Qwen2's q/k/v biases."""

    @classmethod
    def from_hf(cls, hf_config) -> ModelShape:
        heads = hf_config.num_attention_heads
        return cls(hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
                   num_layers=hf_config.num_hidden_layers, num_heads=heads,
                   num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                   vocab_size=hf_config.vocab_size, tied_embeddings=bool(hf_config.tie_word_embeddings),
                   qk_norm=hf_config.model_type == "qwen3", qkv_bias=hf_config.model_type == "qwen2")

    def num_params(self, *, tp: int = 1) -> int:
        """Parameters of one tensor-parallel shard (tp=1: the HF model's parameter count, tied weights once).
        Linear layers and the vocabulary (padded to a multiple of tp) are split; norms are replicated."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        linear = self.layer_matmul_params() + (q + 2 * kv if self.qkv_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        vocab = -(-self.vocab_size // tp) * h
        heads = vocab if self.tied_embeddings else 2 * vocab
        return heads + self.num_layers * (linear // tp + norms) + h

    def layer_matmul_params(self) -> int:
        """One decoder layer's projection weights: q, k, v and o, and the MLP's gate, up and down."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size


QWEN3_SHAPES = {
    "qwen3-0.6b": ModelShape(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                             head_dim=128, vocab_size=151936, tied_embeddings=True),
    "qwen3-1.7b": ModelShape(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
                             head_dim=128, vocab_size=151936, tied_embeddings=True),
    "qwen3-4b": ModelShape(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32, num_kv_heads=8,
                           head_dim=128, vocab_size=151936, tied_embeddings=True),
    "qwen3-8b": ModelShape(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                           head_dim=128, vocab_size=151936, tied_embeddings=False),
    "qwen3-14b": ModelShape(hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40, num_kv_heads=8,
                            head_dim=128, vocab_size=151936, tied_embeddings=False),
    "qwen3-32b": ModelShape(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64, num_kv_heads=8,
                            head_dim=128, vocab_size=151936, tied_embeddings=False),
}
"""The Qwen3 family's HF config.json numbers, so a plan needs no model directory (``--model-shape``)."""


def model_shape(cfg: Config) -> ModelShape:
    """model.path's config.json (local files only), or the embedded tiny Qwen3's shape."""
    if cfg.model.path is not None:
        from transformers import AutoConfig

        return ModelShape.from_hf(AutoConfig.from_pretrained(cfg.model.path, local_files_only=True))
    tiny = cfg.model.tiny
    return ModelShape(hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                      num_layers=tiny.num_layers, num_heads=tiny.num_attention_heads,
                      num_kv_heads=tiny.num_key_value_heads, head_dim=tiny.hidden_size // tiny.num_attention_heads,
                      vocab_size=len(TINY_SPECIAL_TOKENS) + len(TINY_CHARS), tied_embeddings=True)


def train_flops(shape: ModelShape, sequence_lengths: Iterable[int], *, recompute: bool = False) -> int:
    """FLOPs of one forward and backward over sequences of these lengths (prompt + response tokens, no padding):
    the model FLOPs that MFU divides by the time taken, or with ``recompute`` the hardware FLOPs of
    ``trainer.recompute`` (HFU). docs/gpu.md has the derivation.

    Matmuls (PaLM's appendix B, Megatron-LM's MFU): a weight of N elements costs 2N FLOPs per token forward (a
    multiply and an add per element) and 4N backward (the input's gradient and the weight's): 6N per token. N is
    every layer's projections and the output head, tied or not (the embedding lookup multiplies nothing), counted
    at every token as the convention does, though the loss reads the head only at response tokens (issue 43's 26%
    counts the same way). Causal attention, per layer, head and sequence of T tokens: query i meets keys 0..i,
    T(T+1)/2 pairs, each a q.k dot product and a p.v product of head_dim elements (4 head_dim FLOPs) forward and
    twice that backward: 6 head_dim T(T+1). ``recompute`` adds the decoder layers' forward once more (2 N_layers
    per token, 2 head_dim T(T+1) per head): the head is not recomputed. The old log-probs of a step's first batch
    come from the same forward, so they add nothing. Left out: norms, RoPE, softmax, SiLU and the loss (a few
    FLOPs per hidden element, under 1%).
    """
    lengths = list(sequence_lengths)
    tokens, pairs = sum(lengths), sum(t * (t + 1) for t in lengths)
    layers = shape.num_layers * shape.layer_matmul_params()
    attention = shape.num_layers * shape.num_heads * shape.head_dim * pairs
    flops = 6 * (layers + shape.vocab_size * shape.hidden_size) * tokens + 6 * attention
    return flops + (2 * layers * tokens + 2 * attention if recompute else 0)


def layer_activation_bytes(shape: ModelShape, *, dtype_bytes: int, tp: int = 1,
                           expanded_kv: bool = False) -> dict[str, float]:
    """Bytes one decoder layer keeps for backward, per token, by tensor (tensor-parallel rank ``tp`` of them): what
    autograd saves in HF's Qwen3 layer (tests/multiprocess/test_memory_plan.py counts it with saved-tensor hooks).

    RMSNorm keeps its input in float32, the normalised input (in the model's dtype) and its product with the weight
    (the next linears' input): 4h + 2dh. q and k: the projection's output in float32 for the q/k norm, the
    normalised one, and the rotated tensor the attention keeps (4 + 2d per element; RoPE's products keep only cos and
    sin; without q/k norm just the rotated tensor, d). v as projected. The attention's output, which o_proj reads
    in place (flash kernels write it [tokens, heads, head_dim]), and a float32 log-sum-exp per head. The MLP: gate,
    silu(gate), up and their product (4d per intermediate element). Residual adds keep nothing. ``expanded_kv``:
    GQA's keys and values repeated to every query head (HF with a padding mask, where SDPA's enable_gqa is not used;
    Megatron's DotProductAttention always).
    """
    d, h = dtype_bytes, shape.hidden_size
    q = shape.num_heads * shape.head_dim / tp
    kv = shape.num_kv_heads * shape.head_dim / tp
    rotated = 4 + 2 * d if shape.qk_norm else d
    norm = 4 * h + 2 * d * h
    return {
        "input norm": norm,
        "q": rotated * q,
        "k": rotated * kv + (d * (q - kv) if expanded_kv else 0),
        "v": d * kv + (d * (q - kv) if expanded_kv else 0),
        "attention output": d * q + 4 * shape.num_heads / tp,
        "post-attention norm": norm,
        "mlp": 4 * d * shape.intermediate_size / tp,
    }


def sequence_len(cfg: Config) -> int:
    """The budget of one sample: the longest prompt plus the longest response."""
    return cfg.data.max_prompt_len + cfg.rollout_max_response_len


def row_cap(cfg: Config) -> int:
    """The most samples a micro-batch holds: a rank's share of the batch, and a group with trainer.exact_accumulation
    (its micro-batches never span two groups)."""
    share = max(1, cfg.global_batch_size // cfg.trainer.data_parallel_size)
    return min(share, cfg.n_samples_per_prompt) if cfg.trainer.exact_accumulation else share


def micro_batch_rows(cfg: Config) -> int:
    """Full-length samples in the largest micro-batch: micro_batch_size, or as many as max_tokens_per_micro_batch
    holds (at least one)."""
    rows = (max(1, cfg.max_tokens_per_micro_batch // sequence_len(cfg)) if cfg.max_tokens_per_micro_batch
            else cfg.micro_batch_size)
    return min(rows, row_cap(cfg))


def micro_batch_size(cfg: Config) -> tuple[int, int]:
    """The largest micro-batch a rank trains: (padded token slots, attention score elements per head: the sum of its
    rows' T^2). A token budget B bounds rows x longest (trainer/batching.py), whatever the rows: up to B slots (one
    sample longer than B goes alone), and the most score elements at r rows of min(longest, B // r) tokens."""
    length, budget, cap = sequence_len(cfg), cfg.max_tokens_per_micro_batch, row_cap(cfg)
    if not budget:
        rows = min(cfg.micro_batch_size, cap)
        return rows * length, rows * length * length
    scores = max(r * min(length, budget // r) ** 2 for r in range(1, cap + 1) if r == 1 or budget // r)
    return min(max(budget, length), cap * length), max(scores, length * length)


def materialised_score_bytes(d: int) -> tuple[int, int, int]:
    """Bytes per attention score element of Megatron's local DotProductAttention: (held for the run, kept by each
    layer until its backward, held by the layer in backward). Its scores go to a [b * heads, T, T] global buffer of
    the model's dtype, d B. Softmax runs in float32 (attention_softmax_in_fp32; without Apex's kernels, and past 4096
    keys with them): each layer keeps the float32 probabilities (softmax's backward) and, for a 16-bit model, their
    cast for the value matmul; in backward two float32 gradients join them, the softmax's input and output (its
    forward holds less: the scores, their float32 copy, the probabilities and their cast). float32: the copy and the
    cast are the tensors themselves. Measured: bench/memory_plan_tracked.py (live tensors, CPU), an H200 (issue 43)."""
    wide = max(d, 4)
    kept = wide + (d if d < 4 else 0)
    return d, kept, kept + 2 * wide
