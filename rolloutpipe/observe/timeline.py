"""The timeline picture: a Gantt of a few RL steps of one or several runs (matplotlib, imported when drawing).

One panel per run, stacked, on one time scale (seconds from the first drawn step's first admission), so
the panel of a faster schedule is visibly shorter. Lanes, top to bottom:

    engine<i>       requests running on the engine (filled, 0 .. the engine's peak) and weight loads
    groups          a tick per complete group (colour: step), a cross per dropped group
    dispatcher      a tick per published group
    trainer <r>     forward/backward and optimizer steps; weight sync; idle time shaded: every moment of the
                    step's window (first admission -> last optimizer step) the rank is not computing, which
                    is what perf/trainer_wait_ratio counts

The title gives the drawn steps' mean perf/rollout_to_train_end_s and perf/trainer_wait_ratio from
metrics.jsonl; each step's own values are written above it.

``finish_run`` is the end of a run on trainer rank 0: merge the trace (trace.py), draw this picture, hand both to
the W&B tracker (tracking.py).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from rolloutpipe.observe.metrics import read_spans
from rolloutpipe.observe.trace import (
    FORWARD_BACKWARD,
    GROUP_COMPLETE,
    GROUP_DROPPED,
    OPTIMIZER_STEP,
    PUBLISH,
    REQUEST,
    SYNC_WEIGHTS,
    engines_by_host,
    merge_run,
)
from rolloutpipe.types import Span

COLORS = {
    "engine": "#4c9a5b", "weights": "#8e6bbf", "forward_backward": "#3b6fb6", "optimizer_step": "#173f7a",
    "idle": "#f2b8b5", "publish": "#d08a2e", "step_a": "#2d7d46", "step_b": "#b5651d", "dropped": "#c0392b",
}


@dataclass(kw_only=True, slots=True)
class RunTimeline:
    """What the picture needs of one run."""

    label: str
    mode: str
    """``pipeline.mode``, with ``+fgd`` when admission is frontier-group dispatch."""
    spans: list[Span]
    metrics: dict[int, dict]
    """metrics.jsonl records by step."""


def run_mode(config: dict) -> str:
    """``sync``, ``cgp``, ``cgp+fgd``, ...: the schedule a run used, from its config.yaml."""
    mode = str(config.get("pipeline", {}).get("mode", "?"))
    admission = str(config.get("rollout", {}).get("admission", "fifo"))
    return mode if admission == "fifo" else f"{mode}+{admission}"


def read_config_dict(run_dir: Path) -> dict:
    import yaml

    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.exists() else {}


def read_metrics(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["step"]: r for r in records}


def load_run(run_dir: Path, *, label: str | None = None, spans: list[Span] | None = None) -> RunTimeline:
    mode = run_mode(read_config_dict(run_dir))
    return RunTimeline(label=label or mode, mode=mode, spans=read_spans(run_dir) if spans is None else spans,
                       metrics=read_metrics(run_dir))


def default_steps(run: RunTimeline, num_steps: int = 3) -> list[int]:
    """Up to ``num_steps`` steps after step 0 (which includes start-up), or step 0 alone in a 1-step run."""
    steps = sorted({s.step for s in run.spans if s.name == OPTIMIZER_STEP})
    later = steps[1:] or steps
    return later[:num_steps]


def step_windows(spans: list[Span], steps: list[int]) -> dict[int, tuple[float, float]]:
    """Each step's window: its first admission to the end of its last optimizer step."""
    windows = {}
    for step in steps:
        admitted = [s.start_s - s.attrs.get("queued_s", 0.0) for s in spans if s.name == REQUEST and s.step == step]
        trained = [s.end_s for s in spans if s.name == OPTIMIZER_STEP and s.step == step]
        if admitted and trained:
            windows[step] = (min(admitted), max(trained))
    return windows


