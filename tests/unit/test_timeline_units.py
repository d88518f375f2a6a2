"""Span recording, the clock offset, trace packing, group lifecycles and console progress: pure, in milliseconds
(the clock server test uses a real TCPStore in this process)."""

from __future__ import annotations

import io
import itertools
import json
import time
from pathlib import Path

import pytest

from rolloutpipe.control.clock import ClockServer, ClockSync, measure_offset, sync_clock
from rolloutpipe.control.transport import StoreAddress, Transport
from rolloutpipe.observe.metrics import SPAN_FLUSH, SpanRecorder, read_span_files, read_spans
from rolloutpipe.observe.progress import Progress
from rolloutpipe.observe.trace import (
    GROUP_COMPLETE,
    GROUP_DROPPED,
    OPTIMIZER_STEP,
    PUBLISH,
    REQUEST,
    REWARD,
    WAIT,
    group_lifecycles,
    pack,
    recording_overhead,
)
from rolloutpipe.types import LifecycleState, Span


def test_spans_are_shifted_onto_the_run_clock_and_the_header_keeps_the_offset(tmp_path):
    clock = ClockSync(offset_s=2.5, rtt_s=0.001, num_rounds=8, reference="store host")
    spans = SpanRecorder(role="trainer", rank=1, path=tmp_path / "spans" / "trainer-1.jsonl", clock=clock)
    spans.add("train/wait", step=0, start_s=10.0, end_s=11.0, group=3)
    with spans.span("train/optimizer_step", step=0, batch=0) as extra:
        extra["groups"] = [3]
    spans.flush()
    [f] = read_span_files(tmp_path)
    assert f.header["clock"]["offset_s"] == 2.5 and f.header["role"] == "trainer" and f.header["add_cost_s"] > 0
    wait, step, flush = f.spans
    assert (wait.name, wait.role, wait.rank, wait.start_s, wait.end_s, wait.attrs) == (
        "train/wait", "trainer", 1, 12.5, 13.5, {"group": 3})
    assert step.attrs == {"batch": 0, "groups": [3]} and abs(step.start_s - (time.time() + 2.5)) < 5
    assert flush.name == SPAN_FLUSH and flush.attrs["num_spans"] == 2 and flush.end_s >= flush.start_s
    assert spans.now() - time.time() == pytest.approx(2.5, abs=0.01)


def test_a_restarted_process_appends_a_header_that_applies_to_its_own_spans(tmp_path):
    path = tmp_path / "spans" / "trainer-0.jsonl"
    for offset_s in (0.0, 100.0):  # the first life, then a resumed one with another clock offset
        spans = SpanRecorder(role="trainer", rank=0, path=path,
                             clock=ClockSync(offset_s=offset_s, rtt_s=0.0, num_rounds=1, reference="store host"))
        now = time.time()
        spans.add(WAIT, step=0, start_s=now, end_s=now + 0.25)
        spans.flush()
    [f] = read_span_files(tmp_path)
    first, second = (s for s in f.spans if s.name == WAIT)
    assert f.header["clock"]["offset_s"] == 0.0
    assert second.start_s - first.start_s == pytest.approx(100.0, abs=1.0)
    assert first.end_s - first.start_s == pytest.approx(0.25, abs=2e-6)


def test_a_last_line_cut_short_by_a_killed_process_is_skipped(tmp_path):
    spans = SpanRecorder(role="rollout", rank=0, path=tmp_path / "spans" / "rollout-0.jsonl")
    spans.add("rollout/reward", step=0, start_s=1.0, end_s=2.0)
    spans.flush()
    with (tmp_path / "spans" / "rollout-0.jsonl").open("a") as f:
        f.write('{"name": "rollout/req')
    assert [s.name for s in read_spans(tmp_path)] == ["rollout/reward", SPAN_FLUSH]


