"""Side-by-side benchmark: the same workload, same seed, in sync, cgp, cgp+fgd, cgp+fgd+spec and async_one_step.

    python bench/pipeline_bench.py                       # both workloads, 3 repeats
    python bench/pipeline_bench.py --workload long_tail --repeats 5 --steps 8
    python bench/pipeline_bench.py --response-len 256    # the response-length knob, for either regime
    python bench/pipeline_bench.py --rollout-nodes 2     # + sync and cgp+fgd on two rollout hosts
    python bench/pipeline_bench.py --modes sync,cgp+fgd,cgp+fgd+spec --lr 1e-7,1e-4   # speculative, two lrs

Every mode runs as a real job (``launch.py``: two node groups, the store, weight sync). Repeats are
interleaved rounds (sync, cgp, fgd, async, sync, ...): each round runs every mode once; step 0 of each
run is dropped (warm-up). Each plain cell is the median over the remaining steps of all repeats, and the
reductions are ratios of medians from this one invocation: quote those, never a lone absolute time.
``r2t range`` is the spread: the lowest and highest per-repeat median.

How sure a step-time figure is. The step-time claims carry a 95% interval, from paired rounds: each run is
reduced to its median step time, each round's ratio is that over the same round's sync run (its step time, or
the bound from its stages), and the interval is Student's t over rounds on the logs of those ratios (the
geometric mean of the ratios, minus 1). Drift between rounds (the machine getting slower for a while) moves a
round's mode and its sync together, so it cancels; noise inside a round does not, and widens the interval. t
assumes the log ratios are roughly normal; with few rounds it is wide (t = 4.30 at 3 rounds), as it should be.
``step_s`` is the mean over rounds of the per-run medians, with its t-interval (drift included). A mode "beats
the bound" only where the whole interval of ``step vs bound`` lies below zero; where it crosses zero the row
says "within noise". ``--lr`` may list several learning rates: one table each, its own sync rounds.

Step time and the on-policy bound. ``step_s`` is optimizer-step end to optimizer-step end (weight sync, weight
load, rollout and training: ``perf/train_end_s`` differences). ``bound@sync`` is the least step time any on-policy
schedule can have on the sync run's own stages: ideal@sync plus sync's weight sync and load. Only a speculative
rollout (``cgp+fgd+spec``, rollout.speculative: the engines draft step k+1 under policy k while step k trains,
and keep what policy k+1 reproduces) can go below it, because its rollout itself gets shorter. ``drafted`` is the
tokens drafted per step, ``kept`` the share verification kept; both depend on how far one update moves the policy,
so ``--lr`` matters (the default 1e-7 barely moves it).

Efficiency, two ways. ``eff`` is the run's own ``perf/pipeline_efficiency``: it compares the run with a
sync estimate and an ideal bound made from the run's *own* stage times, which overlap slows down, so it
hides that slowdown. ``eff@sync`` is the honest one: (T_sync - T) / (T_sync - ideal@sync), with T_sync
the sync run's measured rollout-to-train-end and ideal@sync the ideal bound from the sync run's stage
times (stages undisturbed). ``rollout``/``compute vs sync`` are each mode's slowdown of the stages it
overlaps. Every comparison is with the sync rows of the same layout. ``noise`` is the most cores other
jobs on the machine used during one of the row's runs (CPU seconds of every process minus those of the
run's own processes, sampled from /proc every 0.2 s, over its wall time) in the runs kept; before each run the
bench waits until they use under ``--quiet-below``, and a run during which they used more than ``--max-noise`` is
run again, as is one that failed (on a crowded machine a store can go unanswered past its peer timeout).

With ``--rollout-nodes N`` (N > 1) ``--host-workloads`` also run ``--host-modes`` in two more layouts, engines
in their own processes (``rollout.engine=embedded_http``, as SGLang) to compare like with like: ``http``,
one rollout node with ``rollout.num_engines`` servers, and ``N hosts``, ``launcher.rollout.nodes=N``
rollout processes standing in for N nodes, each starting its share of the engines (rank 0 drives all).

Workloads (tiny random-init Qwen3, 1 rollout core, 1 trainer core). Responses of the untrained model
stop at its end-of-sequence token with probability ~1/45 per token, so lengths are geometric: most
short, a long tail up to ``rollout_max_response_len`` (the knob), and a group completes with its
longest sample. The learning rate is tiny so the policy, hence the length distribution, stays put.
    long_tail   rollout dominates: long-tailed responses, a cheap trainer
    balanced    training time close to rollout time: small micro-batches make the trainer slower
    multiturn   tool-using episodes (bench/agent_env.py): 1 + geometric model turns (mean 2.5, at most 6) of up to
                48 tokens, each environment call a lognormal latency (median 0.1 s, a long tail; 32 workers), the
                episode's budget --response-len tokens; a group completes with its longest episode (no spec row)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODES = {
    "sync": ["pipeline.mode=sync"],
    "cgp": ["pipeline.mode=cgp", "rollout.admission=fifo"],
    "cgp+fgd": ["pipeline.mode=cgp", "rollout.admission=fgd"],
    "cgp+fgd+spec": ["pipeline.mode=cgp", "rollout.admission=fgd", "rollout.speculative=true"],
    "async_one_step": ["pipeline.mode=async_one_step"],
}

COMMON = ["rollout_batch_size=16", "n_samples_per_prompt=8", "global_batch_size=128", "rollout.num_engines=2",
          "rollout.concurrency=32"]
LR = "trainer.lr=1e-7"
"""The default learning rate: the policy barely moves, so the length distribution stays put (``--lr``)."""

WORKLOADS = {
    "long_tail": [*COMMON, "micro_batch_size=16"],
    "balanced": [*COMMON, "micro_batch_size=1"],
    "multiturn": [*COMMON, "micro_batch_size=4", "environment.name=bench_agent", "environment.max_turns=6",
                  "environment.import_modules=[bench.agent_env]", "environment.num_workers=32",
                  "environment.max_turn_tokens=48", "data.apply_chat_template=true", "eval.interval=0"],
}
UNSUPPORTED = {"multiturn": {"cgp+fgd+spec"}}
"""Modes a workload cannot run: a draft is one response, not an episode (config.py refuses speculation there)."""

COLUMNS = [
    ("perf/rollout_to_train_end_s", "r2t_s"),
    ("perf/trainer_wait_ratio", "wait"),
    ("perf/rollout_s", "rollout_s"),
    ("perf/train_compute_s", "compute_s"),
    ("perf/ideal_rollout_to_train_end_s", "ideal_s"),
    ("perf/pipeline_efficiency", "eff"),
    ("perf/first_group_s", "first_grp_s"),
    ("perf/tokens_per_s", "tok/s"),
]
R2T, IDEAL, STEP = "perf/rollout_to_train_end_s", "perf/ideal_rollout_to_train_end_s", "step_s"
SYNC_S = ("perf/weight_sync_s", "perf/weight_load_s")
DRAFTS = ("rollout/num_draft_tokens", "rollout/draft_kept_ratio")


T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t, 97.5th percentile, for 1..30 degrees of freedom; past 30 the 30's (a hair wide, never narrow)."""


