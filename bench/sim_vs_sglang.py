"""The simulator's SGLang model (sim.scheduler.kind=sglang) against the real server: predicted vs measured.

    .venv-sglang/bin/python bench/sglang_fgd_bench.py --out bench/runs/sglang-fgd    # the measured runs
    python bench/sim_vs_sglang.py bench/runs/sglang-fgd [more run directories of that bench]

For each setting and admission of the bench's runs, the table gives the measured medians (steps after step 0, all
repeats) beside the simulator's (20 simulated steps of the same job, read from each run's config.yaml).

    engine       fitted to the decode lines SGLang logged ("Decode batch, #running-req: B, #token: C, ..., gen
                 throughput") in the calibration runs only: request_limit with FIFO (batches of at most 4), or with
                 --engine-from-all in every one-engine run (batches up to 32: the cost of a decode step, never the
                 schedule, is taken from them). A prefill is costed as a decode step of its tokens (SGLang logs no
                 prefill time)
    scheduler    each setting's SGLang flags: --max-total-tokens, --max-running-requests and the ratio variables of
                 the bench's SETTINGS, the radix cache on, priority scheduling under FGD (as the launcher starts it)
    trainer etc. conf/sim/hardware/embedded_cpu.yaml (the same tiny model, calibrated on this machine)
    lengths      geometric with the runs' measured mean, cut at their rollout_max_response_len (the bench's model
                 stops with probability ~1/45 per token)

Two engines on this machine share its two cores; the model gives each its own (it has no CPU contention): the
two_engines rows show what that costs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from pipeline_bench import aligned_table  # noqa: E402
from sglang_fgd_bench import SETTINGS, retracted  # noqa: E402

from rolloutpipe.config import load_config  # noqa: E402
from rolloutpipe.sim.calibrate import _fit  # noqa: E402
from rolloutpipe.sim.models import (  # noqa: E402
    EngineModel,
    LengthKind,
    LengthModel,
    OverheadModel,
    SchedulerKind,
    SchedulerModel,
    SimConfig,
    TrainerModel,
)
from rolloutpipe.sim.run import Simulation  # noqa: E402

COLUMNS = [("perf/first_group_s", "first_grp_s"), ("perf/rollout_to_train_end_s", "r2t_s"),
           ("perf/trainer_wait_ratio", "wait")]
DECODE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+),.*?gen throughput \(token/s\): ([\d.]+)")
CALIBRATION = ("request_limit", "fifo")


def decode_rows(run: Path) -> tuple[list[list[float]], list[float]]:
    """(1, B, context) and seconds per decode step from SGLang's logs of a run (its throughput over the last 40)."""
    rows, times = [], []
    for log in sorted((run / "engines").rglob("*.log")):
        for b, tokens, throughput in DECODE.findall(log.read_text(errors="replace")):
            if float(throughput) > 0:
                rows.append([1.0, float(b), float(tokens)])
                times.append(int(b) / float(throughput))
    return rows, times


def engine_model(calibration: list[Path]) -> EngineModel:
    rows, times = [], []
    for run in calibration:
        r, t = decode_rows(run)
        rows += r
        times += t
    if not rows:
        raise SystemExit(f"no SGLang decode lines in {calibration}: are these runs of bench/sglang_fgd_bench.py?")
    base, per_request, per_context = _fit(rows, times)
    return EngineModel(decode_base_s=base, decode_per_request_s=per_request, decode_per_context_token_s=per_context,
                       prefill_base_s=base, prefill_per_token_s=per_request + per_context,
                       source=f"SGLang decode logs of {len(calibration)} calibration runs ({len(rows)} lines)")


def scheduler_of(setting: str, admission: str) -> SchedulerModel:
    spec = SETTINGS[setting]
    args = dict(zip(spec["args"][::2], spec["args"][1::2]))
    environ = spec.get("environ", {})
    return SchedulerModel(kind=SchedulerKind.sglang, max_total_tokens=int(args["--max-total-tokens"]),
                          max_running_requests=int(args["--max-running-requests"]),
                          init_new_token_ratio=float(environ.get("SGLANG_INIT_NEW_TOKEN_RATIO", 0.7)),
                          min_new_token_ratio_factor=float(environ.get("SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR", 0.14)),
                          radix_cache=True)


