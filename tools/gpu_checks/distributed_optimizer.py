"""distributed_optimizer: Megatron's DistributedOptimizer (``trainer.megatron.distributed_optimizer=true``) against
the torch backend, through a checkpoint, and at real width (a whole job's stop and resume: runs.py ``resume``).

1. A tiny float32 Qwen3's first step on the trainer ranks (one process each, data parallel over the GPUs) equals the
   torch backend's on one device (loss, entropy and gradient norm within ``MATCH_RTOL``, the update within
   ``UPDATE_RTOL``).
2. Its sharded optimizer state goes through a real checkpoint (every rank's restore point copies and writes its own
   shards, rank 0 the policy; then ``load_training_shards`` into a fresh trainer on every rank): the next step is
   within ``RESUME_RTOL`` of the uninterrupted one.
3. GPU only: each rank's peak memory at Qwen3-1.7B's width in bfloat16, with and without the distributed optimizer,
   held to the memory plan's figure for that many ranks within [0.8, 1.25].
4. The step's last update deferred and applied by DDP bucket as weight sync reads the policy (every rank all-gathers
   each bucket as rank 0's reads reach it, on a thread one bucket ahead: NCCL on the GPUs) sends what the step of all
   gives (``RESUME_RTOL``, and whether to the bit).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from gpu_checks.common import Machine, Row, Verdict, qwen3_config, tiny_model_config, verdict

MATCH_RTOL = 1e-4
"""float32 on both backends: loss, entropy and gradient norm agree to the order of additions (relative)."""
UPDATE_RTOL = 1e-3
"""||megatron update - torch update|| / ||torch update|| after one step: Adam divides each gradient by its own
magnitude, so elements whose gradient is near eps (1e-8) differ by up to lr; the norm of the difference stays small."""
RESUME_RTOL = 1e-5
"""The step after a resume vs the uninterrupted one, relative to that step's update: the same state and samples
(bit-identical but for non-deterministic kernels); a lost moment or step count is off by O(1)."""
DDP_BUCKET_SIZE = 4000
"""Parameters per DDP bucket of the tiny model's trainers: several buckets, so that check 4 steps by parts."""
PLAN_RANGE = (0.8, 1.25)
PROMPT_TOKENS, RESPONSE_TOKENS = 512, 2048
"""Each rank's two samples in the memory comparison (3)."""


def check(machine: Machine) -> list[Row]:
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import save_file

    from rolloutpipe.control.env import free_port

    world = machine.num_ranks
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
        mp.spawn(_rank, args=(world, machine.layers, out, free_port()), nprocs=world)
        got = json.loads((out / "rank0.json").read_text())
    close = all(abs(got[key] - want) <= MATCH_RTOL * max(abs(want), 1.0)
                for key, want in (("loss", result.loss), ("entropy_sum", result.entropy_sum),
                                  ("grad_norm", result.grad_norm)))
    rows = [
        Row(part="distributed_optimizer", checked=f"first step on {world} rank(s), float32, vs the torch backend",
            measured=f"loss {got['loss']:.6f} / {result.loss:.6f}, grad norm {got['grad_norm']:.6f} / "
                     f"{result.grad_norm:.6f}, update differs by {got['update_rdiff']:.1e}",
            limit=f"{MATCH_RTOL:g} relative; update {UPDATE_RTOL:g}",
            verdict=verdict(close and got["update_rdiff"] <= UPDATE_RTOL), figures=got | {"torch_loss": result.loss}),
        Row(part="distributed_optimizer", checked="next step after a checkpoint round trip vs uninterrupted",
            measured=f"differs by {got['resume_rdiff']:.1e} (bit-identical: {got['resume_identical']})",
            limit=f"{RESUME_RTOL:g} of the step's update", verdict=verdict(got["resume_rdiff"] <= RESUME_RTOL)),
        Row(part="distributed_optimizer", checked="the step's last update by DDP bucket, read by weight sync's "
                                                  "buckets, vs the step of all",
            measured=f"differs by {got['by_bucket_rdiff']:.1e} (bit-identical: {got['by_bucket_identical']})",
            limit=f"{RESUME_RTOL:g} of the step's update", verdict=verdict(got["by_bucket_rdiff"] <= RESUME_RTOL)),
    ]
    if not got["memory"]:
        rows.append(Row(part="distributed_optimizer", checked="peak memory per rank at Qwen3-1.7B width",
                        measured="skipped: no CUDA memory on the CPU", limit="-", verdict=Verdict.skipped))
    low, high = PLAN_RANGE
    for r in got["memory"]:
        rows.append(Row(part="distributed_optimizer",
                        checked=f"peak memory per rank, distributed optimizer {'on' if r['distributed'] else 'off'},"
                                f" {world} rank(s), {machine.layers} layers at Qwen3-1.7B width",
                        measured=f"peak {r['peak_gib']:.1f} / plan {r['planned_gib']:.1f} GiB = {r['ratio']:.2f}",
                        limit=f"peak / plan in [{low}, {high}]", verdict=verdict(low <= r["ratio"] <= high),
                        figures=r))
    return rows


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
    from rolloutpipe.config import load_config
    from rolloutpipe.model import build_tiny_tokenizer, load_model
    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend

    model_cfg = tiny_model_config()
    if model_path is not None:
        model_cfg.path = str(model_path)
    megatron = {"distributed_optimizer": distributed, "ddp_bucket_size": DDP_BUCKET_SIZE}
    cfg = load_config({"trainer": {"backend": backend, "max_grad_norm": 0.1,  # the clip is part of the check
                                   **({"megatron": megatron} if distributed else {})}})
    return trainer_class(TrainerBackend(backend))(
        model=load_model(model_cfg, len(build_tiny_tokenizer())), cfg=cfg.trainer, grpo=cfg.grpo, temperature=1.0,
        pad_id=0, multi_step=False, process_group_active=process_group_active, old_logprobs=OldLogprobSource.trainer)


