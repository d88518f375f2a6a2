"""The memory plan against the live tensor bytes of the GPU code paths, run on the CPU: what a GPU's allocator holds.

    python bench/memory_plan_tracked.py                 # the four rows of tools/gpu_check.py's trainer_size, scaled
    python bench/memory_plan_tracked.py --only 0 --hidden 512

tools/gpu_check.py measures ``torch.cuda.max_memory_allocated`` at Qwen3-1.7B's width on a GPU: the bytes of live
tensors, which is not what a process's RSS shows. This bench counts the same quantity on the CPU, with torch's
MemTracker (a dispatch mode that follows every tensor storage from its creation to its last reference), over the
same code: Megatron's local layer spec in bfloat16 with its DistributedOptimizer (trainer/megatron/cpu.py redirects
its CUDA calls; Megatron's attention takes the same unfused path past 4096 keys on a GPU without Apex), and the torch
backend in bfloat16, each with and without trainer.recompute, micro-batches packed by a token budget as the check's
are (token budget 4096; prompts of 128 and responses a quarter of the check's). Each case runs in a fresh process:
one warm-up batch (AdamW's state appears at its step), then the peak of a second, against
memory_plan.planned_allocated_bytes for the same shape and config. What the CPU cannot show: SDPA's kernel choice
(the torch backend's attention is O(T) here too, as flash is on a GPU), cuBLAS workspaces, allocator rounding.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 128
RESPONSE_TOKENS = [2048, 1024, 512, 256, 128, 1500, 75, 1750]
BUDGET = 4096
CASES = [("megatron", False), ("megatron", True), ("torch", False), ("torch", True)]

CASE = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import Qwen3Config, Qwen3ForCausalLM
sys.path.insert(0, sys.argv[1])
from bench.memory_plan_tracked import BUDGET, PROMPT_TOKENS, RESPONSE_TOKENS, config, shape_of
from rolloutpipe.launch.memory_plan import AttentionKind, planned_allocated_bytes
from rolloutpipe.trainer.backend import trainer_class
from rolloutpipe.trainer.batching import BatchConsumer, MicroBatch
from rolloutpipe.trainer.config import OldLogprobSource, TrainerBackend
from rolloutpipe.trainer.grpo_trainer import TrainSample, sequence_len
backend, recompute, hidden, layers = sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
hf = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=hidden // 16, tie_word_embeddings=True,
                 max_position_embeddings=4096, rope_theta=1e6)
cfg = config(backend, recompute)
gen = torch.Generator().manual_seed(0)
samples = [TrainSample(prompt_ids=torch.randint(5, 151000, (PROMPT_TOKENS,), generator=gen).tolist(),
                       response_ids=torch.randint(5, 151000, (n,), generator=gen).tolist(),
                       engine_logprobs=[0.0] * n, advantage=(-1.0) ** i) for i, n in enumerate(RESPONSE_TOKENS)]

class Handle:
    batch, group = 0, 0

tracker = MemTracker()
with tracker:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf).to(torch.bfloat16)
    trainer = trainer_class(TrainerBackend(backend))(
        model=model, cfg=cfg.trainer, grpo=cfg.grpo, temperature=1.0, pad_id=0, multi_step=False,
        process_group_active=False, old_logprobs=OldLogprobSource.trainer)
    del model
    for batch in range(2):
        consumer = BatchConsumer(num_batches=1, groups_per_batch=1, micro_batch_size=cfg.micro_batch_size,
                                 max_tokens_per_micro_batch=BUDGET, length=sequence_len)
        micro = [w for w in consumer.arrive(Handle(), lambda h: list(samples)) if isinstance(w, MicroBatch)]
        if batch == 1:  # the steady batch: its peak alone (MemTracker keeps one peak per device; reset it here)
            tracker._peak_mem.clear(); tracker._peak_mem_snap.clear()
        trainer.begin_step()
        for m in micro:
            tracker.reset_mod_stats()  # (its per-module figures take one call per module; only the total is read)
            trainer.forward_backward(m.samples, first_batch_of_step=True)
        trainer.finish_batch()
    peak = max(tracker.get_tracker_snapshot("peak")[d]["Total"] for d in tracker.get_tracker_snapshot("peak"))
attention = AttentionKind.materialised if backend == "megatron" else AttentionKind.fused
print(json.dumps({"micro_batches": [[len(m.samples), m.num_padded_tokens] for m in micro], "peak": peak,
                  "planned": planned_allocated_bytes(cfg, shape_of(hf), attention=attention)}))
"""


def config(backend: str, recompute: bool):
    from rolloutpipe.config import load_config

    return load_config({"model": {"dtype": "bfloat16"}, "max_tokens_per_micro_batch": BUDGET,
                        "data": {"max_prompt_len": PROMPT_TOKENS}, "rollout_max_response_len": max(RESPONSE_TOKENS),
                        "n_samples_per_prompt": len(RESPONSE_TOKENS), "global_batch_size": len(RESPONSE_TOKENS),
                        "rollout_batch_size": 1,
                        "trainer": {"backend": backend, "recompute": recompute,
                                    **({"megatron": {"distributed_optimizer": True}} if backend == "megatron"
                                       else {})}})


def shape_of(hf_config):
    from rolloutpipe.launch.model_shapes import ModelShape

    return ModelShape.from_hf(hf_config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, nargs="*", help="case indices (default: all)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"hidden {args.hidden}, {args.layers} layers, 16 heads, vocabulary 151,936, bfloat16; budget {BUDGET} "
          f"tokens; responses {RESPONSE_TOKENS} after {PROMPT_TOKENS} prompt tokens")
    print("| backend | spec | recompute | micro-batches (rows x padded tokens) | live peak MiB | planned MiB | "
          "peak / plan |")
    print("|---|---|---|---|---|---|---|")
    for i in args.only if args.only is not None else range(len(CASES)):
        backend, recompute = CASES[i]
        out = subprocess.run([sys.executable, "-c", CASE, str(REPO), backend, str(int(recompute)), str(args.hidden),
                              str(args.layers)], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        spec = "local (distributed optimizer)" if backend == "megatron" else "sdpa"
        shapes = " ".join(f"{rows}x{tokens}" for rows, tokens in r["micro_batches"])
        print(f"| {backend} | {spec} | {recompute} | {shapes} | {r['peak'] / 2**20:.0f} | "
              f"{r['planned'] / 2**20:.0f} | {r['peak'] / r['planned']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
