"""Does the simulator predict real runs? Predicted vs measured, side by side, for the benchmark workloads.

    python bench/sim_validation.py                    # 8 settings + 2 calibration runs, x 2 repeats (~25 min)
    python bench/sim_validation.py --no-calibrate --repeats 3

1. Run each setting for real (launch.py, as bench/pipeline_bench.py does; repeats interleaved, step 0
   dropped, medians over the remaining steps of all repeats), and in each repeat the calibration runs
   too (another seed), so calibration and validation see the machine in the same state.
2. Calibrate the simulator on those calibration runs only (tools/calibrate_sim.py ->
   conf/sim/hardware/embedded_cpu.yaml), unless --no-calibrate.
3. Simulate the same job config (the same overrides, bound to the same Config) on the calibrated models,
   40 steps (the expected value, not one draw of a few steps), step 0 dropped, medians.
``--measured DIR`` predicts again against the runs of an earlier invocation instead of running them.
Every setting tried is reported; none is left out. The two-engine settings share one CPU between the
two embedded engines (the rollout node group has one core here), which the simulator's independent
engines do not model: they are listed to show that limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.pipeline_bench import MODES, WORKLOADS, run_one  # noqa: E402
from rolloutpipe.config import load_config  # noqa: E402
from rolloutpipe.sim.models import SimConfig  # noqa: E402
from rolloutpipe.sim.run import simulate  # noqa: E402
from tools import calibrate_sim as calibration  # noqa: E402

ONE_ENGINE = ["rollout.num_engines=1", "rollout.concurrency=64"]
SETTINGS = {
    **{f"{w} {m}": [*WORKLOADS[w], *ONE_ENGINE, *MODES[m]] for w in ("long_tail", "balanced")
       for m in ("sync", "cgp", "cgp+fgd")},
    **{f"long_tail {m}, 2 engines on 1 CPU": [*WORKLOADS["long_tail"], *MODES[m]] for m in ("sync", "cgp")},
}
SIM_STEPS = 40
KEYS = [("perf/rollout_to_train_end_s", "r2t_s"), ("perf/trainer_wait_ratio", "wait")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--response-len", type=int, default=192)
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--measured", type=Path, default=None, help="reuse the runs of an earlier --out")
    parser.add_argument("--hardware", type=Path, default=REPO / "conf" / "sim" / "hardware" / "embedded_cpu.yaml")
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "runs" / f"sim-validation-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    common = [f"num_rollout={args.steps}", f"rollout_max_response_len={args.response_len}"]
    measured: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    runs = args.measured or args.out
    for rep in range(0 if args.measured else args.repeats):
        calibration.run_calibration(runs / "calibration" / str(rep))
        for name, overrides in SETTINGS.items():
            run_one(runs / _dir_name(name) / str(rep), [*overrides, *common])
            print(f"  {name} repeat {rep}: done", file=sys.stderr, flush=True)
    for name in SETTINGS:
        for run_dir in sorted((runs / _dir_name(name)).iterdir()):
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            measured[name] += [json.loads(line) for line in lines][1:]
    if not args.no_calibrate:
        calibration.calibrate(args.hardware, sorted((runs / "calibration").iterdir()))
    sim = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SimConfig), OmegaConf.load(args.hardware)))
    rows = [["setting", *(f"{s} measured" for _, s in KEYS), *(f"{s} predicted" for _, s in KEYS),
             *(f"{s} error" for _, s in KEYS)]]
    for name, overrides in SETTINGS.items():
        job = load_config(OmegaConf.from_dotlist([*overrides, *common]))
        predicted = simulate(job, sim, SIM_STEPS).records[1:]
        m = {k: statistics.median(r[k] for r in measured[name]) for k, _ in KEYS}
        p = {k: statistics.median(r[k] for r in predicted) for k, _ in KEYS}
        rows.append([name, *(f"{m[k]:.3f}" for k, _ in KEYS), *(f"{p[k]:.3f}" for k, _ in KEYS),
                     *(f"{100 * (p[k] / m[k] - 1):+.1f}%" for k, _ in KEYS)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    table.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    text = "\n".join(table)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    print(f"\nruns and table in {args.out}")


def _dir_name(setting: str) -> str:
    return setting.replace(" ", "_").replace(",", "")


if __name__ == "__main__":
    main()
