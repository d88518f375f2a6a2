"""Where the CPU goes, thread by thread, inside each step's rollout window: one job, sampled from /proc.

    python bench/cpu_profile.py --out /tmp/prof-cgp -- pipeline.mode=cgp micro_batch_size=1 ...

Runs ``launch.py`` with the overrides, samples every thread of the job's processes (utime + stime from
/proc/<pid>/task/<tid>/stat, every 20 ms) and names them once mid-run with ``py-spy dump`` (if installed;
Python 3.11 does not give its threads OS names). After the run it reads the spans and prints, for steps
1.. (step 0 is warm-up), the median per step of: the rollout window (first admission to last request end),
the CPU seconds each thread spent inside it, and the engines' CPU per generated token, plus the same for
the trainer's compute window. CPU seconds of an engine thread per token that grow while the wall time of the
window grows as much say the core is slower (memory system, host); CPU that other threads take on the
rollout core says the engine lost its core to them.

This sampler costs a few percent of a core (``own load`` in its output), and on a 2-core machine where cgp keeps
both cores busy that load has to preempt the engines or the trainer: it disturbs what it measures. ``--light``
reads only the trainer's main thread (``/proc/<pid>/task/<pid>/schedstat``: CPU and run-queue wait) and the
rollout process's CPU, every 10 ms, and prints per step the trainer's compute wall, CPU and run-queue wait
(time it was ready to run but another task had its core) and the rollout window's wall and the rollout
process's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def job_pids(run_dir: Path) -> dict[int, str]:
    """pid -> label of every process whose environment names this run (node processes and their children)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in x)
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if env.get(b"RP_RUN_DIR", b"").decode() == str(run_dir) or str(run_dir) in cmd:
            role = env.get(b"RP_ROLE", b"").decode() + env.get(b"RP_RANK", b"").decode()
            found[int(pid)] = (role if "rolloutpipe.launch.node" in cmd else
                               "engine-server" if "http_server" in cmd else f"{role}-child:{cmd[-40:]}")
    return found


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (comm, (int(rest[11]) + int(rest[12])) * TICK_S)
    return out


def names_by_tid(pid: int) -> dict[int, str]:
    try:
        dump = subprocess.run(["py-spy", "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(t): n for t, n in re.findall(r'Thread (?:0x[0-9A-Fa-f]+ )?\(?(\d+)\)?[^"]*"([^"]+)"', dump)}


def windows(run_dir: Path) -> dict[str, dict[int, list]]:
    """Per step: the rollout window [first request start, last request end, tokens, [(start, end)]] and the
    trainer's [first compute start, last compute end, 0, [(start, end) of every compute span]]."""
    out: dict[str, dict[int, list]] = {"rollout": {}, "trainer": {}}
    for path in (run_dir / "spans").glob("*.jsonl"):
        lines = path.read_text().splitlines()
        base = json.loads(lines[0])["header"]["time_base_s"]
        for line in lines[1:]:
            for name, step, start, end, extra in json.loads(line).get("spans", []):
                side = "rollout" if name == "rollout/request" else "trainer" if name.startswith("train/") and \
                    name != "train/wait" else None
                if side is None:
                    continue
                s, e = base + start * 1e-6, base + end * 1e-6
                w = out[side].setdefault(step, [s, e, 0, []])
                w[0], w[1], w[2] = min(w[0], s), max(w[1], e), w[2] + extra.get("num_tokens", 0)
                w[3].append((s, e))
    for step, w in out["rollout"].items():
        w[3] = [(w[0], w[1])]  # the rollout window is one interval; the trainer's is its compute spans
    return out


