"""The host memory plan's trainer terms (rolloutpipe/launch/host_memory.py) against RSS measured on the CPU.

    python bench/host_memory.py                        # every case, a few minutes on 2 CPU cores
    python bench/host_memory.py --cases fsdp-bfloat16 megatron-float32

Each case is real processes (gloo, torch.multiprocessing.spawn) of one trainer backend over a Qwen3 saved to disk
(hidden 512, 2 layers, tied, the real 151,936-entry vocabulary: 85M parameters), loaded as the trainer node loads
it (rolloutpipe.model.load_model: from_pretrained on the CPU), one training step, then the step's end as
trainer/node.py and weight sync make it: every rank's restore point copies its own shards (FSDP, Megatron's
distributed optimizer), rank 0 copies the policy (and a replicated backend's whole optimizer state) and writes the
weights file disk weight sync sends (``write_weights``). Each rank measures, in MiB, with glibc returning freed
blocks over 1 MiB (``MALLOC_MMAP_THRESHOLD_``):

    start      peak RSS while the model loads and the backend is built, over the RSS before (the process's imports)
    held       RSS after the first step's end over the RSS before it: the restore point's copies, FSDP rank 0's
               CPU model (built by the first read), rank 0's bucket buffers (the first weight sync fills them)
    step end   peak RSS during the second step's end over the RSS before it (the buffers are reused): rank 0's
               transients (FSDP: one gathered bucket at a time; Megatron: none)
    rank 0     Megatron: rank 0's RSS less rank 1's before the first step's end: the HF model that only rank 0
               keeps

against the plan's terms for the same shape and config: "plan [+ CPU] -> measured (measured / predicted)". On
the CPU the training state is in host memory too, so where a GPU run would hold a tensor on the device the CPU's
share is added and named: FSDP's float32 shards built at its start, the torch backend's parameters laid out in one
tensor at its start (``lay_out_flat``: the loaded model's copy), and the full float32 tensor (the largest, the
embedding, with its cast) its gathers make on the way to rank 0's host. Megatron builds its model and gradient
buffers on the host here, so its start is not compared, nor is the torch backend's step end (its policy is already
on the host; on a GPU hf_state copies it there). The loaded model is read once, as the move to a GPU reads it
(from_pretrained maps the file: its pages count only once read).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.fsdp_memory import reset_peak, rss_bytes  # noqa: E402

MiB = 1 << 20
GLIBC_RETURNS_FREED_BLOCKS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
CASES = {  # name: (backend, dtype, ranks, Megatron's tensor-parallel size)
    "torch-float32": ("torch", "float32", 1, 1),
    "torch-bfloat16": ("torch", "bfloat16", 1, 1),
    "fsdp-float32": ("fsdp", "float32", 2, 1),
    "fsdp-bfloat16": ("fsdp", "bfloat16", 2, 1),
    "megatron-float32": ("megatron", "float32", 2, 1),
    "megatron-bfloat16": ("megatron", "bfloat16", 2, 1),
    "megatron-tp2-float32": ("megatron", "float32", 2, 2),
}
HIDDEN, LAYERS, VOCAB = 512, 2, 151936


def hf_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=LAYERS,
                       num_attention_heads=HIDDEN // 64, num_key_value_heads=HIDDEN // 128, head_dim=64,
                       tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)


def trainer_config(backend: str, dtype: str, ranks: int, tp: int):
    from rolloutpipe.config import load_config

    return load_config({"model": {"dtype": dtype}, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
                        "global_batch_size": 4, "rollout_max_response_len": 16, "data": {"max_prompt_len": 16},
                        "trainer": {"backend": backend, "num_ranks": ranks,
                                    "megatron": {"distributed_optimizer": True, "tensor_parallel_size": tp}},
                        "launcher": {"trainer": {"tasks_per_node": ranks}}})


def rank_main(rank: int, world: int, port: int, case: str, model_dir: str, out_dir: str, results) -> None:
    import torch
    import torch.distributed as dist

    from rolloutpipe.control.weights.disk import write_weights
    from rolloutpipe.model import ModelConfig, load_model
    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource
    from rolloutpipe.trainer.grpo_trainer import TrainSample
    from rolloutpipe.trainer.restore import RestorePoint

    backend, dtype, _, tp = CASES[case]
    cfg = trainer_config(backend, dtype, world, tp)
    torch.set_num_threads(1)
    if world > 1 or backend == "megatron":
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401 - imports are the process's, not the start's
    if backend == "megatron":
        import megatron.core  # noqa: F401
    before_load = rss_bytes()
    reset_peak()
    model = load_model(ModelConfig(path=model_dir, dtype=cfg.model.dtype), VOCAB)
    with torch.no_grad():  # every byte read once, as the move to a GPU reads it (from_pretrained maps the file)
        sum(float(p.sum()) for p in model.parameters())  # (no name left holding a tensor: it would keep the map)
    trainer = trainer_class(cfg.trainer.backend)(
        model=model, cfg=cfg.trainer, grpo=GRPOConfig(), temperature=1.0, pad_id=0, multi_step=False,
        process_group_active=dist.is_initialized(), old_logprobs=OldLogprobSource.trainer)
    del model
    start = rss_bytes("VmHWM") - before_load
    samples = [TrainSample(prompt_ids=list(range(2, 18)), response_ids=list(range(40 + i, 56 + i)),
                           engine_logprobs=[0.0] * 16, advantage=(-1.0) ** i) for i in range(2)]
    point = RestorePoint(run_dir=Path(out_dir), tokenizer=None, config_yaml="", keep_last=1, on_disk=-1,
                         rank=rank, world_size=world)
    measured = {"process": before_load, "start": start}
    for step in range(2):
        trainer.forward_backward(samples, first_batch_of_step=True)
        trainer.finish_batch()
        if dist.is_initialized():
            dist.barrier()
        before = rss_bytes()
        if step == 0:
            measured["before_step_end"] = before
        reset_peak()
        if trainer.sharded_checkpoint:  # as trainer/node.py's end_step
            point.capture_shards(step, trainer.training_shards())
        with trainer.writer_reads():
            if rank == 0:
                point.capture(step, model=trainer.hf_model(), optimizer=trainer.optimizer, source_state={})
                write_weights(Path(out_dir) / "weights.safetensors", *trainer.hf_buckets(), b"k" * 32)  # disk
                # weight sync's file
        after = rss_bytes()
        measured["held" if step == 0 else "step_end"] = (after - before) if step == 0 else rss_bytes("VmHWM") - before
    results[rank] = measured
    if dist.is_initialized():
        dist.barrier()
    trainer.close()
    if dist.is_initialized() and dist.group.WORLD is not None:
        dist.destroy_process_group()


def measure(case: str, model_dir: str) -> dict[int, dict[str, int]]:
    import torch.multiprocessing as mp

    from rolloutpipe.control.env import free_port

    world = CASES[case][2]
    manager = mp.Manager()
    results = manager.dict()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_main, args=(world, free_port(), case, model_dir, out_dir, results), nprocs=world, join=True)
    return dict(results)


def predicted(case: str) -> dict[int, dict[str, tuple[int, int]]]:
    """Per rank and measured quantity: (the plan's host bytes, what the CPU adds: a GPU run's device tensors)."""
    from rolloutpipe.launch.host_memory import trainer_processes
    from rolloutpipe.launch.memory_plan import ModelShape, fsdp_root_and_layer

    backend, dtype, world, tp = CASES[case]
    cfg, shape = trainer_config(backend, dtype, world, tp), ModelShape.from_hf(hf_config())
    d, params = cfg.model.dtype.torch.itemsize, shape.num_params()
    out = {}
    for rank in range(world):
        terms = {t.name: t.num_bytes for t in trainer_processes(cfg, shape, rank_0=rank == 0).terms}
        buffers = terms.get("rank 0's bucket buffers", 0)
        held = sum(v for k, v in terms.items() if k.startswith("restore point")
                   or (k == "rank 0's CPU model" and backend == "fsdp")) + buffers  # (Megatron's exists from its start)
        # FSDP on the CPU: its float32 shards are built on the host, and rank 0's gathers of full tensors (float32,
        # the largest one at a time, and its cast) are made there: on a GPU they are device memory
        largest = fsdp_root_and_layer(shape)[0] - HIDDEN  # the (tied) embedding
        # the torch backend lays its parameters out in one tensor (lay_out_flat): a copy, on its GPU on a GPU
        cpu_start = params * 4 // world if backend == "fsdp" else params * d if backend == "torch" else 0
        cpu_step_end = largest * (4 + (d if d < 4 else 0)) if backend == "fsdp" else 0
        out[rank] = {"start": (terms["model load"], cpu_start), "held": (held, 0),
                     "step_end": (terms.get("step end", 0), cpu_step_end),
                     "rank_0_model": (terms.get("rank 0's CPU model", 0), 0)}
    return out


def cell(predicted_bytes: tuple[int, int], measured_bytes: int) -> str:
    """plan [+ the CPU's own] -> measured (measured / their sum), MiB."""
    (plan, cpu), m = (b / MiB for b in predicted_bytes), measured_bytes / MiB
    if plan + cpu == 0:
        return f"0 -> {m:.0f}"
    return f"{plan:.0f}{f' + {cpu:.0f}' if cpu else ''} -> {m:.0f} ({m / (plan + cpu):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    os.environ.update(GLIBC_RETURNS_FREED_BLOCKS)  # the rank processes inherit it
    import torch
    from transformers import Qwen3ForCausalLM

    from rolloutpipe.launch.memory_plan import ModelShape

    params = ModelShape.from_hf(hf_config()).num_params()
    print(f"torch {torch.__version__}; Qwen3 hidden {HIDDEN}, {LAYERS} layers, vocabulary {VOCAB}, tied: "
          f"{params / 1e6:.1f}M parameters; MiB, predicted -> measured (measured / predicted)\n")
    print("| case | rank | process (imports) | start: model load | held: restore point (+ CPU model) | "
          "step end (rank 0) | rank 0's CPU model (rank 0 - rank 1) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            torch.manual_seed(0)
            Qwen3ForCausalLM(hf_config()).to(getattr(torch, dtype)).save_pretrained(Path(tmp) / dtype)
        for case in args.cases:
            backend, dtype, world, _ = CASES[case]
            got, want = measure(case, str(Path(tmp) / dtype)), predicted(case)

            for rank in range(world):
                start = (cell(want[rank]["start"], got[rank]["start"]) if backend != "megatron"
                         and (backend != "torch" or dtype == "float32") else "-")
                step_end = cell(want[0]["step_end"], got[0]["step_end"]) if rank == 0 and backend != "torch" else "-"
                rank_0 = (cell(want[0]["rank_0_model"], got[0]["before_step_end"] - got[1]["before_step_end"])
                          if backend == "megatron" and rank == 0 else "-")
                print(f"| {case} | {rank} | {got[rank]['process'] / MiB:.0f} | {start} | "
                      f"{cell(want[rank]['held'], got[rank]['held'])} | {step_end} | {rank_0} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
