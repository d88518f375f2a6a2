"""HF <-> Megatron-core parameter mapping for the Qwen2 / Qwen3 architecture, with tensor-parallel shards.

    HF (one layer i)                         Megatron GPTModel (local spec), per tensor-parallel rank
    model.embed_tokens.weight [V, H]         embedding.word_embeddings.weight    rows (vocab) split, V padded
    input_layernorm.weight                   decoder.layers.i.input_layernorm.weight               replicated
    self_attn.{q,k,v}_proj.weight (+bias)    decoder.layers.i.self_attention.linear_qkv.weight     see below
    self_attn.{q,k}_norm.weight (Qwen3)      decoder.layers.i.self_attention.{q,k}_layernorm.weight replicated
    self_attn.o_proj.weight                  decoder.layers.i.self_attention.linear_proj.weight    columns split
    post_attention_layernorm.weight          decoder.layers.i.pre_mlp_layernorm.weight             replicated
    mlp.{gate,up}_proj.weight                decoder.layers.i.mlp.linear_fc1.weight  [gate shard; up shard]
    mlp.down_proj.weight                     decoder.layers.i.mlp.linear_fc2.weight                columns split
    model.norm.weight                        decoder.final_layernorm.weight                        replicated
    lm_head.weight (untied only)             output_layer.weight                 rows (vocab) split, V padded

linear_qkv keeps Megatron's interleaved layout: for each query group g (a KV head), the rows of the
group's query heads, then its key head, then its value head; tensor parallelism splits whole query
groups. The vocabulary is padded with zero rows to a multiple of the tensor-parallel size (Megatron's
vocab-parallel embedding needs equal shards); the trainer slices the padded logits off, and the HF
export drops the rows again.

Transformer Engine's layer spec fuses each layer's two norms into the linear layer after them; only the names
change (``TE_FUSED_NORMS``, applied by ``transformer_engine_names`` / ``local_names``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rolloutpipe.control.weights.buckets import Bucket, plan_buckets, unpack

Tensor = torch.Tensor


@dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    """What the mapping needs from an HF Qwen2 / Qwen3 config, and the tensor-parallel size."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    tp_size: int

    @classmethod
    def from_hf(cls, hf_config, *, tp_size: int) -> Layout:
        return cls(
            num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads, num_query_groups=hf_config.num_key_value_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
            vocab_size=hf_config.vocab_size, tied_embeddings=bool(hf_config.tie_word_embeddings),
            # Qwen2 has q/k/v biases and no q/k norms; Qwen3 the other way round
            qkv_bias=hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=hf_config.model_type == "qwen3", tp_size=tp_size,
        )

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.tp_size) * self.tp_size

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups


TE_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
"""Per layer: the local spec's name -> Transformer Engine's (TELayerNormColumnParallelLinear holds the norm)."""


def transformer_engine_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A local-spec state dict under Transformer Engine's layer-spec names."""
    return {_rename(k, TE_FUSED_NORMS): v for k, v in state.items()}


