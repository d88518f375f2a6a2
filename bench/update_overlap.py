"""The step's last optimizer update against weight sync: applied whole and then sent, or applied bucket by bucket
while the buckets before are sent (grpo_trainer.py, "the step's last update"), on the torch backend, or on
Megatron's distributed optimizer (``--backend megatron-distributed``: one rank, gloo, trainer/megatron/cpu.py; its
DDP buckets as large as weight sync's, each stepped and all-gathered as the buckets reach it).

    python bench/update_overlap.py                     # about two minutes on 2 CPU cores, ~3 GB of memory
    python bench/update_overlap.py --hidden 2048 --layers 16 --bucket-mb 64
    python bench/update_overlap.py --backend megatron-distributed

A Qwen3-shaped bfloat16 policy with float32 master weights (mixed precision, as on a GPU). Each round trains one
micro-batch (not timed), then times, from the batch's ``finish_batch`` to the last byte written:
    update, then send        ``finish_batch()`` applies AdamW to every parameter, then disk weight sync writes the
                             policy (``write_weights``: the file in /dev/shm, hashed while written)
    update while sending     ``finish_batch(defer_update=True)``, then the same write, each bucket updated just
                             before it is taken, one bucket ahead on a thread (what trainer rank 0 does)
and the parts: the update alone (whole), the update by bucket alone (the buckets taken and dropped: AdamW on a
bucket at a time is itself faster on a CPU, its temporaries a bucket's size), and the send alone. The rows alternate
round by round (a burst of other work on a shared machine lands on one round); each is the median of ``--rounds``,
each ratio the median of the rounds' ratios. Not in it: a GPU (there the update is one fused kernel per bucket, and
the send a copy to the host or an NCCL broadcast).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def policy_trainer(hidden: int, layers: int, vocab: int, bucket_mb: float, backend: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.config import GRPOConfig, MegatronConfig, OldLogprobSource, TrainerBackend, TrainerConfig

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512),
                         head_dim=128, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    cfg = TrainerConfig()
    if backend == "megatron-distributed":
        cfg = TrainerConfig(backend=TrainerBackend.megatron, megatron=MegatronConfig(
            distributed_optimizer=True, ddp_bucket_size=int(bucket_mb * 2**20) // 2))  # bfloat16 parameters
    trainer = trainer_class(cfg.backend)(model=model, cfg=cfg, grpo=GRPOConfig(), temperature=1.0, pad_id=0,
                                         multi_step=False, process_group_active=False,
                                         old_logprobs=OldLogprobSource.trainer)
    assert trainer.updates_by_bucket
    trainer.bucket_bytes = int(bucket_mb * 2**20)
    return trainer


def gradients(trainer) -> None:
    from rolloutpipe.trainer.grpo_trainer import TrainSample

    sample = TrainSample(prompt_ids=list(range(5, 21)), response_ids=list(range(30, 46)), engine_logprobs=[],
                         advantage=1.0)
    trainer.forward_backward([sample], first_batch_of_step=True)


def send(trainer, path: Path) -> None:
    from rolloutpipe.control.weights.disk import write_weights

    path.unlink(missing_ok=True)
    write_weights(path, *trainer.hf_buckets(), b"bench key, 32 bytes long exactly")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", choices=["torch", "megatron-distributed"], default="torch")
    args = parser.parse_args()
    from rolloutpipe.control.weights.disk import SHM

    trainer = policy_trainer(args.hidden, args.layers, args.vocab, args.bucket_mb, args.backend)
    num_params = sum(p.numel() for p in trainer._policy().parameters())
    rows: dict[str, list[float]] = {}
    wall = time.perf_counter()

    def timed(name: str, fn) -> None:
        start = time.perf_counter()
        fn()
        rows.setdefault(name, []).append(time.perf_counter() - start)

    with tempfile.TemporaryDirectory(dir=SHM if SHM.is_dir() else None, prefix="rolloutpipe-bench-") as tmp:
        path = Path(tmp) / "policy.safetensors"
        for _ in range(args.rounds):
            gradients(trainer)
            timed("update alone", trainer.finish_batch)
            gradients(trainer)
            timed("update by bucket alone", lambda: (trainer.finish_batch(defer_update=True),
                                                     [None for _ in trainer.hf_buckets()[1]]))
            timed("send alone", lambda: send(trainer, path))
            gradients(trainer)
            timed("update, then send", lambda: (trainer.finish_batch(), send(trainer, path)))
            gradients(trainer)
            timed("update while sending", lambda: (trainer.finish_batch(defer_update=True), send(trainer, path),
                                                   trainer.apply_deferred_update()))
    print(f"{args.backend} backend; Qwen3-shaped, hidden {args.hidden}, {args.layers} layers: "
          f"{num_params / 1e6:.0f}M parameters, bfloat16 "
          f"with float32 masters, {args.bucket_mb:g} MiB buckets, {os.cpu_count()} CPUs, median of {args.rounds} "
          f"rounds, {time.perf_counter() - wall:.0f} s wall")
    print("| from finish_batch to the last byte written | seconds |")
    print("|---|---|")
    for name, times in rows.items():
        print(f"| {name} | {median(times):.2f} |")
    def ratio(name: str, to: list[float]) -> str:
        r = [a / b for a, b in zip(rows[name], to, strict=True)]
        return f"{median(r):.2f} [{min(r):.2f}, {max(r):.2f}]"

    serial = [u + s for u, s in zip(rows["update by bucket alone"], rows["send alone"], strict=True)]
    print(f"update while sending / update, then send = {ratio('update while sending', rows['update, then send'])}")
    print(f"update while sending / (update by bucket alone + send alone) = {ratio('update while sending', serial)}")

if __name__ == "__main__":
    main()
