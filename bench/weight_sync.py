"""Weight sync's transports on this machine for a Qwen3-1.7B-shaped bfloat16 policy (3.4 GB), against the
memory-copy bandwidth, the physical floor of moving those bytes once.

    python bench/weight_sync.py                 # about a minute on 2 CPU cores, ~12 GB of memory
    python bench/weight_sync.py --repeats 3 --bucket-mb 512

Rows (each the best of ``--repeats``):
    memory copy     one copy of every tensor (torch ``copy_``): the floor
    disk            what ``pipeline.weight_sync=disk`` does on the trainer and the rollout side: the safetensors file
                    written by buckets as the FSDP backend streams it (run_dir's file system, page cache included),
                    its sha256 (the sealed record's digest, computed by the trainer and checked by the rollout), and
                    one engine reading it back (safetensors ``load_file``, every tensor copied once)
    broadcast       ``pipeline.weight_sync=distributed`` over gloo: trainer rank 0 broadcasts every tensor of each
                    bucket to one engine process, which receives into fresh tensors (distributed.py's calls)

What is not in it: an engine's own work after the bytes arrive (SGLang's load into its weight layout), the gather
of FSDP shards (one all-gather per bucket), and a GPU (NCCL broadcasts, PCIe copies).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GB = 1e9


def qwen3_state(shape) -> dict:
    """HF names and shapes of a Qwen3 (untied head if the shape says so), bfloat16, filled (no lazy zero pages)."""
    import torch

    h, q, kv, inter = (shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim,
                       shape.intermediate_size)
    shapes = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, q), p + "self_attn.q_norm.weight": (shape.head_dim,),
                   p + "self_attn.k_norm.weight": (shape.head_dim,), p + "post_attention_layernorm.weight": (h,),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    shapes["model.norm.weight"] = (h,)
    if not shape.tied_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    return {name: torch.full(s, 0.5, dtype=torch.bfloat16) for name, s in shapes.items()}


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memory_copy(state: dict) -> None:
    for t in state.values():
        t.clone()


def disk_write(state: dict, path: Path, bucket_bytes: int) -> None:
    import torch

    from rolloutpipe.control.weights.buckets import plan_buckets
    from rolloutpipe.trainer.fsdp_backend import safetensors_header

    with path.open("wb") as f:
        f.write(safetensors_header({k: (v.dtype, tuple(v.shape)) for k, v in state.items()}))
        for bucket in plan_buckets(state, bucket_bytes):
            for name in bucket.names:
                f.write(state[name].view(-1).view(torch.uint8).numpy().tobytes())


def digest(path: Path) -> None:
    with path.open("rb") as f:
        hashlib.file_digest(f, "sha256")


def engine_read(path: Path) -> None:
    from safetensors.torch import load_file

    for t in load_file(str(path)).values():  # (mapped lazily: an engine copies every byte into its weights)
        t.clone()


def broadcast_rank(rank: int, port: int, shapes: dict, bucket_bytes: int, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    from rolloutpipe.control.weights.buckets import plan_buckets

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    state = ({k: torch.full(s, 0.5, dtype=torch.bfloat16) for k, s in shapes.items()} if rank == 0
             else {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()})
    buckets = plan_buckets(state, bucket_bytes)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for bucket in buckets:
            if rank == 0:
                works = [dist.broadcast(state[n], src=0, async_op=True) for n in bucket.names]
            else:  # fresh tensors each time, as an engine's receive_bucket makes them
                works = [dist.broadcast(torch.empty(state[n].shape, dtype=torch.bfloat16), src=0, async_op=True)
                         for n in bucket.names]
            for work in works:
                work.wait()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        results["broadcast"] = min(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen3-1.7b")
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk row writes (default: a temp dir)")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from rolloutpipe.control.env import free_port
    from rolloutpipe.launch.memory_plan import QWEN3_SHAPES

    bucket_bytes = int(args.bucket_mb * 2**20)
    state = qwen3_state(QWEN3_SHAPES[args.model_shape])
    size = sum(t.numel() * t.element_size() for t in state.values())
    rows = {"memory copy": best(lambda: memory_copy(state), args.repeats)}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "policy.safetensors"
        rows["disk: write (trainer)"] = best(lambda: disk_write(state, path, bucket_bytes), args.repeats)
        rows["disk: sha256 (trainer, rollout)"] = best(lambda: digest(path), args.repeats)
        rows["disk: read (engine)"] = best(lambda: engine_read(path), args.repeats)
    rows["disk: total (write + 2 x sha256 + read)"] = (rows["disk: write (trainer)"] + rows["disk: read (engine)"]
                                                      + 2 * rows["disk: sha256 (trainer, rollout)"])
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    state.clear()  # the engine process allocates its own
    results = mp.Manager().dict()
    mp.spawn(broadcast_rank, args=(free_port(), shapes, bucket_bytes, args.repeats, results), nprocs=2, join=True)
    rows["broadcast (gloo, 1 engine)"] = results["broadcast"]
    floor = rows["memory copy"]
    print(f"{args.model_shape} bfloat16: {size / GB:.2f} GB, buckets of {args.bucket_mb:g} MiB, {os.cpu_count()} CPUs, "
          f"best of {args.repeats}")
    print("| transport | seconds | GB/s | x memory copy |")
    print("|---|---|---|---|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds:.2f} | {size / GB / seconds:.2f} | {seconds / floor:.1f} |")


if __name__ == "__main__":
    main()