def local_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of ``transformer_engine_names``."""
    inverse = {te: local for local, te in TE_FUSED_NORMS.items()}
    return {_rename(k, inverse): v for k, v in state.items()}


def _rename(name: str, suffixes: dict[str, str]) -> str:
    prefix, dot, rest = name.partition(".layers.")
    number, _, suffix = rest.partition(".")
    return f"{prefix}{dot}{number}.{suffixes[suffix]}" if dot and suffix in suffixes else name


def hf_to_megatron(hf: dict[str, Tensor], layout: Layout, *, tp_rank: int) -> dict[str, Tensor]:
    """The Megatron parameters of tensor-parallel rank ``tp_rank`` from a full HF state dict."""
    tp = layout.tp_size

    def rows(t: Tensor) -> Tensor:
        return t.chunk(tp, dim=0)[tp_rank]

    def cols(t: Tensor) -> Tensor:
        return t.chunk(tp, dim=1)[tp_rank]

    out = {"embedding.word_embeddings.weight": rows(_pad_vocab(hf["model.embed_tokens.weight"], layout)),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not layout.tied_embeddings:
        out["output_layer.weight"] = rows(_pad_vocab(hf["lm_head.weight"], layout))
    for i in range(layout.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = rows(_fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], layout))
        if layout.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = rows(_fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], layout))
        if layout.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = cols(hf[attn + "o_proj.weight"])
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [rows(hf[h + "mlp.gate_proj.weight"]), rows(hf[h + "mlp.up_proj.weight"])])
        out[m + "mlp.linear_fc2.weight"] = cols(hf[h + "mlp.down_proj.weight"])
    return out


def megatron_to_hf(shards: list[dict[str, Tensor]], layout: Layout) -> dict[str, Tensor]:
    """The full HF state dict from every tensor-parallel rank's Megatron parameters (rank order): new tensors on the
    host, none sharing memory with ``shards``.

    With tied embeddings ``lm_head.weight`` is left out, as HF's safetensors files do.
    """
    sources, out = hf_sources(layout), {}
    for bucket in hf_plan(shards, layout, bucket_bytes=1 << 62):  # one bucket (one per dtype alignment)
        out |= map_bucket(shards, layout, bucket, torch.empty(bucket.num_bytes, dtype=torch.uint8), sources)
    return out


@dataclass(frozen=True, slots=True)
class Source:
    """Where one HF tensor lies in the tensor-parallel ranks' Megatron parameter ``name``: ``part`` is ``whole``
    (replicated), ``rows`` (the vocabulary, padded), ``cols``, ``q`` / ``k`` / ``v`` (of linear_qkv's query groups)
    or ``gate`` / ``up`` (linear_fc1's halves)."""

    name: str
    part: str


def hf_sources(layout: Layout) -> dict[str, Source]:
    """Every HF tensor's ``Source``: the embedding, the final norm, the head (tied: left out), then layer by layer;
    the order of weight sync's buckets."""
    out = {"model.embed_tokens.weight": Source("embedding.word_embeddings.weight", "rows"),
           "model.norm.weight": Source("decoder.final_layernorm.weight", "whole")}
    if not layout.tied_embeddings:
        out["lm_head.weight"] = Source("output_layer.weight", "rows")
    for i in range(layout.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[h + "input_layernorm.weight"] = Source(m + "input_layernorm.weight", "whole")
        out[h + "post_attention_layernorm.weight"] = Source(m + "pre_mlp_layernorm.weight", "whole")
        for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
            for proj in "qkv":
                out[f"{attn}{proj}_proj.{kind}"] = Source(f"{m}self_attention.linear_qkv.{kind}", proj)
        if layout.qk_norm:
            out[attn + "q_norm.weight"] = Source(m + "self_attention.q_layernorm.weight", "whole")
            out[attn + "k_norm.weight"] = Source(m + "self_attention.k_layernorm.weight", "whole")
        out[attn + "o_proj.weight"] = Source(m + "self_attention.linear_proj.weight", "cols")
        out[h + "mlp.gate_proj.weight"] = Source(m + "mlp.linear_fc1.weight", "gate")
        out[h + "mlp.up_proj.weight"] = Source(m + "mlp.linear_fc1.weight", "up")
        out[h + "mlp.down_proj.weight"] = Source(m + "mlp.linear_fc2.weight", "cols")
    return out


def hf_shape(shards: list[dict[str, Tensor]], layout: Layout, source: Source) -> torch.Size:
    """The shape of the HF tensor that ``source`` describes."""
    first, tp = shards[0][source.name], len(shards)
    rest = first.shape[1:]
    if source.part == "whole":
        return first.shape
    if source.part == "rows":
        return torch.Size((layout.vocab_size, *rest))
    if source.part == "cols":
        return torch.Size((first.shape[0], first.shape[1] * tp))
    if source.part in ("gate", "up"):
        return torch.Size((first.shape[0] // 2 * tp, *rest))
    return torch.Size((layout.num_query_groups * _qkv_rows(layout, source.part)[1], *rest))


def write_hf(shards: list[dict[str, Tensor]], layout: Layout, source: Source, out: Tensor) -> None:
    """Copy the HF tensor ``source`` describes into ``out`` (contiguous, of ``hf_shape``, any dtype or device):
    straight from the shards, each element once, through no tensor in between."""
    pieces = [shard[source.name].detach() for shard in shards]
    tp, part = len(pieces), source.part
    if part == "whole":
        out.copy_(pieces[0])
    elif part == "rows":  # the padded vocabulary's rows, split in order; the padding (at the end) left out
        offset = 0
        for piece in pieces:
            piece = piece[:layout.vocab_size - offset]
            out[offset:offset + piece.shape[0]].copy_(piece)
            offset += piece.shape[0]
    elif part == "cols":
        width = pieces[0].shape[1]
        for t, piece in enumerate(pieces):
            out[:, t * width:(t + 1) * width].copy_(piece)
    elif part in ("gate", "up"):
        half = pieces[0].shape[0] // 2
        for t, piece in enumerate(pieces):
            out[t * half:(t + 1) * half].copy_(piece[:half] if part == "gate" else piece[half:])
    else:  # each rank holds whole query groups: [q heads, k, v] per group
        groups, d = layout.num_query_groups // tp, layout.head_dim
        start, size = _qkv_rows(layout, part)
        rest = out.shape[1:]
        into = out.view(tp, groups, size, *rest)
        for t, piece in enumerate(pieces):
            into[t].copy_(piece.view(groups, (layout.heads_per_group + 2) * d, *rest)[:, start:start + size])


def hf_plan(shards: list[dict[str, Tensor]], layout: Layout, bucket_bytes: int) -> list[Bucket]:
    """The HF tensors' ``plan_buckets`` buckets, from the shards' shapes and dtypes alone (meta tensors will do)."""
    return plan_buckets({name: torch.empty(hf_shape(shards, layout, source), dtype=shards[0][source.name].dtype,
                                           device="meta") for name, source in hf_sources(layout).items()},
                        bucket_bytes)


def bucket_sources(names: Iterable[str], sources: dict[str, Source]) -> list[str]:
    """The Megatron parameters the HF tensors ``names`` (a bucket's) are mapped from, in order, each once (a fused
    one whose HF tensors fall in two buckets is read for each)."""
    return list(dict.fromkeys(sources[name].name for name in names))


def map_bucket(shards: list[dict[str, Tensor]], layout: Layout, bucket: Bucket, flat: Tensor,
               sources: dict[str, Source]) -> dict[str, Tensor]:
    """``bucket``'s HF tensors mapped (``write_hf``) from ``shards`` into ``flat`` (uint8, at least the bucket's
    size): views of it, back to back, so a broadcast sends it as it lies (buckets.py ``packed``)."""
    out = unpack(bucket, flat)
    for name in bucket.names:
        write_hf(shards, layout, sources[name], out[name])
    return out


def _qkv_rows(layout: Layout, part: str) -> tuple[int, int]:
    """Where ``part`` (q, k or v) starts in a query group's rows of linear_qkv, and how many rows it has."""
    q = layout.heads_per_group * layout.head_dim
    return {"q": (0, q), "k": (q, layout.head_dim), "v": (q + layout.head_dim, layout.head_dim)}[part]


def _pad_vocab(t: Tensor, layout: Layout) -> Tensor:
    padding = layout.padded_vocab_size - t.shape[0]
    return torch.cat([t, t.new_zeros(padding, *t.shape[1:])]) if padding else t


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, layout: Layout) -> Tensor:
    """[q heads of group 0, k 0, v 0, q heads of group 1, k 1, v 1, ...] along dim 0 (weights or biases)."""
    groups, d = layout.num_query_groups, layout.head_dim
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, layout.heads_per_group * d, *rest), k.reshape(groups, d, *rest),
                      v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)
