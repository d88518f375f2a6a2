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

from dataclasses import dataclass

import torch

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
    """The full HF state dict from every tensor-parallel rank's Megatron parameters (rank order).

    With tied embeddings ``lm_head.weight`` is left out, as HF's safetensors files do.
    """
    first = shards[0]

    def rows(name: str) -> Tensor:
        return torch.cat([s[name] for s in shards], dim=0)

    def cols(name: str) -> Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    vocab = layout.vocab_size
    out = {"model.embed_tokens.weight": rows("embedding.word_embeddings.weight")[:vocab],
           "model.norm.weight": first["decoder.final_layernorm.weight"]}
    if not layout.tied_embeddings:
        out["lm_head.weight"] = rows("output_layer.weight")[:vocab]
    for i in range(layout.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[h + "input_layernorm.weight"] = first[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
        q, k, v = _split_qkv(rows(m + "self_attention.linear_qkv.weight"), layout)
        out[attn + "q_proj.weight"], out[attn + "k_proj.weight"], out[attn + "v_proj.weight"] = q, k, v
        if layout.qkv_bias:
            q, k, v = _split_qkv(rows(m + "self_attention.linear_qkv.bias"), layout)
            out[attn + "q_proj.bias"], out[attn + "k_proj.bias"], out[attn + "v_proj.bias"] = q, k, v
        if layout.qk_norm:
            out[attn + "q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"]
            out[attn + "k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"]
        out[attn + "o_proj.weight"] = cols(m + "self_attention.linear_proj.weight")
        gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up])
        out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up])
        out[h + "mlp.down_proj.weight"] = cols(m + "mlp.linear_fc2.weight")
    return out


def _pad_vocab(t: Tensor, layout: Layout) -> Tensor:
    padding = layout.padded_vocab_size - t.shape[0]
    return torch.cat([t, t.new_zeros(padding, *t.shape[1:])]) if padding else t


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, layout: Layout) -> Tensor:
    """[q heads of group 0, k 0, v 0, q heads of group 1, k 1, v 1, ...] along dim 0 (weights or biases)."""
    groups, d = layout.num_query_groups, layout.head_dim
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, layout.heads_per_group * d, *rest), k.reshape(groups, d, *rest),
                      v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, layout: Layout) -> tuple[Tensor, Tensor, Tensor]:
    groups, d = layout.num_query_groups, layout.head_dim
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (layout.heads_per_group + 2) * d, *rest).split(
        [layout.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
