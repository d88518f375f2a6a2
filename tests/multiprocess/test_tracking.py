"""W&B tracking never gets in training's way: it starts in the background, falls back to offline, turns itself off
on errors, and keeps whole steps when a table is too long. One test starts a real (offline) W&B run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.observe.tracking import (
    Tracker,
    WandbConfig,
    WandbMode,
    current_wandb_run_id,
    latest_steps,
    open_tracker,
)
from tests.conftest import DENSE_REWARD, SMALL, read_metrics, run_job, start_nodes


class FakeRun:
    dir = "/nonexistent/wandb/run-x/files"

    def __init__(self, fail_on_log: bool = False) -> None:
        self.logged: list[tuple[dict, int]] = []
        self.finished = threading.Event()
        self.fail_on_log = fail_on_log

    def log(self, data: dict, step: int) -> None:
        if self.fail_on_log:
            raise ConnectionError("W&B went away")
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished.set()


class SlowRun(FakeRun):
    def log(self, data: dict, step: int) -> None:
        time.sleep(0.5)
        super().log(data, step)


def test_logging_a_step_never_waits_for_wandb():
    run = SlowRun()
    tracker = Tracker(lambda: run)
    tracker.wait_started()
    start = time.monotonic()
    for step in range(3):
        tracker.log_step({"step": step, "train/loss": 0.0})
    assert time.monotonic() - start < 0.2
    tracker.finish(None, None)
    assert [step for _, step in run.logged] == [0, 1, 2]


def test_steps_logged_while_the_run_starts_reach_it_in_order():
    run, release = FakeRun(), threading.Event()
    tracker = Tracker(lambda: release.wait(5) and run)
    for step in range(3):
        tracker.log_step({"step": step, "train/loss": -step})  # returns at once: the run is still starting
    assert run.logged == []
    release.set()
    tracker.wait_started()
    tracker.log_step({"step": 3, "train/loss": -3})
    tracker.finish(None, None)
    assert run.logged == [({"train/loss": -s}, s) for s in range(4)]
    assert run.finished.is_set()


def test_a_logging_error_warns_once_and_turns_tracking_off(capsys):
    run = FakeRun(fail_on_log=True)
    tracker = Tracker(lambda: run)
    tracker.wait_started()
    tracker.log_step({"step": 0, "train/loss": 0.5})
    tracker.log_step({"step": 1, "train/loss": 0.4})
    tracker.finish(None, None)
    assert capsys.readouterr().err.count("W&B is off for the rest of this run") == 1
    assert run.finished.wait(5) and tracker.run is None


def test_a_run_that_never_starts_does_not_hold_up_the_end_of_training(capsys):
    tracker = Tracker(lambda: time.sleep(30), wait_start_s=0.2)
    tracker.log_step({"step": 0})
    start = time.monotonic()
    tracker.finish(None, None)
    assert time.monotonic() - start < 5
    assert "did not start" in capsys.readouterr().err


def test_disabled_or_not_rank_0_opens_nothing(tmp_path):
    for cfg, enabled in ((WandbConfig(mode=WandbMode.disabled), True), (WandbConfig(), False)):
        tracker = open_tracker(cfg, run_dir=tmp_path, run_id="r", config={}, enabled=enabled)
        tracker.log_step({"step": 0, "train/loss": 1.0})
        tracker.finish(None, None)
        assert tracker.run is None
    assert not (tmp_path / "wandb").exists()


def test_online_without_credentials_or_network_falls_back_to_offline_with_a_warning(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # no stored login
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = WandbConfig(mode=WandbMode.online, init_timeout_s=10, system_metrics=False)
    start = time.monotonic()
    tracker = open_tracker(cfg, run_dir=tmp_path, run_id="fallback", config={"seed": 1}, enabled=True)
    tracker.wait_started(timeout_s=60)
    assert tracker.run is not None and time.monotonic() - start < 60
    tracker.log_step({"step": 0, "perf/trainer_wait_ratio": 0.25})
    tracker.finish(None, None)
    assert "could not start an online run" in capsys.readouterr().err
    [offline] = (tmp_path / "wandb").glob("offline-run-*")
    assert list(offline.glob("run-*.wandb"))


def test_an_offline_run_has_started_when_open_tracker_returns(tmp_path, monkeypatch):
    """The trainer imports torch and transformers right after open_tracker; wandb's start parses source too,
    and two threads parsing at once can fail on CPython 3.11 (gh-106905), so the start is over by then."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = WandbConfig(mode=WandbMode.offline, system_metrics=False)
    tracker = open_tracker(cfg, run_dir=tmp_path, run_id="started", config={"seed": 1}, enabled=True)
    assert tracker.run is not None
    tracker.finish(None, None)


