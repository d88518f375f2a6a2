"""The memory plan's trainer terms against measured peak memory of the CPU torch and FSDP trainers.

    python bench/memory_plan_validation.py            # both tables, about six minutes on 2 CPU cores
    python bench/memory_plan_validation.py --tables torch --only 0 3
    python bench/memory_plan_validation.py --tables fsdp

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

The FSDP table (``trainer.backend=fsdp``, bench/fsdp_memory.py's real gloo processes at 1, 2 and 4 ranks, float32,
two samples per micro-batch): each rank's parameter, gradient and AdamW shards (bytes of the local tensors) against
the plan's weights, gradients and optimizer state terms (1/N each), and the peak of a steady micro-batch (the second
of a batch, after an optimizer step: AdamW's state held, the gradient shards allocated by the first; its transient,
peak RSS over the RSS just before it, plus the gradient shards) against the plan's gradients plus its
forward/backward peak: the unsharded parameters in flight (the root for the whole pass, the layer running, the next
one prefetched, one layer's unsharded gradient), the activations and the log-prob chunk. "in flight" is what FSDP
adds to the micro-batch's transient: its transient less the replicated torch backend's on the same model and batch
(one process, its gradients whole), against the plan's unsharded-in-flight term.

The transient is taken over the RSS just before the measured micro-batch, not before the batch: the first
micro-batch grows glibc's heap with sub-MiB blocks (under the 1 MiB mmap threshold) that are freed but not returned,
more for FSDP (mallinfo2, hidden 512, 1 rank: the heap 6.7 MiB larger after it, no more of it in use; likely
the unsharded copies and gradients of sub-MiB parameters, e.g. the 0.5 MiB key/value projections). Counted
from before the batch they added 3-10 MiB to FSDP's "in flight" (1.04-1.13 at hidden 512 over repeated runs) that
is no tensor: the torch profiler's live tensors at the peak differ between the backends by exactly the plan's term
(hidden 512: 64.0 MiB at 1 rank, 76.0 at 2). A GPU's caching allocator keeps such blocks as reserve, which the plan
counts in its "CUDA context" term (allocator slack), not here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import os  # noqa: E402
import types  # noqa: E402

from bench import fsdp_memory  # noqa: E402
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
FSDP_CASES = [  # (hidden, layers, vocabulary, response tokens, logprob_chunk_tokens), each at 1, 2 and 4 ranks
    (512, 4, 32768, 512, 256),     # activations and the log-prob chunk beside the root and two layers in flight
    (1024, 4, 32768, 128, 256),    # wider layers, fewer tokens: the unsharded parameters dominate the transient
]
FSDP_RANKS = (1, 2, 4)
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


def predict_fsdp(hidden: int, layers: int, vocab: int, tokens: int, chunk: int, num_ranks: int) -> dict[str, float]:
    """MiB of the plan's FSDP terms for bench/fsdp_memory.py's model (tied embeddings, 64-wide heads) and batch."""
    from transformers import Qwen3Config

    cfg = load_config({"micro_batch_size": 2, "rollout_max_response_len": tokens,
                       "data": {"max_prompt_len": PROMPT_TOKENS}, "model": {"dtype": "float32"},
                       "trainer": {"backend": "fsdp", "num_ranks": num_ranks, "logprob_chunk_tokens": chunk}})
    shape = ModelShape.from_hf(Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                           num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                           num_key_value_heads=hidden // 128, head_dim=64, tie_word_embeddings=True))
    estimate = trainer_estimate(cfg, shape, capacity_bytes=0)
    terms = {t.name: t.num_bytes / MiB for t in estimate.terms}
    return {**terms, "micro-batch peak": terms["gradients"] + max(estimate.phase_bytes(Phase.forward_backward),
                                                                   estimate.phase_bytes(Phase.end_of_backward)) / MiB}


def fsdp_table() -> None:
    os.environ.update(GLIBC_RETURNS_FREED_BLOCKS)  # the rank processes inherit it
    print("\nFSDP: bench/fsdp_memory.py's ranks (gloo), Qwen3 (64-wide heads, intermediate 3 x hidden, tied), float32, "
          "two samples of 32 prompt + N response tokens per micro-batch; MiB per rank (rank 0, largest of any rank "
          "for the shards), predicted -> measured (measured / predicted)")
    print("| hidden | layers | tokens | chunk | ranks | weights | gradients | AdamW | in flight | torch backend's "
          "transient (measured) | steady micro-batch peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for hidden, layers, vocab, tokens, chunk in FSDP_CASES:
        args = types.SimpleNamespace(hidden=hidden, layers=layers, vocab=vocab, tokens=tokens, chunk=chunk,
                                     recompute=False, backend="torch")
        baseline = fsdp_memory.measure(1, args)[0]["micro_batch_transient"] / MiB
        args.backend = "fsdp"
        for n in FSDP_RANKS:
            p = predict_fsdp(hidden, layers, vocab, tokens, chunk, n)
            results = fsdp_memory.measure(n, args)
            m = {key: max(r[key] for r in results.values()) / MiB for key in ("params", "grads", "optimizer")}
            transient = results[0]["micro_batch_transient"] / MiB  # its gradient shards already allocated
            peak = transient + results[0]["grads"] / MiB
            in_flight = transient - baseline

            def cell(predicted: float, measured: float) -> str:
                return f"{predicted:.0f} -> {measured:.0f} ({measured / predicted:.2f})"

            print(f"| {hidden} | {layers} | {PROMPT_TOKENS + tokens} | {chunk} | {n} | "
                  f"{cell(p['weights'], m['params'])} | {cell(p['gradients'], m['grads'])} | "
                  f"{cell(p['optimizer state'], m['optimizer'])} | {cell(p['unsharded in flight'], in_flight)} | "
                  f"{baseline:.0f} | {cell(p['micro-batch peak'], peak)} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=int, nargs="+", help="indices into CASES")
    parser.add_argument("--tables", nargs="+", choices=["torch", "fsdp"], default=["torch", "fsdp"])
    args = parser.parse_args()
    cases = [CASES[i] for i in args.only] if args.only else CASES
    if "fsdp" in args.tables and "torch" not in args.tables:
        fsdp_table()
        return 0
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
    if "fsdp" in args.tables:
        fsdp_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
