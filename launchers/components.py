"""RolloutPipe as a TorchX app: a ``rollout`` role and a ``trainer`` role running ``python -m rolloutpipe.launch.node``.

    torchx run -s local_cwd launchers/components.py:grpo num_rollout=20
    torchx run -s slurm -cfg partition=gpu,time=240 launchers/components.py:grpo \\
        --trainer_gpus 1 trainer.num_ranks=8 +experiment=gpqa model.path=... data.path=...

The positional arguments are Hydra overrides, as for ``python launch.py``. The component resolves and
checks the config, creates the run directory and writes ``config.yaml`` before TorchX starts anything
(run from the repository root; the run directory must be visible to every node). The rollout role has
``launcher.rollout.nodes`` replicas (each the engine host of its node; replica 0 also the rollout manager),
the trainer role ``trainer.num_ranks``. On Slurm, TorchX submits one heterogeneous job with one het group per
replica: group 0 is ``rollout-0`` (whose node hosts the store), then ``rollout-1``, ..., ``trainer-0``, ...

What each replica gets (rolloutpipe/control/env.py): RP_ROLE and RP_WORLD_SIZE per role, RP_RANK from TorchX's
``replica_id``, RP_STORE_HOST_VAR set to TorchX's ``rank0_env`` (the variable naming the first replica's
host: SLURM_JOB_NODELIST_HET_GROUP_0 on Slurm, TORCHX_RANK0_HOST locally), RP_STORE_PORT, RP_RUN_ID and
RP_RUN_DIR. The run's secret is NOT in the AppDef, because TorchX writes a role's env into the batch
script: the component puts RP_RUN_SECRET into the environment of the ``torchx`` process itself, which
local_cwd copies into every replica and which sbatch (and srun's --export=ALL,...) pass on to the job.
"""

from __future__ import annotations

import os
import secrets
import sys
from datetime import datetime
from pathlib import Path

import torchx.specs as specs

import rolloutpipe

CONF_DIR = Path(rolloutpipe.__file__).resolve().parent.parent / "conf"
"""launch.py's Hydra configs (TorchX execs this file, so its own __file__ is not where it lies)."""


def grpo(
    *overrides: str,
    rollout_cpus: int = 2,
    rollout_gpus: int = 0,
    trainer_cpus: int = 2,
    trainer_gpus: int = 0,
    mem_mb: int = 4096,
    store_port: int = 0,
) -> specs.AppDef:
    """On-policy GRPO with the rollout and trainer node groups as two roles.

    Args:
        overrides: Hydra overrides, as for launch.py (e.g. num_rollout=20 trainer.num_ranks=2)
        rollout_cpus: CPUs per rollout replica (one per rollout node: launcher.rollout.nodes)
        rollout_gpus: GPUs per rollout replica (its node's engines)
        trainer_cpus: CPUs per trainer replica (one replica per trainer rank)
        trainer_gpus: GPUs per trainer replica
        mem_mb: memory per replica in MB
        store_port: port of the store on the rollout's host; 0 picks one that is free on this machine
    """
    from rolloutpipe.control.env import free_port

    cfg, run_dir = _prepare(list(overrides))
    if rollout_gpus or trainer_gpus:
        from rolloutpipe.launch.preflight import warn_memory

        warn_memory(cfg)  # log lines naming the term and the knob when an estimate exceeds a GPU
    os.environ["RP_RUN_SECRET"] = secrets.token_bytes(32).hex()  # see the module docstring: not in the AppDef
    common = {
        "RP_RUN_ID": str(cfg.run.id),
        "RP_RUN_DIR": str(run_dir),
        "RP_RANK": specs.macros.replica_id,
        "RP_STORE_HOST_VAR": specs.macros.rank0_env,
        "RP_STORE_PORT": str(store_port or free_port()),
        "PYTHONUNBUFFERED": "1",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }

    def role(name: str, num_replicas: int, cpus: int, gpus: int) -> specs.Role:
        return specs.Role(
            name=name, image=os.getcwd(), entrypoint=sys.executable, args=["-u", "-m", "rolloutpipe.launch.node"],
            num_replicas=num_replicas, resource=specs.Resource(cpu=cpus, gpu=gpus, memMB=mem_mb),
            env={**common, "RP_ROLE": name, "RP_WORLD_SIZE": str(num_replicas)},
        )

    return specs.AppDef(name="rolloutpipe", roles=[
        # first: het group 0 on Slurm, whose host is rank0_env; one replica per rollout node (rollout/engines/hosts.py)
        role("rollout", cfg.launcher.rollout.nodes, rollout_cpus, rollout_gpus),
        role("trainer", cfg.trainer.num_ranks, trainer_cpus, trainer_gpus),
    ])


def _prepare(overrides: list[str]):
    """Compose conf/ with the overrides (as launch.py does), check it and the model (launch/preflight.py, as launch.py
    does: before anything is queued), and write the run's config.yaml."""
    from rolloutpipe.config import compose_config
    from rolloutpipe.launch.config import LauncherKind
    from rolloutpipe.launch.local import prepare_run
    from rolloutpipe.launch.preflight import check_model
    from rolloutpipe.launch.slurm import has_control_characters

    cfg = compose_config(overrides, CONF_DIR)
    if cfg.launcher.kind is not LauncherKind.local:
        raise ValueError(f"launcher={cfg.launcher.kind.value} does not apply here: TorchX is the launcher.")
    check_model(cfg)
    run_dir = Path(cfg.run.dir or f"outputs/torchx/{datetime.now():%Y-%m-%d/%H-%M-%S}").resolve()
    for key, value in (("run.id", cfg.run.id), ("run.dir", str(run_dir))):
        # TorchX's Slurm scheduler writes a role's env into its batch script as srun --export=ALL,KEY=VALUE,...
        if value is not None and ("," in value or has_control_characters(value)):
            raise ValueError(f"{key}={value!r} holds a comma or a control character: on Slurm, TorchX passes it in "
                             "srun's comma-separated --export list, on one line of its batch script. Leave them out.")
    return prepare_run(cfg, run_dir), run_dir