@dataclass(frozen=True, slots=True)
class Interval:
    """An estimate and its 95% interval."""

    estimate: float
    low: float
    high: float


def t_interval(values: list[float]) -> Interval:
    """The mean of ``values`` and its 95% Student's t-interval; one value gives an unbounded interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Interval(estimate=mean, low=-math.inf, high=math.inf)
    half = T975[min(len(values) - 1, len(T975)) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(estimate=mean, low=mean - half, high=mean + half)


def paired_difference(ratios: list[float]) -> Interval:
    """The relative difference (-0.1: 10% below) from per-round ratios (a mode's step time over its own round's
    reference), and its 95% interval: the t-interval of the logs, back as ratio - 1."""
    logs = t_interval([math.log(r) for r in ratios])
    return Interval(estimate=math.expm1(logs.estimate), low=math.expm1(logs.low), high=math.expm1(logs.high))


def verdict(difference: Interval) -> str:
    """Against the bound: beaten only when the whole interval lies below zero."""
    if difference.high < 0:
        return "beats the bound"
    if difference.low > 0:
        return "above the bound"
    return "within noise"


def percent(difference: Interval) -> str:
    """``-12.3% [-20.1, -4.0]``: the estimate and its 95% interval, in percent."""
    return f"{100 * difference.estimate:+.1f}% [{100 * difference.low:+.1f}, {100 * difference.high:+.1f}]"


def layouts(num_nodes: int, engines: int) -> dict[str, list[str]]:
    """Row-label suffix -> extra overrides: the default layout, and with several hosts the like-for-like pair."""
    if num_nodes <= 1:
        return {"": []}
    http = ["rollout.engine=embedded_http"]
    return {"": [], " http": [*http, f"rollout.num_engines={engines}"],
            f" {num_nodes} hosts": [*http, f"launcher.rollout.nodes={num_nodes}",
                                    f"rollout.engines_per_node={engines // num_nodes}"]}


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used (all cores), from /proc/stat."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def run_cpu_s(pids: dict[int, float], launcher: int, run_dir: Path) -> None:
    """Update ``pids`` (pid -> its own CPU seconds, last seen) with every live process of the run: the launcher
    and every process whose environment names ``run_dir`` (node processes, engine servers, reward workers,
    also those a dying parent leaves to init, whose CPU never comes back to us as a child's)."""
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) != launcher and f"RP_RUN_DIR={run_dir}".encode() not in \
                    Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        pids[int(pid)] = (int(fields[11]) + int(fields[12])) / tick


