"""W&B tracking: the only module of the package that imports ``wandb``, and only on its own thread.

Who writes. Trainer rank 0 opens one W&B run per job (``open_tracker(enabled=rank == 0)``); every other
process gets a tracker that does nothing. The rollout node's per-step numbers reach W&B through rank 0's
metrics record (``rollout/*`` keys), so the rollout manager needs a run of its own only for metrics that
never reach the trainer; ``open_tracker(..., job_type="rollout")`` gives it one (``wandb.group`` shows the
two together).

What is logged.
    every step     the metrics.jsonl record, same names (``perf/trainer_wait_ratio``, ``train/loss``, ...),
                   at W&B step = RL step; ``train/weights_digest`` is a str, which W&B keeps in the history and
                   the summary (the runs table shows it) without a chart
    on resume      the same W&B run, unless the resume redoes steps it already logged (a crash after the last
                   checkpoint): W&B ignores a step below its last and its rewind is a private preview, so the
                   resumed run then logs to a new W&B run, ``<id>-redo<n>``, which first gets the steps
                   metrics.jsonl keeps; its charts show what metrics.jsonl shows, and the old run keeps the
                   abandoned attempt. ``<run_dir>/wandb/<job_type>.run_id`` names the current one
    end of run     ``timeline/spans`` (the span table), ``timeline/groups`` (one lifecycle row per group),
                   ``timeline/picture`` (timeline.png), ``timeline/gantt`` (a Gantt panel: a table drawn by
                   the custom chart preset ``wandb.gantt_spec``; create it once per W&B entity from
                   ``wandb_gantt.vega.json`` beside this file, see docs/observability.md)

Never in the way of training.
    ``offline`` (the default) writes ``<run_dir>/wandb/offline-run-*`` and needs no network; ``wandb sync``
    uploads it later. ``online`` tries for ``wandb.init_timeout_s``; if W&B cannot be reached (no network,
    no API key) it warns and falls back to offline, so nothing is lost. ``disabled`` logs nothing. The run
    starts on the tracker's thread and ``open_tracker`` waits for it, at most 15 s (so its start-up is
    neither spent inside a step nor parsing source beside the trainer's imports); logging a step only
    enqueues. A logging error warns once and turns the tracker off; ``finish`` waits at most
    ``wandb.finish_timeout_s`` for the upload and then leaves it to ``wandb sync``.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import queue
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolloutpipe.observe.trace import MergedRun

GANTT_SPEC_PATH = Path(__file__).with_name("wandb_gantt.vega.json")
MAX_TABLE_ROWS = 10_000
"""W&B truncates a logged table beyond this (wandb.Table.MAX_ROWS); we keep whole, latest steps instead."""


class WandbMode(enum.Enum):
    offline = "offline"
    """Write the W&B run under the run directory; ``wandb sync <dir>`` uploads it later. No network."""
    online = "online"
    """Stream to the W&B server (needs an API key); falls back to offline with a warning if unreachable."""
    disabled = "disabled"


@dataclass(kw_only=True, slots=True)
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "rolloutpipe"
    entity: str | None = None
    name: str | None = None
    """The W&B run name. Null: the run id."""
    group: str | None = None
    """Groups runs in the W&B UI (e.g. the runs of one sweep). Null: none."""
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 30.0
    """Longest wait for the W&B server at start (online only); then the run goes on offline."""
    finish_timeout_s: float = 60.0
    """Longest wait for W&B to finish uploading at the end; what is left is in the offline directory."""
    gantt_spec: str = "rolloutpipe-gantt"
    """Name of the W&B custom chart preset (made from wandb_gantt.vega.json) that draws timeline/gantt."""
    system_metrics: bool = True
    """Let W&B sample CPU/GPU/memory use every 15 s."""

    def __post_init__(self) -> None:
        for key in ("init_timeout_s", "finish_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"wandb.{key}={getattr(self, key)} must be > 0.")


def _warn(message: str) -> None:
    print(f"warning: W&B: {message}", file=sys.stderr, flush=True)


_CLOSE = object()


class Tracker:
    """Logs to one W&B run, or does nothing. Never raises into training, and never makes it wait.

    W&B thread (``wandb``)
        consumes  ``start`` (opens the run: wandb.init spawns its service and, online, talks to the server),
                  then metrics records and the end-of-run timeline, in order, from a queue
        produces  run.log calls, then run.finish()
        waits for the next item; ``log_step`` only enqueues, so a slow W&B never delays a step
        shuts down after the timeline (``finish``), which waits for it at most ``wait_start_s`` (the run
                  never started) plus ``finish_timeout_s`` (the upload); a logging error warns once and
                  the thread drops everything after it.
    """

    def __init__(self, start: Callable[[], Any] | None = None, *, finish_timeout_s: float = 60.0,
                 wait_start_s: float = 60.0, gantt_spec: str = "") -> None:
        self.run: Any = None
        self.finish_timeout_s = finish_timeout_s
        self.wait_start_s = wait_start_s
        self.gantt_spec = gantt_spec
        self.last_step = 0
        self._queue: queue.Queue = queue.Queue()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        if start is not None:
            self._thread = threading.Thread(target=self._work, args=(start,), name="wandb", daemon=True)
            self._thread.start()

    @property
    def directory(self) -> Path | None:
        """The W&B run's local directory (``.../wandb/offline-run-*`` or ``run-*``), once started."""
        return Path(self.run.dir).parent if self.run is not None else None

    def wait_started(self, timeout_s: float = 15.0) -> None:
        """Wait (at most ``timeout_s``) for the run to start, so that its start-up CPU is not spent during a
        step; an online start that takes longer goes on in the background."""
        self._started.wait(timeout_s)

    def log_step(self, record: dict) -> None:
        """One metrics.jsonl record, logged at W&B step = its RL step (on the W&B thread)."""
        if self._thread is not None:
            self._queue.put(("step", record))

    def log(self, payload: dict) -> None:
        """Anything else W&B takes (tables, images), at the current step (on the W&B thread)."""
        if self._thread is not None:
            self._queue.put(("payload", payload))

    def finish(self, merged: MergedRun | None, picture: Path | None) -> None:
        """Log the timeline (tables, picture, Gantt panel) and close the run, waiting a bounded time."""
        if self._thread is None:
            return
        self._queue.put(("timeline", (merged, picture)))
        self._queue.put(_CLOSE)
        if not self._started.wait(self.wait_start_s):
            _warn(f"the W&B run did not start within {self.wait_start_s:.0f} s; nothing more is logged.")
            return
        self._thread.join(self.finish_timeout_s)
        if self._thread.is_alive():
            where = f" in {self.directory}" if self.directory else ""
            _warn(f"W&B did not finish within wandb.finish_timeout_s={self.finish_timeout_s:.0f} s; "
                  f"the rest is{where} ('wandb sync' uploads it).")

    def _work(self, start: Callable[[], Any]) -> None:
        self.run = start()
        self._started.set()
        while (item := self._queue.get()) is not _CLOSE:
            if self.run is None:
                continue
            kind, payload = item
            try:
                if kind == "step":
                    self.last_step = int(payload["step"])
                    self.run.log({k: v for k, v in payload.items() if k != "step"}, step=self.last_step)
                elif kind == "payload":
                    self.run.log(payload, step=self.last_step)
                else:
                    merged, picture = payload
                    if merged is not None:
                        self.run.log(timeline_payload(merged, picture, gantt_spec=self.gantt_spec),
                                     step=self.last_step)
            except Exception as err:  # noqa: BLE001 - W&B must never stop training
                _warn(f"logging {'a step' if kind == 'step' else 'the timeline'} failed ({type(err).__name__}: "
                      f"{err}); W&B is off for the rest of this run.")
                self._finish_run()
        self._finish_run()

    def _finish_run(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish()
            except Exception as err:  # noqa: BLE001
                _warn(f"closing the run failed ({type(err).__name__}: {err}).")


def wandb_run_id(run_id: str, job_type: str | None) -> str:
    """The W&B run id of a RolloutPipe run: the same on every resume and requeue, so the steps land in one W&B run.
    (W&B ids take letters, digits, ``-`` and ``_``.)"""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"{run_id}-{job_type}" if job_type else run_id)[:64]


