"""The paper-style table from several runs: per setting, each mode's rollout-to-train-end and trainer waiting
ratio, and the reductions vs ``sync`` (``tools/report.py`` is the command).

Runs are the directories under the given paths that hold ``config.yaml`` and ``metrics.jsonl`` (a Hydra
multirun sweep, bench output, or hand-picked runs). A *setting* is everything in config.yaml except the
schedule (``pipeline.mode``, ``rollout.admission``), the seed and the bookkeeping (``run``, ``wandb``,
``launcher``), compared on the keys every run's config has; runs of one setting and mode (e.g. several
seeds) are averaged. The setting's label lists the keys that differ between settings.

Per run, each metric is the mean (or median) over its steps after ``skip_steps`` (step 0 includes
start-up; a run with fewer steps keeps all of them). Reductions compare with the ``sync`` row of the
same setting:
    rollout_to_train_end_reduction   1 - T_mode / T_sync      (higher is better)
    wait_ratio_change_pts            100 * (wait_mode - wait_sync), percentage points (negative is better)
The recording overhead is the largest over the run's processes of (CPU time in SpanRecorder.add and
flush) / (the process's wall time from first to last span), as measured by the run itself
(trace.recording_overhead).

Two runs step by step (``first_difference``): the first step whose ``train/weights_digest`` differs, over the steps
both runs logged; equal digests mean bit-identical policies (control/weights/digest.py).
"""

from __future__ import annotations

import csv
import io
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from rolloutpipe.observe.metrics import read_span_files
from rolloutpipe.observe.timeline import read_config_dict, read_metrics, run_mode
from rolloutpipe.observe.trace import recording_overhead

IGNORED_PREFIXES = ("pipeline.mode", "rollout.admission", "seed", "run.", "wandb.", "launcher.")
METRICS = {
    "rollout_to_train_end_s": "perf/rollout_to_train_end_s",
    "trainer_wait_ratio": "perf/trainer_wait_ratio",
    "rollout_s": "perf/rollout_s",
    "train_compute_s": "perf/train_compute_s",
    "ideal_s": "perf/ideal_rollout_to_train_end_s",
}
COLUMNS = ["setting", "mode", "num_runs", "num_steps", *METRICS, "rollout_to_train_end_reduction",
           "wait_ratio_change_pts", "span_overhead_ratio", "eval_pass@1", "eval_step"]


@dataclass(kw_only=True, slots=True)
class RunSummary:
    run_dir: Path
    setting: tuple
    """The run's config items that define its setting (see module docstring)."""
    mode: str
    num_steps: int
    means: dict[str, float]
    span_overhead_ratio: float | None
    eval_pass1: float | None = None
    """The last evaluation's ``eval/<set>/pass@1``, averaged over its sets (None: the run did not evaluate)."""
    eval_step: int | None = None


