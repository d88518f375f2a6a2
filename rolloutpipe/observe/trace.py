"""The run's timeline: per-process span files merged into a Chrome/Perfetto trace and per-group lifecycles.

At the end of a run, trainer rank 0 calls ``merge_run`` through ``timeline.finish_run`` (``python -m
rolloutpipe.observe.trace RUN_DIR`` merges afterwards, e.g. for a run that crashed). It writes into the run directory:

    trace.json       Chrome trace format (open in ui.perfetto.dev or chrome://tracing): one process per
                     engine (a step lane, its requests packed into slot lanes, a running-requests counter),
                     the rollout manager (main, groups, dispatcher, reward slots), one per trainer rank,
                     and the group lifecycles (one bar per group, admitted -> trained or dropped)
    lifecycle.jsonl  one GroupLifecycle per group
    timeline.png     the timeline picture of a few steps (timeline.py), when matplotlib is installed

and hands spans, lifecycles and picture to the W&B tracker (tracking.py), if one is open.

Why the merge is complete when trainer rank 0 runs it: the rollout flushes a step's spans before it
publishes the step's stats, which rank 0 waits for; the other trainer ranks flush before the final
barrier. Nothing is re-timed here: spans are already on the run's clock (control/clock.py).

Lifecycles are derived from spans, so recording costs nothing extra: admitted is the first request's
submission (``start - queued_s`` of ``rollout/request``), generated the last request's end, rewarded
the last ``rollout/reward``, complete ``rollout/group_complete``, published ``dispatch/publish``,
consumed the first ``train/wait`` that returned its handle, trained the end of the
``train/optimizer_step`` whose ``groups`` (or ``batch``) holds it. A group is dropped when a
``rollout/group_dropped`` span says so, when its requests were aborted, or when it completed but its
step trained without it (filtered).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from rolloutpipe.observe.metrics import SPAN_FLUSH, SpanFile, read_span_files
from rolloutpipe.types import GroupLifecycle, LifecycleState, Span

REQUEST, REWARD, GROUP_COMPLETE, GROUP_DROPPED = (
    "rollout/request", "rollout/reward", "rollout/group_complete", "rollout/group_dropped")
PUBLISH, WAIT, FORWARD_BACKWARD, OPTIMIZER_STEP, SYNC_WEIGHTS = (
    "dispatch/publish", "train/wait", "train/forward_backward", "train/optimizer_step", "sync/weights")
COMPUTE = (FORWARD_BACKWARD, OPTIMIZER_STEP)

_ENGINE_PID, _ROLLOUT_PID, _TRAINER_PID, _LIFECYCLE_PID = 1, 100, 200, 1000


# ------------------------------------------------------------------------------------------------
# Group lifecycles
# ------------------------------------------------------------------------------------------------
def group_lifecycles(spans: Iterable[Span]) -> list[GroupLifecycle]:
    """One record per (step, group) seen in the spans (see module docstring for the rules)."""
    lives: dict[tuple[int, int], GroupLifecycle] = {}
    engines: dict[tuple[int, int], set[str]] = defaultdict(set)
    aborted_s: dict[tuple[int, int], float] = {}
    trained: list[Span] = []

    def life(step: int, group: int) -> GroupLifecycle:
        key = (step, group)
        if key not in lives:
            lives[key] = GroupLifecycle(step=step, group=group, state=LifecycleState.ADMITTED)
        return lives[key]

    for s in spans:
        a = s.attrs
        if s.name == OPTIMIZER_STEP:
            trained.append(s)
        if "group" not in a:
            continue
        key = (s.step, a["group"])
        g = life(*key)
        if s.name == REQUEST:
            admitted = s.start_s - a.get("queued_s", 0.0)
            g.admitted_s = admitted if g.admitted_s is None else min(g.admitted_s, admitted)
            engines[key].add(a.get("engine", ""))
            if a.get("policy_version") is not None:
                g.policy_version_admitted = a["policy_version"]
            if a.get("aborted"):
                aborted_s[key] = max(aborted_s.get(key, s.end_s), s.end_s)
            else:
                g.generated_s = _later(g.generated_s, s.end_s)
        elif s.name == REWARD:
            g.rewarded_s = _later(g.rewarded_s, s.end_s)
        elif s.name == GROUP_COMPLETE:
            g.complete_s = s.start_s
        elif s.name == GROUP_DROPPED:
            g.dropped_s, g.drop_reason = s.end_s, str(a.get("reason", "filtered"))
        elif s.name == PUBLISH:
            g.published_s = s.end_s
            g.batch = a.get("batch", g.batch)
        elif s.name == WAIT:
            g.consumed_s = s.end_s if g.consumed_s is None else min(g.consumed_s, s.end_s)

    for s in trained:
        if "groups" in s.attrs:
            members = [lives[(s.step, g)] for g in s.attrs["groups"] if (s.step, g) in lives]
        else:
            members = [g for g in lives.values() if g.step == s.step and g.batch is not None
                       and g.batch == s.attrs.get("batch")]
        for g in members:
            g.trained_s = _later(g.trained_s, s.end_s)
            g.policy_version_trained = s.attrs.get("policy_version", g.policy_version_trained)

    steps_trained = {g.step for g in lives.values() if g.trained_s is not None}
    for key, g in lives.items():
        g.engine = ",".join(sorted(engines[key] - {""}))
        if g.dropped_s is None and key in aborted_s and g.trained_s is None:
            g.dropped_s, g.drop_reason = aborted_s[key], "aborted"
        elif (g.dropped_s is None and g.complete_s is not None and g.published_s is None
              and g.step in steps_trained):
            g.dropped_s, g.drop_reason = g.complete_s, "filtered"
        g.state = _state(g)
    return sorted(lives.values(), key=lambda g: (g.step, g.group))


def _later(current: float | None, t: float) -> float:
    return t if current is None else max(current, t)


def _state(g: GroupLifecycle) -> LifecycleState:
    if g.dropped_s is not None:
        return LifecycleState.DROPPED
    reached = [(g.trained_s, LifecycleState.TRAINED), (g.consumed_s, LifecycleState.CONSUMED),
               (g.published_s, LifecycleState.PUBLISHED), (g.complete_s, LifecycleState.COMPLETE),
               (g.rewarded_s, LifecycleState.REWARDED), (g.generated_s, LifecycleState.GENERATED)]
    return next((state for t, state in reached if t is not None), LifecycleState.ADMITTED)


def lifecycle_record(g: GroupLifecycle) -> dict:
    record = asdict(g)
    record["state"] = g.state.value
    return record


# ------------------------------------------------------------------------------------------------
# Chrome / Perfetto trace
# ------------------------------------------------------------------------------------------------
def pack(intervals: list[tuple[float, float]]) -> list[int]:
    """Slot of each interval such that intervals in one slot never overlap (greedy, by start time)."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    ends: list[float] = []
    slots = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        slot = next((j for j, e in enumerate(ends) if e <= start), len(ends))
        if slot == len(ends):
            ends.append(end)
        else:
            ends[slot] = end
        slots[i] = slot
    return slots


