"""Timelines of real runs: spans well formed on one clock, the Perfetto trace, group lifecycles, the picture,
the offline W&B run, and the report over two runs (sync and cgp of the small workload, W&B offline)."""

from __future__ import annotations

import csv
import json
import math
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from rolloutpipe.observe.metrics import read_span_files
from rolloutpipe.observe.trace import (
    FORWARD_BACKWARD,
    GROUP_COMPLETE,
    OPTIMIZER_STEP,
    PUBLISH,
    REQUEST,
    REWARD,
    SYNC_WEIGHTS,
    WAIT,
)
from rolloutpipe.observe.tracking import SPAN_COLUMNS
from tests.conftest import REPO, SMALL, node_environ, read_metrics, run_job

pytestmark = pytest.mark.multiprocess

NUM_STEPS, NUM_GROUPS, NUM_SAMPLES = 2, 4, 4  # SMALL


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("timeline")
    dirs = {}
    for mode in ("sync", "cgp"):
        run_dir = base / mode
        draw = f"run.draw_timeline={mode == 'cgp'}"  # the picture of cgp's run only
        result = run_job(run_dir, *SMALL, f"pipeline.mode={mode}", "wandb.mode=offline", draw)
        assert result.returncode == 0, result.stderr[-3000:]
        dirs[mode] = run_dir
    return dirs


def test_every_span_is_closed_and_on_the_store_hosts_clock(runs):
    for run_dir in runs.values():
        files = {f.path.stem: f for f in read_span_files(run_dir)}
        assert set(files) == {"rollout-0", "trainer-0"}
        assert files["rollout-0"].header["clock"]["offset_s"] == 0.0  # the store host is the reference
        trainer_clock = files["trainer-0"].header["clock"]
        assert trainer_clock["reference"] == "store host" and trainer_clock["num_rounds"] > 0
        assert 0 < trainer_clock["rtt_s"] < 0.5 and abs(trainer_clock["offset_s"]) < 0.05  # one machine
        spans = [s for f in files.values() for s in f.spans]
        for s in spans:
            assert math.isfinite(s.start_s) and math.isfinite(s.end_s), s
            assert s.end_s >= s.start_s, s
        names = {s.name for s in spans}
        assert {REQUEST, REWARD, GROUP_COMPLETE, PUBLISH, WAIT, FORWARD_BACKWARD, OPTIMIZER_STEP,
                SYNC_WEIGHTS} <= names
        assert sum(s.name == REQUEST for s in spans) == NUM_STEPS * NUM_GROUPS * NUM_SAMPLES
        assert sum(s.name == GROUP_COMPLETE for s in spans) == NUM_STEPS * NUM_GROUPS


def test_merged_trace_is_chrome_trace_json_with_a_lane_per_engine_dispatcher_and_trainer_rank(runs):
    trace = json.loads((runs["cgp"] / "trace.json").read_text())
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms" and events
    assert {e["ph"] for e in events} <= {"M", "X", "i", "C"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"engine0", "rollout manager", "trainer rank 0", "group lifecycle"} <= set(processes.values())
    manager = next(pid for pid, name in processes.items() if name == "rollout manager")
    assert {"dispatcher", "groups", "reward"} <= {name for (pid, _), name in threads.items() if pid == manager}

    lanes: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in events:
        if e["ph"] in ("X", "i"):
            assert isinstance(e["ts"], (int, float)) and e["name"] and (e["pid"], e["tid"]) in threads
            assert e["ph"] == "i" or e["dur"] >= 0
            lanes[(e["pid"], e["tid"])].append(e)
    for lane, lane_events in lanes.items():
        times = [e["ts"] for e in lane_events]
        assert times == sorted(times), f"lane {threads[lane]} is not sorted by time"
        ends: list[float] = []  # open complete events: each new one must nest inside or follow them
        for e in (e for e in lane_events if e["ph"] == "X"):
            while ends and ends[-1] <= e["ts"] + 1e-3:
                ends.pop()
            assert not ends or e["ts"] + e["dur"] <= ends[-1] + 1e-3, f"overlap in lane {threads[lane]}: {e}"
            ends.append(e["ts"] + e["dur"])