def cpu_in(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds between start and end, from (time, cumulative cpu) samples, linearly interpolated."""
    def at(t: float) -> float:
        prev = samples[0]
        for s in samples:
            if s[0] >= t:
                if s[0] == prev[0]:
                    return s[1]
                return prev[1] + (s[1] - prev[1]) * (t - prev[0]) / (s[0] - prev[0])
            prev = s
        return samples[-1][1]
    return at(end) - at(start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--light", action="store_true", help="only the trainer's main thread and the rollout's CPU")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run_dir = (args.out / "run").resolve()
    job = subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *args.overrides],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started, own = time.time(), time.process_time()
    if args.light:
        light(job, run_dir)
    else:
        full(job, run_dir)
    print(f"\nown load: {(time.process_time() - own) / (time.time() - started):.3f} cores (this sampler)")


def light(job: subprocess.Popen, run_dir: Path) -> None:
    """Per step: the trainer main thread's compute wall, CPU and run-queue wait; the rollout window and CPU."""
    found: dict[str, int] = {}
    trainer: list[tuple[float, float, float]] = []  # (time, cpu s, run-queue wait s)
    rollout: list[tuple[float, float]] = []
    while job.poll() is None:
        if len(found) < 2:
            found = {label: pid for pid, label in job_pids(run_dir).items() if label in ("trainer0", "rollout0")}
            time.sleep(0.2)
            continue
        now, pid = time.time(), found["trainer0"]
        try:
            on_cpu, queued = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:2]
            stat = Path(f"/proc/{found['rollout0']}/stat").read_text()
        except OSError:
            break
        trainer.append((now, int(on_cpu) * 1e-9, int(queued) * 1e-9))
        fields = stat[stat.rindex(")") + 2:].split()
        rollout.append((now, (int(fields[11]) + int(fields[12])) * TICK_S))
        time.sleep(0.01)
    if job.wait() != 0:
        raise SystemExit(f"run failed ({job.returncode}); see {run_dir}")
    spans = windows(run_dir)
    cpu, queue = [(t, c) for t, c, _ in trainer], [(t, q) for t, _, q in trainer]
    steps = sorted(spans["trainer"])[1:]
    compute = [spans["trainer"][k][3] for k in steps]  # each step's compute spans
    wall = statistics.median(sum(e - s for s, e in step_spans) for step_spans in compute)
    on = statistics.median(sum(cpu_in(cpu, s, e) for s, e in step_spans) for step_spans in compute)
    waited = statistics.median(sum(cpu_in(queue, s, e) for s, e in step_spans) for step_spans in compute)
    print(f"trainer compute spans, median of steps {steps[0]}..{steps[-1]}: wall {wall:.3f} s, CPU {on:.3f} s, "
          f"run-queue wait {waited:.3f} s")
    rollout_windows = [spans["rollout"][k] for k in sorted(spans["rollout"])[1:]]
    print(f"rollout window: wall {statistics.median(w[1] - w[0] for w in rollout_windows):.3f} s, rollout process CPU "
          f"{statistics.median(cpu_in(rollout, w[0], w[1]) for w in rollout_windows):.3f} s")


def full(job: subprocess.Popen, run_dir: Path) -> None:
    series: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    labels: dict[int, str] = {}
    names: dict[int, str] = {}
    named_at, num_named = time.time() + 6, 0
    machine: list[tuple[float, float]] = []
    while job.poll() is None:
        now = time.time()
        labels.update(job_pids(run_dir)) if len(series) < 5 or int(now * 2) % 4 == 0 else None
        for pid in list(labels):
            try:
                for tid, (comm, cpu) in thread_cpu(pid).items():
                    series[(pid, tid)].append((now, cpu))
                    names.setdefault(tid, comm)
            except OSError:
                continue
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        machine.append((now, (sum(map(int, fields)) - int(fields[3]) - int(fields[4])) * TICK_S))
        if num_named < 3 and now > named_at:  # threads start late (engines, dispatcher): name them thrice
            for pid, label in labels.items():
                if label in ("rollout0", "rollout1", "trainer0") or label == "engine-server":
                    names.update(names_by_tid(pid))
            named_at, num_named = now + 4, num_named + 1
        time.sleep(0.02)
    if job.returncode != 0:
        raise SystemExit(f"run failed ({job.returncode}); see {run_dir}")
    spans = windows(run_dir)
    for side in ("rollout", "trainer"):
        steps = sorted(spans[side])[1:]
        per_thread: dict[str, list[float]] = defaultdict(list)
        walls = [sum(e - s for s, e in spans[side][k][3]) for k in steps]
        for k in steps:
            totals: dict[str, float] = defaultdict(float)
            for start, end in spans[side][k][3]:
                for (pid, tid), s in series.items():
                    totals[f"{labels.get(pid, pid)}/{names.get(tid, tid)}"] += cpu_in(s, start, end)
                totals["machine (all processes)"] += cpu_in(machine, start, end)
            for key, v in totals.items():
                per_thread[key].append(v)
        what = "window" if side == "rollout" else "compute spans"
        print(f"\n{side} {what}, median of steps {steps[0]}..{steps[-1]}: wall {statistics.median(walls):.3f} s")
        if side == "rollout":
            tokens = [spans[side][k][2] for k in steps]
            engines = [sum(v[i] for key, v in per_thread.items() if "engine-" in key.split("/")[-1])
                       for i in range(len(steps))]
            print(f"  engine threads: {statistics.median(engines):.3f} CPU s, "
                  f"{1e3 * statistics.median(e / t for e, t in zip(engines, tokens)):.3f} CPU ms/token")
        for key, v in sorted(per_thread.items(), key=lambda kv: -statistics.median(kv[1])):
            if statistics.median(v) >= 0.005:
                print(f"  {statistics.median(v):7.3f} CPU s  {key}")


if __name__ == "__main__":
    main()