@dataclass(kw_only=True, slots=True)
class _Lane:
    pid: int
    process: str
    thread: str
    spans: list[Span]


def engines_by_host(spans: list[Span]) -> dict[str, str]:
    """Every engine of the run's request spans and its host (empty on one rollout node), ordered host by host, and
    by index within a host (engine2 before engine10)."""
    hosts = {s.attrs.get("engine", ""): s.attrs.get("host", "") for s in spans if s.name == REQUEST}

    def order(engine: str) -> tuple:
        digits = "".join(c for c in engine.removeprefix("engine").split("-")[0] if c.isdigit())
        return hosts[engine], int(digits or 0), engine

    return {engine: hosts[engine] for engine in sorted(hosts, key=order)}


def _lanes(spans: list[Span]) -> list[_Lane]:
    """Which process and thread of the trace each span belongs to (see module docstring)."""
    engines = engines_by_host(spans)
    by_lane: dict[tuple[int, str, str], list[Span]] = defaultdict(list)
    for s in spans:
        if s.name == REQUEST:
            engine = s.attrs.get("engine", "")
            pid = _ENGINE_PID + list(engines).index(engine)
            name = engine or "engine"
            lane = (pid, f"{name} on {engines[engine]}" if engines[engine] else name, "slot")
        elif s.role == "trainer":
            lane = (_TRAINER_PID + s.rank, f"trainer rank {s.rank}", "main")
        else:
            thread = {REWARD: "reward", GROUP_COMPLETE: "groups", GROUP_DROPPED: "groups", PUBLISH: "dispatcher",
                      SYNC_WEIGHTS: "main", SPAN_FLUSH: "main"}.get(s.name, s.name)
            suffix = f" rank {s.rank}" if s.rank else ""
            lane = (_ROLLOUT_PID + s.rank, f"rollout manager{suffix}", thread)
        by_lane[lane].append(s)
    return [_Lane(pid=pid, process=process, thread=thread, spans=lane_spans)
            for (pid, process, thread), lane_spans in sorted(by_lane.items(), key=lambda kv: kv[0])]