def wait_quiet(max_cores: float, max_wait_s: float) -> None:
    """Wait (at most ``max_wait_s``) until other jobs use under ``max_cores`` of the machine for a second."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        busy = machine_busy_s()
        time.sleep(1.0)
        if machine_busy_s() - busy < max_cores:
            return


class RunFailed(SystemExit):
    """A run exited non-zero. A SystemExit, so that a script calling ``run_one`` stops with the run's message."""


def run_one(run_dir: Path, overrides: list[str], environ: dict[str, str] | None = None) -> tuple[list[dict], float]:
    """The run's metrics records, and the cores other jobs on the machine used meanwhile (the noise); ``environ``:
    the job's environment (None: this process's)."""
    busy, start, ours = machine_busy_s(), time.monotonic(), {}
    with subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *overrides], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environ) as job:
        stderr = []
        reader = threading.Thread(target=lambda: stderr.append(job.stderr.read()), daemon=True)
        reader.start()
        while job.poll() is None:
            run_cpu_s(ours, job.pid, run_dir.resolve())
            time.sleep(0.2)
        reader.join()
    if job.returncode != 0:
        raise RunFailed(f"run {run_dir} failed:\n{''.join(stderr)[-3000:]}")
    foreign = max(0.0, (machine_busy_s() - busy) - sum(ours.values())) / (time.monotonic() - start)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for before, record in itertools.pairwise(records):
        record[STEP] = record["perf/train_end_s"] - before["perf/train_end_s"]
    return records, foreign


def medians(repeats: list[list[dict]], foreign: list[float]) -> dict:
    """Medians over every measured step of every repeat, the per-repeat r2t medians' range, the most
    cores other jobs used during one of the runs, and per round (repeat) the run's median step time
    (``rounds_step``) and the on-policy bound its stages give (``rounds_bound``: used when this is a sync row)."""
    records = [r for rep in repeats for r in rep]
    out = {key: statistics.median(r[key] for r in records) for key in [k for k, _ in COLUMNS] + [STEP, *SYNC_S]}
    out.update({key: statistics.median(r.get(key, 0) for r in records) for key in DRAFTS})
    per_repeat = [statistics.median(r[R2T] for r in rep) for rep in repeats]
    out["r2t_min"], out["r2t_max"] = min(per_repeat), max(per_repeat)
    out["foreign"] = max(foreign)
    out["rounds_step"] = [statistics.median(r[STEP] for r in rep) for rep in repeats]
    out["rounds_bound"] = [sum(statistics.median(r[key] for r in rep) for key in (IDEAL, *SYNC_S)) for rep in repeats]
    return out


def table(workload: str, results: dict[str, dict[str, float]]) -> str:
    """One row per mode and layout; every ratio against the sync row of the same layout, the step-time ones paired
    by round with a 95% interval."""
    head = ["mode", *(short for _, short in COLUMNS[:5]), "ideal@sync", "eff", "eff@sync",
            *(short for _, short in COLUMNS[6:]), "r2t range", "r2t vs sync", "wait vs sync",
            "rollout vs sync", "compute vs sync", "step_s [95%]", "bound@sync", "step vs sync [95%]",
            "step vs bound [95%]", "vs bound", "drafted", "kept", "noise"]
    rows = [head]

    def vs(m: dict, base: dict, key: str) -> str:
        return f"{100 * (m[key] / base[key] - 1):+.1f}%"

    for label, m in results.items():
        base = results["sync" + label[label.index(" "):] if " " in label else "sync"]
        ideal, t_sync = base[IDEAL], base[R2T]
        honest = (t_sync - m[R2T]) / (t_sync - ideal) if t_sync > ideal else 0.0
        step = t_interval(m["rounds_step"])
        vs_sync = paired_difference([t / s for t, s in zip(m["rounds_step"], base["rounds_step"], strict=True)])
        vs_bound = paired_difference([t / b for t, b in zip(m["rounds_step"], base["rounds_bound"], strict=True)])
        cells = {short: f"{m[key]:.0f}" if short == "tok/s" else f"{m[key]:.3f}" for key, short in COLUMNS}
        rows.append([
            label, *(cells[short] for _, short in COLUMNS[:5]), f"{ideal:.3f}", cells["eff"], f"{honest:.3f}",
            *(cells[short] for _, short in COLUMNS[6:]), f"{m['r2t_min']:.2f}-{m['r2t_max']:.2f}",
            vs(m, base, R2T), vs(m, base, "perf/trainer_wait_ratio"), vs(m, base, "perf/rollout_s"),
            vs(m, base, "perf/train_compute_s"), f"{step.estimate:.3f} [{step.low:.3f}, {step.high:.3f}]",
            f"{statistics.fmean(base['rounds_bound']):.3f}", percent(vs_sync), percent(vs_bound), verdict(vs_bound),
            f"{m[DRAFTS[0]]:.0f}", f"{m[DRAFTS[1]]:.3f}", f"{m['foreign']:.2f}",
        ])
    return "\n".join([f"workload: {workload}", *aligned_table(rows)])


