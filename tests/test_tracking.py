"""W&B tracking never gets in training's way: it starts in the background, falls back to offline, turns itself off
on errors, and keeps whole steps when a table is too long. One test starts a real (offline) W&B run."""

from __future__ import annotations

import threading
import time

import pytest
from omegaconf import OmegaConf

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.observe.tracking import Tracker, WandbConfig, WandbMode, latest_steps, open_tracker


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