def current_wandb_run_id(run_dir: Path, run_id: str, job_type: str, *, redo: bool) -> str:
    """The W&B run this start logs to: the one the run used last (``wandb_run_id`` at first), or with ``redo`` the
    next ``<id>-redo<n>``, remembered in ``<run_dir>/wandb/<job_type>.run_id`` (module docstring: on resume)."""
    path = run_dir / "wandb" / f"{job_type}.run_id"
    current = path.read_text().strip() if path.exists() else wandb_run_id(run_id, job_type)
    if redo:
        base, _, num = current.rpartition("-redo")
        base, num = (base, int(num)) if base and num.isdigit() else (current, 0)
        current = f"{base[:56]}-redo{num + 1}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(current + "\n")
    return current


def open_tracker(cfg: WandbConfig, *, run_dir: Path, run_id: str, config: Any, enabled: bool,
                 job_type: str = "train", redo_history: list[dict] | None = None) -> Tracker:
    """A tracker for this process: a W&B run when ``enabled`` and ``cfg.mode`` is not disabled.

    ``config`` is the job's Config (logged as the W&B run config) or a plain dict. ``redo_history``: this start
    redoes steps the W&B run logged already; the metrics records the resume keeps, which a new W&B run gets first
    (module docstring: on resume). The run starts on the tracker's own thread; this waits for that start (at most
    15 s, see ``Tracker.wait_started``).
    """
    if not enabled or cfg.mode is WandbMode.disabled:
        return Tracker()
    if importlib.util.find_spec("wandb") is None:
        _warn(f"wandb.mode={cfg.mode.value} but wandb is not installed; logging to W&B is off. "
              "pip install 'rolloutpipe[wandb]', or set wandb.mode=disabled to silence this.")
        return Tracker()
    if not isinstance(config, dict):
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)

    wandb_id = current_wandb_run_id(run_dir, run_id, job_type, redo=redo_history is not None)

    def start() -> Any:
        import wandb  # here, on the tracker's thread: importing wandb takes a second of CPU

        # Tables are staged as artifact files until synced; keep them with the run, not in ~/.local/share.
        os.environ.setdefault("WANDB_DATA_DIR", str(run_dir / "wandb" / "data"))
        mode = cfg.mode
        while True:
            try:
                return wandb.init(
                    mode=mode.value, dir=str(run_dir), project=cfg.project, entity=cfg.entity,
                    name=cfg.name or run_id, group=cfg.group, tags=list(cfg.tags) or None, job_type=job_type,
                    config=config, id=wandb_id, resume="allow",  # one run across resumes (module docstring)
                    settings=wandb.Settings(init_timeout=cfg.init_timeout_s, console="off", quiet=True,
                                            save_code=False, x_disable_stats=not cfg.system_metrics),
                )
            except Exception as err:  # noqa: BLE001 - W&B must never stop training
                if mode is WandbMode.online:
                    _warn(f"could not start an online run ({type(err).__name__}: {str(err).splitlines()[0]}); "
                          f"logging offline under {run_dir / 'wandb'} instead ('wandb sync' uploads it later).")
                    mode = WandbMode.offline
                    continue
                _warn(f"could not start a {mode.value} run ({type(err).__name__}: {err}); logging to W&B is off.")
                return None

    # online may take init_timeout_s (W&B waits about twice that) before the offline fallback starts
    tracker = Tracker(start, finish_timeout_s=cfg.finish_timeout_s, wait_start_s=3 * cfg.init_timeout_s + 30,
                      gantt_spec=cfg.gantt_spec)
    for record in redo_history or []:  # the kept steps, before any new one
        tracker.log_step(record)
    # Importing wandb and wandb.init parse Python source (pydantic reads docstrings with ast.parse), and
    # CPython 3.11 keeps one AST recursion counter per interpreter, so two threads parsing at once can fail
    # either of them with "SystemError: AST constructor recursion depth mismatch"
    # (cpython gh-106905). The caller is about to import torch and transformers, which parse too: wait here.
    tracker.wait_started()
    return tracker


