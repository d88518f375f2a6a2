"""What one trainer rank of ``trainer.backend=fsdp`` holds, at 1, 2 and 4 ranks: parameters, gradients, AdamW state.

    python bench/fsdp_memory.py                       # about a minute on 2 CPU cores
    python bench/fsdp_memory.py --ranks 1 2 4 --hidden 1024 --layers 8

Each case is real processes on gloo: the FSDPTrainer over a random-init Qwen3 (float32), one micro-batch of two
samples and the batch's optimizer step, as a run makes them (``--backend torch``: the replicated PolicyTrainer on
the same model and batch, the baseline bench/memory_plan_validation.py sets FSDP's transient against). Then each
rank counts the bytes of the tensors it holds: its parameter shards, their gradients, and AdamW's two moments (the
storage of each local shard, shared storage counted once). The peak RSS over the step, above the RSS before it
(the kernel's high-water mark, reset before: the unsharded layers in flight, activations, the log-prob chunk, the
gradients and AdamW state the step allocates, and the allocator's slack), is printed beside it; so is the peak of a
second batch's second micro-batch over the RSS before that batch (AdamW's state held, the gradient shards
allocated: a micro-batch as most of a run's are), and the same peak over the RSS just before that micro-batch
(``micro_batch_transient``: what the micro-batch itself adds; bench/memory_plan_validation.py sets it against the
memory plan). The two differ by the gradient shards and by what glibc's heap kept of the first micro-batch's freed
sub-MiB blocks (a few MiB that no tensor holds; bench/memory_plan_validation.py says more).
The table gives rank 0's figures and the largest of any rank.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 1 << 20


def held_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (VmRSS), or its high-water mark since the last ``reset_peak`` (VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak() -> None:
    """The kernel's peak RSS starts again from the RSS now (Linux: clear_refs 5), so no transient is missed."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerConfig
    from rolloutpipe.trainer.fsdp_backend import FSDPTrainer
    from rolloutpipe.trainer.grpo_trainer import TrainSample
    from rolloutpipe.trainer.torch_backend import PolicyTrainer

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 128, head_dim=64, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    num_params = sum(p.numel() for p in model.parameters())
    cfg = TrainerConfig(num_ranks=world, logprob_chunk_tokens=args.chunk, recompute=args.recompute)
    trainer_class = PolicyTrainer if getattr(args, "backend", "fsdp") == "torch" else FSDPTrainer
    trainer = trainer_class(model=model, cfg=cfg, grpo=GRPOConfig(), temperature=1.0,
                          pad_id=0, multi_step=False, process_group_active=True,
                          old_logprobs=OldLogprobSource.trainer)
    del model
    trained = getattr(trainer, "root", trainer.model)  # FSDP: the sharded root; torch: the model, replicated
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    samples = [TrainSample(prompt_ids=list(range(2, 34)), response_ids=list(range(40, 40 + args.tokens)),
                           engine_logprobs=[0.0] * args.tokens, advantage=a) for a in (1.0, -1.0)]
    dist.barrier()
    before = rss_bytes()
    reset_peak()  # the step's peak (the high-water mark so far includes the whole model built at start)
    trainer.forward_backward(samples, first_batch_of_step=True)
    # the gradients as the optimizer sees them (set_to_none clears them after the step)
    grads = held_bytes(p.grad for p in trained.parameters() if p.grad is not None)
    trainer.finish_batch()
    peak = rss_bytes("VmHWM")
    params = held_bytes(trained.parameters())
    adamw = held_bytes(t for state in optimizer.state.values() for t in state.values()
                       if torch.is_tensor(t) and t.dim() > 0)
    dist.barrier()
    # a second batch of two micro-batches: the second is one as most of a run's are, AdamW's state held and the
    # gradient shards allocated by the first (the optimizer step set them to None)
    second = rss_bytes()
    trainer.forward_backward(samples, first_batch_of_step=False)
    steady = rss_bytes()  # the gradient shards allocated, and glibc's heap grown to a micro-batch's working size
    reset_peak()
    trainer.forward_backward(samples, first_batch_of_step=False)
    micro_batch_peak = rss_bytes("VmHWM")
    trainer.finish_batch()
    results[rank] = {"params": params, "grads": grads, "optimizer": adamw, "num_params": num_params,
                     "step_peak_over_start": max(peak - before, 0),
                     "micro_batch_peak_over_start": max(micro_batch_peak - second, 0),
                     "micro_batch_transient": max(micro_batch_peak - steady, 0)}
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, args) -> dict[int, dict[str, int]]:
    import torch.multiprocessing as mp

    from rolloutpipe.control.env import free_port

    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(rank_main, args=(world, free_port(), args, results), nprocs=world, join=True)
    return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=64, help="response tokens per sample")
    parser.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_tokens")
    parser.add_argument("--recompute", action="store_true", help="trainer.recompute")
    parser.add_argument("--backend", choices=["fsdp", "torch"], default="fsdp",
                        help="torch: the replicated backend on the same model and batch (1 rank: the baseline)")
    args = parser.parse_args()
    rows = []
    for world in args.ranks:
        results = measure(world, args)
        r0 = results[0]
        total = r0["params"] + r0["grads"] + r0["optimizer"]
        largest = max(r["params"] + r["grads"] + r["optimizer"] for r in results.values())
        rows.append((world, r0, total, largest))
    full = rows[0][2] * rows[0][0] if rows else 0
    print(f"Qwen3 hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}: "
          f"{rows[0][1]['num_params'] / 1e6:.1f}M parameters, float32, AdamW")
    print("| ranks | params MiB | grads MiB | AdamW MiB | total MiB (rank 0) | largest rank MiB | x 1/N of 1 rank | "
          "step peak RSS over start MiB | steady micro-batch peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world, r0, total, largest in rows:
        print(f"| {world} | {r0['params'] / MiB:.1f} | {r0['grads'] / MiB:.1f} | {r0['optimizer'] / MiB:.1f} | "
              f"{total / MiB:.1f} | {largest / MiB:.1f} | {largest / (full / world):.3f} | "
              f"{r0['step_peak_over_start'] / MiB:.0f} | {r0['micro_batch_peak_over_start'] / MiB:.0f} |")


if __name__ == "__main__":
    main()