def draw_timeline(runs: list[RunTimeline], out: Path, *, steps: list[int] | None = None,
                  formats: tuple[str, ...] = ("png",), title: str | None = None) -> list[Path]:
    """Draw ``runs`` (one panel each) and write ``out`` with each suffix of ``formats``; returns the paths."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = []
    for run in runs:
        run_steps = steps or default_steps(run)
        windows = step_windows(run.spans, run_steps)
        if not windows:
            raise ValueError(f"{run.label}: no complete step among {run_steps} in its spans")
        panels.append((run, windows))
    span_s = max(max(end for _, end in w.values()) - min(start for start, _ in w.values()) for _, w in panels)
    heights = [len(_lanes_of(run.spans)) * 0.42 + 1.1 for run, _ in panels]
    fig = Figure(figsize=(12, sum(heights) + 0.9), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (run, windows) in zip(axes, panels):
        _draw_panel(ax, run, windows, span_s)
    axes[-1].set_xlabel("seconds from the first drawn step's first admission (run clock)")
    legend = [Patch(color=COLORS["engine"], alpha=0.6, label="engine: running requests"),
              Patch(color=COLORS["weights"], label="weight sync / load"),
              Patch(color=COLORS["forward_backward"], label="forward/backward"),
              Patch(color=COLORS["optimizer_step"], label="optimizer step"),
              Patch(color=COLORS["idle"], label="trainer idle (waiting)"),
              Patch(color=COLORS["publish"], label="group published")]
    fig.legend(handles=legend, loc="outside lower center", ncols=6, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    paths = []
    for fmt in formats:
        path = out.with_suffix(f".{fmt}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: small and searchable
            fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _lanes_of(spans: list[Span]) -> list[str]:
    engines = list(engines_by_host(spans))  # grouped by host when the engines span several rollout nodes
    ranks = sorted({s.rank for s in spans if s.role == "trainer"})
    return [*engines, "groups", "dispatcher", *(f"trainer {r}" for r in ranks)]


def _draw_panel(ax, run: RunTimeline, windows: dict[int, tuple[float, float]], span_s: float) -> None:
    t0 = min(start for start, _ in windows.values())
    t1 = max(end for _, end in windows.values())
    lanes = _lanes_of(run.spans)
    y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}  # top to bottom
    pad = 0.02 * span_s
    shown = [s for s in run.spans if s.end_s >= t0 - pad and s.start_s <= t1 + pad]
    step_color = {step: COLORS["step_a"] if i % 2 == 0 else COLORS["step_b"] for i, step in enumerate(sorted(windows))}

    def bar(lane: str, start: float, end: float, color: str, height: float = 0.7, **kw) -> None:
        ax.broken_barh([(start - t0, max(end - start, span_s * 1e-4))], (y[lane] - height / 2, height),
                       facecolors=color, **kw)

    engines = lanes[: lanes.index("groups")]
    peaks: dict[str, int] = {}
    for engine in engines:
        requests = [s for s in run.spans if s.name == REQUEST and s.attrs.get("engine", "") == engine]
        if not requests:
            continue
        peak = _peak_running(requests)
        xs, ys = _running(requests, t0 - pad, t1 + pad)
        ax.fill_between([x - t0 for x in xs], y[engine] - 0.38, [y[engine] - 0.38 + 0.76 * v / peak for v in ys],
                        step="post", color=COLORS["engine"], alpha=0.6, linewidth=0)
        peaks[engine] = peak
    for s in shown:
        if s.name == SYNC_WEIGHTS and s.role == "rollout":
            for engine in engines:
                bar(engine, s.start_s, s.end_s, COLORS["weights"])
        elif s.name == GROUP_COMPLETE:
            ax.vlines(s.start_s - t0, y["groups"] - 0.35, y["groups"] + 0.35, color=step_color.get(s.step, "#777"),
                      linewidth=1.0)
        elif s.name == GROUP_DROPPED:
            ax.plot([s.end_s - t0], [y["groups"]], marker="x", color=COLORS["dropped"], markersize=4)
        elif s.name == PUBLISH:
            bar("dispatcher", s.start_s, s.end_s, COLORS["publish"], height=0.5)
        elif s.role == "trainer" and s.name in (FORWARD_BACKWARD, OPTIMIZER_STEP, SYNC_WEIGHTS):
            color = {FORWARD_BACKWARD: "forward_backward", OPTIMIZER_STEP: "optimizer_step",
                     SYNC_WEIGHTS: "weights"}[s.name]
            bar(f"trainer {s.rank}", s.start_s, s.end_s, COLORS[color], edgecolor="white", linewidth=0.3)
    for lane in lanes:
        if not lane.startswith("trainer"):
            continue
        rank = int(lane.split()[1])
        compute = [(s.start_s, s.end_s) for s in run.spans
                   if s.role == "trainer" and s.rank == rank and s.name in (FORWARD_BACKWARD, OPTIMIZER_STEP)]
        for start, end in windows.values():
            for gap_start, gap_end in _gaps(compute, start, end):
                bar(lane, gap_start, gap_end, COLORS["idle"], height=0.8, zorder=0)

    for step, (start, end) in sorted(windows.items()):
        ax.axvline(start - t0, color="#999", linestyle=":", linewidth=0.8)
        record = run.metrics.get(step)
        note = f"step {step}"
        if record:
            note += (f": {record['perf/rollout_to_train_end_s']:.2f} s, "
                     f"wait {100 * record['perf/trainer_wait_ratio']:.0f}%")
        ax.text(start - t0, len(lanes) - 0.45, note, fontsize=7, va="bottom", ha="left", color="#333")
    hosts = engines_by_host(run.spans)
    ax.set_yticks([y[lane] for lane in lanes],
                  [f"{lane}{' on ' + hosts[lane] if hosts.get(lane) else ''}\n(peak {peaks[lane]} running)"
                   if lane in peaks else lane for lane in lanes], fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.1)
    ax.set_xlim(-pad, span_s + 2 * pad)
    ax.grid(axis="x", color="#eee", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(_panel_title(run, sorted(windows)), fontsize=9, loc="left")


def _panel_title(run: RunTimeline, steps: list[int]) -> str:
    records = [run.metrics[s] for s in steps if s in run.metrics]
    label = run.label if run.label == run.mode else f"{run.label} ({run.mode})"
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    if not records:
        return f"{label}, {where}"
    end_s = sum(r["perf/rollout_to_train_end_s"] for r in records) / len(records)
    wait = sum(r["perf/trainer_wait_ratio"] for r in records) / len(records)
    return f"{label}, {where}: rollout->train-end {end_s:.2f} s, trainer waiting {100 * wait:.0f}% (mean)"


def _running(requests: list[Span], lo: float, hi: float) -> tuple[list[float], list[int]]:
    """The number of running requests as a step function over [lo, hi]."""
    changes = sorted([(s.start_s, 1) for s in requests] + [(s.end_s, -1) for s in requests])
    xs, ys, running = [lo], [0], 0
    for t, delta in changes:
        running += delta
        if t < lo:
            ys[0] = running
        elif t <= hi:
            xs.append(t)
            ys.append(running)
    xs.append(hi)
    ys.append(running)
    return xs, ys


def _peak_running(requests: list[Span]) -> int:
    changes = sorted([(s.start_s, 1) for s in requests] + [(s.end_s, -1) for s in requests])
    peak = running = 0
    for _, delta in changes:
        running += delta
        peak = max(peak, running)
    return max(peak, 1)


def _gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """Parts of [start, end] covered by no interval of ``busy``."""
    gaps, cursor = [], start
    for b_start, b_end in sorted(busy):
        if b_end <= cursor or b_start >= end:
            continue
        if b_start > cursor:
            gaps.append((cursor, b_start))
        cursor = max(cursor, b_end)
    if cursor < end:
        gaps.append((cursor, end))
    return gaps


def finish_run(run_dir: Path, tracker=None, *, draw: bool = True) -> None:
    """Merge the trace, draw the picture (``draw``: run.draw_timeline), hand both to the tracker. Never raises: the
    run's work is done."""
    try:
        merged = merge_run(run_dir)
    except Exception as err:  # noqa: BLE001 - a broken trace must not fail a finished run
        print(f"warning: could not merge the spans of {run_dir} into trace.json: {type(err).__name__}: {err}",
              file=sys.stderr)
        merged = None
    picture = None
    if merged is not None and draw:
        try:
            picture = run_dir / "timeline.png"
            draw_timeline([load_run(run_dir, spans=merged.spans)], picture)
        except ImportError:
            picture = None  # matplotlib is optional (pip install rolloutpipe[viz])
        except Exception as err:  # noqa: BLE001
            print(f"warning: could not draw {run_dir / 'timeline.png'}: {type(err).__name__}: {err}", file=sys.stderr)
            picture = None
    if tracker is not None:
        tracker.finish(merged, picture)
