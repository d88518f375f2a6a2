"""Launch a RolloutPipe job: ``python launch.py [overrides]`` (Hydra; see conf/ and README.md)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rolloutpipe.config import ConfigError, load_config, register_hydra_schema, save_config
from rolloutpipe.launcher import LocalLauncher, new_run_id

register_hydra_schema()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(raw: DictConfig) -> None:
    try:
        cfg = load_config(raw)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    run_dir = Path(cfg.run.dir or HydraConfig.get().runtime.output_dir).resolve()
    cfg.run = replace(cfg.run, dir=str(run_dir), id=cfg.run.id or new_run_id(run_dir))
    save_config(cfg, run_dir / "config.yaml")
    print(f"run {cfg.run.id}: {cfg.pipeline.mode.value} mode, outputs in {run_dir}", flush=True)
    code = LocalLauncher().launch(cfg, run_dir)
    if code == 0:
        print(f"done: metrics in {run_dir / 'metrics.jsonl'}, final weights in {run_dir / 'checkpoints' / 'final'}")
    sys.exit(code)


if __name__ == "__main__":
    main()
