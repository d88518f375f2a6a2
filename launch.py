"""Launch a RolloutPipe job: ``python launch.py [overrides]`` (Hydra; see conf/ and README.md).

    python launch.py                              both node groups as processes on this machine
    python launch.py launcher=slurm               one heterogeneous Slurm job (submitit); waits for it
    python launch.py -m pipeline.mode=sync,cgp    a sweep: each point its own run directory and run id
        [hydra/launcher=submitit_slurm]           ... each point as a Slurm job (which, with
                                                  launcher=slurm, submits its own het job)
    launcher=sbatch                               used by slurm/rolloutpipe.sbatch inside its allocation
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rolloutpipe.config import Config, ConfigError, check_command_line, load_config, register_hydra_schema
from rolloutpipe.launch.config import LauncherKind
from rolloutpipe.launch.local import Launcher, LocalLauncher, prepare_run
from rolloutpipe.launch.preflight import check_model, warn_memory

register_hydra_schema()


def make_launcher(cfg: Config) -> Launcher:
    if cfg.launcher.kind is LauncherKind.slurm:
        from rolloutpipe.launch.slurm import SlurmLauncher

        return SlurmLauncher()
    return LocalLauncher()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(raw: DictConfig) -> None:
    # In a sweep a failed point raises (Hydra reports it and runs the other points); sys.exit would end the sweep.
    sweep = HydraConfig.get().mode is RunMode.MULTIRUN
    try:
        cfg = load_config(raw)
        if sweep and (cfg.run.dir or cfg.run.id):
            raise ConfigError("run.dir and run.id name one run, but a sweep makes several: drop them (each point gets "
                              "<hydra.sweep.dir>/<job number> and its own run id), or set hydra.sweep.dir=... instead.")
        run_dir = Path(cfg.run.dir or HydraConfig.get().runtime.output_dir).resolve()
        gpu_launcher = cfg.launcher.kind is not LauncherKind.local  # Slurm: GPU nodes (the local run is on CPU)
        if gpu_launcher:
            from rolloutpipe.launch.slurm import check_launch

            check_launch(cfg, run_dir)
        check_model(cfg)  # reads config.json and the tokenizer: a model that cannot run right stops here
        if gpu_launcher:
            warn_memory(cfg)  # log lines naming the term and the knob when an estimate exceeds a GPU's memory
        cfg = prepare_run(cfg, run_dir)
    except ConfigError as err:
        if sweep:
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    inside_sbatch = cfg.launcher.kind is LauncherKind.sbatch
    print(f"run {cfg.run.id}: {cfg.pipeline.mode.value} mode, outputs in {run_dir}", flush=True,
          file=sys.stderr if inside_sbatch else sys.stdout)
    if raw.pipeline.weight_sync is None:  # (the GPU presets: chosen at load, and said why; set, it goes unsaid)
        print(f"weight sync: {cfg.pipeline.weight_sync.value} (chosen: {cfg.weight_sync_choice()[1]})", flush=True,
              file=sys.stderr if inside_sbatch else sys.stdout)
    if inside_sbatch:  # slurm/rolloutpipe.sbatch sources the file, then starts the step itself
        from rolloutpipe.launch.slurm import write_sbatch_vars

        write_sbatch_vars(cfg, run_dir)
        return
    code = make_launcher(cfg).launch(cfg, run_dir)
    if code == 0:
        if not cfg.launcher.dry_run:
            print(f"done: metrics in {run_dir / 'metrics.jsonl'}, final weights in {run_dir / 'checkpoints' / 'final'}")
        return
    print(f"to resume from the last checkpoint: {resume_command(run_dir)}", file=sys.stderr, flush=True)
    if sweep and code <= 128:  # a signal (128 + its number) stops the sweep too
        raise RuntimeError(f"run {cfg.run.id} failed (exit code {code}); see the messages above and {run_dir}")
    sys.exit(code)


def resume_command(run_dir: Path) -> str:
    """This run's launch command with ``run.dir=<run_dir> run.resume=auto`` (a sweep point's: its own overrides)."""
    kept = [o for o in HydraConfig.get().overrides.task if not o.lstrip("+~").startswith(("run.dir=", "run.resume="))]
    return shlex.join(["python", sys.argv[0], *kept, f"run.dir={run_dir}", "run.resume=auto"])


if __name__ == "__main__":
    try:  # an unknown key stops here, with its name and the closest known ones, before Hydra composes anything
        check_command_line(sys.argv[1:], Config, Path(__file__).resolve().parent / "conf")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
