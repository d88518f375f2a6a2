"""The memory plan (launch/memory_plan.py): its terms on known shapes, the knobs it names, the CLI on a preset,
and the warning GPU launchers log before submitting."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rolloutpipe.config import compose_config, load_config
from rolloutpipe.launch import memory_plan
from rolloutpipe.launch.memory_plan import AttentionKind, ModelShape, Phase, plan, trainer_estimate
from rolloutpipe.launch.preflight import warn_memory
from tests.conftest import REPO, node_environ

QWEN3_1_7B = memory_plan.QWEN3_SHAPES["qwen3-1.7b"]
GIB = memory_plan.GiB


def preset(name: str, *overrides: str):
    return compose_config([f"+experiment={name}", "model.path=null", "data.path=null", *overrides], REPO / "conf")


def gpqa(*overrides: str):
    return preset("gpqa", *overrides)


UNPLANNED = ["max_tokens_per_micro_batch=0", "micro_batch_size=4", "rollout.concurrency=64"]
"""The gpqa preset as it was before the plan: 4 full-length samples per micro-batch, 64 requests per engine."""


def term(estimate, name: str) -> int:
    return next(t.num_bytes for t in estimate.terms if t.name.startswith(name))


@pytest.mark.parametrize("tied", [True, False])
def test_weights_are_the_hf_models_parameter_count_times_the_dtypes_bytes(tied):
    small = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=tied)
    for config, model_class in ((Qwen3Config(**small, head_dim=32), Qwen3ForCausalLM),
                                (Qwen2Config(**small), Qwen2ForCausalLM)):  # Qwen2: q/k/v biases, no q/k norm
        count = sum(p.numel() for p in model_class(config).parameters())  # tied weights once
        shape = ModelShape.from_hf(config)
        assert shape.num_params() == count
        cfg = load_config({"model": {"dtype": "bfloat16"}})
        estimate = trainer_estimate(cfg, shape, capacity_bytes=GIB)
        assert term(estimate, "weights") == 2 * count
        assert term(estimate, "master weights") == 4 * count
        assert term(estimate, "optimizer state") == 8 * count


def test_qwen3_1_7b_shape_has_its_published_parameter_count():
    assert round(QWEN3_1_7B.num_params() / 1e9, 2) == 1.72
    # tensor parallel: linears and the vocabulary split, norms replicated
    assert QWEN3_1_7B.num_params() / 2 < QWEN3_1_7B.num_params(tp=2) < QWEN3_1_7B.num_params() / 2 + 1e6


def test_fsdp_keeps_a_1_over_n_share_of_the_training_state_and_names_the_fewest_ranks_that_fit():
    """bf16 with FSDP: float32 master, gradient and Adam shards (16 B/param in all) / N, no replicated copy; the
    memory plan's ladder ends at the fewest trainer ranks that fit (qwen3-32b: 16 of 80 GiB, with recompute)."""
    qwen3_32b = memory_plan.QWEN3_SHAPES["qwen3-32b"]
    count = qwen3_32b.num_params()
    assert round(count / 1e9, 1) == 32.8  # the published 32.8B
    for n in (8, 16):
        estimate = trainer_estimate(gpqa("trainer.backend=fsdp", f"trainer.num_ranks={n}"), qwen3_32b,
                                    capacity_bytes=80 * GIB)
        assert (term(estimate, "weights"), term(estimate, "gradients"), term(estimate, "optimizer state")) == (
            4 * count // n, 4 * count // n, 8 * count // n)
        assert not any(t.name.startswith(("master weights", "fp32 gradients")) for t in estimate.terms)
        assert term(estimate, "unsharded in flight") > 0
    result = plan(gpqa("trainer.backend=fsdp", "trainer.num_ranks=8"), qwen3_32b, gpu_memory_gib=80)
    assert not result.trainer.fits and result.fix[-1] == "trainer.num_ranks=16", result.fix
    fewer = [f for f in result.fix if not f.startswith("trainer.num_ranks")]
    assert not plan(gpqa("trainer.backend=fsdp", "trainer.num_ranks=8", *fewer), qwen3_32b).trainer.fits
    assert plan(gpqa("trainer.backend=fsdp", *result.fix), qwen3_32b).trainer.fits


def test_the_plan_names_the_fewest_trainer_gpus_that_fit_and_fewer_do_not():
    qwen3_32b = memory_plan.QWEN3_SHAPES["qwen3-32b"]
    for given in (["trainer.backend=fsdp"], ["+experiment=math", "trainer.backend=fsdp"],
                  ["+experiment=math", "trainer.megatron.tensor_parallel_size=4"]):  # distributed optimizer
        given = [*given, "model.path=null", "data.path=null"]
        cfg = compose_config(given, REPO / "conf")
        n, overrides = plan(cfg, qwen3_32b).fewest_ranks
        assert overrides[-1] == f"trainer.num_ranks={n}"
        assert trainer_estimate(compose_config([*given, *overrides], REPO / "conf"), qwen3_32b,
                                capacity_bytes=80 * GIB).fits
        # fewer GPUs do not fit, even with every memory-saving rung of the ladder
        saving = ([cfg] + fix_rungs(cfg, qwen3_32b))[-1]
        counts = memory_plan.TRAINER_RANK_COUNTS
        fewer = [c for c in counts[:counts.index(n)] if c % cfg.trainer.megatron.tensor_parallel_size == 0]
        assert fewer and not any(trainer_estimate(memory_plan.with_ranks(saving, c), qwen3_32b,
                                                  capacity_bytes=80 * GIB).fits for c in fewer)
    # the torch backend keeps the whole state on every rank: more GPUs do not make a rank fit
    assert plan(load_config({}), qwen3_32b).fewest_ranks is None
    cmd = [sys.executable, str(REPO / "tools" / "memory_plan.py"), "--model-shape", "qwen3-32b", "trainer.backend=fsdp"]
    out = subprocess.run(cmd, cwd=REPO, env=node_environ(), capture_output=True, text=True, timeout=120,
                         check=False).stdout
    assert re.search(r"fewest trainer GPUs that fit: 8 \(.*trainer\.recompute=true trainer\.num_ranks=8\)", out), out


def fix_rungs(cfg, shape):
    """The ladder's micro-batch and recompute rungs (the last saves the most), without its rank or tp rungs."""
    return [c for o, c in memory_plan.fix_candidates(cfg, shape)
            if not any(x.startswith(("trainer.num_ranks", "trainer.megatron.")) for x in o)]


@pytest.mark.parametrize("distributed_optimizer", [None, True, False])
def test_megatrons_distributed_optimizer_shards_master_weights_and_adam_state_over_data_parallel_ranks(
        distributed_optimizer):
    qwen3_8b = memory_plan.QWEN3_SHAPES["qwen3-8b"]
    cfg = preset("math", "trainer.megatron.tensor_parallel_size=2", "trainer.megatron.distributed_optimizer="
                 + {None: "null", True: "true", False: "false"}[distributed_optimizer])
    estimate = trainer_estimate(cfg, qwen3_8b, capacity_bytes=80 * GIB)
    shard = qwen3_8b.num_params(tp=2)
    dp = 1 if distributed_optimizer is False else 4  # 8 ranks / tp 2; null is a GPU launch's default: true
    assert (term(estimate, "master weights"), term(estimate, "optimizer state")) == (4 * shard // dp,
                                                                                     8 * shard // dp)
    # DDP's bf16 weights and float32 gradient buffer stay whole on every data-parallel rank
    assert (term(estimate, "weights"), term(estimate, "gradients")) == (2 * shard, 4 * shard)
    note = next(n for n in estimate.notes if n.startswith("distributed optimizer"))
    assert ("counted as true" in note) == (distributed_optimizer is None)
    assert (plan(cfg, qwen3_8b).fewest_ranks is None) == (distributed_optimizer is False)


def test_every_gpu_preset_fits_its_model_on_80_gib_gpus():
    for name, shape in (("gpqa", "qwen3-1.7b"), ("math", "qwen3-1.7b"), ("math_8b", "qwen3-8b")):
        result = plan(preset(name), memory_plan.QWEN3_SHAPES[shape], gpu_memory_gib=80)
        assert all(e.fits for e in result.estimates), memory_plan.format_plan(result)
    math_8b = preset("math_8b")  # FSDP over one node's 8 GPUs
    assert (math_8b.trainer.backend.value, math_8b.trainer.num_ranks) == ("fsdp", 8)


def test_fsdp_counts_the_root_and_whichever_is_larger_the_chunks_backward_or_the_last_layers_backward():
    """The log-prob chunk's backward comes first (the last layer prefetched beside it on N > 1 ranks) and is freed
    before the last layer's backward unshards it and the next one, the head's gradient held until the root's
    reduce-scatter (bench/memory_plan_validation.py measures both regimes, at 1, 2 and 4 ranks)."""
    qwen3_8b = memory_plan.QWEN3_SHAPES["qwen3-8b"]
    root, layer = memory_plan.fsdp_root_and_layer(qwen3_8b)
    assert qwen3_8b.num_params() == root + 36 * layer
    head_grad = 151936 * 4096 * 4  # float32, as the CPU validation
    activations = 18432 * sum(memory_plan.layer_activation_bytes(qwen3_8b, dtype_bytes=4).values())
    gradient = max(0, int(layer * 8 - activations))  # its gradient and reduce-scatter copy, its activations freed

    def estimate(chunk, n):
        return trainer_estimate(preset("math_8b", "model.dtype=float32", f"trainer.logprob_chunk_tokens={chunk}",
                                       f"trainer.num_ranks={n}"), qwen3_8b, capacity_bytes=80 * GIB)

    for n, layers in ((8, 2), (1, 1)):  # one rank: no all-gather, nothing prefetched
        large, small = estimate(8192, n), estimate(64, n)
        assert term(large, "unsharded in flight") == root * 4 + (layer * 4 if n > 1 else 0)
        assert term(small, "unsharded in flight") == root * 4 + (layers * layer * 4 + head_grad + gradient
                                                                 - term(small, "log-prob chunk"))
    assert term(estimate(64, 1), "unsharded in flight") == term(estimate(64, 8), "unsharded in flight") - layer * 4


def test_activations_grow_with_the_micro_batch_and_recompute_lowers_them():
    local = AttentionKind.materialised  # Megatron's local spec: [heads, T, T] kept per layer

    def estimate(*overrides, attention=None):
        return trainer_estimate(gpqa(*overrides), QWEN3_1_7B, capacity_bytes=80 * GIB, attention=attention)

    base, recompute = estimate(*UNPLANNED), estimate(*UNPLANNED, "trainer.recompute=true")
    one_row = estimate(*UNPLANNED, "max_tokens_per_micro_batch=10240")
    assert term(one_row, "activations") < term(base, "activations") / 3.5  # 4 rows -> 1
    assert term(recompute, "activations") < term(base, "activations") / 10
    base_local = estimate(*UNPLANNED, attention=local)
    recompute_local = estimate(*UNPLANNED, "trainer.recompute=true", attention=local)
    assert term(recompute_local, "attention") < term(base_local, "attention") / 10  # one layer's T x T, not 28
    # fused attention (Transformer Engine, SDPA: the default) keeps no T x T term, only Megatron's [T, T] bool mask
    assert term(base, "attention") == 10240 * 10240 < term(base_local, "attention") / 1000


def test_a_plan_that_does_not_fit_names_the_knob_and_a_change_that_fits():
    result = plan(gpqa(*UNPLANNED), QWEN3_1_7B, gpu_memory_gib=80)
    assert plan(gpqa(), QWEN3_1_7B, gpu_memory_gib=80).trainer.fits  # the preset as shipped
    assert not result.trainer.fits and not result.engine.fits
    trainer_line, engine_line = memory_plan.warnings(result)
    # each large term with the keys that lower it
    assert re.search(r"activations [\d.]+ GiB \(lower it: trainer\.recompute=true, max_tokens_per_micro_batch=10240",
                     trainer_line), trainer_line
    local_line = memory_plan.warnings(plan(gpqa(*UNPLANNED), QWEN3_1_7B, gpu_memory_gib=80,
                                           attention=AttentionKind.materialised))[0]
    assert re.search(r"attention \(materialised\) [\d.]+ GiB \(lower it: trainer\.recompute=true, more "
                     r"trainer\.megatron\.tensor_parallel_size", local_line), local_line
    assert "rollout.concurrency=" in engine_line and "KV cache" in engine_line
    fixed = plan(gpqa(*UNPLANNED, *result.fix), QWEN3_1_7B, gpu_memory_gib=80)
    assert fixed.trainer.fits, memory_plan.format_plan(fixed)
    most = int(engine_line.split("rollout.concurrency=")[1].split()[0])
    assert plan(gpqa(*UNPLANNED, f"rollout.concurrency={most}"), QWEN3_1_7B).engine.fits
    assert not plan(gpqa(*UNPLANNED, f"rollout.concurrency={most + 1}"), QWEN3_1_7B).engine.fits


def test_the_embedded_tiny_model_fits_and_its_engines_are_not_planned():
    cfg = load_config({})
    result = plan(cfg, memory_plan.model_shape(cfg))
    assert result.engine is None and result.trainer.fits and memory_plan.warnings(result) == []


def test_cli_plans_the_gpqa_preset_from_a_built_in_shape():
    cmd = [sys.executable, str(REPO / "tools" / "memory_plan.py"), "+experiment=gpqa", "--model-shape", "qwen3-1.7b"]
    shipped = subprocess.run(cmd, cwd=REPO, env=node_environ(), capture_output=True, text=True, timeout=120)
    assert shipped.returncode == 0 and "every estimate fits" in shipped.stdout, shipped.stdout + shipped.stderr
    over = subprocess.run([*cmd, *UNPLANNED], cwd=REPO, env=node_environ(), capture_output=True, text=True,
                          timeout=120)
    assert over.returncode == 1, over.stderr
    for word in ("trainer rank (megatron, tp=1)", "rollout engine (SGLang, tp=1)", "optimizer state", "KV cache",
                 "attention (fused)", "log-prob chunk", "DOES NOT FIT", "Fits with: ",
                 "host memory of trainer node 0", "restore point: state", "host memory of rollout node 0"):
        assert word in over.stdout
    roomy = subprocess.run([*cmd, *UNPLANNED, "--gpu-memory-gib", "100000"], cwd=REPO, env=node_environ(),
                           capture_output=True,
                           text=True, timeout=120)
    assert roomy.returncode == 0 and "every estimate fits" in roomy.stdout, roomy.stdout + roomy.stderr
    small_node = subprocess.run([*cmd, *UNPLANNED, "--gpu-memory-gib", "100000", "launcher.trainer.mem_gb=4"],
                                cwd=REPO, env=node_environ(), capture_output=True, text=True, timeout=120,
                                check=False)
    assert small_node.returncode == 1 and "host memory plan: trainer node 0" in small_node.stdout, small_node.stdout


def test_gpu_launchers_warn_naming_the_term_and_the_knob(caplog, tmp_path):
    cfg = load_config({"rollout": {"engine": "sglang", "concurrency": 10**7}})
    with caplog.at_level(logging.WARNING, logger="rolloutpipe.launch.preflight"):
        lines = warn_memory(cfg)
    assert len(lines) == 1 and "KV cache" in lines[0] and "rollout.concurrency=" in lines[0]
    assert caplog.records and "KV cache" in caplog.records[0].getMessage()
    assert warn_memory(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, concurrency=4))) == []
    # the launcher itself: a Slurm dry run plans and warns, and still writes its batch script (exit 0)
    run = subprocess.run([sys.executable, str(REPO / "launch.py"), f"run.dir={tmp_path / 'run'}", "launcher=slurm",
                          "launcher.dry_run=true", "rollout.engine=sglang", "rollout.concurrency=10000000",
                          "launcher.trainer.mem_gb=1"], cwd=REPO, env=node_environ(), capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    output = run.stdout + run.stderr  # Hydra's log handler writes to stdout
    assert "WARNING] - memory plan: each rollout engine" in output and "rollout.concurrency=" in output
    # the host memory plan against the node's memory, which sbatch asks for (--mem)
    assert "WARNING] - host memory plan: trainer node 0 (1 rank)" in output and "launcher.trainer.mem_gb=1" in output
    assert re.search(r"#SBATCH .*--mem.?=.?1024M", output), output


def test_peak_is_what_is_always_held_plus_the_largest_transient_phase():
    # a short float32 sample: the end of backward (the tied embedding's gradient being summed) is the largest
    cfg = load_config({"micro_batch_size": 1, "rollout_max_response_len": 8, "data": {"max_prompt_len": 8}})
    estimate = trainer_estimate(cfg, QWEN3_1_7B, capacity_bytes=80 * GIB)
    phases = {phase: estimate.phase_bytes(phase) for phase in Phase}
    assert phases[Phase.end_of_backward] > max(phases[Phase.forward_backward], phases[Phase.optimizer_step])
    assert estimate.peak_bytes == phases[Phase.always] + phases[Phase.end_of_backward]
    # bfloat16: the optimizer step's float32 copy of the gradients
    bf16 = trainer_estimate(load_config({"model": {"dtype": "bfloat16"}, "micro_batch_size": 1}), QWEN3_1_7B,
                            capacity_bytes=80 * GIB)
    assert bf16.phase_bytes(Phase.optimizer_step) == 4 * QWEN3_1_7B.num_params()
    assert bf16.peak_bytes == bf16.phase_bytes(Phase.always) + bf16.phase_bytes(Phase.optimizer_step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_activation_count_is_what_autograd_saves_for_backward(dtype):
    config = Qwen3Config(vocab_size=100, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = 512
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_decoder()(input_ids=torch.randint(0, 100, (1, tokens)))
    d = torch.finfo(dtype).bits // 8
    shape = ModelShape.from_hf(config)
    per_layer = sum(memory_plan.layer_activation_bytes(shape, dtype_bytes=d).values())
    predicted = tokens * (config.num_hidden_layers * per_layer + 4 * 256 + 2 * d * 256)  # + the final norm
    assert 0.9 < sum(saved.values()) / predicted < 1.1
