"""What the restore point costs (rolloutpipe/trainer/restore.py): the per-step copy of the training state that lets
any stop keep every finished step, and the checkpoint written from it when the run stops.

    python bench/restore_point.py                       # the default tiny model, and Qwen3 layers at two widths
    python bench/restore_point.py --shapes 1024x8 --repeats 7

For each shape (hidden x layers, Qwen3 proportions: MLP 3 x hidden, 16 heads of 64 or fewer, Qwen3's 151,936-token
vocabulary unless --vocab), a float32 model and its AdamW state after one step, on the CPU, like the trainer on this
machine. It times, in one process and interleaved so that machine noise hits every column alike:

    step        one forward/backward of 4 samples x 64 tokens plus the optimizer step (PolicyTrainer): the training
                work a step has at the very least, for scale
    capture     RestorePoint.capture: the copy into host buffers reused from the previous step (what every step pays)
    write       RestorePoint.write: the checkpoint written from the copy (what a stop pays, and a periodic checkpoint)

and prints medians of --repeats, the capture's share of the step and the host memory the copy holds. On a GPU the
capture is a device-to-host copy instead (not measured here: no GPU on this machine).

    python bench/restore_point.py --megatron-ranks 2 --shapes 512x4 --dtype bfloat16

Megatron's distributed optimizer on that many gloo ranks (one process each, under trainer/megatron/cpu.py's
redirection), the step's end as trainer/node.py makes it: every rank that checkpoints its own shards copies them
(``sharded_checkpoint``), and rank 0 copies the policy and the optimizer's state inside ``writer_reads`` (where,
before the sharded checkpoint, it gathered the whole optimizer state while the other ranks joined). Per rank: the
step's end (median of --repeats), the host bytes the restore point holds, the step end's peak RSS over the RSS
before it, and the rank's RSS. Run from an older checkout (copy this file into its bench/) for the before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QWEN3_VOCAB = 151936


def build(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rolloutpipe.model import ModelConfig, build_tiny_tokenizer, load_model

    if hidden == 0:  # the default run's embedded tiny model and its tokenizer
        tokenizer = build_tiny_tokenizer()
        return load_model(ModelConfig(), len(tokenizer)), tokenizer
    heads = max(1, min(16, hidden // 64))
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         head_dim=hidden // heads, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval(), build_tiny_tokenizer()


def measure(hidden: int, layers: int, vocab: int, repeats: int) -> dict:
    import torch

    from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerConfig
    from rolloutpipe.trainer.grpo_trainer import TrainSample
    from rolloutpipe.trainer.restore import RestorePoint
    from rolloutpipe.trainer.torch_backend import PolicyTrainer

    model, tokenizer = build(hidden, layers, vocab)
    trainer = PolicyTrainer(model=model, cfg=TrainerConfig(), grpo=GRPOConfig(), temperature=1.0, pad_id=0,
                            multi_step=False, process_group_active=False, old_logprobs=OldLogprobSource.trainer)
    size = model.config.vocab_size
    samples = [TrainSample(prompt_ids=list(range(5, 21)), response_ids=torch.randint(5, size - 1, (48,)).tolist(),
                           engine_logprobs=[0.0] * 48, advantage=1.0 - i) for i in range(4)]
    with tempfile.TemporaryDirectory() as run_dir:
        point = RestorePoint(run_dir=Path(run_dir), tokenizer=tokenizer, config_yaml="", keep_last=1, on_disk=-1)
        times: dict[str, list[float]] = {"step": [], "capture": [], "write": []}
        for step in range(repeats + 1):  # the first round warms up (and allocates the buffers): not counted
            start = time.perf_counter()
            trainer.forward_backward(samples, first_batch_of_step=True)
            trainer.finish_batch()
            stepped = time.perf_counter()
            point.capture(step, model=trainer.hf_model(), optimizer=trainer.optimizer, source_state={})
            captured = time.perf_counter()
            point.write()
            written = time.perf_counter()
            if step:
                times["step"].append(stepped - start)
                times["capture"].append(captured - stepped)
                times["write"].append(written - captured)
        held = {t.data_ptr(): t.numel() * t.element_size()  # tied weights share one copy
                for state in (point._model_state, point._optimizer_state) for t in _tensors(state)}  # noqa: SLF001
        copy_bytes = sum(held.values())
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "copy_mib": copy_bytes / 2**20, **{k: statistics.median(v) for k, v in times.items()}}


def _tensors(tree):
    import torch

    if isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, torch.Tensor):
        yield tree


def megatron_rank(rank: int, world: int, port: int, hidden: int, layers: int, vocab: int, dtype: str, repeats: int,
                  results) -> None:
    """One rank of the --megatron-ranks table (torch.multiprocessing.spawn)."""
    import torch
    import torch.distributed as dist

    from bench.fsdp_memory import reset_peak, rss_bytes
    from rolloutpipe.model import DType
    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.config import GRPOConfig, MegatronConfig, OldLogprobSource, TrainerBackend, TrainerConfig
    from rolloutpipe.trainer.grpo_trainer import TrainSample
    from rolloutpipe.trainer.restore import RestorePoint

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model, tokenizer = build(hidden, layers, vocab)
    for param in model.parameters():
        param.data = param.data.to(DType(dtype).torch)
    cfg = TrainerConfig(backend=TrainerBackend.megatron, num_ranks=world,
                        megatron=MegatronConfig(distributed_optimizer=True))
    trainer = trainer_class(TrainerBackend.megatron)(
        model=model, cfg=cfg, grpo=GRPOConfig(), temperature=1.0, pad_id=0, multi_step=False,
        process_group_active=True, old_logprobs=OldLogprobSource.trainer)
    del model
    sharded = getattr(trainer, "sharded_checkpoint", False)
    samples = [TrainSample(prompt_ids=list(range(5, 21)), response_ids=list(range(30 + i, 46 + i)),
                           engine_logprobs=[0.0] * 16, advantage=(-1.0) ** i) for i in range(4)][rank::world]
    times, peaks = [], []
    with tempfile.TemporaryDirectory() as run_dir:
        point = RestorePoint(run_dir=Path(run_dir), tokenizer=tokenizer, config_yaml="", keep_last=1, on_disk=-1,
                             rank=rank, world_size=world)
        for step in range(repeats + 1):  # the first round allocates the buffers: not counted
            trainer.forward_backward(samples, first_batch_of_step=True)
            trainer.finish_batch()
            dist.barrier()
            before = rss_bytes()
            reset_peak()
            start = time.perf_counter()
            if sharded:  # trainer/node.py end_step: every rank its own shards
                point.capture_shards(step, trainer.training_shards())
            with trainer.writer_reads():  # (before: rank 0 gathered the whole state here, the others joined)
                if rank == 0:
                    point.capture(step, model=trainer.hf_model(), optimizer=trainer.optimizer, source_state={})
            if step:
                times.append(time.perf_counter() - start)
                peaks.append(rss_bytes("VmHWM") - before)
        held = {t.data_ptr(): t.numel() * t.element_size() for state in (
                point._model_state, point._optimizer_state, {k: s.tensor for k, s in (point._shards or {}).items()})
                for t in _tensors(state)}
        results[rank] = {"sharded": sharded, "step_end": statistics.median(times), "peak": max(peaks),
                         "held": sum(held.values()), "rss": rss_bytes(),
                         "params": sum(p.numel() for p in trainer.gpt.parameters())}
    dist.barrier()
    trainer.close()


def megatron_table(args) -> None:
    import torch.multiprocessing as mp

    from rolloutpipe.control.env import free_port

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # (the ranks inherit it) freed blocks go back: RSS is live
    print(f"Megatron's distributed optimizer on {args.megatron_ranks} gloo ranks, {args.dtype}, medians of "
          f"{args.repeats} step ends\n")
    print("| shape | parameters | checkpoint | rank | step end | restore point (host) | step end's peak RSS "
          "over before | rank's RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        hidden, layers = (0, 0) if shape == "tiny" else map(int, shape.split("x"))
        results = mp.Manager().dict()
        mp.spawn(megatron_rank, args=(args.megatron_ranks, free_port(), hidden, layers, args.vocab, args.dtype,
                                      args.repeats, results), nprocs=args.megatron_ranks, join=True)
        for rank, r in sorted(results.items()):
            print(f"| {shape} | {r['params'] / 1e6:.2f}M | {'each rank its shard' if r['sharded'] else 'gathered'} | "
                  f"{rank} | {r['step_end'] * 1e3:.1f} ms | {r['held'] / 2**20:.1f} MiB | "
                  f"{r['peak'] / 2**20:.1f} MiB | {r['rss'] / 2**20:.0f} MiB |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "512x4", "1024x8"],
                        help="'tiny' (the default run's model) or HIDDENxLAYERS")
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megatron-ranks", type=int, default=0,
                        help="Megatron's distributed optimizer on this many ranks instead (see above)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="with --megatron-ranks")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.megatron_ranks:
        megatron_table(args)
        return
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 on the CPU, medians of "
          f"{args.repeats} (the first round not counted)\n")
    print("| shape | parameters | copy (host) | step (fwd/bwd + optimizer) | capture | capture / step | write |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        hidden, layers = (0, 0) if shape == "tiny" else map(int, shape.split("x"))
        r = measure(hidden, layers, args.vocab, args.repeats)
        print(f"| {shape} | {r['params'] / 1e6:.2f}M | {r['copy_mib']:.1f} MiB | {r['step'] * 1e3:.1f} ms | "
              f"{r['capture'] * 1e3:.2f} ms | {r['capture'] / r['step']:.1%} | {r['write'] * 1e3:.0f} ms |",
              flush=True)


if __name__ == "__main__":
    main()
