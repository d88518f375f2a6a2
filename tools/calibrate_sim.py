"""Calibrate the simulator on this machine and write conf/sim/hardware/embedded_cpu.yaml.

    python tools/calibrate_sim.py                 # ~5 minutes on 2 cores
    python tools/calibrate_sim.py --out /tmp/hw.yaml --run-dir /tmp/calibration-runs

1. the embedded engine and the PyTorch trainer, each timed alone in a process pinned to one CPU (as the
   rollout and trainer node groups are), fitted to the cost models (rolloutpipe/sim/calibrate.py);
2. short real runs of the benchmark's long_tail workload (sync and cgp, another seed than the benchmark's)
   for the stage latencies (reward, publish, weight save and load) and the response-length law of the
   untrained model (geometric: it stops at its end-of-sequence token with a constant probability);
3. the same runs simulated, to fit what a process alone does not show (calibrate.fit_in_situ): the host
   work per finished request that shares the engine's CPU, and the trainer's speed beside the rollout.
Runs already finished under ``--run-dir`` are reused. bench/sim_validation.py interleaves these runs
with the runs it validates against, so both see the machine in the same state.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.pipeline_bench import LR, MODES, WORKLOADS, run_one  # noqa: E402
from rolloutpipe.config import load_config  # noqa: E402
from rolloutpipe.model import build_tiny_tokenizer  # noqa: E402
from rolloutpipe.sim.calibrate import (  # noqa: E402
    fit_in_situ,
    geometric_mean_tokens,
    overheads_from_run,
    response_lengths,
)
from rolloutpipe.sim.models import (  # noqa: E402
    EngineModel,
    LengthKind,
    LengthModel,
    SimConfig,  # noqa: E402
    TrainerModel,
)

MAX_RESPONSE_LEN = 192  # the benchmark's default response budget
CALIBRATION_RUNS = {
    mode: [*WORKLOADS["long_tail"], LR, *MODES[mode], "num_rollout=8", "seed=99", "run.save_samples=true",
           f"rollout_max_response_len={MAX_RESPONSE_LEN}", "rollout.num_engines=1", "rollout.concurrency=64"]
    for mode in ("sync", "cgp")
}


def measure(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "rolloutpipe.sim.calibrate", kind], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_calibration(run_dir: Path) -> None:
    """One sync and one cgp calibration run under ``run_dir`` (kept if already there)."""
    for mode, overrides in CALIBRATION_RUNS.items():
        if not (run_dir / mode / "metrics.jsonl").exists():
            run_one(run_dir / mode, overrides)


def calibrate(out: Path, run_dirs: list[Path]) -> None:
    """Microbenchmarks, then the in-situ fit to the calibration runs under each of ``run_dirs``; writes ``out``."""
    engine, trainer = measure("engine"), measure("trainer")
    records = {mode: [r for d in run_dirs for r in _records(d / mode)[1:]] for mode in CALIBRATION_RUNS}
    first = run_dirs[0] / "sync"
    lengths = [n for d in run_dirs for n in response_lengths(d / "sync")]
    tokenizer = build_tiny_tokenizer()
    prompts = [json.loads(line)["prompt"] for line in (first / "rollouts" / "step=1.jsonl").read_text().splitlines()]
    sim = SimConfig(engine=EngineModel(**engine), trainer=TrainerModel(**trainer), overheads=overheads_from_run(first),
                    lengths=LengthModel(kind=LengthKind.geometric,
                                        mean_tokens=round(geometric_mean_tokens(lengths, MAX_RESPONSE_LEN), 2),
                                        prompt_tokens=round(sum(len(tokenizer(p)["input_ids"]) for p in prompts)
                                                            / len(prompts))))
    jobs = {mode: load_config(OmegaConf.from_dotlist(o)) for mode, o in CALIBRATION_RUNS.items()}
    sim = fit_in_situ(sim, sync_job=jobs["sync"], sync_records=records["sync"], cgp_job=jobs["cgp"],
                      cgp_records=records["cgp"])
    preset = {key: asdict(getattr(sim, key)) for key in ("engine", "trainer", "overheads", "lengths")}
    preset["lengths"]["kind"] = sim.lengths.kind.value
    header = ("# @package sim\n"
              f"# Written by tools/calibrate_sim.py on {time.strftime('%Y-%m-%d %H:%M')} (this machine: "
              "embedded engine and PyTorch trainer on one CPU each, then fitted in situ to real sync and cgp runs of "
              f"the long_tail workload, {len(lengths)} samples). Rerun to recalibrate.\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + OmegaConf.to_yaml(OmegaConf.create(preset)))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "conf" / "sim" / "hardware" / "embedded_cpu.yaml")
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="rolloutpipe-calibration-"))
    run_calibration(run_dir)
    calibrate(args.out, [run_dir])
    print(f"wrote {args.out}\n{args.out.read_text()}")


if __name__ == "__main__":
    main()