def test_recording_overhead_adds_the_time_in_add_and_in_flush(tmp_path):
    spans = SpanRecorder(role="rollout", rank=0, path=tmp_path / "spans" / "rollout-0.jsonl")
    for i in range(100):
        spans.add(REQUEST, step=0, start_s=100.0 + i, end_s=101.0 + i)
    spans.flush()
    [overhead] = recording_overhead(read_span_files(tmp_path))
    assert overhead.num_spans == 100 and overhead.wall_s > 99
    assert overhead.record_s == pytest.approx(100 * spans.add_cost_s) and overhead.flush_s > 0


class SkewedHost:
    """A transport whose store host's clock runs ``skew_s`` ahead and answers after ``delay_s``."""

    is_host = False

    def __init__(self, skew_s: float, delay_s: float) -> None:
        self.skew_s, self.delay_s, self.tickets, self.pongs = skew_s, delay_s, 0, {}

    def key(self, *parts):
        return "/".join(map(str, parts))

    def add(self, key, amount):
        self.tickets += amount
        return self.tickets

    def set(self, key, value):
        time.sleep(self.delay_s)
        self.pongs[key.replace("ping", "pong")] = {"time_s": time.time() + self.skew_s}
        time.sleep(self.delay_s)

    def wait_record(self, key, *, what):
        return self.pongs[key]


def test_clock_offset_recovers_a_skewed_host_clock_within_half_a_round_trip():
    clock = measure_offset(SkewedHost(skew_s=-3.25, delay_s=0.002), num_rounds=5)
    assert clock.num_rounds == 5 and clock.rtt_s >= 0.004
    assert clock.offset_s == pytest.approx(-3.25, abs=clock.rtt_s / 2 + 1e-3)


def test_store_host_serves_its_clock_to_other_processes_through_the_store(tmp_path):
    from rolloutpipe.control.env import free_port

    address = StoreAddress(host="127.0.0.1", port=free_port(), hosted_by="this test")
    common = {"address": address, "run_id": "clock", "secret": b"s" * 32, "run_dir": tmp_path, "connect_timeout_s": 10}
    host = Transport.open(is_host=True, **common)
    server = ClockServer(host.connect_another()).start()  # what sync_clock starts on the store host
    try:
        client = Transport.open(is_host=False, **common)
        for _ in range(2):  # two clients in turn take tickets from the same counter
            clock = sync_clock(client, num_rounds=4)
            assert clock.reference == "store host" and clock.num_rounds == 4
            assert abs(clock.offset_s) <= clock.rtt_s / 2 + 0.005 and clock.rtt_s < 0.5  # one machine: one clock
    finally:
        server.stop()


def test_packing_never_puts_overlapping_intervals_in_one_slot():
    intervals = [(0.0, 3.0), (1.0, 2.0), (2.0, 4.0), (3.0, 5.0), (0.5, 0.6), (4.0, 4.0)]
    slots = pack(intervals)
    assert max(slots) + 1 == 2  # two at most overlap at any moment
    for slot in set(slots):
        mine = sorted(iv for iv, s in zip(intervals, slots) if s == slot)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(mine))


def span(name: str, step: int, start: float, end: float | None = None, **attrs) -> Span:
    role = "trainer" if name in (WAIT, OPTIMIZER_STEP) else "rollout"
    return Span(name=name, role=role, rank=0, step=step, start_s=start, end_s=start if end is None else end,
                attrs=attrs)


def group_spans(step: int, group: int, t: float, *, publish: bool = True, aborted: bool = False) -> list[Span]:
    out = [span(REQUEST, step, t + 0.1, t + 1.0, group=group, sample=s, engine="engine1", queued_s=0.1,
                policy_version=step, aborted=aborted) for s in range(2)]
    if aborted:
        return out
    out += [span(REWARD, step, t + 1.0, t + 1.1, group=group, sample=s) for s in range(2)]
    out.append(span(GROUP_COMPLETE, step, t + 1.2, group=group))
    if publish:
        out += [span(PUBLISH, step, t + 1.2, t + 1.3, group=group, seq=group, batch=0),
                span(WAIT, step, t + 0.5, t + 1.35, group=group, seq=group)]
    return out


