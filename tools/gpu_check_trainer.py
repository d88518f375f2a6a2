"""tools/gpu_check.py's trainer check at real width: memory as planned, the Megatron spec agreeing with the HF model.

    python tools/gpu_check_trainer.py [--layers 4]        # alone; tools/gpu_check.py runs it as ``trainer_size``

A Qwen3 at Qwen3-1.7B's width (hidden 2048, MLP 6144, 16 heads, 8 KV heads, head_dim 128) with Qwen3's 151,936-entry
vocabulary, ``--layers`` layers, bfloat16 with float32 master weights, on one GPU. Eight samples of 512 prompt tokens
and mixed response lengths up to 8,192 are packed by ``max_tokens_per_micro_batch=16384`` (trainer/batching.py);
each backend (Megatron-core: Transformer Engine's layer spec when it imports; torch: SDPA) trains them with and
without ``trainer.recompute``, log-probs in chunks of 1024 (trainer/logprobs.py), then steps. Printed per case: the
micro-batches, the peak of ``torch.cuda.max_memory_allocated`` against the memory plan's estimate
(launch/memory_plan.py, without its assumed CUDA context), and tokens/s. Checked: the two backends' first loss and
entropy agree to bfloat16 accuracy (a wrong Transformer Engine name mapping or spec would not), and each peak is
within 1.5x of the plan.

``--distributed-optimizer`` (tools/gpu_check.py runs it as ``distributed_optimizer``): Megatron's DistributedOptimizer
data parallel over every GPU of the machine against the torch backend, through a checkpoint and back, and its peak
memory per rank beside the plan's (``check_distributed_optimizer``; tolerances stated beside it).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPT_TOKENS = 512
RESPONSE_TOKENS = [8192, 4096, 2048, 1024, 512, 6000, 300, 7000]
BUDGET = 16384
DTYPE = "bfloat16"


def check_trainer_size(layers: int = 4) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rolloutpipe.config import load_config
    from rolloutpipe.launch.memory_plan import CUDA_CONTEXT_BYTES, GiB, ModelShape, trainer_estimate
    from rolloutpipe.trainer.batching import BatchConsumer, MicroBatch
    from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend
    from rolloutpipe.trainer.grpo_trainer import TrainSample, sequence_len
    from rolloutpipe.trainer.megatron.model import uses_transformer_engine
    from rolloutpipe.trainer.node import trainer_class

    hf_config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                            max_position_embeddings=PROMPT_TOKENS + max(RESPONSE_TOKENS) + 64, rope_theta=1e6)
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(hf_config).to(getattr(torch, DTYPE)).eval()
    gen = torch.Generator().manual_seed(0)
    samples = [TrainSample(prompt_ids=torch.randint(5, 151000, (PROMPT_TOKENS,), generator=gen).tolist(),
                           response_ids=torch.randint(5, 151000, (n,), generator=gen).tolist(),
                           engine_logprobs=[0.0] * n, advantage=(-1.0) ** i) for i, n in enumerate(RESPONSE_TOKENS)]

    class Handle:  # one group of all eight samples, the batch's only one
        batch, group = 0, 0

    rows = []
    first = {}
    for backend in ("megatron", "torch"):
        for recompute in (False, True):
            cfg = load_config({"model": {"dtype": DTYPE}, "max_tokens_per_micro_batch": BUDGET,
                               "data": {"max_prompt_len": PROMPT_TOKENS}, "rollout_max_response_len": 8192,
                               "n_samples_per_prompt": 8, "global_batch_size": 8, "rollout_batch_size": 1,
                               "trainer": {"backend": backend, "recompute": recompute}})
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            trainer = trainer_class(TrainerBackend(backend))(
                model=copy.deepcopy(base), cfg=cfg.trainer, grpo=cfg.grpo, temperature=1.0, pad_id=0,
                multi_step=False, process_group_active=False, old_logprobs=OldLogprobSource.trainer)
            consumer = BatchConsumer(num_batches=1, groups_per_batch=1, micro_batch_size=cfg.micro_batch_size,
                                     max_tokens_per_micro_batch=BUDGET, length=sequence_len)
            work = consumer.arrive(Handle(), lambda h: list(samples))
            micro = [w for w in work if isinstance(w, MicroBatch)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.begin_step()
            sums = [trainer.forward_backward(m.samples, first_batch_of_step=True) for m in micro]
            result = trainer.finish_batch()
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated()
            if not recompute:
                first[backend] = (float(sums[0].loss.detach()), sums[0].entropy_sum / sums[0].num_tokens)
            planned = trainer_estimate(cfg, ModelShape.from_hf(hf_config), capacity_bytes=1 << 40).peak_bytes
            planned -= CUDA_CONTEXT_BYTES
            spec = ("transformer engine" if uses_transformer_engine() else "local") if backend == "megatron" else "sdpa"
            rows.append({"backend": backend, "spec": spec, "recompute": recompute,
                         # null resolves to true on a GPU: check_distributed_optimizer compares both
                         "distributed_optimizer": getattr(trainer, "distributed_optimizer", None),
                         "micro_batches": [len(m.samples) for m in micro], "peak_gib": peak / GiB,
                         "planned_gib": planned / GiB, "ratio": peak / planned,
                         "tokens_per_s": result.num_tokens / elapsed})
            if backend == "megatron":
                trainer.close()
            del trainer
    print("| backend | spec | recompute | micro-batches (rows) | peak GiB | planned GiB | peak / plan | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['spec']} | {r['recompute']} | {r['micro_batches']} | {r['peak_gib']:.1f} | "
              f"{r['planned_gib']:.1f} | {r['ratio']:.2f} | {r['tokens_per_s']:.0f} |", flush=True)
    (loss_m, entropy_m), (loss_t, entropy_t) = first["megatron"], first["torch"]
    agree = abs(loss_m - loss_t) <= 2e-2 * max(abs(loss_t), 1.0) and abs(entropy_m - entropy_t) <= 2e-2 * entropy_t
    print(f"first micro-batch: loss megatron {loss_m:.5f} torch {loss_t:.5f}, entropy megatron {entropy_m:.4f} "
          f"torch {entropy_t:.4f}", flush=True)
    return {"trainer_size_rows": rows, "trainer_size_backends_agree_ok": agree,
            "trainer_size_memory_as_planned_ok": all(r["ratio"] <= 1.5 for r in rows)}


DISTRIBUTED_OPTIMIZER_RTOL = 1e-4
"""float32 on both backends: loss, entropy and gradient norm agree to the order of additions (relative)."""
UPDATE_RTOL = 1e-3
RESUME_RTOL = 1e-5
"""The step after a resume vs the uninterrupted one, relative to that step's update: the same state and samples
(bit-identical but for non-deterministic kernels); a lost moment or step count is off by O(1)."""
"""||megatron update - torch update|| / ||torch update|| after one step: Adam divides each gradient by its own
magnitude, so elements whose gradient is near eps (1e-8) differ by up to lr; the norm of the difference stays small."""


def check_distributed_optimizer(layers: int = 4, num_gpus: int | None = None) -> dict:
    """Megatron's DistributedOptimizer on every GPU (``trainer.megatron.distributed_optimizer=true``, data parallel
    over the GPUs, one process each): (1) a tiny float32 Qwen3's first step equals the torch backend's (one GPU, the
    same eight samples) within ``DISTRIBUTED_OPTIMIZER_RTOL`` / ``UPDATE_RTOL``; (2) its optimizer state goes through a
    real checkpoint (trainer rank 0's restore point, then ``load_optimizer`` into a fresh trainer on every rank) and
    the next step is bit-identical to the uninterrupted one; (3) at Qwen3-1.7B's width in bfloat16, each rank's peak
    memory with and without the distributed optimizer, beside the memory plan's figure for that many ranks."""
    import tempfile

    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import save_file

    from rolloutpipe.control.env import free_port

    world = num_gpus or torch.cuda.device_count()
    torch.manual_seed(0)
    reference = _tiny_trainer("torch", process_group_active=False)
    before = {k: v.detach().cpu().clone().contiguous() for k, v in reference.hf_state().items()}
    reference.forward_backward(_tiny_samples(), first_batch_of_step=True)
    result = reference.finish_batch()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        save_file(before, str(out / "before.safetensors"))
        save_file({k: v.detach().cpu().contiguous() for k, v in reference.hf_state().items()},
                  str(out / "torch.safetensors"))
        del reference
        torch.cuda.empty_cache()
        mp.spawn(_distributed_optimizer_rank, args=(world, layers, out, free_port()), nprocs=world)
        got = json.loads((out / "rank0.json").read_text())
    close = {key: abs(got[key] - want) <= DISTRIBUTED_OPTIMIZER_RTOL * max(abs(want), 1.0)
             for key, want in (("loss", result.loss), ("entropy_sum", result.entropy_sum),
                               ("grad_norm", result.grad_norm))}
    print(f"distributed optimizer on {world} GPU(s) vs torch backend: loss {got['loss']:.6f} / {result.loss:.6f}, "
          f"grad norm {got['grad_norm']:.6f} / {result.grad_norm:.6f}, relative update difference "
          f"{got['update_rdiff']:.1e}; resumed next step vs uninterrupted: relative difference "
          f"{got['resume_rdiff']:.1e} (bit-identical: {got['resume_identical']})", flush=True)
    print("| distributed optimizer | ranks | peak GiB (max over ranks) | planned GiB | peak / plan |")
    print("|---|---|---|---|---|")
    for r in got["memory"]:
        print(f"| {r['distributed']} | {world} | {r['peak_gib']:.1f} | {r['planned_gib']:.1f} | {r['ratio']:.2f} |")
    return {"distributed_optimizer_ranks": world, "distributed_optimizer_rows": got["memory"],
            "distributed_optimizer_matches_torch_ok": all(close.values()) and got["update_rdiff"] <= UPDATE_RTOL,
            "distributed_optimizer_resume_ok": got["resume_rdiff"] <= RESUME_RTOL,
            "distributed_optimizer_memory_as_planned_ok": all(r["ratio"] <= 1.5 for r in got["memory"])}


def _tiny_samples() -> list:
    import torch

    from rolloutpipe.model import build_tiny_tokenizer
    from rolloutpipe.trainer.grpo_trainer import TrainSample

    gen, vocab = torch.Generator().manual_seed(1), len(build_tiny_tokenizer())
    return [TrainSample(prompt_ids=torch.randint(5, vocab, (8,), generator=gen).tolist(),
                        response_ids=torch.randint(5, vocab, (n,), generator=gen).tolist(),
                        engine_logprobs=[0.0] * n, advantage=(-1.0) ** i)
            for i, n in enumerate((24, 7, 16, 3, 30, 12, 9, 20))]


def _tiny_trainer(backend: str, *, process_group_active: bool, model_path: Path | None = None,
                  distributed: bool | None = None):
    from gpu_check import tiny_model_config

    from rolloutpipe.config import load_config
    from rolloutpipe.model import build_tiny_tokenizer, load_model
    from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend
    from rolloutpipe.trainer.node import trainer_class

    model_cfg = tiny_model_config()
    if model_path is not None:
        model_cfg.path = str(model_path)
    cfg = load_config({"trainer": {"backend": backend, "max_grad_norm": 0.1,  # the clip is part of the check
                                   **({"megatron": {"distributed_optimizer": distributed}} if distributed else {})}})
    return trainer_class(TrainerBackend(backend))(
        model=load_model(model_cfg, len(build_tiny_tokenizer())), cfg=cfg.trainer, grpo=cfg.grpo, temperature=1.0,
        pad_id=0, multi_step=False, process_group_active=process_group_active, old_logprobs=OldLogprobSource.trainer)


def _distributed_optimizer_rank(rank: int, world: int, layers: int, out: Path, port: int) -> None:
    """One trainer rank of ``check_distributed_optimizer`` (torch.multiprocessing.spawn); rank 0 writes rank0.json."""
    import os

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from rolloutpipe.control.checkpoint import latest_checkpoint, load_optimizer
    from rolloutpipe.control.env import trainer_process_group_backend
    from rolloutpipe.model import build_tiny_tokenizer
    from rolloutpipe.trainer.restore import RestorePoint

    os.environ["LOCAL_RANK"] = str(rank)  # trainer_process_group_backend binds this rank to its GPU
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # Transformer Engine: the resume comparison wants repeats
    dist.init_process_group(trainer_process_group_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    samples = _tiny_samples()
    mine = samples[rank::world]  # the data-parallel rank's share; the batch normaliser is the whole batch's
    trainer = _tiny_trainer("megatron", process_group_active=True, distributed=True)
    assert trainer.distributed_optimizer and trainer.data_parallel_size == world
    assert type(trainer.megatron_optimizer.chained_optimizers[0]).__name__ == "DistributedOptimizer"
    trainer.forward_backward(mine, first_batch_of_step=True)
    result = trainer.finish_batch()
    report = {"loss": result.loss, "entropy_sum": result.entropy_sum, "grad_norm": result.grad_norm}
    if rank == 0:
        before, want = load_file(str(out / "before.safetensors")), load_file(str(out / "torch.safetensors"))
        got = trainer.hf_state()
        diff = sum(float((got[k].cpu().double() - want[k].double()).norm() ** 2) for k in want) ** 0.5
        update = sum(float((want[k].double() - before[k].double()).norm() ** 2) for k in want) ** 0.5
        report["update_rdiff"] = diff / update
    point = RestorePoint(run_dir=out / "run", tokenizer=build_tiny_tokenizer(), config_yaml="", keep_last=1,
                         on_disk=-1)
    with trainer.writer_reads():  # rank 0 gathers the sharded state; the others join the gather
        if rank == 0:
            point.capture(0, model=trainer.hf_model(), optimizer=trainer.optimizer, source_state={})
            point.write()
    dist.barrier()
    first = {k: v.clone() for k, v in trainer.hf_state().items()} if rank == 0 else None
    trainer.forward_backward(mine, first_batch_of_step=True)
    trainer.finish_batch()
    uninterrupted = trainer.hf_state() if rank == 0 else None
    trainer.close()
    checkpoint = latest_checkpoint(out / "run")
    resumed = _tiny_trainer("megatron", process_group_active=True, distributed=True, model_path=checkpoint.directory)
    load_optimizer(resumed.optimizer, checkpoint)
    resumed.forward_backward(mine, first_batch_of_step=True)
    resumed.finish_batch()
    if rank == 0:
        again = resumed.hf_state()
        report["resume_identical"] = all(torch.equal(v, again[k]) for k, v in uninterrupted.items())
        diff = sum(float((again[k].double() - v.double()).norm() ** 2) for k, v in uninterrupted.items()) ** 0.5
        update = sum(float((v.double() - first[k].double()).norm() ** 2) for k, v in uninterrupted.items()) ** 0.5
        report["resume_rdiff"] = diff / update
    resumed.close()
    report["memory"] = [_rank_peak(rank, world, layers, distributed) for distributed in (True, False)]
    if rank == 0:
        (out / "rank0.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _rank_peak(rank: int, world: int, layers: int, distributed: bool) -> dict:
    """Every rank: one bfloat16 training batch at Qwen3-1.7B's width; the largest peak over the ranks vs the plan."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rolloutpipe.config import load_config
    from rolloutpipe.launch.memory_plan import CUDA_CONTEXT_BYTES, GiB, ModelShape, trainer_estimate
    from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend
    from rolloutpipe.trainer.grpo_trainer import TrainSample
    from rolloutpipe.trainer.node import trainer_class

    hf_config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                            max_position_embeddings=4096, rope_theta=1e6)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_config).to(getattr(torch, DTYPE)).eval()
    cfg = load_config({"model": {"dtype": DTYPE}, "data": {"max_prompt_len": PROMPT_TOKENS},
                       "rollout_max_response_len": 2048, "n_samples_per_prompt": 2 * world,
                       "global_batch_size": 2 * world, "rollout_batch_size": 1, "micro_batch_size": 2,
                       "trainer": {"backend": "megatron", "num_ranks": world,
                                   "megatron": {"distributed_optimizer": distributed}}})
    gen = torch.Generator().manual_seed(rank)
    mine = [TrainSample(prompt_ids=torch.randint(5, 151000, (PROMPT_TOKENS,), generator=gen).tolist(),
                        response_ids=torch.randint(5, 151000, (2048,), generator=gen).tolist(),
                        engine_logprobs=[0.0] * 2048, advantage=(-1.0) ** i) for i in range(2)]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = trainer_class(TrainerBackend.megatron)(
        model=model, cfg=cfg.trainer, grpo=cfg.grpo, temperature=1.0, pad_id=0, multi_step=False,
        process_group_active=True, old_logprobs=OldLogprobSource.trainer)
    del model
    trainer.forward_backward(mine, first_batch_of_step=True)
    trainer.finish_batch()
    torch.cuda.synchronize()
    peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    trainer.close()
    del trainer
    planned = trainer_estimate(cfg, ModelShape.from_hf(hf_config), capacity_bytes=1 << 40).peak_bytes
    planned -= CUDA_CONTEXT_BYTES
    return {"distributed": distributed, "peak_gib": float(peak) / GiB, "planned_gib": planned / GiB,
            "ratio": float(peak) / planned}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="also run check_distributed_optimizer on every GPU of this machine")
    args = parser.parse_args()
    summary = check_trainer_size(args.layers)
    if args.distributed_optimizer:
        summary |= check_distributed_optimizer(args.layers)
    print(json.dumps(summary, indent=2))
    return 0 if all(v for k, v in summary.items() if k.endswith("_ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