# ------------------------------------------------------------------------------------------------
# The end-of-run timeline, as W&B objects
# ------------------------------------------------------------------------------------------------
SPAN_COLUMNS = ["name", "role", "rank", "step", "start_s", "end_s", "duration_s", "group", "sample", "engine",
                "batch"]
GROUP_COLUMNS = ["step", "group", "state", "engine", "batch", "admitted_s", "generated_s", "rewarded_s",
                 "complete_s", "published_s", "consumed_s", "trained_s", "dropped_s", "drop_reason",
                 "policy_version_admitted", "policy_version_trained"]
GANTT_COLUMNS = ["lane", "lane_order", "kind", "name", "step", "start_s", "end_s"]


def span_rows(merged: MergedRun) -> tuple[list[list], float]:
    """The span table (times relative to the run's first span), and that first span's time."""
    spans = merged.spans
    t0 = spans[0].start_s if spans else 0.0
    rows = [[s.name, s.role, s.rank, s.step, s.start_s - t0, s.end_s - t0, s.end_s - s.start_s,
             s.attrs.get("group"), s.attrs.get("sample"), s.attrs.get("engine"), s.attrs.get("batch")]
            for s in spans]
    return rows, t0


def gantt_rows(merged: MergedRun, t0: float) -> list[list]:
    """Rows for the Gantt panel: per engine one bar per step, and every dispatcher and trainer span."""
    from rolloutpipe.observe.trace import (
        FORWARD_BACKWARD,
        GROUP_COMPLETE,
        OPTIMIZER_STEP,
        PUBLISH,
        REQUEST,
        SYNC_WEIGHTS,
    )

    rows: list[list] = []
    busy: dict[tuple[str, int], list[float]] = {}
    for s in merged.spans:
        if s.name == REQUEST:
            key = (str(s.attrs.get("engine", "engine")), s.step)
            lo_hi = busy.setdefault(key, [s.start_s, s.end_s])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], s.start_s), max(lo_hi[1], s.end_s)
        elif s.name == GROUP_COMPLETE:
            rows.append(["groups", 1, "group complete", f"group={s.attrs.get('group')}", s.step, s.start_s, s.end_s])
        elif s.name == PUBLISH:
            rows.append(["dispatcher", 2, "publish", f"group={s.attrs.get('group')}", s.step, s.start_s, s.end_s])
        elif s.name == SYNC_WEIGHTS and s.role == "rollout":
            rows.append(["engine weights", 0, "weight load", s.name, s.step, s.start_s, s.end_s])
        elif s.role == "trainer" and s.name in (FORWARD_BACKWARD, OPTIMIZER_STEP, SYNC_WEIGHTS):
            kind = {FORWARD_BACKWARD: "forward_backward", OPTIMIZER_STEP: "optimizer_step",
                    SYNC_WEIGHTS: "weight sync"}[s.name]
            rows.append([f"trainer {s.rank}", 3 + s.rank, kind, s.name, s.step, s.start_s, s.end_s])
    for (engine, step), (lo, hi) in busy.items():
        rows.append([engine, 0, "generate", f"step={step}", step, lo, hi])
    return [[*row[:5], row[5] - t0, row[6] - t0] for row in sorted(rows, key=lambda r: (r[1], r[5]))]


