"""Side-by-side benchmark: the same workload, same seed, in sync, cgp, cgp+fgd and async_one_step.

    python bench/pipeline_bench.py                       # both workloads, 3 repeats
    python bench/pipeline_bench.py --workload long_tail --repeats 5 --steps 8
    python bench/pipeline_bench.py --response-len 256    # the response-length knob, for either regime

Every mode runs as a real job (``launch.py``: two node groups, the store, weight sync). Repeats are
interleaved (sync, cgp, fgd, async, sync, ...) so machine noise hits every mode alike; step 0 of each
run is dropped (warm-up). Each cell is the median over the remaining steps of all repeats, and the
reductions are ratios of medians from this one invocation: quote those, never a lone absolute time.

Workloads (tiny random-init Qwen3, 1 rollout core, 1 trainer core). Responses of the untrained model
stop at its end-of-sequence token with probability ~1/45 per token, so lengths are geometric: most
short, a long tail up to ``rollout_max_response_len`` (the knob), and a group completes with its
longest sample. The learning rate is tiny so the policy, hence the length distribution, stays put.
    long_tail   rollout dominates: long-tailed responses, a cheap trainer
    balanced    training time close to rollout time: small micro-batches make the trainer slower
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODES = {
    "sync": ["pipeline.mode=sync"],
    "cgp": ["pipeline.mode=cgp", "rollout.admission=fifo"],
    "cgp+fgd": ["pipeline.mode=cgp", "rollout.admission=fgd"],
    "async_one_step": ["pipeline.mode=async_one_step"],
}

COMMON = ["rollout_batch_size=16", "n_samples_per_prompt=8", "global_batch_size=128", "trainer.lr=1e-7",
          "rollout.num_engines=2", "rollout.concurrency=32"]

WORKLOADS = {
    "long_tail": [*COMMON, "micro_batch_size=16"],
    "balanced": [*COMMON, "micro_batch_size=1"],
}

COLUMNS = [
    ("perf/rollout_to_train_end_s", "r2t_s"),
    ("perf/trainer_wait_ratio", "wait"),
    ("perf/rollout_s", "rollout_s"),
    ("perf/train_compute_s", "compute_s"),
    ("perf/ideal_rollout_to_train_end_s", "ideal_s"),
    ("perf/pipeline_efficiency", "eff"),
    ("perf/first_group_s", "first_grp_s"),
    ("perf/tokens_per_s", "tok/s"),
]


def run_one(run_dir: Path, overrides: list[str]) -> list[dict]:
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *overrides],
                            cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"run {run_dir} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def medians(records: list[dict]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in records) for key, _ in COLUMNS}


def table(workload: str, results: dict[str, dict[str, float]]) -> str:
    base = results["sync"]
    head = ["mode", *(short for _, short in COLUMNS), "r2t vs sync", "wait vs sync"]
    rows = [head]
    for mode, m in results.items():
        rows.append([
            mode,
            *(f"{m[key]:.0f}" if short == "tok/s" else f"{m[key]:.3f}" for key, short in COLUMNS),
            f"{100 * (m['perf/rollout_to_train_end_s'] / base['perf/rollout_to_train_end_s'] - 1):+.1f}%",
            f"{100 * (m['perf/trainer_wait_ratio'] / base['perf/trainer_wait_ratio'] - 1):+.1f}%",
        ])
    return "\n".join([f"workload: {workload}", *aligned_table(rows)])


def aligned_table(rows: list[list[str]]) -> list[str]:
    """Markdown lines of ``rows`` (the first is the header), each column right-aligned to its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run (step 0 is dropped)")
    parser.add_argument("--response-len", type=int, default=192, help="rollout_max_response_len")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    modes = args.modes.split(",")
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    report = []
    for workload in workloads:
        records: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            for mode in modes:
                run_dir = args.out / workload / f"{mode}-{rep}"
                overrides = [*WORKLOADS[workload], *MODES[mode], f"num_rollout={args.steps}",
                             f"rollout_max_response_len={args.response_len}"]
                records[mode] += run_one(run_dir, overrides)[1:]
                print(f"  {workload} {mode} repeat {rep}: done", file=sys.stderr, flush=True)
        report.append(table(workload, {m: medians(r) for m, r in records.items()}))
        print(report[-1], flush=True)
    (args.out / "table.md").write_text("\n\n".join(report) + "\n")
    print(f"\nruns and table in {args.out}")


if __name__ == "__main__":
    main()
