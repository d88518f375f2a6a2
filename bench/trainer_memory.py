"""Peak memory of one trainer forward/backward with a real vocabulary, full logits vs chunked log-probs.

    python bench/trainer_memory.py                          # real-width Qwen3-1.7B layers, 1k / 4k / 16k tokens
    python bench/trainer_memory.py --tokens 1024 4096 --vocab 32768 151936 --hidden 1024

A 2-layer Qwen3 at Qwen3-1.7B's width (hidden 2048, MLP 6144, 16 heads, 8 KV heads) with Qwen3's 151,936-entry
vocabulary (float32, CPU), one sample of N response tokens after 32 prompt tokens, one forward/backward through the
torch backend (PolicyTrainer), each case in a fresh process (``measure``): the peak RSS minus the RSS resident just
before the step, so the gradients (allocated in backward) are in it. ``trainer.logprob_chunk_tokens=0`` is the
model's own forward (a [N, vocabulary] logits tensor, and its log-softmax in float32); 1024 is the default. Full
logits are not run past --full-max-tokens (at 16k tokens their logits, log-softmax and gradient alone are about
28 GiB). Cases alternate so machine noise hits both; the table gives MiB per token and tokens/s (median of
--repeats).
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
VOCAB = 151936
"""Qwen3's vocabulary."""

CASE = r"""
import json, resource, sys, time
import torch
from transformers import Qwen3ForCausalLM
from bench.trainer_memory import model_config
from rolloutpipe.trainer.config import OldLogprobSource, TrainerConfig
from rolloutpipe.trainer.config import GRPOConfig
from rolloutpipe.trainer.grpo_trainer import TrainSample
from rolloutpipe.trainer.torch_backend import PolicyTrainer
tokens, chunk, hidden, layers, steps, vocab, recompute = (int(a) for a in sys.argv[1:8])
torch.manual_seed(0)
trainer = PolicyTrainer(model=Qwen3ForCausalLM(model_config(hidden, layers, tokens, vocab)),
                        cfg=TrainerConfig(logprob_chunk_tokens=chunk, recompute=bool(recompute)), grpo=GRPOConfig(),
                        temperature=1.0, pad_id=0, multi_step=False, process_group_active=False,
                        old_logprobs=OldLogprobSource.trainer)
sample = TrainSample(prompt_ids=list(range(5, 5 + PROMPT_TOKENS)),
                     response_ids=torch.randint(5, vocab - 1, (tokens,)).tolist(), engine_logprobs=[0.0] * tokens,
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


def model_config(hidden: int, layers: int, tokens: int, vocab: int = VOCAB):
    """The measured model: Qwen3's vocabulary, intermediate 3 x hidden, 16 heads, 8 key/value heads, tied (hidden
    2048: Qwen3-1.7B's layer)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=hidden // 16, tie_word_embeddings=True,
                       max_position_embeddings=tokens + PROMPT_TOKENS + 64)


def measure(tokens: int, chunk: int, hidden: int, layers: int = 2, steps: int = 1, vocab: int = VOCAB,
            recompute: bool = False, environ: dict[str, str] | None = None) -> dict:
    """``steps`` forward/backwards (micro-batches of one batch) of ``tokens`` response tokens (after PROMPT_TOKENS
    prompt tokens) in a fresh process:
    ``peak_mib`` (peak RSS minus the peak RSS before the step), ``peak_over_resident_mib`` (minus the RSS resident
    just before the step: what the step itself added, even where building the model peaked higher, as it does when
    HF allocates an lm_head and then ties it to the embedding) and ``tokens_per_s``. ``environ``: more environment
    for the child. Raises with the child's stderr."""
    argv = [str(a) for a in (tokens, chunk, hidden, layers, steps, vocab, int(recompute))]
    out = subprocess.run([sys.executable, "-c", CASE, *argv], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **(environ or {}), "PYTHONPATH": str(REPO)})
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024])
    parser.add_argument("--vocab", type=int, nargs="+", default=[VOCAB])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--recompute", action="store_true", help="trainer.recompute=true in every case")
    parser.add_argument("--full-max-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    cases = [(t, v, c) for t in args.tokens for v in args.vocab for c in args.chunks if c or t <= args.full_max_tokens]
    runs: dict[tuple[int, int, int], list[dict]] = {}
    for _ in range(args.repeats):
        for tokens, vocab, chunk in cases:
            try:
                runs.setdefault((tokens, vocab, chunk), []).append(
                    measure(tokens, chunk, args.hidden, vocab=vocab, recompute=args.recompute))
            except RuntimeError as err:
                print(err, file=sys.stderr)
                return 1
    print(f"one forward/backward, 2-layer Qwen3, hidden {args.hidden}, MLP {3 * args.hidden}, float32 on CPU"
          f"{', trainer.recompute' if args.recompute else ''}; median of {args.repeats}")
    print("| tokens | vocabulary | logprob_chunk_tokens | peak MiB | MiB/token | tokens/s |")
    print("|--------|------------|----------------------|----------|-----------|----------|")
    for (tokens, vocab, chunk), rs in sorted(runs.items()):
        peak = statistics.median(r["peak_over_resident_mib"] for r in rs)
        speed = statistics.median(r["tokens_per_s"] for r in rs)
        print(f"| {tokens:>6} | {vocab:>10,} | {chunk or 'off (full logits)':>20} | {peak:>8.0f} | "
              f"{peak / tokens:>9.3f} | {speed:>8.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