def latest_steps(rows: list[list], step_column: int, max_rows: int = MAX_TABLE_ROWS) -> list[list]:
    """The rows of the latest whole steps that fit in ``max_rows``."""
    if len(rows) <= max_rows:
        return rows
    per_step: dict[int, int] = {}
    for row in rows:
        per_step[row[step_column]] = per_step.get(row[step_column], 0) + 1
    kept, total = set(), 0
    for step in sorted(per_step, reverse=True):
        if total + per_step[step] > max_rows:
            break
        kept.add(step)
        total += per_step[step]
    return [row for row in rows if row[step_column] in kept]


def timeline_payload(merged: MergedRun, picture: Path | None, *, gantt_spec: str) -> dict:
    import wandb

    from rolloutpipe.observe.trace import lifecycle_record

    spans, t0 = span_rows(merged)
    groups = []
    for g in merged.lifecycles:
        record = lifecycle_record(g)
        groups.append([record[c] - t0 if c.endswith("_s") and record[c] is not None else record[c]
                       for c in GROUP_COLUMNS])
    gantt = wandb.Table(columns=GANTT_COLUMNS, data=latest_steps(gantt_rows(merged, t0), 4))
    payload = {
        "timeline/spans": wandb.Table(columns=SPAN_COLUMNS, data=latest_steps(spans, 3)),
        "timeline/groups": wandb.Table(columns=GROUP_COLUMNS, data=latest_steps(groups, 0)),
        "timeline/gantt": wandb.plot_table(
            gantt_spec, gantt,
            fields={"lane": "lane", "lane_order": "lane_order", "kind": "kind", "name": "name",
                    "start": "start_s", "end": "end_s"},
            string_fields={"title": "RolloutPipe timeline (seconds from the run's first span)"}),
    }
    if picture is not None and picture.exists():
        payload["timeline/picture"] = wandb.Image(str(picture), caption="timeline (tools/timeline.py)")
    return payload
