"""trainer_size: each backend at Qwen3-1.7B's width, its peak memory against the memory plan, its speed warmed up.

A Qwen3 at Qwen3-1.7B's width and vocabulary (hidden 2048, MLP 6144, 16 heads, 8 KV heads, head_dim 128, 151,936
entries), ``--layers`` layers, bfloat16 with float32 master weights, on one GPU. Eight samples of 512 prompt tokens
and responses of 300 to 8,192 tokens are packed by ``max_tokens_per_micro_batch=16384`` (trainer/batching.py: rows
[1, 3, 2, 2]). Each backend (torch: SDPA; FSDP on one rank; Megatron-core: Transformer Engine's layer spec when it
imports, else the local one) trains the batch with and without ``trainer.recompute``, log-probs in chunks of 1024.

Per row: the peak of ``torch.cuda.max_memory_allocated`` over the batches, held to the memory plan's figure
(``planned_allocated_bytes``; Megatron's local spec materialises attention scores, the others are fused) within
[0.8, 1.25]; then one batch untimed (allocator, kernels, optimizer state), ``--num-timed`` batches timed, and the
best one's real tokens/s (prompt + response, padding not counted) and MFU (``train_flops`` over the time, against
``--peak-tflops``; HFU counts recompute's second forward). And a row that the backends' first micro-batch agrees
(loss and entropy, bfloat16 accuracy): a wrong Transformer Engine name mapping or layer spec would not.

``--cpu-smoke``: hidden 128, 2 layers, vocabulary 2,048, every length / 128, float32; the plan is printed, not
judged.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time

from gpu_checks.common import Machine, Row, Verdict, qwen3_config, verdict

BACKENDS = ("torch", "fsdp", "megatron")
PROMPT_TOKENS = 512
RESPONSE_TOKENS = (8192, 4096, 2048, 1024, 512, 6000, 300, 7000)
BUDGET = 16384
SMOKE_SCALE = 128
"""--cpu-smoke divides every length and the token budget by this, in float32 (bfloat16 matmuls crawl on a CPU)."""
PLAN_RANGE = (0.8, 1.25)
"""Measured peak / planned peak (issue 43)."""
AGREE_RTOL = 2e-2
"""The backends' first loss and entropy: bfloat16 (8 bits of mantissa) through a few layers."""

PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
               ("A100", 312.0))
"""Dense bfloat16 TFLOP/s per NVIDIA's spec sheets, by the first match in torch.cuda.get_device_name() (the SXM
parts last). Measured on an H200 (issue 43): 790 TFLOP/s for a large bfloat16 matmul."""


def default_peak_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for part, peak in PEAK_TFLOPS if part in name), None)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Batch:
    """The model and the training batch of this machine's rows."""

    shape: object
    """launch/model_shapes.ModelShape"""
    prompt_tokens: int
    response_tokens: list[int]
    budget: int
    """max_tokens_per_micro_batch"""
    dtype: str