def test_a_long_table_keeps_the_latest_whole_steps():
    rows = [[step, i] for step in range(5) for i in range(step + 1)]  # step k has k + 1 rows
    assert latest_steps(rows, 0, max_rows=100) == rows
    assert latest_steps(rows, 0, max_rows=10) == [[3, i] for i in range(4)] + [[4, i] for i in range(5)]


def test_wandb_keys_are_checked_at_the_edge():
    assert load_config(OmegaConf.create({"wandb": {"mode": "disabled"}})).wandb.mode is WandbMode.disabled
    with pytest.raises(ConfigError, match="wandb.mode"):
        load_config(OmegaConf.create({"wandb": {"mode": "sometimes"}}))
    with pytest.raises(ConfigError, match="wandb.init_timeout_s"):
        load_config(OmegaConf.create({"wandb": {"init_timeout_s": 0}}))


def test_a_resume_that_redoes_logged_steps_moves_to_the_next_wandb_run(tmp_path):
    assert current_wandb_run_id(tmp_path, "r.1", "train", redo=False) == "r-1-train"
    assert current_wandb_run_id(tmp_path, "r.1", "train", redo=False) == "r-1-train", "a plain resume stays"
    assert current_wandb_run_id(tmp_path, "r.1", "train", redo=True) == "r-1-train-redo1"
    assert current_wandb_run_id(tmp_path, "r.1", "train", redo=False) == "r-1-train-redo1"
    assert current_wandb_run_id(tmp_path, "r.1", "train", redo=True) == "r-1-train-redo2"
    assert current_wandb_run_id(tmp_path, "r.1", "rollout", redo=False) == "r-1-rollout"


def wandb_history(run_dir: Path, wandb_id: str) -> dict[int, dict]:
    """What the offline W&B run ``wandb_id`` holds, step by step, read from its ``run-<id>.wandb`` files: W&B's
    transaction log (LevelDB's log format, 32 KiB blocks of CRC'd chunks, after a 7-byte W&B header) of protobuf
    records. Every offline start of the same id adds a file; ``wandb sync`` merges them the same way."""
    import struct

    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict] = {}
    for path in sorted(run_dir.glob(f"wandb/offline-run-*-{wandb_id}/run-{wandb_id}.wandb")):
        data, pos, chunk, records = path.read_bytes(), 7, b"", []
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
                pos += left
                continue
            payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            chunk = payload if kind in (1, 2) else chunk + payload  # full, first; middle, last
            if kind in (1, 4):
                records.append(chunk)
        for raw in records:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                history.setdefault(items["_step"], items)  # W&B keeps the first value of a step
    return history


def test_after_a_crash_the_wandb_run_shows_what_metrics_jsonl_shows(tmp_path):
    """The trainer is SIGKILLed in step 3 (the last checkpoint is step 1's, and a killed process writes no stop
    checkpoint): the resume redoes step 2, which W&B logged already and would ignore. The resumed run logs to
    ``<id>-redo1``, which holds every step once with metrics.jsonl's values, the kept ones replayed first. (Offline,
    the killed attempt's W&B service may not flush what it got: online it would be uploaded, and kept.)"""
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [*SMALL, *DENSE_REWARD, "num_rollout=5", "run.checkpoint_every=2", "wandb.mode=offline",
                 "wandb.system_metrics=false"]
    procs = start_nodes(run_dir, *overrides,
                        commands={"trainer": ["-m", "tests.faults.inject", "mid_optimizer_step", "4"]})
    outputs = {role: p.communicate(timeout=180) for role, p in procs.items()}
    assert procs["trainer"].returncode == -9, outputs["trainer"][1][-2000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1, 2], "steps 0-2 were logged before the crash"
    resumed = run_job(run_dir, *overrides, "run.resume=auto", "run.id=bytest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run_dir / "wandb" / "train.run_id").read_text().strip() == "bytest-train-redo1"
    history = wandb_history(run_dir, "bytest-train-redo1")
    metrics = read_metrics(run_dir)
    assert sorted(history) == [m["step"] for m in metrics] == list(range(5))
    assert [history[m["step"]]["train/loss"] for m in metrics] == [m["train/loss"] for m in metrics]