def chrome_trace(files: list[SpanFile], lifecycles: list[GroupLifecycle]) -> dict:
    """The Chrome trace format (JSON object form) of a run: see the module docstring for the lanes."""
    spans = [s for f in files for s in f.spans]
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(s.start_s for s in spans)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events: list[dict] = []
    meta: list[dict] = []
    tids: dict[int, int] = defaultdict(int)

    def thread(pid: int, process: str, name: str) -> int:
        if pid not in tids:
            meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
            meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        tids[pid] += 1
        tid = tids[pid]
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        return tid

    def emit(pid: int, tid: int, name: str, start: float, end: float, args: dict) -> None:
        if end > start:
            events.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": us(start),
                           "dur": round((end - start) * 1e6, 3), "args": args})
        else:
            events.append({"ph": "i", "s": "t", "name": name, "pid": pid, "tid": tid, "ts": us(start), "args": args})

    for lane in _lanes(spans):
        if lane.thread == "slot":  # an engine: its steps, then its requests packed into slots, and a counter
            steps_tid = thread(lane.pid, lane.process, "steps")
            by_step: dict[int, list[Span]] = defaultdict(list)
            for s in lane.spans:
                by_step[s.step].append(s)
            for step, step_spans in sorted(by_step.items()):
                emit(lane.pid, steps_tid, f"step={step}", min(s.start_s for s in step_spans),
                     max(s.end_s for s in step_spans), {"num_requests": len(step_spans)})
            changes = sorted([(s.start_s, 1) for s in lane.spans] + [(s.end_s, -1) for s in lane.spans])
            running = 0
            for t, delta in changes:
                running += delta
                events.append({"ph": "C", "name": "running requests", "pid": lane.pid, "tid": 0, "ts": us(t),
                               "args": {"requests": running}})
        slots = pack([(s.start_s, s.end_s) for s in lane.spans])
        if lane.thread == "slot":
            names = [f"slot {j}" for j in range(max(slots) + 1)]
        else:  # a lane of one thread needs one slot; overlapping spans (reward threads) get more
            names = [lane.thread if j == 0 else f"{lane.thread} #{j + 1}" for j in range(max(slots) + 1)]
        slot_tids = [thread(lane.pid, lane.process, name) for name in names]
        for s, slot in zip(lane.spans, slots):
            name = _event_name(s)
            emit(lane.pid, slot_tids[slot], name, s.start_s, s.end_s, {"step": s.step, **s.attrs})

    lives = [g for g in lifecycles if g.admitted_s is not None]
    ends = [_life_end(g) for g in lives]
    slots = pack([(g.admitted_s, end) for g, end in zip(lives, ends)]) if lives else []
    life_tids = [thread(_LIFECYCLE_PID, "group lifecycle", f"groups {j}") for j in range(max(slots, default=-1) + 1)]
    for g, end, slot in zip(lives, ends, slots):
        emit(_LIFECYCLE_PID, life_tids[slot], f"step={g.step}/group={g.group} {g.state.value}", g.admitted_s, end,
             lifecycle_record(g))

    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"]))
    headers = {f.path.stem: f.header for f in files}
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"t0_s": t0, "clock": "store host wall clock (see control/clock.py)", "processes": headers}}


