"""Weight sync's transports on this machine for a Qwen3-1.7B-shaped bfloat16 policy (3.4 GB), each against its own
floor, in one invocation.

    python bench/weight_sync.py                          # about two minutes on 2 CPU cores, ~12 GB of memory
    python bench/weight_sync.py --bucket-mb 128 512 --dir /path/on/the/run/file/system
    python bench/weight_sync.py --device cuda            # on a GPU machine: adds the GPU rows

The rows run in rounds, each round every row once in turn, so a burst of other work on a shared machine lands on
one round, not on one row; each row is the median of ``--rounds``, each ratio the median of its rounds' ratios.
Rows:
    memory copy          one copy of every tensor (torch ``copy_``): the physical floor
    disk: write / read   the floors of the disk way: the safetensors file written bucket by bucket with nothing else
                         (trainer), and read back by one engine (safetensors ``load_file``, every tensor copied once)
    disk: write + MAC    what ``pipeline.weight_sync=disk`` does on trainer rank 0 (disk.py ``write_weights``): each
                         tensor hashed (BLAKE3 for the step's weights digest, GMAC for the file's MAC) on a second
                         thread while it is written
    disk: read + check   what the rollout node does for engines of their own processes (SGLang servers; disk.py
                         ``Receiver.load``): one engine reads the file while the node recomputes its MAC
    disk: read into weights          the floor for engines of the rollout node's own process (the embedded engine):
                         the file read into an engine's existing weights (safetensors ``load_file``, each tensor
                         copied into its place, as ``load_state_dict`` does)
    disk: read + check into weights  what the rollout node does for those (disk.py ``copy_checked``): the file read
                         once into the engine's weights, 1 MiB at a time, each piece's MAC taken from the cache
                         right after its copy
    broadcast            the distributed way's transport over gloo to one engine process (distributed.py: one
                         broadcast per bucket of ``--bucket-mb``; the engine unpacks each bucket), from a policy laid
                         out as the torch and FSDP backends hand it over: a bucket is one range of memory, sent as it
                         lies (buckets.py ``packed``)
    broadcast, Megatron  the same from Megatron's layout (tensor-parallel size 1: fused q/k/v, fused gate/up), as
                         trainer.backend=megatron sends it (convert.py ``map_bucket``): each bucket mapped into one of
                         three reused flat buffers while the ones before it are sent, then sent as it lies
    broadcast + MAC      what ``pipeline.weight_sync=distributed`` does into embedded engines (SGLang ones get no MAC):
                         as above, and the trainer gives each bucket its MAC (GMAC) before it sends it and digests
                         it (BLAKE3, a second thread), the MAC reaches the engine through a TCPStore, and the engine
                         checks the bucket before it would load it
    raw broadcast        the floor of that transport: one ``torch.distributed.broadcast`` of every byte as one flat
                         tensor, on the same process group
With ``--device cuda`` (a GPU machine), as on a GPU cluster today: the trainer's policy starts on the GPU and each
backend hands weight sync a host copy (distributed.py ``weight_sync_backend``: gloo), and the engine receives into
GPU memory, as an SGLang server's scheduler does (every broadcast row then ends on the GPU). Rows added:
    device: memory copy  one copy of every tensor on the GPU: the floor there
    device: to host      the hand-over: every tensor copied into pinned host memory (one transfer each)

The disk rows write where a one-node run does (disk.py ``Sender.place``: /dev/shm unless the working directory's
file system is memory-backed; ``--dir`` to choose). Not in it: an engine's own work after the bytes arrive
(SGLang's load into its weight layout), the gather of FSDP shards, NCCL (it needs a GPU per rank: two GPUs).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GB = 1e9
KEY = b"bench" * 8
DISK_ROWS = ("disk: write (trainer, the floor)", "disk: read (engine, the floor)",
             "disk: write + MAC (trainer, one pass)", "disk: read + check (rollout, at once)",
             "disk: read into weights (embedded engine, the floor)",
             "disk: read + check into weights (rollout, one read)")
DISK_TOTAL = "disk: total (write + MAC, read + check)"
DISK_TOTAL_IN_PLACE = "disk: total into weights (write + MAC, read + check into weights)"


def bucket_row(mb: float, mac: bool = True, megatron: bool = False) -> str:
    return f"broadcast{', Megatron' if megatron else ''}{' + MAC' if mac else ''} (gloo, {mb:g} MiB buckets)"


def megatron_shards(state: dict, shape) -> tuple[list[dict], object]:
    """``state`` (HF, tied or not) in Megatron's layout at tensor-parallel size 1 (on ``state``'s device), and it."""
    from rolloutpipe.trainer.megatron.convert import Layout, hf_to_megatron

    layout = Layout(num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_heads=shape.num_heads,
                    num_query_groups=shape.num_kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab_size,
                    tied_embeddings=shape.tied_embeddings, qkv_bias=False, qk_norm=True, tp_size=1)
    return [hf_to_megatron(state, layout, tp_rank=0)], layout


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


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memory_copy(state: dict) -> None:
    for t in state.values():
        t.clone()


def by_bucket(state: dict, bucket_bytes: int):
    from rolloutpipe.control.weights.buckets import plan_buckets

    buckets = plan_buckets(state, bucket_bytes)
    return buckets, ({name: state[name] for name in bucket.names} for bucket in buckets)


def plain_write(state: dict, path: Path, bucket_bytes: int) -> None:
    from rolloutpipe.control.weights.digest import tensor_bytes
    from rolloutpipe.control.weights.disk import safetensors_header

    buckets, tensors = by_bucket(state, bucket_bytes)
    path.unlink(missing_ok=True)  # a new file's pages, as write_weights gets (it writes a new file, then renames)
    with path.open("wb") as f:
        f.write(safetensors_header(buckets))
        for bucket_state in tensors:
            for tensor in bucket_state.values():
                f.write(tensor_bytes(tensor))


def one_pass_write(state: dict, path: Path, bucket_bytes: int):
    from rolloutpipe.control.weights.disk import write_weights
    from rolloutpipe.control.weights.mac import weights_key

    path.unlink(missing_ok=True)
    return write_weights(path, *by_bucket(state, bucket_bytes), weights_key(KEY))


def engine_read(path: Path) -> None:
    from safetensors.torch import load_file

    for t in load_file(str(path)).values():  # (mapped lazily: an engine copies every byte into its weights)
        t.clone()


def read_into(path: Path, weights: dict) -> None:
    from safetensors.torch import load_file

    for name, t in load_file(str(path)).items():
        weights[name].copy_(t)


def read_and_check_into(path: Path, written, weights: dict) -> None:
    from rolloutpipe.control.weights.disk import copy_checked
    from rolloutpipe.control.weights.mac import weights_key

    assert copy_checked(path, weights_key(KEY), bytes.fromhex(written.salt), [weights]) == written.mac


def read_and_check(path: Path, written) -> None:
    from rolloutpipe.control.weights.disk import file_mac
    from rolloutpipe.control.weights.mac import weights_key

    checked: list[str] = []
    salt = bytes.fromhex(written.salt)
    checking = threading.Thread(target=lambda: checked.append(file_mac(path, weights_key(KEY), salt)))
    checking.start()
    engine_read(path)
    checking.join()
    assert checked == [written.mac]


def broadcast_rank(rank: int, port: int, store_port: int, model_shape: str, bucket_mbs: list[float], rounds: int,
                   device: str, results) -> None:
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rolloutpipe.control.weights.buckets import BUCKETS_HELD, Bucket, BufferRing, WeightGroup, plan_buckets, unpack
    from rolloutpipe.control.weights.digest import Digest
    from rolloutpipe.control.weights.distributed import authenticated, bucket_mac, check_bucket
    from rolloutpipe.control.weights.group import Broadcaster, join_group, receive_bucket
    from rolloutpipe.control.weights.mac import weights_key
    from rolloutpipe.launch.memory_plan import QWEN3_SHAPES
    from rolloutpipe.trainer.megatron.convert import hf_plan, hf_sources, map_bucket

    torch.set_num_threads(1)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in qwen3_state(QWEN3_SHAPES[model_shape]).items()}
    key = weights_key(KEY)
    store = dist.TCPStore("127.0.0.1", store_port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    group = WeightGroup(master_address="127.0.0.1", master_port=port, world_size=2)
    numels = {k: torch.Size(s).numel() for k, s in shapes.items()}
    num_bytes = 2 * sum(numels.values())
    whole = torch.full((num_bytes // 2,), 0.5, dtype=torch.bfloat16) if rank == 0 else None
    state = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()}
    megatron, layout = megatron_shards(state, QWEN3_SHAPES[model_shape])  # on the meta device: only the plans
    if rank == 0:  # the policy in one tensor (the torch backend's lay_out_flat), and in Megatron's layout
        state = unpack(Bucket(names=list(shapes), dtypes=["bfloat16"] * len(shapes), shapes=list(shapes.values())),
                       whole.view(torch.uint8))
        megatron, _ = megatron_shards(state, QWEN3_SHAPES[model_shape])
        sender = Broadcaster(group=group, bucket_bytes=1, timeout_s=120, check=lambda what: None)
        pg = sender._pg
    else:
        pg = join_group(group, 1, timeout_s=120)

    def landed() -> None:  # (gloo's work on a CUDA tensor is done once its copy onto the GPU is)
        if device == "cuda":
            torch.cuda.synchronize()

    def timed_together(fn) -> float:
        dist.barrier(group=pg)
        start = time.perf_counter()
        fn()
        landed()
        dist.barrier(group=pg)
        return time.perf_counter() - start

    # The engine receives into memory it holds already, as the embedded engine's server reuses its receive buffer
    # and SGLang's CUDA caching allocator its blocks: a fresh CPU buffer costs a page fault every 4 KiB, which on a
    # VM that hands freed memory back to its host takes longer than the bytes' move (2026-12-05: 8.5 s, not 1 s).
    inbox = torch.zeros(num_bytes, dtype=torch.uint8, device=device) if rank == 1 else None
    plans = {mb: plan_buckets(state, int(mb * 2**20)) for mb in bucket_mbs}
    megatron_plans = {mb: hf_plan(megatron, layout, int(mb * 2**20)) for mb in bucket_mbs}
    sources = hf_sources(layout)
    ring = BufferRing(BUCKETS_HELD)  # as MegatronTrainer's (its distributed optimizer: no bucket mapped ahead)

    def send_megatron(mb: float) -> None:
        buckets = hf_plan(megatron, layout, int(mb * 2**20))
        sender.stream(((bucket, map_bucket(megatron, layout, bucket, ring(i, bucket.num_bytes), sources))
                       for i, bucket in enumerate(buckets)), 1)

    def send(buckets: list, at: str) -> None:
        """distributed.py ``Sender.publish``: each bucket's MAC published before it is sent, its digest taken after."""
        publish = lambda i, record: store.set(f"{at}/{i}", json.dumps(record))  # noqa: E731
        sender.stream(authenticated(buckets, (state for _ in buckets), key, Digest(), publish), 1)

    def receive(buckets: list, at: str) -> None:
        """The rollout node reads each bucket's MAC, the engine receives the bucket and checks it."""
        for i, bucket in enumerate(buckets):
            mac = bucket_mac(json.loads(store.get(f"{at}/{i}")), key)
            assert check_bucket(bucket, receive_bucket(pg, bucket, inbox), mac)

    for r in range(rounds):
        results[("raw", rank, r)] = timed_together(
            lambda: dist.broadcast(whole.view(torch.uint8) if rank == 0 else inbox, src=0, group=pg))
        for mb, buckets in plans.items():
            for kind, plan, fn in (("flat", buckets, lambda b=buckets: sender.send(state, b, 1)),
                                   ("megatron", megatron_plans[mb], lambda mb=mb: send_megatron(mb))):
                if rank == 0:
                    results[(mb, kind, rank, r)] = timed_together(fn)
                else:
                    results[(mb, kind, rank, r)] = timed_together(
                        lambda b=plan: [receive_bucket(pg, bucket, inbox) for bucket in b])
            move = send if rank == 0 else receive
            results[(mb, "mac", rank, r)] = timed_together(lambda b=buckets, at=f"{r}/{mb}": move(b, at))
    dist.destroy_process_group(pg)