def aligned_table(rows: list[list[str]]) -> list[str]:
    """Markdown lines of ``rows`` (the first is the header), each column right-aligned to its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run (step 0 is dropped)")
    parser.add_argument("--response-len", type=int, default=192, help="rollout_max_response_len")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--lr", default=LR.split("=")[1], help="trainer.lr, or several comma-separated (a table "
                        "each; the default: the policy barely moves)")
    parser.add_argument("--rollout-nodes", type=int, default=1,
                        help="N > 1: also run --host-modes with embedded_http engines on 1 and on N rollout hosts")
    parser.add_argument("--host-modes", default="sync,cgp+fgd")
    parser.add_argument("--quiet-below", type=float, default=0.25,
                        help="before each run wait (up to --quiet-wait-s) until other jobs use fewer cores than this")
    parser.add_argument("--quiet-wait-s", type=float, default=60.0)
    parser.add_argument("--max-noise", type=float, default=0.3,
                        help="rerun a run during which other jobs used more cores than this, or that failed "
                        "(at most --max-reruns)")
    parser.add_argument("--max-reruns", type=int, default=2)
    parser.add_argument("--host-workloads", default="balanced",
                        help="workloads that get the host rows (comma-separated, or all)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    modes = args.modes.split(",")
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    report = []
    engines = int(next(o for o in COMMON if o.startswith("rollout.num_engines=")).split("=")[1])
    for workload, lr in itertools.product(workloads, args.lr.split(",")):
        rows = {mode: [*MODES[mode]] for mode in modes if mode not in UNSUPPORTED.get(workload, ())}
        if args.host_workloads == "all" or workload in args.host_workloads.split(","):
            for suffix, extra in list(layouts(args.rollout_nodes, engines).items())[1:]:
                rows.update({mode + suffix: [*MODES[mode], *extra] for mode in args.host_modes.split(",")})
        records: dict[str, list[list[dict]]] = {label: [] for label in rows}
        noise: dict[str, list[float]] = {label: [] for label in rows}
        reruns = dict.fromkeys(rows, 0)
        for rep in range(args.repeats):
            for label, extra in rows.items():
                run_dir = args.out / f"{workload}-lr{lr}" / f"{label.replace(' ', '_')}-{rep}"
                overrides = [*WORKLOADS[workload], f"trainer.lr={lr}", f"num_rollout={args.steps}",
                             f"rollout_max_response_len={args.response_len}", *extra]
                for attempt in range(1 + args.max_reruns):  # a run the neighbours disturbed is run again
                    wait_quiet(args.quiet_below, args.quiet_wait_s)
                    try:
                        steps, foreign = run_one(run_dir / f"try{attempt}", overrides)
                    except RunFailed as failed:  # e.g. its store starved past pipeline.peer_timeout_s by other jobs
                        if attempt == args.max_reruns:
                            raise
                        print(f"{failed}\n  {workload} lr {lr} {label} repeat {rep}: failed; again", file=sys.stderr,
                              flush=True)
                        continue
                    if foreign <= args.max_noise:
                        break
                    print(f"  {workload} lr {lr} {label} repeat {rep}: other jobs used {foreign:.2f} cores; "
                          f"{'again' if attempt < args.max_reruns else 'kept'}", file=sys.stderr, flush=True)
                reruns[label] += attempt
                records[label].append(steps[1:])
                noise[label].append(foreign)
                print(f"  {workload} lr {lr} {label} repeat {rep}: done (other jobs used {foreign:.2f} cores)",
                      file=sys.stderr, flush=True)
        report.append(table(f"{workload}, lr {lr}", {label: medians(r, noise[label]) for label, r in records.items()}))
        report[-1] += f"\nreruns (disturbed runs run again): {sum(reruns.values())}"
        print(report[-1], flush=True)
    (args.out / "table.md").write_text("\n\n".join(report) + "\n")
    print(f"\nruns and table in {args.out}")


if __name__ == "__main__":
    main()