def measured(runs: list[Path]) -> tuple[dict[str, float], float]:
    """Medians of the steps after step 0, retractions per step (all steps: SGLang's log counts them all), and
    the mean response length."""
    steps = [json.loads(line) for run in runs for line in (run / "metrics.jsonl").read_text().splitlines()[1:]]
    num_steps = sum(len((run / "metrics.jsonl").read_text().splitlines()) for run in runs)
    cells = {key: statistics.median(s[key] for s in steps) for key, _ in COLUMNS}
    cells["retracted"] = sum(retracted(run) for run in runs) / num_steps
    return cells, statistics.mean(s["rollout/response_len_mean"] for s in steps)


def predicted(run: Path, sim: SimConfig, num_steps: int = 20) -> dict[str, float]:
    raw = yaml.safe_load((run / "config.yaml").read_text())
    job = load_config({k: v for k, v in raw.items() if k not in ("run", "model", "launcher", "wandb")})
    simulation = Simulation(job, sim)
    records = simulation.run(num_steps).records
    cells = {key: statistics.median(r[key] for r in records) for key, _ in COLUMNS}
    cells["retracted"] = sum(len(e.retracted) for e in simulation.engines) / num_steps
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="+", help="output directories of bench/sglang_fgd_bench.py")
    parser.add_argument("--engine-from-all", action="store_true",
                        help="fit the engine's decode cost to the one-engine runs of every setting, not only the "
                             "calibration runs (their batch sizes reach 32, the calibration's only 4)")
    args = parser.parse_args()
    runs: dict[tuple[str, str], list[Path]] = {}
    for out in args.out:
        for metrics in sorted(out.glob("*/*-*/metrics.jsonl")):
            setting, name = metrics.parent.parent.name, metrics.parent.name
            runs.setdefault((setting, name.rsplit("-", 1)[0]), []).append(metrics.parent)
    if CALIBRATION not in runs:
        raise SystemExit(f"no {CALIBRATION[0]} {CALIBRATION[1]} runs in {args.out}: they calibrate the engine")
    engine = engine_model([run for (setting, _), group in runs.items() if setting != "two_engines" for run in group]
                          if args.engine_from_all else runs[CALIBRATION])
    hardware = yaml.safe_load((REPO / "conf" / "sim" / "hardware" / "embedded_cpu.yaml").read_text())
    print(f"engine: decode {engine.decode_base_s * 1e3:.2f} ms + {engine.decode_per_request_s * 1e3:.3f} ms x B + "
          f"{engine.decode_per_context_token_s * 1e6:.3f} us x context ({engine.source})", flush=True)
    rows = [["setting", "admission", *(f"{short} meas" for _, short in COLUMNS),
             *(f"{short} sim" for _, short in COLUMNS), "retracted/step meas", "sim", "r2t sim/meas",
             "fgd vs fifo r2t meas", "sim"]]
    results = {}
    for (setting, admission), group in sorted(runs.items(), key=lambda kv: (list(SETTINGS).index(kv[0][0]),
                                                                             kv[0][1] != "fifo")):
        meas, mean_len = measured(group)
        sim = SimConfig(engine=engine, scheduler=scheduler_of(setting, admission),
                        trainer=TrainerModel(**{k: v for k, v in hardware["trainer"].items() if k != "source"}),
                        overheads=OverheadModel(**hardware["overheads"]),
                        # the reversal task's prompts are 3-4 tokens (SGLang logs #new-token 3-4 per request)
                        lengths=LengthModel(kind=LengthKind.geometric, mean_tokens=mean_len, prompt_tokens=4))
        pred = predicted(group[0], sim)
        results[setting, admission] = meas, pred
        calibrates = args.engine_from_all and setting != "two_engines" or (setting, admission) == CALIBRATION
        cells = [setting, admission + (" (engine fit)" if calibrates else ""),
                 *(f"{meas[k]:.3f}" for k, _ in COLUMNS), *(f"{pred[k]:.3f}" for k, _ in COLUMNS),
                 f"{meas['retracted']:.2f}", f"{pred['retracted']:.2f}",
                 f"{pred['perf/rollout_to_train_end_s'] / meas['perf/rollout_to_train_end_s']:.2f}"]
        if admission == "fgd" and (setting, "fifo") in results:
            base_meas, base_pred = results[setting, "fifo"]
            key = "perf/rollout_to_train_end_s"
            cells += [f"{100 * (meas[key] / base_meas[key] - 1):+.1f}%",
                      f"{100 * (pred[key] / base_pred[key] - 1):+.1f}%"]
        else:
            cells += ["", ""]
        rows.append(cells)
    print("\n".join(aligned_table(rows)))
    ratios = [p["perf/rollout_to_train_end_s"] / m["perf/rollout_to_train_end_s"] for m, p in results.values()]
    print(f"\nr2t sim/measured over {len(ratios)} cells: median {statistics.median(ratios):.2f}, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