def _rank(rank: int, world: int, layers: int, out: Path, port: int) -> None:
    """One trainer rank (torch.multiprocessing.spawn) of checks 1-3; rank 0 writes rank0.json."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from rolloutpipe.control.checkpoint import ShardedState, latest_checkpoint, optimizer_groups
    from rolloutpipe.control.env import trainer_process_group_backend
    from rolloutpipe.model import build_tiny_tokenizer
    from rolloutpipe.trainer.restore import RestorePoint

    os.environ["LOCAL_RANK"] = str(rank)  # trainer_process_group_backend binds this rank to its GPU
    if not torch.cuda.is_available():  # the ranks share the CPU's cores: OpenMP's spinning threads would crawl
        torch.set_num_threads(1)
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # Transformer Engine: the resume comparison wants repeats
    dist.init_process_group(trainer_process_group_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    mine = _tiny_samples()[rank::world]  # the data-parallel rank's share; the batch normaliser is the whole batch's
    trainer = _tiny_trainer("megatron", process_group_active=True, distributed=True)
    assert trainer.distributed_optimizer and trainer.data_parallel_size == world
    assert type(trainer.megatron_optimizer.chained_optimizers[0]).__name__ == "DistributedOptimizer"
    trainer.forward_backward(mine, first_batch_of_step=True)
    result = trainer.finish_batch()
    report = {"loss": result.loss, "entropy_sum": result.entropy_sum, "grad_norm": result.grad_norm}
    if rank == 0:
        before, want = load_file(str(out / "before.safetensors")), load_file(str(out / "torch.safetensors"))
        report["update_rdiff"] = _relative_difference(trainer.hf_state(), want, before)
    point = RestorePoint(run_dir=out / "run", tokenizer=build_tiny_tokenizer(), config_yaml="", keep_last=1,
                         on_disk=-1, rank=rank, world_size=world)
    point.capture_shards(0, trainer.training_shards())  # every rank its own shards: nothing gathered
    if rank == 0:
        point.capture(0, model=trainer.hf_model(), optimizer=trainer.optimizer, source_state={})
    point.write(wait_s=60)  # each rank writes its file; rank 0 completes the checkpoint once every file is there
    dist.barrier()
    first = {k: v.clone() for k, v in trainer.hf_state().items()} if rank == 0 else None
    trainer.forward_backward(mine, first_batch_of_step=True)
    trainer.finish_batch()
    uninterrupted = trainer.hf_state() if rank == 0 else None
    trainer.close()
    checkpoint = latest_checkpoint(out / "run")
    resumed = _tiny_trainer("megatron", process_group_active=True, distributed=True, model_path=checkpoint.directory)
    assert checkpoint.sharded
    with ShardedState(checkpoint.directory / "optimizer") as state:
        resumed.load_training_shards(state, optimizer_groups(checkpoint))
    resumed.forward_backward(mine, first_batch_of_step=True)
    resumed.finish_batch()
    if rank == 0:
        again = resumed.hf_state()
        report["resume_identical"] = all(torch.equal(v, again[k]) for k, v in uninterrupted.items())
        report["resume_rdiff"] = _relative_difference(again, uninterrupted, first)
    resumed.close()
    report |= _by_bucket(rank, mine, out)
    report["memory"] = ([_rank_peak(rank, world, layers, distributed) for distributed in (True, False)]
                        if torch.cuda.is_available() else [])
    if rank == 0:
        (out / "rank0.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _by_bucket(rank: int, mine: list, out: Path) -> dict:
    """Check 4 on every rank: the first step (from before.safetensors' weights) deferred and read by 2 KiB weight-sync
    buckets on rank 0, against the same step applied whole."""
    import torch
    from safetensors.torch import load_file

    sent = {}
    for deferred in (False, True):
        trainer = _tiny_trainer("megatron", process_group_active=True, distributed=True)
        trainer.forward_backward(mine, first_batch_of_step=True)
        trainer.finish_batch(defer_update=deferred)
        trainer.bucket_bytes = 2048
        with trainer.writer_reads():
            if rank == 0:
                buckets, tensors = trainer.hf_buckets()
                sent[deferred] = {k: v.cpu().clone() for bucket in tensors for k, v in bucket.items()}
                assert len(buckets) > 4 and len(trainer.ddp.bucket_groups) > 1
        trainer.apply_deferred_update()
        trainer.close()
    if rank != 0:
        return {}
    before = load_file(str(out / "before.safetensors"))
    return {"by_bucket_identical": all(torch.equal(v, sent[True][k]) for k, v in sent[False].items()),
            "by_bucket_rdiff": _relative_difference(sent[True], sent[False], before)}


def _relative_difference(got: dict, want: dict, start: dict) -> float:
    """||got - want|| / ||want - start|| over every tensor, in float64: how far ``got`` is from ``want``, relative to
    the step that took ``start`` to ``want``."""
    def norm(a: dict, b: dict) -> float:
        return sum(float((a[k].cpu().double() - b[k].cpu().double()).norm() ** 2) for k in b) ** 0.5

    return norm(got, want) / norm(want, start)


def _rank_peak(rank: int, world: int, layers: int, distributed: bool) -> dict:
    """Every rank: one bfloat16 training batch at Qwen3-1.7B's width; the largest peak over the ranks vs the plan."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from transformers import Qwen3ForCausalLM

    from rolloutpipe.config import load_config
    from rolloutpipe.launch.memory_plan import AttentionKind, GiB, planned_allocated_bytes
    from rolloutpipe.launch.model_shapes import QWEN3_SHAPES
    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend
    from rolloutpipe.trainer.grpo_trainer import TrainSample
    from rolloutpipe.trainer.megatron.model import uses_transformer_engine

    shape = dataclasses.replace(QWEN3_SHAPES["qwen3-1.7b"], num_layers=layers)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config(shape, max_positions=PROMPT_TOKENS + RESPONSE_TOKENS))
    model = model.to(torch.bfloat16).eval()
    cfg = load_config({"model": {"dtype": "bfloat16"}, "data": {"max_prompt_len": PROMPT_TOKENS},
                       "rollout_max_response_len": RESPONSE_TOKENS, "n_samples_per_prompt": 2 * world,
                       "global_batch_size": 2 * world, "rollout_batch_size": 1, "micro_batch_size": 2,
                       "trainer": {"backend": "megatron", "num_ranks": world,
                                   "megatron": {"distributed_optimizer": distributed}}})
    gen = torch.Generator().manual_seed(rank)
    mine = [TrainSample(prompt_ids=torch.randint(5, shape.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist(),
                        response_ids=torch.randint(5, shape.vocab_size, (RESPONSE_TOKENS,), generator=gen).tolist(),
                        engine_logprobs=[0.0] * RESPONSE_TOKENS, advantage=(-1.0) ** i) for i in range(2)]
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
    attention = AttentionKind.fused if uses_transformer_engine() else AttentionKind.materialised
    planned = planned_allocated_bytes(cfg, shape, attention=attention)
    return {"distributed": distributed, "peak_gib": float(peak) / GiB, "planned_gib": planned / GiB,
            "ratio": float(peak) / planned}
