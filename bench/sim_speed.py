"""How fast is the simulator? The issue's target: 1,000 steps of 512 prompts x 16 samples in under a minute
of one core. Runs the scale preset (conf/sim/experiment/scale.yaml) and prints one table.

    python bench/sim_speed.py                         # 1,000 steps, sync and cgp+fgd, 1 repeat (~4 min)
    python bench/sim_speed.py --steps 200 --repeats 3

Each run is timed in process CPU seconds (the simulator is single-threaded), with a bare Python loop timed
just before and after it: this machine is shared and its speed moves within minutes, so read the loop's
time beside each run (a run is comparable with another only at a similar loop time) and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rolloutpipe.sim.sweep import SimulateConfig, run_sweep  # noqa: E402

TARGET_S = 60.0
LOOP_ITERATIONS = 10_000_000


def loop_s() -> float:
    """CPU seconds of a bare 10-million-iteration loop: the machine's speed right now."""
    start = time.process_time()
    for _ in range(LOOP_ITERATIONS):
        pass
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["sync", "cgp+fgd"])
    args = parser.parse_args()

    ConfigStore.instance().store(name="simulate_schema", node=SimulateConfig)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose("simulate", overrides=["+sim/experiment=scale", f"num_steps={args.steps}"])
    rows = []  # (mode, repeat, cpu_s, loop_s before, loop_s after), repeats interleaved over the modes
    for repeat in range(args.repeats):
        for mode in args.modes:
            cfg: SimulateConfig = OmegaConf.to_object(OmegaConf.merge(raw, {"modes": [mode]}))
            before = loop_s()
            [row] = run_sweep(cfg, raw.job, raw.sim)
            rows.append((mode, repeat, row.cpu_s, before, loop_s()))
            print(f"{mode} repeat {repeat}: {row.cpu_s:.1f} s", file=sys.stderr)

    head = ["mode", "steps", "cpu_s per repeat", "median cpu_s", "per 1,000 steps", "target", "loop_s beside"]
    lines = [head]
    for mode in args.modes:
        runs = [r for r in rows if r[0] == mode]
        median = statistics.median(r[2] for r in runs)
        per_1000 = median * 1000 / args.steps
        lines.append([mode, str(args.steps), " ".join(f"{r[2]:.1f}" for r in runs), f"{median:.1f}",
                      f"{per_1000:.1f}", f"{'met' if per_1000 < TARGET_S else 'missed'} (< {TARGET_S:.0f} s)",
                      " ".join(f"{r[3]:.2f}/{r[4]:.2f}" for r in runs)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    print("\n".join(out))


if __name__ == "__main__":
    main()
