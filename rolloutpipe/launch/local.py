"""Launchers start both node groups with the same resolved config and the environment of control/env.py.

``launcher.kind`` picks one (Hydra: ``launcher=local|slurm|sbatch``):
    local   LocalLauncher, below: both node groups as processes on this machine (the default).
    slurm   slurm.SlurmLauncher: one heterogeneous Slurm job through submitit; waits for it.
    sbatch  slurm.check_allocation: inside slurm/rolloutpipe.sbatch, checks the config against the
            job's allocation and writes config.yaml; the script's own srun starts the node groups.
The TorchX component (launchers/components.py) is the fourth way in; it uses prepare_run below.

LocalLauncher: both node groups as processes on this machine. The rollout process (rank 0, the store
host) and each trainer rank get CPUs of their own where the machine has enough (rollout first half,
trainer ranks the rest), so generation and training do not fight for a core.

Monitor loop
    waits for  any child to exit (polls every 0.2 s)
    on success every child exited 0 -> return 0
    on failure the first child to exit non-zero is the culprit; the others are given
               ``peer_timeout_s + grace`` to notice through the store and exit with their own message,
               then are terminated; the launcher names the culprit and returns non-zero
    on Ctrl-C  terminates every child
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from rolloutpipe.config import Config, save_config
from rolloutpipe.control.env import NodeEnv, Role, free_port, loopback_interface


class Launcher(Protocol):
    def launch(self, cfg: Config, run_dir: Path) -> int:
        """Run the job to completion; returns the exit code for the user's shell."""


def new_run_id(run_dir: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{run_dir.parent.name}-{run_dir.name}").strip("-")
    return f"{stem}-{secrets.token_hex(3)}"


def prepare_run(cfg: Config, run_dir: Path) -> Config:
    """Fix the run's directory and id, and write the resolved config that both node groups read."""
    cfg.run = replace(cfg.run, dir=str(run_dir), id=cfg.run.id or new_run_id(run_dir))
    save_config(cfg, run_dir / "config.yaml")
    return cfg


def plan_cpus(available: list[int], num_trainer_ranks: int) -> tuple[list[int], list[list[int]]]:
    """Rollout gets the first half of the CPUs, trainer ranks share the rest; everyone shares if too few."""
    if len(available) < 2:
        return available, [available] * num_trainer_ranks
    half = len(available) // 2
    rollout, rest = available[:half], available[half:]
    per_rank = max(1, len(rest) // num_trainer_ranks)
    trainers = [rest[(r * per_rank) % len(rest):][:per_rank] for r in range(num_trainer_ranks)]
    return rollout, trainers


@dataclass(kw_only=True, slots=True)
class Child:
    label: str
    process: subprocess.Popen


class LocalLauncher:
    grace_s: float = 10.0

    def launch(self, cfg: Config, run_dir: Path) -> int:
        assert cfg.run.id is not None
        secret = secrets.token_bytes(32)
        port = free_port()
        rollout_cpus, trainer_cpus = plan_cpus(sorted(os.sched_getaffinity(0)), cfg.trainer.num_ranks)
        envs = [NodeEnv(role=Role.rollout, rank=0, world_size=1, store_host="127.0.0.1", store_port=port,
                        run_id=cfg.run.id, secret=secret, run_dir=run_dir, cpus=rollout_cpus)]
        envs += [NodeEnv(role=Role.trainer, rank=r, world_size=cfg.trainer.num_ranks, store_host="127.0.0.1",
                         store_port=port, run_id=cfg.run.id, secret=secret, run_dir=run_dir, cpus=trainer_cpus[r])
                 for r in range(cfg.trainer.num_ranks)]
        children = [self._start(env) for env in envs]
        try:
            return self._monitor(children, cfg.pipeline.peer_timeout_s)
        except KeyboardInterrupt:
            print("interrupted: stopping both node groups", file=sys.stderr)
            _stop(children)
            return 130

    def _start(self, env: NodeEnv) -> Child:
        environ = {**os.environ, **env.to_environ(), "PYTHONUNBUFFERED": "1"}
        if (loopback := loopback_interface()) is not None:  # gloo's peer sockets: loopback too, like the stores
            environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        root = str(Path(__file__).resolve().parents[2])  # the directory that holds the package
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, environ.get("PYTHONPATH")]))
        process = subprocess.Popen([sys.executable, "-m", "rolloutpipe.launch.node"], env=environ)
        return Child(label=f"{env.role.value} rank {env.rank}", process=process)

    def _monitor(self, children: list[Child], peer_timeout_s: float) -> int:
        culprit: Child | None = None
        deadline = float("inf")
        while True:
            codes = {c.label: c.process.poll() for c in children}
            if all(code == 0 for code in codes.values()):
                return 0
            if culprit is None:
                culprit = next((c for c in children if c.process.returncode not in (None, 0)), None)
                if culprit is not None:
                    deadline = time.monotonic() + peer_timeout_s + self.grace_s
            if culprit is not None and (all(code is not None for code in codes.values()) or time.monotonic() > deadline):
                _stop(children)
                print(f"run failed: {culprit.label} exited with {_describe(culprit.process.returncode)}; "
                      "the other processes were stopped. See the messages above.", file=sys.stderr)
                return 1
            time.sleep(0.2)


def _stop(children: list[Child]) -> None:
    for c in children:
        if c.process.poll() is None:
            c.process.terminate()
    for c in children:
        try:
            c.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            c.process.kill()
            c.process.wait()


def _describe(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
