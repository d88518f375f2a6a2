"""Simulate RolloutPipe's schedules at any scale: ``python tools/simulate.py [overrides]`` (Hydra, conf/simulate.yaml).

    python tools/simulate.py                                        the bench workload on this machine's models
    python tools/simulate.py +sim/experiment=paper                  Qwen3-1.7B on H100s: the paper's regime
    python tools/simulate.py job.rollout_batch_size=512 job.n_samples_per_prompt=16 num_steps=1000
    python tools/simulate.py '+sweep.job.rollout.concurrency=[32,64,128]' modes=[sync,cgp+fgd]
    python tools/simulate.py timeline=sim.png csv=sim.csv
    python tools/simulate.py 'modes=[sync,cgp+fgd,cgp+fgd+spec@0.99,cgp+fgd+spec@0.999]'   speculative next-step rollout

``job`` takes the keys launch.py takes (the same Config, checked the same way); ``sim`` the cost models
(rolloutpipe/sim/models.py); see rolloutpipe/sim/sweep.py for the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rolloutpipe.sim import compiled

COMPILED = compiled.activate()  # before the modules it compiles are imported (sim/compiled.py)

from rolloutpipe.config import ConfigError, bind, check_command_line, register_hydra_schema  # noqa: E402
from rolloutpipe.sim.sweep import LISTED_BY, SimulateConfig, draw, format_table, run_sweep, write_csv  # noqa: E402

register_hydra_schema("simulate_schema", SimulateConfig)


@hydra.main(version_base=None, config_path="../conf", config_name="simulate")
def main(raw: DictConfig) -> None:
    try:
        cfg: SimulateConfig = bind(SimulateConfig, raw, listed_by=LISTED_BY)
        rows = run_sweep(cfg, raw.job, raw.sim)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(format_table(rows))
    print(f"(simulator {'compiled with mypyc' if COMPILED else 'interpreted'}: rolloutpipe/sim/compiled.py)",
          file=sys.stderr)
    if cfg.csv:
        write_csv(rows, Path(cfg.csv))
    if cfg.timeline:
        for path in draw(rows, Path(cfg.timeline)):
            print(f"timeline: {path}")


if __name__ == "__main__":
    try:  # an unknown key (job.*, sim.*, ...) stops here, before Hydra composes anything
        check_command_line(sys.argv[1:], SimulateConfig, Path(__file__).resolve().parent.parent / "conf",
                           listed_by=LISTED_BY)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
