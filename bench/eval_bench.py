"""Side-by-side benchmark: the same workload, same seed, with evaluation off, in the rollout's tail, and as a phase.

    python bench/eval_bench.py                          # 2 repeats of 5 steps, evaluating every step
    python bench/eval_bench.py --repeats 3 --steps 8 --response-len 128

Every mode runs as a real job (``launch.py``: two node groups, the store, weight sync), cgp with FIFO admission,
evaluating the default run's held-out split (8 prompts x 4 samples, responses as long as training's) at every
step. Repeats are interleaved (off, tail, phase, off, ...) so machine noise hits every mode alike; step 0 of each
run is dropped (warm-up). Each cell is the median over the remaining steps of all repeats, and the ratios are
ratios of medians from this one invocation: quote those, never a lone absolute time.

Columns
    r2t_s        perf/rollout_to_train_end_s: first admission of the step's training rollout to its last
                 optimizer step (in phase mode the eval phase comes before it, so it is not inside)
    step_s       start of step k to start of step k+1 on the rollout node: the eval phase (phase), the rollout, the
                 wait for the tail's unfinished eval requests (tail) and the weight load; what a run's length is
    eval_wait_s  tail: the wait after the rollout for eval requests still running; phase: the phase itself
    eval_in_tail eval samples finished while the step's training rollout was still running (rode for free)
    eval_n       eval samples per step
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pipeline_bench  # noqa: E402  (bench/ is on sys.path when this script runs)
from pipeline_bench import aligned_table  # noqa: E402

from rolloutpipe.observe.metrics import read_spans  # noqa: E402

MODES = {
    "off": ["eval.interval=0"],
    "tail": ["eval.interval=1", "eval.mode=tail"],
    "phase": ["eval.interval=1", "eval.mode=phase"],
}

WORKLOAD = ["rollout_batch_size=8", "n_samples_per_prompt=8", "global_batch_size=64", "micro_batch_size=16",
            "trainer.lr=1e-7", "rollout.num_engines=2", "rollout.concurrency=16", "pipeline.mode=cgp",
            "rollout.admission=fifo"]
"""The long-tail regime of bench/pipeline_bench.py, smaller: rollout dominates, lengths geometric up to the cap."""


def run_one(run_dir: Path, overrides: list[str]) -> list[dict]:
    """bench/pipeline_bench.py's run, and each step's time from its start to the next step's start."""
    records, _ = pipeline_bench.run_one(run_dir, overrides)  # (records, other jobs' load)
    starts: dict[int, float] = {}  # a step starts at its eval phase, or else at its first training request
    for s in read_spans(run_dir):
        if s.role == "rollout" and s.name in ("eval/phase", "rollout/request") and s.step not in starts:
            starts[s.step] = s.start_s  # (spans come by start time)
    for r in records:
        k = r["step"]
        r["step_s"] = starts[k + 1] - starts[k] if k + 1 in starts else None
    return records


def row(records: list[dict]) -> dict[str, float]:
    def med(key: str) -> float:
        values = [r[key] for r in records if r.get(key) is not None]
        return statistics.median(values) if values else 0.0

    return {"r2t_s": med("perf/rollout_to_train_end_s"), "step_s": med("step_s"), "eval_wait_s": med("eval/wait_s"),
            "eval_in_tail": med("eval/num_samples_in_tail"), "eval_n": med("eval/num_samples")}


def table(results: dict[str, dict[str, float]]) -> str:
    base = results["off"]
    head = ["eval", "r2t_s", "step_s", "eval_wait_s", "eval_in_tail", "eval_n", "r2t vs off", "step vs off"]
    rows = [head]
    for mode, m in results.items():
        rows.append([mode, f"{m['r2t_s']:.3f}", f"{m['step_s']:.3f}", f"{m['eval_wait_s']:.3f}",
                     f"{m['eval_in_tail']:.0f}", f"{m['eval_n']:.0f}",
                     f"{m['r2t_s'] / base['r2t_s']:.3f}x", f"{m['step_s'] / base['step_s']:.3f}x"])
    return "\n".join(aligned_table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="RL steps per run (step 0 is dropped)")
    parser.add_argument("--response-len", type=int, default=96, help="rollout_max_response_len (eval's too)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "runs" / f"eval-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: step 0 is dropped, and a step's time needs the next step's start")
    records: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode, overrides in MODES.items():
            run_dir = args.out / f"{mode}-{rep}"
            records[mode] += run_one(run_dir, [*WORKLOAD, *overrides, f"num_rollout={args.steps}",
                                               f"rollout_max_response_len={args.response_len}"])[1:]
            print(f"  {mode} repeat {rep}: done", file=sys.stderr, flush=True)
    report = table({m: row(r) for m, r in records.items()})
    print(report)
    (args.out / "table.md").write_text(report + "\n")
    print(f"\nruns and table in {args.out}")


if __name__ == "__main__":
    main()
