"""Peak memory of one trainer forward/backward with a real vocabulary, full logits vs chunked log-probs.

    python bench/trainer_memory.py                          # responses of 1k, 2k and 4k tokens
    python bench/trainer_memory.py --tokens 1024 4096 16384 --hidden 2048

A 2-layer Qwen3 with Qwen3's 151,936-entry vocabulary (float32, CPU), one sample of N response tokens, one
forward/backward through the torch backend (PolicyTrainer), each case in a fresh process so its peak RSS is its own
(``resource.getrusage``: ru_maxrss), minus the RSS before the step. ``trainer.logprob_chunk_tokens=0`` is the model's
own forward (a [N, vocabulary] logits tensor, and its log-softmax in float32); 1024 is the default. Cases alternate so
machine noise hits both; the table gives MiB per token and tokens/s (median of --repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CASE = r"""
import json, resource, sys, time
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from rolloutpipe.trainer.config import OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.grpo import GRPOConfig
from rolloutpipe.trainer.torch_backend import PolicyTrainer, TrainSample
tokens, chunk, hidden = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
config = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=2,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=hidden // 16, tie_word_embeddings=True,
                     max_position_embeddings=tokens + 64)
trainer = PolicyTrainer(model=Qwen3ForCausalLM(config), cfg=TrainerConfig(logprob_chunk_tokens=chunk),
                        grpo=GRPOConfig(), temperature=1.0, pad_id=0, multi_step=False,
                        process_group_active=False, old_logprobs=OldLogprobSource.trainer)
sample = TrainSample(prompt_ids=list(range(5, 37)), response_ids=torch.randint(5, 151000, (tokens,)).tolist(),
                     engine_logprobs=[0.0] * tokens, advantage=1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
trainer.begin_step(); trainer.forward_backward([sample], first_batch_of_step=True)
elapsed = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mib": (peak - before) / 1024, "tokens_per_s": tokens / elapsed}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 1024])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    runs: dict[tuple[int, int], list[dict]] = {}
    for _ in range(args.repeats):
        for tokens in args.tokens:
            for chunk in args.chunks:
                out = subprocess.run([sys.executable, "-c", CASE, str(tokens), str(chunk), str(args.hidden)],
                                     cwd=REPO, capture_output=True, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
                if out.returncode != 0:
                    print(out.stderr[-2000:], file=sys.stderr)
                    return 1
                runs.setdefault((tokens, chunk), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"one forward/backward, 2-layer Qwen3, hidden {args.hidden}, vocabulary 151,936, float32 on CPU")
    print("| tokens | logprob_chunk_tokens | peak MiB | MiB/token | tokens/s |")
    print("|--------|----------------------|----------|-----------|----------|")
    for (tokens, chunk), rs in sorted(runs.items()):
        peak = statistics.median(r["peak_mib"] for r in rs)
        speed = statistics.median(r["tokens_per_s"] for r in rs)
        print(f"| {tokens:>6} | {chunk or 'off':>20} | {peak:>8.0f} | {peak / tokens:>9.3f} | {speed:>8.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
