"""Draw the timeline of one run, or of several side by side, as PNG and SVG.

    python tools/timeline.py runs/sync runs/cgp --out docs/timeline_sync_vs_cgp      # steps 1-3 of each
    python tools/timeline.py runs/cgp --steps 5-7 --label "cgp, 2 engines"
    python tools/timeline.py runs/cgp --trace        # also (re)write runs/cgp/trace.json and lifecycle.jsonl

One panel per run on one time scale: engines (running requests), group completions, the dispatcher, each
trainer rank (forward/backward, optimizer steps, weight sync, idle time shaded); the title gives the steps'
rollout-to-train-end and trainer waiting ratio (see rolloutpipe/observe/timeline.py). trace.json opens in
ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rolloutpipe.observe.timeline import draw_timeline, load_run
from rolloutpipe.observe.trace import merge_run


def parse_steps(text: str) -> list[int]:
    """``3`` or ``2-5`` or ``1,4,6``."""
    steps: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        steps += range(int(lo), int(hi or lo) + 1)
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (with spans/ and metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="output path without suffix (default: <first run>/timeline)")
    parser.add_argument("--steps", type=parse_steps, help="steps to draw, e.g. 2-4 (default: 3 steps after step 0)")
    parser.add_argument("--label", action="append", default=[], help="panel label, once per run (default: mode)")
    parser.add_argument("--title", help="a title over all panels")
    parser.add_argument("--format", action="append", choices=["png", "svg", "pdf"],
                        help="output formats (default: png and svg)")
    parser.add_argument("--trace", action="store_true", help="also write each run's trace.json and lifecycle.jsonl")
    args = parser.parse_args(argv)
    if args.label and len(args.label) != len(args.runs):
        parser.error(f"--label given {len(args.label)} times for {len(args.runs)} runs")

    for run_dir in args.runs:
        if not (run_dir / "spans").is_dir():
            parser.error(f"{run_dir} has no spans/ directory: not a RolloutPipe run directory")
        if args.trace:
            print(f"wrote {merge_run(run_dir).trace_path}")
    labels = args.label or [None] * len(args.runs)
    runs = [load_run(run_dir, label=label) for run_dir, label in zip(args.runs, labels)]
    out = args.out or args.runs[0] / "timeline"
    for path in draw_timeline(runs, out, steps=args.steps, formats=tuple(args.format or ("png", "svg")),
                              title=args.title):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
