"""The paper-style table from several runs, printed and written as Markdown and CSV.

    python tools/report.py multirun/2026-11-29/10-00-00            # a Hydra sweep: writes report.md and .csv in it
    python tools/report.py runs/sync runs/cgp --out docs/bench     # hand-picked runs; docs/bench.md and .csv
    python tools/report.py /tmp/bench --timeline                   # also draw each setting's modes side by side
    python tools/report.py runs/ --wandb my-entity/my-project      # also log the table (and timelines) to W&B
    python tools/report.py --first-difference runs/sync runs/cgp   # the first step whose weights digests differ

Per setting: each mode's rollout-to-train-end and trainer waiting ratio, the reductions vs sync, and the
measured span-recording overhead (definitions in rolloutpipe/observe/report.py). With ``--first-difference`` it
compares two runs' ``train/weights_digest`` step by step instead; exit status 0 if they agree at every common step,
1 if they differ, 2 if a run cannot be compared (no digests, no common step).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rolloutpipe.observe.report import (
    build_table,
    describe_difference,
    find_runs,
    first_difference,
    summarise_run,
    to_csv,
    to_markdown,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="run directories, or directories holding runs")
    parser.add_argument("--first-difference", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"),
                        help="print the first step where the two runs' train/weights_digest differ (no table)")
    parser.add_argument("--out", type=Path,
                        help="writes OUT.md and OUT.csv (default: report.md and report.csv in the directory the runs "
                             "share: the sweep's, or the run's)")
    parser.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out of each run (default 1)")
    parser.add_argument("--stat", choices=["mean", "median"], default="mean", help="over a run's steps")
    parser.add_argument("--timeline", action="store_true",
                        help="draw each setting's modes side by side: OUT_<n>.png and .svg")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="log the table and timelines to a W&B run")
    parser.add_argument("--wandb-mode", choices=["offline", "online"], default="offline")
    args = parser.parse_args(argv)
    if args.first_difference:
        run_a, run_b = args.first_difference
        try:
            comparison = first_difference(run_a, run_b)
        except ValueError as err:
            print(f"cannot compare: {err}", file=sys.stderr)
            return 2
        print(describe_difference(comparison, run_a, run_b), end="")
        return 0 if comparison.first_difference is None else 1
    if not args.paths:
        parser.error("name run directories (or --first-difference RUN_A RUN_B)")

    out = args.out or default_out(args.paths)
    runs = find_runs(args.paths)
    summaries = [s for s in (summarise_run(r, skip_steps=args.skip_steps, stat=args.stat) for r in runs) if s]
    if not summaries:
        print(f"no runs (directories with config.yaml and metrics.jsonl) under {', '.join(map(str, args.paths))}",
              file=sys.stderr)
        return 1
    rows = build_table(summaries)
    markdown = to_markdown(rows)
    print(markdown, end="")
    out.parent.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = out.with_suffix(".md"), out.with_suffix(".csv")
    md_path.write_text(markdown)
    csv_path.write_text(to_csv(rows))
    print(f"wrote {md_path} and {csv_path} ({len(summaries)} runs)")
    pictures = draw_settings(summaries, rows, out) if args.timeline else []
    for path in pictures:
        print(f"wrote {path}")
    if args.wandb:
        log_to_wandb(args.wandb, args.wandb_mode, rows, [p for p in pictures if p.suffix == ".png"], out.parent)
    return 0


def default_out(paths: list[Path]) -> Path:
    """``report`` in the directory the runs share (a sweep's, a run's, their parent): beside the runs, in a tree
    .gitignore covers for Hydra's outputs/ and multirun/, not in the working directory. Runs with nothing in common
    but the root: in the first one named."""
    shared = Path(os.path.commonpath([p.resolve() for p in paths]))
    return (paths[0].resolve() if shared == Path(shared.anchor) else shared) / "report"


def draw_settings(summaries, rows, out: Path) -> list[Path]:
    """One picture per setting: the first run of each mode, sync first."""
    from rolloutpipe.observe.report import setting_labels
    from rolloutpipe.observe.timeline import draw_timeline, load_run

    labels = setting_labels(sorted({s.setting for s in summaries}, key=str))
    paths = []
    for n, label in enumerate(dict.fromkeys(r["setting"] for r in rows)):
        chosen = {}
        for s in sorted(summaries, key=lambda s: (s.mode != "sync", s.mode, str(s.run_dir))):
            if labels[s.setting] == label:
                chosen.setdefault(s.mode, s.run_dir)
        timelines = [load_run(run_dir) for run_dir in chosen.values()]
        paths += draw_timeline(timelines, out.with_name(f"{out.name}_{n}"), formats=("png", "svg"), title=label)
    return paths


def log_to_wandb(target: str, mode: str, rows: list[dict], pictures: list[Path], directory: Path) -> None:
    """A W&B run (job_type=report) with the table and the pictures; offline unless --wandb-mode online."""
    from rolloutpipe.observe.report import COLUMNS
    from rolloutpipe.observe.tracking import WandbConfig, WandbMode, open_tracker

    entity, _, project = target.rpartition("/")
    cfg = WandbConfig(mode=WandbMode(mode), entity=entity or None, project=project, system_metrics=False)
    tracker = open_tracker(cfg, run_dir=directory, run_id="report", config={"runs": len(rows)}, enabled=True,
                           job_type="report")
    import wandb

    payload = {"report/table": wandb.Table(columns=COLUMNS, data=[[r[c] for c in COLUMNS] for r in rows])}
    payload.update({f"report/timeline_{i}": wandb.Image(str(p)) for i, p in enumerate(pictures)})
    tracker.log(payload)
    tracker.finish(None, None)
    print(f"logged the table to W&B ({mode}) under {directory / 'wandb'}")


if __name__ == "__main__":
    sys.exit(main())
