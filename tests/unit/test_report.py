"""The report's table: settings told apart by what differs, modes compared with sync, seeds averaged."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rolloutpipe.observe.report import COLUMNS, build_table, find_runs, summarise_run, to_csv, to_markdown
from tests.conftest import REPO


def make_run(path: Path, *, mode: str, batch: int, seed: int, end_s: list[float], wait: list[float],
             admission: str = "fifo") -> Path:
    path.mkdir(parents=True)
    config = {"seed": seed, "rollout_batch_size": batch, "pipeline": {"mode": mode},
              "rollout": {"admission": admission}, "run": {"dir": str(path), "id": path.name}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    with (path / "metrics.jsonl").open("w") as f:
        for step, (e, w) in enumerate(zip(end_s, wait, strict=True)):
            f.write(json.dumps({"step": step, "perf/rollout_to_train_end_s": e, "perf/trainer_wait_ratio": w,
                                "perf/rollout_s": e / 2, "perf/train_compute_s": e / 4,
                                "perf/ideal_rollout_to_train_end_s": e / 3}) + "\n")
    return path


def test_each_setting_compares_its_modes_with_sync_and_averages_seeds(tmp_path):
    sweep = tmp_path / "multirun"
    make_run(sweep / "0", mode="sync", batch=16, seed=1, end_s=[9.0, 2.0, 2.0], wait=[0.9, 0.5, 0.5])
    make_run(sweep / "1", mode="cgp", batch=16, seed=1, end_s=[9.0, 1.5, 1.5], wait=[0.9, 0.3, 0.3])
    make_run(sweep / "2", mode="cgp", batch=16, seed=2, end_s=[9.0, 1.3, 1.3], wait=[0.9, 0.2, 0.2])
    make_run(sweep / "3", mode="cgp", batch=16, seed=1, end_s=[9.0, 1.0, 1.0], wait=[0.9, 0.1, 0.1], admission="fgd")
    make_run(sweep / "4", mode="sync", batch=32, seed=1, end_s=[9.0, 4.0], wait=[0.9, 0.6])
    make_run(sweep / "5", mode="cgp", batch=32, seed=1, end_s=[9.0, 3.0], wait=[0.9, 0.4])
    (sweep / "not-a-run").mkdir()

    runs = find_runs([sweep])
    assert [r.name for r in runs] == ["0", "1", "2", "3", "4", "5"]
    rows = build_table([summarise_run(r, skip_steps=1) for r in runs])
    table = {(r["setting"], r["mode"]): r for r in rows}
    assert list(table) == [("rollout_batch_size=16", "sync"), ("rollout_batch_size=16", "cgp"),
                           ("rollout_batch_size=16", "cgp+fgd"), ("rollout_batch_size=32", "sync"),
                           ("rollout_batch_size=32", "cgp")]
    cgp = table[("rollout_batch_size=16", "cgp")]
    assert (cgp["num_runs"], cgp["num_steps"]) == (2, 4)  # two seeds, steps 1-2 of each
    assert cgp["rollout_to_train_end_s"] == pytest.approx(1.4)
    assert cgp["rollout_to_train_end_reduction"] == pytest.approx(1 - 1.4 / 2.0)
    assert cgp["wait_ratio_change_pts"] == pytest.approx(100 * (0.25 - 0.5))
    assert table[("rollout_batch_size=16", "cgp+fgd")]["rollout_to_train_end_reduction"] == pytest.approx(0.5)
    assert table[("rollout_batch_size=32", "cgp")]["rollout_to_train_end_reduction"] == pytest.approx(0.25)
    assert table[("rollout_batch_size=16", "sync")]["rollout_to_train_end_reduction"] is None

    markdown = to_markdown(rows)
    assert "| rollout_batch_size=16 | cgp | 2 | 4 | 1.400 | 25.0% |" in markdown and "30.0% | -25.0 pts |" in markdown
    parsed = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert list(parsed[0]) == COLUMNS and len(parsed) == 5


def test_a_one_step_run_keeps_its_only_step(tmp_path):
    run = make_run(tmp_path / "r", mode="sync", batch=4, seed=0, end_s=[3.0], wait=[0.7])
    summary = summarise_run(run, skip_steps=1)
    assert summary.num_steps == 1 and summary.means["rollout_to_train_end_s"] == 3.0
    assert summarise_run(run, stat="median").means["trainer_wait_ratio"] == 0.7


def test_the_report_shows_the_last_evaluation(tmp_path):
    from rolloutpipe.observe.report import summarise_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("pipeline:\n  mode: cgp\nrollout:\n  admission: fifo\n")
    records = [{"step": s, "perf/rollout_to_train_end_s": 1.0, "perf/trainer_wait_ratio": 0.5, "perf/rollout_s": 1.0,
                "perf/train_compute_s": 0.5, "perf/ideal_rollout_to_train_end_s": 0.8} for s in range(3)]
    records[0] |= {"eval/a/pass@1": 0.1, "eval/b/pass@1": 0.3}
    records[2] |= {"eval/a/pass@1": 0.5, "eval/b/pass@1": 0.7, "eval/b/pass@4": 0.9}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarise_run(run)
    assert (summary.eval_pass1, summary.eval_step) == (pytest.approx(0.6), 2)
    row = build_table([summary])[0]
    assert row["eval_pass@1"] == pytest.approx(0.6) and "| 0.600 (2) |" in to_markdown([row])
    assert "eval_pass@1" in to_csv([row]).splitlines()[0]


def test_the_report_goes_beside_the_runs_not_into_the_working_directory(tmp_path):
    """tools/report.py without --out: report.md and report.csv in the sweep (or the runs' shared directory)."""
    sweep, elsewhere = tmp_path / "multirun", tmp_path / "cwd"
    make_run(sweep / "0", mode="sync", batch=4, seed=1, end_s=[2.0, 2.0], wait=[0.5, 0.5])
    make_run(sweep / "1", mode="cgp", batch=4, seed=1, end_s=[2.0, 1.0], wait=[0.5, 0.2])
    elsewhere.mkdir()
    tool = [sys.executable, str(REPO / "tools" / "report.py")]
    done = subprocess.run([*tool, str(sweep)], check=False, cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote {sweep / 'report.md'} and {sweep / 'report.csv'}" in done.stdout
    assert "| cgp |" in (sweep / "report.md").read_text() and list(elsewhere.iterdir()) == []
    done = subprocess.run([*tool, str(sweep / "0"), str(sweep / "1")], check=False, cwd=elsewhere,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"wrote {sweep / 'report.md'}" in done.stdout, done.stderr
    assert list(elsewhere.iterdir()) == [] and find_runs([sweep]) == [sweep / "0", sweep / "1"]