def find_runs(paths: list[Path]) -> list[Path]:
    found: set[Path] = set()
    for path in paths:
        candidates = [path, *path.rglob("*")] if path.is_dir() else []
        found.update(p for p in candidates if (p / "metrics.jsonl").is_file() and (p / "config.yaml").is_file())
    return sorted(found)


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):  # eval.sets: eval.sets.0.name
            flat.update(flatten({str(i): v for i, v in enumerate(value)}, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return flat


def summarise_run(run_dir: Path, *, skip_steps: int = 1, stat: str = "mean") -> RunSummary | None:
    """``stat``: ``mean`` or ``median`` over the run's kept steps."""
    config = read_config_dict(run_dir)
    records = [r for _, r in sorted(read_metrics(run_dir).items())]
    if not records:
        return None
    kept = records[skip_steps:] if len(records) > skip_steps else records
    reduce = {"mean": statistics.fmean, "median": statistics.median}[stat]
    setting = tuple(sorted((k, v) for k, v in flatten(config).items()
                           if not k.startswith(IGNORED_PREFIXES)))
    overheads = recording_overhead(read_span_files(run_dir)) if (run_dir / "spans").is_dir() else []
    evaluated = [r for r in records if any(k.startswith("eval/") and k.endswith("/pass@1") for k in r)]
    last_eval = evaluated[-1] if evaluated else {}
    pass1 = [v for k, v in last_eval.items() if k.startswith("eval/") and k.endswith("/pass@1")]
    return RunSummary(
        eval_pass1=statistics.fmean(pass1) if pass1 else None, eval_step=last_eval.get("step"),
        run_dir=run_dir, setting=setting, mode=run_mode(config), num_steps=len(kept),
        means={name: reduce([r[key] for r in kept]) for name, key in METRICS.items()},
        span_overhead_ratio=max((o.ratio for o in overheads), default=None),
    )


def setting_labels(settings: list[tuple]) -> dict[tuple, str]:
    """``key=value, ...`` of the keys whose values differ between settings; ``default`` when only one."""
    values: dict[str, set] = defaultdict(set)
    for setting in settings:
        for key, value in setting:
            values[key].add(value)
    varying = sorted(k for k, v in values.items() if len(v) > 1)
    labels = {}
    for setting in settings:
        items = dict(setting)
        labels[setting] = ", ".join(f"{k}={items.get(k)}" for k in varying) or "default"
    return labels


def common_settings(summaries: list[RunSummary]) -> dict[Path, tuple]:
    """Each run's setting restricted to the keys every run has: runs made by different versions of
    RolloutPipe (one has a config key the other lacks) are compared on what they share."""
    shared = set.intersection(*({k for k, _ in s.setting} for s in summaries))
    return {s.run_dir: tuple((k, v) for k, v in s.setting if k in shared) for s in summaries}


def build_table(summaries: list[RunSummary]) -> list[dict]:
    """One row per (setting, mode); ``sync`` first within a setting."""
    settings = common_settings(summaries)
    summaries = [replace(s, setting=settings[s.run_dir]) for s in summaries]
    groups: dict[tuple, list[RunSummary]] = defaultdict(list)
    for s in summaries:
        groups[(s.setting, s.mode)].append(s)
    labels = setting_labels(sorted({s.setting for s in summaries}, key=str))
    rows = []
    for (setting, mode), runs in sorted(groups.items(), key=lambda kv: (labels[kv[0][0]], kv[0][1] != "sync",
                                                                      kv[0][1])):
        overheads = [r.span_overhead_ratio for r in runs if r.span_overhead_ratio is not None]
        row = {"setting": labels[setting], "mode": mode, "num_runs": len(runs),
               "num_steps": sum(r.num_steps for r in runs),
               **{name: statistics.fmean(r.means[name] for r in runs) for name in METRICS},
               "rollout_to_train_end_reduction": None, "wait_ratio_change_pts": None,
               "span_overhead_ratio": max(overheads) if overheads else None,
               "eval_pass@1": _mean_or_none([r.eval_pass1 for r in runs]),
               "eval_step": max((r.eval_step for r in runs if r.eval_step is not None), default=None)}
        rows.append(row)
    for row in rows:
        sync = next((r for r in rows if r["setting"] == row["setting"] and r["mode"] == "sync"), None)
        if sync is not None and row is not sync:
            row["rollout_to_train_end_reduction"] = 1 - row["rollout_to_train_end_s"] / sync["rollout_to_train_end_s"]
            row["wait_ratio_change_pts"] = 100 * (row["trainer_wait_ratio"] - sync["trainer_wait_ratio"])
    return rows


def to_markdown(rows: list[dict]) -> str:
    header = ["setting", "mode", "runs", "steps", "rollout->train-end (s)", "trainer waiting", "rollout (s)",
              "train compute (s)", "ideal (s)", "reduction vs sync", "waiting vs sync", "span overhead",
              "eval pass@1 (step)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for r in rows:
        cells = [r["setting"], r["mode"], str(r["num_runs"]), str(r["num_steps"]),
                 f"{r['rollout_to_train_end_s']:.3f}", f"{100 * r['trainer_wait_ratio']:.1f}%",
                 f"{r['rollout_s']:.3f}", f"{r['train_compute_s']:.3f}", f"{r['ideal_s']:.3f}",
                 _percent(r["rollout_to_train_end_reduction"]),
                 "" if r["wait_ratio_change_pts"] is None else f"{r['wait_ratio_change_pts']:+.1f} pts",
                 "" if r["span_overhead_ratio"] is None else f"{100 * r['span_overhead_ratio']:.2f}%",
                 "" if r["eval_pass@1"] is None else f"{r['eval_pass@1']:.3f} ({r['eval_step']})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _mean_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


DIGEST = "train/weights_digest"


@dataclass(kw_only=True, slots=True)
class DigestComparison:
    """Two runs' weights digests, step by step."""

    common_steps: list[int]
    """The steps both runs logged a digest for, in order."""
    first_difference: int | None
    """The first of ``common_steps`` whose digests differ (None: they agree at every one)."""
    digests: tuple[str, str] | None
    """Run A's and run B's digest at ``first_difference``."""
    steps: tuple[list[int], list[int]]
    """The steps each run logged a digest for."""


def run_digests(run_dir: Path) -> dict[int, str]:
    """Step -> ``train/weights_digest`` of a run's metrics.jsonl; raises ValueError with the reason if it has none."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: not a run directory")
    digests = {step: r[DIGEST] for step, r in read_metrics(run_dir).items() if DIGEST in r}
    if not digests:
        raise ValueError(f"{run_dir}/metrics.jsonl logs no {DIGEST} (a run from before weights digests, or a "
                         "simulated one): it cannot be compared step by step")
    return digests


def first_difference(run_a: Path, run_b: Path) -> DigestComparison:
    a, b = run_digests(run_a), run_digests(run_b)
    common = sorted(a.keys() & b.keys())
    if not common:
        raise ValueError(f"{run_a} logged digests at steps {_steps(sorted(a))} and {run_b} at {_steps(sorted(b))}: "
                         "no step in common")
    differ = next((step for step in common if a[step] != b[step]), None)
    return DigestComparison(common_steps=common, first_difference=differ,
                            digests=None if differ is None else (a[differ], b[differ]), steps=(sorted(a), sorted(b)))


def describe_difference(comparison: DigestComparison, run_a: Path, run_b: Path) -> str:
    """What ``tools/report.py --first-difference`` prints."""
    common, differ = comparison.common_steps, comparison.first_difference
    if differ is None:
        line = (f"the weights digests agree at all {len(common)} common steps ({_steps(common)}): the policies are "
                "bit-identical after each")
    else:
        agreed = [s for s in common if s < differ]
        a, b = comparison.digests
        line = (f"first difference at step {differ}: {DIGEST} {a} ({run_a}) vs {b} ({run_b}); "
                + (f"the {len(agreed)} common steps before it agree ({_steps(agreed)})" if agreed
                   else "no common step before it"))
    steps_a, steps_b = comparison.steps
    if steps_a != steps_b:
        line += f"\n(only the common steps are compared: {run_a} logged {_steps(steps_a)}, {run_b} {_steps(steps_b)})"
    return line + "\n"


def _steps(steps: list[int]) -> str:
    """``0-29``, or the list where steps are missing."""
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