def batch(machine: Machine) -> Batch:
    from rolloutpipe.launch.model_shapes import QWEN3_SHAPES, ModelShape

    if machine.cpu_smoke:
        return Batch(shape=ModelShape(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2,
                                      num_kv_heads=1, head_dim=64, vocab_size=2048, tied_embeddings=True),
                     prompt_tokens=PROMPT_TOKENS // SMOKE_SCALE,
                     response_tokens=[n // SMOKE_SCALE for n in RESPONSE_TOKENS], budget=BUDGET // SMOKE_SCALE,
                     dtype="float32")
    return Batch(shape=dataclasses.replace(QWEN3_SHAPES["qwen3-1.7b"], num_layers=machine.layers),
                 prompt_tokens=PROMPT_TOKENS, response_tokens=list(RESPONSE_TOKENS), budget=BUDGET,
                 dtype="bfloat16")


def check(machine: Machine) -> list[Row]:
    import torch
    from transformers import Qwen3ForCausalLM

    from rolloutpipe.trainer.grpo_trainer import TrainSample

    work = batch(machine)
    shape, prompt, responses = work.shape, work.prompt_tokens, work.response_tokens
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(qwen3_config(shape, max_positions=prompt + max(responses)))
    base = base.to(getattr(torch, work.dtype)).eval()
    gen = torch.Generator().manual_seed(0)
    samples = [TrainSample(prompt_ids=torch.randint(5, shape.vocab_size, (prompt,), generator=gen).tolist(),
                           response_ids=torch.randint(5, shape.vocab_size, (n,), generator=gen).tolist(),
                           engine_logprobs=[0.0] * n, advantage=(-1.0) ** i) for i, n in enumerate(responses)]
    rows, first = [], {}
    for backend in BACKENDS:
        for recompute in (False, True):
            row, first_sums = _measure(machine, base, work, samples, backend=backend, recompute=recompute)
            rows.append(row)
            if not recompute:
                first[backend] = (float(first_sums.loss.detach()), first_sums.entropy_sum / first_sums.num_tokens)
    loss_t, entropy_t = first["torch"]
    agree = all(abs(loss - loss_t) <= AGREE_RTOL * max(abs(loss_t), 1.0)
                and abs(entropy - entropy_t) <= AGREE_RTOL * entropy_t for loss, entropy in first.values())
    rows.append(Row(part="trainer_size", checked="the backends' first micro-batch (same weights and samples)",
                    measured="loss " + " / ".join(f"{b} {v[0]:.4f}" for b, v in first.items())
                    + "; entropy " + " / ".join(f"{v[1]:.4f}" for v in first.values()),
                    limit=f"within {AGREE_RTOL:g} relative", verdict=verdict(agree),
                    figures={"first_loss_entropy": first}))
    return rows


def _measure(machine: Machine, base, work: Batch, samples, *, backend: str, recompute: bool):
    """One backend, recompute on or off: the table's row and the warm-up batch's first micro-batch sums."""
    import torch

    from rolloutpipe.config import load_config
    from rolloutpipe.launch.memory_plan import AttentionKind, GiB, planned_allocated_bytes
    from rolloutpipe.launch.model_shapes import train_flops
    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.batching import BatchConsumer, MicroBatch
    from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend
    from rolloutpipe.trainer.grpo_trainer import sequence_len
    from rolloutpipe.trainer.megatron.model import uses_transformer_engine

    cuda = torch.cuda.is_available()
    shape, budget = work.shape, work.budget
    cfg = load_config({"model": {"dtype": work.dtype}, "max_tokens_per_micro_batch": budget,
                       "data": {"max_prompt_len": len(samples[0].prompt_ids)},
                       "rollout_max_response_len": max(len(s.response_ids) for s in samples),
                       "n_samples_per_prompt": len(samples), "global_batch_size": len(samples),
                       "rollout_batch_size": 1, "trainer": {"backend": backend, "recompute": recompute}})

    class Handle:  # one group of all the samples, the batch's only one
        batch, group = 0, 0

    consumer = BatchConsumer(num_batches=1, groups_per_batch=1, micro_batch_size=cfg.micro_batch_size,
                             max_tokens_per_micro_batch=budget, length=sequence_len)
    micro = [w for w in consumer.arrive(Handle(), lambda h: list(samples)) if isinstance(w, MicroBatch)]
    baseline = 0
    if cuda:  # the previous row's trainer must be gone: max_memory_allocated counts whatever is still allocated
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()  # (what is left counts against no row: recorded, taken off)
    trainer = trainer_class(TrainerBackend(backend))(
        model=copy.deepcopy(base), cfg=cfg.trainer, grpo=cfg.grpo, temperature=1.0, pad_id=0, multi_step=False,
        process_group_active=False, old_logprobs=OldLogprobSource.trainer)

    def one_batch():
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.begin_step()
        sums = [trainer.forward_backward(m.samples, first_batch_of_step=True) for m in micro]
        trainer.finish_batch()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, sums[0]

    _, first_sums = one_batch()  # warm-up: the allocator, the kernels' first calls, the optimizer state
    best = min(one_batch()[0] for _ in range(machine.num_timed))
    peak = torch.cuda.max_memory_allocated() - baseline if cuda else None
    trainer.close()

    fused = backend != "megatron" or uses_transformer_engine()
    spec = {"torch": "sdpa", "fsdp": "sdpa"}.get(backend) or ("transformer engine" if fused else "local")
    planned = planned_allocated_bytes(cfg, shape, attention=AttentionKind.fused if fused else
                                      AttentionKind.materialised)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    tokens_per_s = sum(lengths) / best
    tflops = train_flops(shape, lengths) / best / 1e12
    hfu_tflops = train_flops(shape, lengths, recompute=recompute) / best / 1e12
    figures = {"backend": backend, "spec": spec, "recompute": recompute,
               "micro_batches": [len(m.samples) for m in micro], "planned_gib": planned / GiB,
               "baseline_gib": baseline / GiB,
               "peak_gib": None if peak is None else peak / GiB, "ratio": None if peak is None else peak / planned,
               "best_batch_s": best, "tokens_per_s": tokens_per_s, "model_tflops_per_s": tflops,
               "mfu": tflops / machine.peak_tflops if machine.peak_tflops else None,
               "hfu": hfu_tflops / machine.peak_tflops if machine.peak_tflops else None}
    speed = f"{tokens_per_s:,.0f} tokens/s, {tflops:.3g} TFLOP/s"
    if machine.peak_tflops:
        speed += f" = MFU {figures['mfu']:.1%}" + (f" (HFU {figures['hfu']:.1%})" if recompute else "")
    checked = (f"{backend} ({spec}), recompute {'on' if recompute else 'off'}, micro-batches "
               f"{figures['micro_batches']}: peak memory vs plan; best of {machine.num_timed} after a warm-up")
    if peak is None:
        return Row(part="trainer_size", checked=checked, measured=f"plan {planned / GiB:.2f} GiB; {speed}",
                   limit="memory not judged (no CUDA memory on the CPU)", verdict=Verdict.passed,
                   figures=figures), first_sums
    low, high = PLAN_RANGE
    return Row(part="trainer_size", checked=checked,
               measured=f"peak {peak / GiB:.1f} / plan {planned / GiB:.1f} GiB = {peak / planned:.2f}; {speed}",
               limit=f"peak / plan in [{low}, {high}]", verdict=verdict(low <= peak / planned <= high),
               figures=figures), first_sums