def test_lifecycles_follow_a_group_to_its_optimizer_step_or_mark_it_dropped():
    spans = [*group_spans(0, 0, 0.0), *group_spans(0, 1, 1.0, publish=False), *group_spans(0, 2, 2.0, aborted=True),
             *group_spans(0, 3, 3.0, publish=False), span(GROUP_DROPPED, 0, 4.3, group=3, reason="zero_variance"),
             span(OPTIMIZER_STEP, 0, 5.0, 5.5, batch=0, groups=[0], policy_version=0),
             *group_spans(1, 0, 6.0)]  # step 1 never trained (the run stopped)
    lives = {(g.step, g.group): g for g in group_lifecycles(spans)}
    trained = lives[(0, 0)]
    assert trained.state is LifecycleState.TRAINED and trained.engine == "engine1"
    assert (trained.admitted_s, trained.generated_s, trained.rewarded_s, trained.complete_s, trained.published_s,
            trained.consumed_s, trained.trained_s) == (0.0, 1.0, 1.1, 1.2, 1.3, 1.35, 5.5)
    assert trained.policy_version_admitted == trained.policy_version_trained == 0 and trained.batch == 0
    assert (lives[(0, 1)].state, lives[(0, 1)].drop_reason) == (LifecycleState.DROPPED, "filtered")
    assert (lives[(0, 2)].state, lives[(0, 2)].drop_reason) == (LifecycleState.DROPPED, "aborted")
    assert (lives[(0, 3)].state, lives[(0, 3)].drop_reason) == (LifecycleState.DROPPED, "zero_variance")
    assert lives[(1, 0)].state is LifecycleState.CONSUMED and lives[(1, 0)].dropped_s is None


def test_progress_without_a_terminal_prints_a_plain_line_at_most_every_interval():
    now = [0.0]
    out = io.StringIO()
    progress = Progress(label="rollout", stream=out, interval_s=60, tty=False, clock=lambda: now[0])
    built = []
    for t in range(0, 200, 5):
        now[0] = float(t)
        progress.update(lambda t=t: built.append(t) or f"{t} samples")
    assert out.getvalue().splitlines() == ["[rollout] 60 samples  (60 s)", "[rollout] 120 samples  (120 s)",
                                           "[rollout] 180 samples  (180 s)"]
    assert built == [60, 120, 180]  # the text is built only when it is shown


def test_progress_on_a_terminal_rewrites_one_line():
    now = [0.0]
    out = io.StringIO()
    progress = Progress(label="trainer", stream=out, tty=True, tty_interval_s=1, clock=lambda: now[0])
    for t in (1.0, 1.5, 2.0):
        now[0] = t
        progress.update(lambda: "3/16 groups")
    progress.done()
    assert "\n" not in out.getvalue() and out.getvalue().count("\r\033[K") == 3


def test_spans_written_by_an_older_version_still_read(tmp_path):
    (tmp_path / "spans").mkdir()
    old = {"name": "train/wait", "role": "trainer", "rank": 0, "step": 0, "start_s": 1.0, "end_s": 2.0, "attrs": {}}
    (tmp_path / "spans" / "trainer-0.jsonl").write_text(json.dumps(old) + "\n")
    [s] = read_spans(Path(tmp_path))
    assert (s.role, s.rank, s.end_s) == ("trainer", 0, 2.0)


def test_a_resumed_process_supersedes_the_spans_of_the_steps_it_redoes(tmp_path):
    """A resume or a requeue redoes the steps after the checkpoint: their spans from before count once, not twice."""
    path = tmp_path / "spans" / "rollout-0.jsonl"
    first = SpanRecorder(role="rollout", rank=0, path=path)
    for step in range(3):  # the first process: steps 0..2; it stopped in step 2, after the checkpoint of step 1
        first.add("rollout/request", step=step, start_s=step, end_s=step + 0.5)
    first.flush()
    again = SpanRecorder(role="rollout", rank=0, path=path)
    again.resume_at(2)
    for step in (2, 3):
        again.add("rollout/request", step=step, start_s=10 + step, end_s=10.5 + step)
    again.flush()
    requests = [s for s in read_spans(tmp_path) if s.name == "rollout/request"]
    assert [(s.step, s.start_s >= 10) for s in requests] == [(0, False), (1, False), (2, True), (3, True)]
