"""How fast is the simulator? The issue's target: 1,000 steps of 512 prompts x 16 samples in under a minute
of one core. Runs the scale preset (conf/sim/experiment/scale.yaml) and prints one table.

    python bench/sim_speed.py                         # 1,000 steps, sync and cgp+fgd, compiled (~2 min)
    python bench/sim_speed.py --steps 200 --repeats 3 --variants compiled interpreted

Each run is its own process (the compiled simulator, rolloutpipe/sim/compiled.py, is chosen at start-up),
timed in process CPU seconds (the simulator is single-threaded), with a bare Python loop timed just before
and after it: this machine is shared and its speed moves within minutes, so read the loop's time beside each
run (runs are comparable at similar loop times), the medians, and the interleaved variants' ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 60.0
LOOP_ITERATIONS = 10_000_000
VARIANTS = {"compiled": "1", "interpreted": "0"}
"""Variant -> ROLLOUTPIPE_SIM_COMPILED."""


def loop_s() -> float:
    """CPU seconds of a bare 10-million-iteration loop: the machine's speed right now."""
    start = time.process_time()
    for _ in range(LOOP_ITERATIONS):
        pass
    return time.process_time() - start


def one_run(mode: str, steps: int) -> dict:
    """In a child process: one simulation, timed."""
    sys.path.insert(0, str(REPO))
    from rolloutpipe.sim import compiled

    compiled.activate()
    from hydra import compose, initialize_config_dir

    from rolloutpipe.config import bind, register_hydra_schema
    from rolloutpipe.sim.sweep import SimulateConfig, run_sweep

    register_hydra_schema("simulate_schema", SimulateConfig)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose("simulate", overrides=["+sim/experiment=scale", f"num_steps={steps}", f"modes=[{mode}]"])
    cfg: SimulateConfig = bind(SimulateConfig, raw)
    before = loop_s()
    [row] = run_sweep(cfg, raw.job, raw.sim)
    return {"cpu_s": row.cpu_s, "loop_before": before, "loop_after": loop_s()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["sync", "cgp+fgd"])
    parser.add_argument("--variants", nargs="+", default=["compiled"], choices=sorted(VARIANTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this mode, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.steps)))
        return

    rows = []  # (variant, mode, result), repeats interleaved over variants and modes
    for repeat in range(args.repeats):
        for mode in args.modes:
            for variant in args.variants:
                env = {**os.environ, "ROLLOUTPIPE_SIM_COMPILED": VARIANTS[variant]}
                out = subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(args.steps)],
                                     env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                rows.append((variant, mode, result))
                print(f"{variant} {mode} repeat {repeat}: {result['cpu_s']:.1f} s", file=sys.stderr)

    head = ["variant", "mode", "steps", "cpu_s per repeat", "median", "per 1,000 steps", "target", "loop_s beside"]
    lines = [head]
    medians = {}  # (variant, mode) -> median cpu_s
    for variant in args.variants:
        for mode in args.modes:
            runs = [r for v, m, r in rows if v == variant and m == mode]
            median = medians[variant, mode] = statistics.median(r["cpu_s"] for r in runs)
            per_1000 = median * 1000 / args.steps
            lines.append([variant, mode, str(args.steps), " ".join(f"{r['cpu_s']:.1f}" for r in runs), f"{median:.1f}",
                          f"{per_1000:.1f}", f"{'met' if per_1000 < TARGET_S else 'missed'} (< {TARGET_S:.0f} s)",
                          " ".join(f"{r['loop_before']:.2f}/{r['loop_after']:.2f}" for r in runs)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    print("\n".join(out))
    if len(args.variants) > 1:
        base = args.variants[0]
        for mode in args.modes:
            ratios = ", ".join(f"{v} {medians[v, mode] / medians[base, mode]:.2f}x" for v in args.variants[1:])
            print(f"{mode}: cpu time relative to {base}: {ratios}")


if __name__ == "__main__":
    main()
