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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    summary = check_trainer_size(parser.parse_args().layers)
    print(json.dumps(summary, indent=2))
    return 0 if all(v for k, v in summary.items() if k.endswith("_ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
