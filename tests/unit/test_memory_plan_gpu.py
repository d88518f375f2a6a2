"""The memory plan held to what a GPU measured: issue 43's four rows from an H200, as data, and Megatron's attention
term to what its code keeps for backward (counted on the CPU, the same code a GPU without Transformer Engine runs).

The H200 rows: tools/gpu_check.py's trainer_size at Qwen3-1.7B's width (4 layers, the 151,936-entry vocabulary,
bfloat16 with float32 masters), eight samples of 512 prompt + [8192, 4096, 2048, 1024, 512, 6000, 300, 7000] response
tokens packed by a 16,384-token budget into micro-batches of [1, 3, 2, 2] rows, one training batch, the peak of
``torch.cuda.max_memory_allocated``; torch 2.11.0+cu130, transformers 5.17.0, megatron-core 0.16.1 without Transformer
Engine or Apex (Megatron's local spec; its distributed optimizer, which null resolves to on a GPU), 2026-12.

Those four cases ran one after the other in one process, and only the first was measured from a clean state: the
MegatronTrainer's close left its training state allocated (reference cycles through Megatron's DDP hooks, freed only
by a full garbage collection; ``close`` collects since, tests/unit/test_megatron_checkpoint.py). A CPU replica of
the check's loop shows the first case's weights, gradient buffer and Adam state alive through every later case,
and the others' for part of the next. So each later row is held to the plan plus the first case's training state.
The fourth row's 24.9 GiB is the three earlier cases' state at its reset (8.6 + 8.6 + 6.7 GiB) as much as its own
peak. tools/gpu_check.py measures each case from a clean, recorded baseline now; its next GPU run replaces these.
"""

from __future__ import annotations

import pytest
import torch

from rolloutpipe.config import load_config
from rolloutpipe.launch.memory_plan import (
    AttentionKind,
    GiB,
    ModelShape,
    Phase,
    materialised_score_bytes,
    planned_allocated_bytes,
    trainer_estimate,
)
from tests.conftest import needs_extra

QWEN3_1_7B_4_LAYERS = ModelShape(hidden_size=2048, intermediate_size=6144, num_layers=4, num_heads=16, num_kv_heads=8,
                                 head_dim=128, vocab_size=151936, tied_embeddings=True)
H200_ROWS = [  # (backend, trainer.recompute, measured peak GiB)
    ("megatron", False, 72.9),
    ("megatron", True, 45.6),
    ("torch", False, 26.4),
    ("torch", True, 24.9),
]
TRAINING_STATE = ("weights", "gradients", "master weights", "optimizer state")
"""The terms a trainer holds for its life, which a trainer left unfreed keeps allocated."""


def check_config(backend: str, recompute: bool):
    """tools/gpu_check.py's trainer_size config."""
    return load_config({"model": {"dtype": "bfloat16"}, "max_tokens_per_micro_batch": 16384,
                        "data": {"max_prompt_len": 512}, "rollout_max_response_len": 8192, "n_samples_per_prompt": 8,
                        "global_batch_size": 8, "rollout_batch_size": 1,
                        "trainer": {"backend": backend, "recompute": recompute}})


def planned(backend: str, recompute: bool) -> int:
    attention = AttentionKind.materialised if backend == "megatron" else AttentionKind.fused  # local spec vs SDPA
    return planned_allocated_bytes(check_config(backend, recompute), QWEN3_1_7B_4_LAYERS, attention=attention)


def training_state(backend: str, recompute: bool) -> int:
    terms = trainer_estimate(check_config(backend, recompute), QWEN3_1_7B_4_LAYERS, capacity_bytes=0).terms
    return sum(t.num_bytes for t in terms if t.phase is Phase.always and t.name in TRAINING_STATE)


@pytest.mark.parametrize("row", range(len(H200_ROWS)), ids=[f"{b}-recompute={r}" for b, r, _ in H200_ROWS])
def test_the_plan_holds_at_the_peaks_an_h200_measured(row):
    backend, recompute, measured_gib = H200_ROWS[row]
    carried = training_state(*H200_ROWS[0][:2]) if row > 0 else 0  # the first case's, left allocated (docstring)
    expected = planned(backend, recompute) + carried
    assert 0.8 <= measured_gib * GiB / expected <= 1.25, (
        f"measured {measured_gib} GiB, planned {planned(backend, recompute) / GiB:.1f} + carried {carried / GiB:.1f}")


def test_the_rows_carried_state_is_the_first_cases_as_the_fourth_rows_reset_shows():
    """The fourth row's peak is at its reset: the three earlier cases' training state, nothing of its own yet."""
    carried = sum(training_state(backend, recompute) for backend, recompute, _ in H200_ROWS[:3])
    assert 0.95 <= H200_ROWS[3][2] * GiB / carried <= 1.1


@needs_extra("megatron", "megatron.core")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_megatrons_local_attention_keeps_what_the_plan_counts_per_score(dtype):
    """What autograd saves in a GPT layer of Megatron's local spec beyond its per-token tensors, per score element
    (heads x T^2): the float32 softmax probabilities and, in bfloat16, their cast for the value matmul. Two lengths
    tell the T^2 part from the per-token part."""
    from megatron.core import parallel_state
    from transformers import Qwen3Config

    from rolloutpipe.trainer.megatron import cpu
    from rolloutpipe.trainer.megatron.model import build_gpt_model, destroy_parallel_state, init_parallel_state

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         max_position_embeddings=1024)
    with cpu.cuda_calls_on_cpu():
        created = init_parallel_state(tp_size=1, pp_size=1)
        try:
            gpt = build_gpt_model(config, dtype=dtype, tp_size=1, pp_size=1)
            params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
            saved_bytes = {}
            for length in (256, 512):
                saved: dict[int, int] = {}

                def pack(t, saved=saved):
                    if t.untyped_storage().data_ptr() not in params:
                        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    return t

                causal = torch.ones(length, length, dtype=torch.bool).triu(1)[None, None]
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    gpt(input_ids=torch.randint(0, 128, (1, length)),
                        position_ids=torch.arange(length)[None], attention_mask=causal)
                saved_bytes[length] = sum(saved.values()) - causal.numel()  # (the mask is the caller's)
            assert parallel_state.model_parallel_is_initialized()
        finally:
            destroy_parallel_state(created_world=created)
    # saved(T) = a T + b T^2 per layer; b / heads is the plan's kept bytes per score element
    a_256, a_512 = saved_bytes[256] / 256, saved_bytes[512] / 512
    per_score = (a_512 - a_256) / (512 - 256) / config.num_attention_heads
    d = torch.finfo(dtype).bits // 8
    _, kept, _ = materialised_score_bytes(d)
    assert per_score == pytest.approx(kept, rel=0.02)