def device_rows(state: dict, rounds: int, rows: dict[str, list[float]]) -> None:
    """The GPU rows (``--device cuda``): a copy on the GPU, and the hand-over to host memory, each timed to the
    GPU's end."""
    import torch

    on_gpu = {name: t.to("cuda") for name, t in state.items()}
    host = {name: torch.empty_like(t).pin_memory() for name, t in state.items()}

    def synchronized(fn):
        return lambda: (fn(), torch.cuda.synchronize())

    for _ in range(rounds):
        for name, fn in [("device: memory copy", lambda: [t.clone() for t in on_gpu.values()]),
                         ("device: to host (pinned)",
                          lambda: [host[n].copy_(t, non_blocking=True) for n, t in on_gpu.items()])]:
            rows.setdefault(name, []).append(timed(synchronized(fn)))
    assert all(torch.equal(host[name], state[name]) for name in state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen3-1.7b")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0, 256.0, 512.0],
                        help="bucket sizes to broadcast with (the disk file is written by the first)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk rows write (default: as a one-node run)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the policy starts on the GPU and the engine receives into GPU memory (docstring)")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU that torch can use (torch.cuda.is_available() is False here)")

    from rolloutpipe.control.env import free_port
    from rolloutpipe.control.weights.disk import SHM, memory_backed
    from rolloutpipe.launch.memory_plan import QWEN3_SHAPES

    where = args.dir or (Path.cwd() if memory_backed(Path.cwd()) else SHM)
    bucket_bytes = int(args.bucket_mb[0] * 2**20)
    state = qwen3_state(QWEN3_SHAPES[args.model_shape])
    size = sum(t.numel() * t.element_size() for t in state.values())
    wall = time.perf_counter()
    copy, write, read, write_mac, read_check, read_into_weights, read_check_into = "memory copy", *DISK_ROWS
    weights = {name: torch.empty_like(t) for name, t in state.items()}  # an engine's, filled in place
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=where, prefix="rolloutpipe-bench-") as tmp:
        path = Path(tmp) / "policy.safetensors"
        for _ in range(args.rounds):
            written: list = []
            for name, fn in [(copy, lambda: memory_copy(state)),
                             (write, lambda: plain_write(state, path, bucket_bytes)),
                             (read, lambda: engine_read(path)),
                             (write_mac, lambda: written.append(one_pass_write(state, path, bucket_bytes))),
                             (read_check, lambda: read_and_check(path, written[-1])),
                             (read_into_weights, lambda: read_into(path, weights)),
                             (read_check_into, lambda: read_and_check_into(path, written[-1], weights))]:
                rows.setdefault(name, []).append(timed(fn))
    if args.device == "cuda":
        device_rows(state, args.rounds, rows)
    rows[DISK_TOTAL] = [a + b for a, b in zip(rows[write_mac], rows[read_check], strict=True)]
    rows[DISK_TOTAL_IN_PLACE] = [a + b for a, b in zip(rows[write_mac], rows[read_check_into], strict=True)]
    state.clear()  # the broadcast processes allocate their own
    weights.clear()
    results = mp.Manager().dict()
    mp.spawn(broadcast_rank, args=(free_port(), free_port(), args.model_shape, args.bucket_mb, args.rounds, args.device,
                                   results), nprocs=2, join=True)
    raw = "raw broadcast (gloo, one flat tensor)"
    rows[raw] = [max(results[("raw", 0, r)], results[("raw", 1, r)]) for r in range(args.rounds)]
    for mb in args.bucket_mb:
        for kind, row in (("flat", bucket_row(mb, False)), ("megatron", bucket_row(mb, False, megatron=True)),
                          ("mac", bucket_row(mb))):
            rows[row] = [max(results[(mb, kind, 0, r)], results[(mb, kind, 1, r)]) for r in range(args.rounds)]
    floor = median(rows[copy])
    gpu = f", {torch.cuda.get_device_name()} (the engine receives there)" if args.device == "cuda" else ""
    print(f"{args.model_shape} bfloat16: {size / GB:.2f} GB, {os.cpu_count()} CPUs{gpu}, disk rows in {where}, "
          f"median of {args.rounds} rounds, {time.perf_counter() - wall:.0f} s wall")
    print("| transport | seconds | GB/s | x memory copy |")
    print("|---|---|---|---|")
    for name, times in rows.items():
        seconds = median(times)
        print(f"| {name} | {seconds:.2f} | {size / GB / seconds:.2f} | {seconds / floor:.1f} |")
    for engines, total, floor_read in (("engines of their own (SGLang)", DISK_TOTAL, read),
                                       ("engines in the rollout node (embedded)", DISK_TOTAL_IN_PLACE,
                                        read_into_weights)):
        disk = [t / (w + r) for t, w, r in zip(rows[total], rows[write], rows[floor_read], strict=True)]
        print(f"disk total / (write + read), {engines}: {median(disk):.2f} [{min(disk):.2f}, {max(disk):.2f}] "
              "(goal <= 1.3)")

    def ratio(over: str, under: str) -> str:
        ratios = [a / b for a, b in zip(rows[over], rows[under], strict=True)]
        return f"{median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"

    for mb in args.bucket_mb:
        print(f"{mb:g} MiB buckets: broadcast / raw broadcast = {ratio(bucket_row(mb, False), raw)} (goal <= 1.2); "
              f"Megatron / raw = {ratio(bucket_row(mb, False, megatron=True), raw)}; "
              f"broadcast + MAC / raw = {ratio(bucket_row(mb), raw)}; broadcast + MAC / broadcast = "
              f"{ratio(bucket_row(mb), bucket_row(mb, False))}")
    # the simulator's weight sync (sim/models.py OverheadModel: the trainer's save, then the engines' load)
    fastest = min(args.bucket_mb, key=lambda mb: median(rows[bucket_row(mb)]))
    print("the simulator's weight sync for this machine and policy (docs/simulator.md):")
    print(f"  disk:        python tools/simulate.py sim.overheads.weight_save_s={median(rows[write_mac]):.3g} "
          f"sim.overheads.weight_load_s={median(rows[read_check]):.3g}")
    print(f"  distributed: python tools/simulate.py sim.overheads.weight_save_s="
          f"{median(rows[bucket_row(fastest)]):.3g} sim.overheads.weight_load_s=0  ({fastest:g} MiB buckets; the "
          "engines receive while it sends)")


if __name__ == "__main__":
    main()