def test_every_group_has_a_lifecycle_from_admission_to_its_optimizer_step(runs):
    for mode, run_dir in runs.items():
        lives = [json.loads(line) for line in (run_dir / "lifecycle.jsonl").read_text().splitlines()]
        assert [(g["step"], g["group"]) for g in lives] == [(k, g) for k in range(NUM_STEPS) for g in range(NUM_GROUPS)]
        for g in lives:
            assert g["state"] == "trained" and g["engine"] == "engine0", (mode, g)
            assert g["policy_version_admitted"] == g["policy_version_trained"] == g["step"]
            order = [g["admitted_s"], g["generated_s"], g["rewarded_s"], g["complete_s"], g["published_s"]]
            assert order == sorted(order), (mode, g)
            # consumed is a trainer-side time: it may precede the dispatcher's own end of publish by microseconds
            assert g["complete_s"] <= g["consumed_s"] <= g["trained_s"] and g["published_s"] <= g["trained_s"]


def test_timeline_picture_of_both_runs_is_written_as_png_and_svg(runs, tmp_path):
    assert (runs["cgp"] / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn at the end of the run
    assert (runs["sync"] / "trace.json").is_file() and not (runs["sync"] / "timeline.png").exists()  # not drawn
    out = tmp_path / "sync_vs_cgp"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "timeline.py"), str(runs["sync"]), str(runs["cgp"]),
                             "--out", str(out), "--steps", "0-1"], env=node_environ(), capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    png, svg = out.with_suffix(".png"), out.with_suffix(".svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = svg.read_text()
    assert "<svg" in text and "trainer waiting" in text and "rollout-&gt;train-end" in text


def _wandb_records(path: Path) -> list:
    """Records of a W&B transaction log (LevelDB log format: 32 KiB blocks of crc, length, type, data)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks, partial = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            partial += chunk
        elif kind == 4:
            chunks.append(partial + chunk)
            partial = b""
    return [wandb_internal_pb2.Record.FromString(c) for c in chunks]


def test_offline_wandb_run_holds_the_step_scalars_and_the_span_table(runs):
    run_dir = runs["cgp"]
    [wandb_dir] = (run_dir / "wandb").glob("offline-run-*")
    history = {}
    for record in _wandb_records(next(wandb_dir.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items
    for m in read_metrics(run_dir):
        logged = history[m["step"]]
        for key in ("perf/trainer_wait_ratio", "perf/rollout_to_train_end_s", "rollout/reward_mean", "train/loss"):
            assert logged[key] == pytest.approx(m[key], rel=1e-12), key

    [spans_table] = (wandb_dir / "files" / "media" / "table" / "timeline").glob("spans_*.table.json")
    table = json.loads(spans_table.read_text())
    assert table["columns"] == SPAN_COLUMNS
    num_spans = sum(len(f.spans) for f in read_span_files(run_dir))
    assert len(table["data"]) == num_spans
    assert {row[0] for row in table["data"]} >= {REQUEST, WAIT, FORWARD_BACKWARD, OPTIMIZER_STEP}
    assert list((wandb_dir / "files" / "media" / "table" / "timeline").glob("gantt_table_*.table.json"))
    assert list((wandb_dir / "files" / "media" / "images" / "timeline").glob("picture_*.png"))


def test_report_tabulates_sync_and_cgp_with_the_reduction_vs_sync(runs, tmp_path):
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "report.py"), str(runs["sync"].parent), "--out",
                             str(out)], env=node_environ(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "| default | sync |" in result.stdout and "| default | cgp |" in result.stdout
    rows = {r["mode"]: r for r in csv.DictReader(out.with_suffix(".csv").open())}
    assert set(rows) == {"sync", "cgp"}
    step1 = {mode: read_metrics(run_dir)[1] for mode, run_dir in runs.items()}  # step 0 is left out as warm-up
    for mode in ("sync", "cgp"):
        assert float(rows[mode]["rollout_to_train_end_s"]) == pytest.approx(step1[mode]["perf/rollout_to_train_end_s"])
        assert float(rows[mode]["trainer_wait_ratio"]) == pytest.approx(step1[mode]["perf/trainer_wait_ratio"])
        assert 0 < float(rows[mode]["span_overhead_ratio"]) < 0.5
    expected = 1 - step1["cgp"]["perf/rollout_to_train_end_s"] / step1["sync"]["perf/rollout_to_train_end_s"]
    assert float(rows["cgp"]["rollout_to_train_end_reduction"]) == pytest.approx(expected)
    assert rows["sync"]["rollout_to_train_end_reduction"] == ""
    assert out.with_suffix(".md").read_text().startswith("| setting | mode |")
