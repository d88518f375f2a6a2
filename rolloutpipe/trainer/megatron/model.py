"""Megatron's parallel state on the trainer ranks, and a GPTModel built from an HF Qwen2 / Qwen3 config.

Ranks: the trainer node group's process group (gloo on CPU; a one-process gloo group when
``trainer.num_ranks=1``) is split by Megatron into tensor-parallel groups of ``tensor_parallel_size``
consecutive ranks and data-parallel groups across them (order tp-cp-ep-dp-pp). The model: RMSNorm, SwiGLU,
RoPE, no biases except Qwen2's q/k/v, Qwen3's per-head q/k RMSNorm, no dropout; on a GPU with Transformer
Engine importable, Transformer Engine's layer spec (fused attention, no [heads, T, T] scores kept; the layer
norms fused into the following linear layers, so two parameter names differ: convert.TE_FUSED_NORMS), else
Megatron's local spec (unfused attention; on CPU), given RMSNorm explicitly (left to itself the local spec takes
Apex's FusedLayerNorm when Apex is installed). ``trainer.recompute``: Megatron's full recomputation of every
layer (recompute_granularity=full, uniform, one layer per checkpoint).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rolloutpipe.trainer.megatron.convert import Layout

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")


RNG_SEED = 1234
"""Seed of Megatron's named RNG streams; they feed only dropout, which these models do not use."""


def init_parallel_state(*, tp_size: int, pp_size: int) -> bool:
    """Give Megatron its process groups and RNG streams; True when this call created the (one-rank) world group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rolloutpipe.control.env import trainer_process_group_backend
    from rolloutpipe.trainer.megatron import cpu

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(trainer_process_group_backend(), store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                             pipeline_model_parallel_size=pp_size)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(RNG_SEED)
    else:
        cpu.seed_rng_tracker(RNG_SEED, tp_rank=parallel_state.get_tensor_model_parallel_rank())
    return created


def destroy_parallel_state(*, created_world: bool) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if created_world:
        dist.destroy_process_group()


def check_supported(hf_config, *, tp_size: int) -> None:
    """Raise with the reason when this backend cannot train the model faithfully with this tensor-parallel size
    (launch/preflight.py calls it before anything starts; MegatronTrainer again on each rank)."""
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"trainer.backend=megatron maps {', '.join(SUPPORTED_MODEL_TYPES)} models only; "
                         f"model.path has model_type={hf_config.model_type!r}. Use trainer.backend=torch.")
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"model.path's config has rope scaling {rope_type!r}, which the Megatron mapping does not "
                         "carry (its logits would be wrong); use trainer.backend=torch, or a model without "
                         "rope_scaling.")
    if hf_config.model_type == "qwen3" and getattr(hf_config, "attention_bias", False):
        raise ValueError("model.path's config has attention_bias=true, whose o_proj bias the Megatron mapping does "
                         "not carry; use trainer.backend=torch.")
    if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
        raise ValueError(f"model.path's config uses sliding-window attention (sliding_window="
                         f"{hf_config.sliding_window}), which the Megatron mapping does not carry; use "
                         "trainer.backend=torch.")
    if hf_config.num_key_value_heads % tp_size:
        raise ValueError(f"trainer.megatron.tensor_parallel_size={tp_size} must divide the model's "
                         f"{hf_config.num_key_value_heads} key/value heads.")
    if hf_config.intermediate_size % tp_size:
        raise ValueError(f"trainer.megatron.tensor_parallel_size={tp_size} must divide the model's "
                         f"intermediate_size={hf_config.intermediate_size}.")


def uses_transformer_engine() -> bool:
    """Transformer Engine's layer spec: on CUDA, when ``transformer_engine`` imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def fused_softmax_kernels() -> bool:
    """Megatron's fused scale-mask-softmax: its compiled kernels (Apex's, or Megatron's own build), on CUDA. Asked for
    without them, Megatron imports them for attention of up to 4096 keys and stops (ModuleNotFoundError: the
    project's own H200 image has neither); its unfused softmax runs instead."""
    import importlib.util

    return torch.cuda.is_available() and all(importlib.util.find_spec(kernels) is not None for kernels in (
        "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))


def transformer_config(hf_config, *, dtype: torch.dtype, tp_size: int, pp_size: int, recompute: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = Layout.from_hf(hf_config, tp_size=tp_size)
    on_cpu = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size, ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=layout.num_heads, num_query_groups=layout.num_query_groups, kv_channels=layout.head_dim,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=layout.qkv_bias,
        qk_layernorm=layout.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # gradients are loss *sums*: Megatron DDP must sum them over data-parallel ranks, not average
        calculate_per_token_loss=True,
        # the weights are overwritten from the HF model, but only the initialisation marks the parameters
        # with their tensor-parallel attributes (which the grad norm needs to skip replicas); fused
        # kernels are CUDA-only
        perform_initialization=True, use_cpu_initialization=on_cpu,
        masked_softmax_fusion=fused_softmax_kernels(), bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        **({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
           if recompute else {}),
    )


def build_gpt_model(hf_config, *, dtype: torch.dtype, tp_size: int, pp_size: int, recompute: bool = False,
                    transformer_engine: bool = False):
    """GPTModel with the HF model's shape (the trainer takes its final hidden states, not its logits)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    layout = Layout.from_hf(hf_config, tp_size=tp_size)
    config = transformer_config(hf_config, dtype=dtype, tp_size=tp_size, pp_size=pp_size, recompute=recompute)
    spec = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=layout.qk_norm) if transformer_engine
            else get_gpt_layer_local_spec(qk_layernorm=layout.qk_norm, normalization="RMSNorm"))
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_theta": hf_config.rope_theta}
    # The local spec's RMSNorm (torch.nn.RMSNorm) makes its weight in the default dtype, not params_dtype. Every
    # parameter in the model's dtype, as the HF model and the engines have it: a float32 norm in a bfloat16 model
    # would be trained unrounded but checkpointed and served rounded, so a resumed run would start from other
    # weights. A 16-bit default dtype would make RoPE's frequencies 16-bit too, so those norms are cast after;
    # ``.data`` keeps the Parameter and its tensor-parallel attributes (model.to(dtype) would not).
    default_dtype = torch.get_default_dtype()
    if dtype in (torch.float32, torch.float64):
        torch.set_default_dtype(dtype)
    try:
        with torch.random.fork_rng(devices=[]):  # the initialisation is thrown away: keep the caller's RNG
            gpt = GPTModel(
                config=config, transformer_layer_spec=spec,
                vocab_size=layout.padded_vocab_size, max_sequence_length=hf_config.max_position_embeddings,
                share_embeddings_and_output_weights=layout.tied_embeddings, position_embedding_type="rope",
                rotary_base=int(rope["rope_theta"]), parallel_output=False,
            )
    finally:
        torch.set_default_dtype(default_dtype)
    for param in gpt.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    return gpt