def _event_name(s: Span) -> str:
    a = s.attrs
    if s.name in (REQUEST, REWARD) and "sample" in a:
        return f"step={s.step}/group={a['group']}/sample={a['sample']}"
    if s.name in (GROUP_COMPLETE, GROUP_DROPPED, PUBLISH, WAIT) and "group" in a:
        return f"{s.name} step={s.step}/group={a['group']}"
    return s.name


def _life_end(g: GroupLifecycle) -> float:
    times = [g.admitted_s, g.generated_s, g.rewarded_s, g.complete_s, g.published_s, g.consumed_s, g.trained_s,
             g.dropped_s]
    return max(t for t in times if t is not None)


# ------------------------------------------------------------------------------------------------
# Recording overhead
# ------------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class RecordingOverhead:
    """What recording spans cost one process: CPU time in ``add`` plus in ``flush`` (metrics.SpanRecorder)."""

    process: str
    num_spans: int
    record_s: float
    flush_s: float
    wall_s: float
    """From the process's first span to its last."""

    @property
    def ratio(self) -> float:
        return (self.record_s + self.flush_s) / self.wall_s if self.wall_s > 0 else 0.0


def recording_overhead(files: list[SpanFile]) -> list[RecordingOverhead]:
    result = []
    for f in files:
        flushes = [s for s in f.spans if s.name == SPAN_FLUSH]
        if not f.spans:
            continue
        result.append(RecordingOverhead(
            process=f.path.stem, num_spans=len(f.spans) - len(flushes),
            record_s=sum(s.attrs["record_s"] for s in flushes),
            flush_s=sum(s.attrs.get("cpu_s", s.end_s - s.start_s) for s in flushes),
            wall_s=max(s.end_s for s in f.spans) - min(s.start_s for s in f.spans),
        ))
    return result


# ------------------------------------------------------------------------------------------------
# End of run
# ------------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class MergedRun:
    run_dir: Path
    files: list[SpanFile]
    lifecycles: list[GroupLifecycle]
    trace_path: Path
    lifecycle_path: Path

    @property
    def spans(self) -> list[Span]:
        return sorted((s for f in self.files for s in f.spans), key=lambda s: s.start_s)


def merge_run(run_dir: Path) -> MergedRun:
    """Write ``trace.json`` and ``lifecycle.jsonl`` from the run's span files."""
    files = read_span_files(run_dir)
    lifecycles = group_lifecycles(s for f in files for s in f.spans)
    trace_path, lifecycle_path = run_dir / "trace.json", run_dir / "lifecycle.jsonl"
    trace_path.write_text(json.dumps(chrome_trace(files, lifecycles)))
    lifecycle_path.write_text("".join(json.dumps(lifecycle_record(g)) + "\n" for g in lifecycles))
    return MergedRun(run_dir=run_dir, files=files, lifecycles=lifecycles, trace_path=trace_path,
                     lifecycle_path=lifecycle_path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Merge a run's span files into trace.json and lifecycle.jsonl.")
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        merged = merge_run(run_dir)
        overhead = max(recording_overhead(merged.files), key=lambda o: o.ratio, default=None)
        print(f"{merged.trace_path}: {sum(len(f.spans) for f in merged.files)} spans, {len(merged.lifecycles)} groups"
              + (f"; span recording overhead {100 * overhead.ratio:.2f}% ({overhead.process})" if overhead else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
