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

PROMPT_TOKENS = 32

CASE = r"""
import json, resource, sys, time
import torch
from transformers import Qwen3ForCausalLM
from bench.trainer_memory import model_config
from rolloutpipe.trainer.config import OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.grpo import GRPOConfig
from rolloutpipe.trainer.torch_backend import PolicyTrainer, TrainSample
tokens, chunk, hidden, layers, steps = (int(a) for a in sys.argv[1:6])
torch.manual_seed(0)
trainer = PolicyTrainer(model=Qwen3ForCausalLM(model_config(hidden, layers, tokens)),
                        cfg=TrainerConfig(logprob_chunk_tokens=chunk), grpo=GRPOConfig(), temperature=1.0, pad_id=0,
                        multi_step=False, process_group_active=False, old_logprobs=OldLogprobSource.trainer)
sample = TrainSample(prompt_ids=list(range(5, 5 + PROMPT_TOKENS)),
                     response_ids=torch.randint(5, 151000, (tokens,)).tolist(), engine_logprobs=[0.0] * tokens,
                     advantage=1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with open("/proc/self/statm") as f:  # resident pages now: below ru_maxrss when building the model peaked higher
    resident = int(f.read().split()[1]) * resource.getpagesize() // 1024
start = time.perf_counter()
trainer.begin_step()
for _ in range(steps):  # micro-batches of one training batch: gradients accumulate, no optimizer step
    trainer.forward_backward([sample], first_batch_of_step=True)
elapsed = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mib": (peak - before) / 1024, "peak_over_resident_mib": (peak - resident) / 1024,
                  "tokens_per_s": steps * tokens / elapsed}))
"""
CASE = CASE.replace("PROMPT_TOKENS", str(PROMPT_TOKENS))


def model_config(hidden: int, layers: int, tokens: int):
    """The measured model: Qwen3's vocabulary, intermediate 3 x hidden, 16 heads, 8 key/value heads, tied."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=hidden // 16, tie_word_embeddings=True,
                       max_position_embeddings=tokens + PROMPT_TOKENS + 64)


def measure(tokens: int, chunk: int, hidden: int, layers: int = 2, steps: int = 1) -> dict:
    """``steps`` forward/backwards (micro-batches of one batch) of ``tokens`` response tokens (after PROMPT_TOKENS
    prompt tokens) in a fresh process:
    ``peak_mib`` (peak RSS minus the peak RSS before the step), ``peak_over_resident_mib`` (minus the RSS resident
    just before the step: what the step itself added, even where building the model peaked higher, as it does when
    HF allocates an lm_head and then ties it to the embedding) and ``tokens_per_s``. Raises with the child's
    stderr."""
    out = subprocess.run([sys.executable, "-c", CASE, str(tokens), str(chunk), str(hidden), str(layers), str(steps)],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


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
                try:
                    runs.setdefault((tokens, chunk), []).append(measure(tokens, chunk, args.hidden))
                except RuntimeError as err:
                    print(err, file=sys.stderr)
                    return 1
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
