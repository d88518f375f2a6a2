"""The embedded engine with and without batch invariance: is a request's output bit-identical among batch-mates,
and what does invariance cost in decode throughput?

    python bench/batch_invariance.py                      # float32 and bfloat16, concurrency 8 and 32, 5 repeats
    python bench/batch_invariance.py --repeats 3 --concurrency 16

Invariance table: one target request (sampled, 40 tokens) runs alone, then among 15 batch-mates of other prompt
lengths, seeds and lengths, at two row positions (it is submitted 8th, then 1st, and joins a batch already
decoding). A cell says how many of its 40 log-probs differ from the alone run, bit for bit, and the largest
difference; tokens follow the log-probs once a near tie flips.

Throughput table: a fixed workload (``--requests`` requests, prompts of 4 to 19 tokens, ``--new-tokens`` tokens
each, EOS ignored) through one engine; tokens/s is generated tokens over the wall time from the first submit to
the last result (prefill included: the invariant engine prefills joiners one by one). Repeats are interleaved
(off, on, off, on, ...) in this one invocation so machine noise hits both alike; cells are medians, and the ratio
is on/off of the medians: quote it, never a lone absolute rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from pipeline_bench import aligned_table  # noqa: E402  (bench/ is on sys.path when this script runs)

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model  # noqa: E402
from rolloutpipe.rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rolloutpipe.types import GenerationRequest  # noqa: E402

VOCAB_SIZE = len(build_tiny_tokenizer())


def make_request(i: int, *, prompt_len: int, max_new_tokens: int, temperature: float = 1.0) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"step=0/group={i}/sample=0",
        input_ids=[4 + (i * 7 + j * 3) % (VOCAB_SIZE - 4) for j in range(prompt_len)],
        max_new_tokens=max_new_tokens, temperature=temperature, sampling_seed=1000 + i, stop_token_ids=[])


def run(dtype: DType, requests: list[GenerationRequest], *, concurrency: int, batch_invariant: bool
        ) -> tuple[dict, float]:
    """Results by id and the wall time from the first submit to the last result."""
    model = load_model(ModelConfig(dtype=dtype), VOCAB_SIZE)
    results, done = {}, threading.Event()

    def on_result(result) -> None:
        results[result.request_id] = result
        if len(results) == len(requests):
            done.set()

    engine = EmbeddedEngine(name="bench", model=model, concurrency=concurrency, on_result=on_result,
                            batch_invariant=batch_invariant)
    start = time.perf_counter()
    for r in requests:
        engine.submit(r, ignore_eos=True)
    done.wait()
    wall_s = time.perf_counter() - start
    engine.shutdown()
    return results, wall_s


def invariance_rows(dtypes: list[DType]) -> list[list[str]]:
    target = make_request(7, prompt_len=9, max_new_tokens=40)
    mates = [make_request(i, prompt_len=2 + i % 11, max_new_tokens=5 + 3 * i, temperature=0.5 + 0.1 * i)
             for i in range(16) if i != 7]
    rows = [["dtype", "batch_invariant", "submitted 8th", "submitted 1st"]]
    for dtype in dtypes:
        for invariant in (False, True):
            alone = run(dtype, [target], concurrency=1, batch_invariant=invariant)[0][target.request_id]
            cells = []
            for order in (mates[:7] + [target] + mates[7:], [target] + mates[::-1]):
                among = run(dtype, order, concurrency=4, batch_invariant=invariant)[0][target.request_id]
                diffs = [abs(a - b) for a, b in zip(alone.output_logprobs, among.output_logprobs)]
                cells.append(f"{sum(d != 0 for d in diffs)}/40 differ, max {max(diffs):.1e}")
            rows.append([dtype.value, str(invariant), *cells])
    return rows


def throughput_rows(dtypes: list[DType], concurrencies: list[int], args) -> list[list[str]]:
    requests = [make_request(i, prompt_len=4 + i % 16, max_new_tokens=args.new_tokens) for i in range(args.requests)]
    num_tokens = args.requests * args.new_tokens
    rows = [["dtype", "concurrency", "off tokens/s", "on tokens/s", "on/off"]]
    for dtype in dtypes:
        for concurrency in concurrencies:
            rates = {False: [], True: []}
            for _ in range(args.repeats):
                for invariant in (False, True):
                    rates[invariant].append(num_tokens / run(dtype, requests, concurrency=concurrency,
                                                             batch_invariant=invariant)[1])
            off, on = statistics.median(rates[False]), statistics.median(rates[True])
            rows.append([dtype.value, str(concurrency), f"{off:.0f}", f"{on:.0f}", f"{on / off:.3f}"])
            print(f"  {' | '.join(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--skip-check", action="store_true", help="only the throughput table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [DType(d) for d in args.dtypes]
    if not args.skip_check:
        print("\n".join(aligned_table(invariance_rows(dtypes))) + "\n", flush=True)
    print("\n".join(aligned_table(throughput_rows(dtypes, args.concurrency, args))))


if __name__ == "__main__":
    main()
