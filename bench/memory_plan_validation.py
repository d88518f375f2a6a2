"""The memory plan's trainer terms against measured peak memory of the CPU torch trainer.

    python bench/memory_plan_validation.py            # the default cases, a few minutes on 2 CPU cores
    python bench/memory_plan_validation.py --only 0 3

Each case is two micro-batches (forward/backward, gradients accumulating, no optimizer step) of one sample
(32 prompt tokens + N response tokens) through PolicyTrainer on a Qwen3 with the real 151,936-entry vocabulary,
float32 on CPU, in a fresh process (bench/trainer_memory.py's ``measure``: peak RSS minus the RSS resident just
before the first; MALLOC_MMAP_THRESHOLD_=1 MiB, see GLIBC_RETURNS_FREED_BLOCKS). The second is a micro-batch as
most of a run's are, with every gradient already allocated; its peak is the run's. The prediction is the same
quantity from rolloutpipe/launch/memory_plan.py, for the same shape
and config: the gradients plus the larger of the forward/backward peak (activations, attention, the log-prob chunk)
and the end of backward (the embedding's gradient being summed). On CPU the torch backend runs
HF's SDPA, so the prediction assumes fused (O(T)) attention; a CPU kernel that materialised T x T scores would show
as a ratio growing with T.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.trainer_memory import PROMPT_TOKENS, measure, model_config  # noqa: E402
from rolloutpipe.config import load_config  # noqa: E402
from rolloutpipe.launch.memory_plan import ModelShape, Phase, trainer_estimate  # noqa: E402

CASES = [  # (hidden, layers, response tokens, logprob_chunk_tokens, trainer.recompute)
    (512, 2, 64, 1024, False),     # few tokens: the peak is the end of backward (the tied embedding's gradient)
    (512, 2, 1024, 1024, False),   # two chunks: the log-prob chunk dominates
    (512, 2, 1024, 0, False),      # the whole micro-batch's logits at once
    (512, 8, 2048, 256, False),    # activations dominate
    (512, 8, 2048, 256, True),     # ... and recomputed
    (1024, 2, 2048, 1024, False),
    (1024, 4, 2048, 512, False),
    (1024, 4, 2048, 512, True),
]
MiB = 1 << 20
GLIBC_RETURNS_FREED_BLOCKS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
"""Every allocation over 1 MiB its own mapping, returned when freed: without it glibc's heap keeps the pages of
freed activations (tens of MiB each) and the RSS counts them, which no GPU allocator would (measured: +10-25%)."""


def predict(hidden: int, layers: int, tokens: int, chunk: int, recompute: bool) -> dict[str, float]:
    """MiB of each forward/backward term of the plan for this case."""
    cfg = load_config({"micro_batch_size": 1, "rollout_max_response_len": tokens,
                       "data": {"max_prompt_len": PROMPT_TOKENS}, "model": {"dtype": "float32"},
                       "trainer": {"logprob_chunk_tokens": chunk, "recompute": recompute}})
    shape = ModelShape.from_hf(model_config(hidden, layers, tokens))
    estimate = trainer_estimate(cfg, shape, capacity_bytes=0)
    terms = {t.name: t.num_bytes / MiB for t in estimate.terms}
    return {"gradients": terms["gradients"], "activations": terms["activations"],
            "log-prob": terms["log-prob chunk"], "embedding gradient": terms["embedding gradient"],
            "predicted": terms["gradients"] + max(estimate.phase_bytes(Phase.forward_backward),
                                                  estimate.phase_bytes(Phase.end_of_backward)) / MiB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=int, nargs="+", help="indices into CASES")
    args = parser.parse_args()
    cases = [CASES[i] for i in args.only] if args.only else CASES
    print("two micro-batches of one sample, Qwen3 (16 heads, 8 kv heads, intermediate 3 x hidden), vocabulary "
          "151,936, float32 on CPU; MiB over the RSS before the step")
    print("| hidden | layers | tokens | chunk | recompute | activations | log-prob | embedding grad (bwd end) | "
          "gradients | predicted | measured | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for hidden, layers, tokens, chunk, recompute in cases:
        p = predict(hidden, layers, tokens, chunk, recompute)
        measured = measure(tokens, chunk, hidden, layers, steps=2, recompute=recompute,
                           environ=GLIBC_RETURNS_FREED_BLOCKS)["peak_over_resident_mib"]
        print(f"| {hidden} | {layers} | {PROMPT_TOKENS + tokens} | {chunk or 'off'} | {'yes' if recompute else 'no'} | "
              f"{p['activations']:.0f} | "
              f"{p['log-prob']:.0f} | {p['embedding gradient']:.0f} | {p['gradients']:.0f} | {p['predicted']:.0f} | "
              f"{measured:.0f} | {measured / p['predicted']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
