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

Each node process runs in its own session, so that its process group (it, its reward workers) is one unit to
signal, and dies with the launcher if the launcher is killed (control/lifetime.py draws the whole tree).

Monitor loop
    waits for  any child to exit, or a stop signal (polls every 0.2 s)
    on success every child exited 0 -> return 0
    on failure the first child to exit non-zero is the culprit (or one a signal ended: the others may have
               noticed it and exited first); the others are given
               ``peer_timeout_s + grace`` to notice through the store and exit with their own message
               (``grace`` alone when the culprit hosted the store: with it gone they can only say so, and a
               thread still connecting to it would hold its process for the connect timeout), then are
               stopped; the launcher names the culprit and returns 1
    on a stop  SIGTERM, SIGINT (Ctrl-C) or SIGHUP: every node's process group gets SIGTERM (each node stops its
               engine servers and reward workers, then exits), the groups still there after
               ``launcher.stop_grace_s`` get SIGKILL; the launcher says how each ended and returns
               128 + the signal (launch.py then prints the resume command)
"""

from __future__ import annotations

import contextlib
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
from rolloutpipe.control.lifetime import PEER_STOPPED_EXIT, STOP_SIGNALS, child_environ, stop_groups


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
    essential: bool = True
    """False for an engine host (rollout rank > 0): the run survives losing one (rollout/engines/hosts.py)."""
    hosts_store: bool = False
    """Rollout rank 0, which hosts the run's TCPStore (pipeline.open_transport)."""


class LocalLauncher:
    grace_s: float = 10.0
    """After a child fails: how long past ``pipeline.peer_timeout_s`` the others get to notice on their own."""

    def __init__(self) -> None:
        self._signal: int | None = None
        """The first stop signal received (the handler only notes it; the monitor loop acts on it)."""

    def launch(self, cfg: Config, run_dir: Path) -> int:
        assert cfg.run.id is not None
        secret = secrets.token_bytes(32)
        port = free_port()
        rollout_cpus, trainer_cpus = plan_cpus(sorted(os.sched_getaffinity(0)), cfg.trainer.num_ranks)
        num_hosts = cfg.launcher.rollout.nodes  # rollout processes, standing in for nodes (rollout/engines/hosts.py)
        envs = [NodeEnv(role=Role.rollout, rank=r, world_size=num_hosts, store_host="127.0.0.1", store_port=port,
                        run_id=cfg.run.id, secret=secret, run_dir=run_dir, cpus=rollout_cpus) for r in range(num_hosts)]
        envs += [NodeEnv(role=Role.trainer, rank=r, world_size=cfg.trainer.num_ranks, store_host="127.0.0.1",
                         store_port=port, run_id=cfg.run.id, secret=secret, run_dir=run_dir, cpus=trainer_cpus[r])
                 for r in range(cfg.trainer.num_ranks)]
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            children = [self._start(env) for env in envs]  # a signal meanwhile is acted on by the monitor
            return self._monitor(children, cfg.pipeline.peer_timeout_s, cfg.launcher.stop_grace_s)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame) -> None:
        if self._signal is None:
            self._signal = signum

    def _start(self, env: NodeEnv) -> Child:
        environ = {**child_environ(), **env.to_environ(), "PYTHONUNBUFFERED": "1"}
        if env.role is Role.trainer:  # every rank on this machine: each binds to its own GPU (control/env.py)
            environ["LOCAL_RANK"] = str(env.rank)
        if (loopback := loopback_interface()) is not None:  # gloo's peer sockets: loopback too, like the stores
            environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        root = str(Path(__file__).resolve().parents[2])  # the directory that holds the package
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, environ.get("PYTHONPATH")]))
        process = subprocess.Popen([sys.executable, "-m", "rolloutpipe.launch.node"], env=environ,
                                   start_new_session=True)
        host = env.role is Role.rollout and env.rank > 0
        return Child(label=f"{env.role.value} rank {env.rank}{' (engine host)' if host else ''}", process=process,
                     essential=not host, hosts_store=env.hosts_store)

    def _monitor(self, children: list[Child], peer_timeout_s: float, stop_grace_s: float) -> int:
        culprit: Child | None = None
        deadline = float("inf")
        while True:
            if self._signal is not None:
                return self._stop_on_signal(children, stop_grace_s)
            codes = {c.label: c.process.poll() for c in children}
            for child in [c for c in children if not c.essential and c.process.returncode not in (None, 0)]:
                children.remove(child)  # the manager retires its engines; the run goes on without it
                _say(f"{child.label} ended with {_describe(child.process.returncode)}; the rollout manager takes its "
                     "engines out of service and the run goes on while rollout.min_engines remain")
            if all(c.process.returncode == 0 for c in children):
                return 0
            if culprit is None:
                culprit = next((c for c in children if c.process.returncode not in (None, 0)), None)
                if culprit is not None:
                    deadline = time.monotonic() + self.grace_s + (0 if culprit.hosts_store else peer_timeout_s)
            if culprit is not None and (all(code is not None for code in codes.values())
                                        or time.monotonic() > deadline):
                # one a signal ended (not ours, below) is the cause, even when a peer noticed and exited first; else
                # one that failed, rather than one that stopped for it (PEER_STOPPED_EXIT)
                codes = {c.label: c.process.poll() for c in children}
                culprit = (next((c for c in children if not 0 <= (codes[c.label] or 0) <= 128), None)
                           or next((c for c in children if codes[c.label] not in (None, 0, PEER_STOPPED_EXIT)), None)
                           or culprit)
                stop_groups([c.process for c in children], stop_grace_s)
                print(f"run failed: {culprit.label} exited with {_describe(culprit.process.returncode)}; "
                      "the other processes were stopped. See the messages above.", file=sys.stderr)
                return 1
            time.sleep(0.2)

    def _stop_on_signal(self, children: list[Child], stop_grace_s: float) -> int:
        name = signal.Signals(self._signal).name
        _say(f"{name}: stopping the run: SIGTERM to the process groups of "
             f"{', '.join(f'{c.label} (pid {c.process.pid})' for c in children)}; each stops its children (engine "
             "servers, reward workers) and exits, or its group is killed after "
             f"launcher.stop_grace_s={stop_grace_s:g}s")
        killed = stop_groups([c.process for c in children], stop_grace_s)
        ended = [f"{c.label} killed (SIGKILL) after {stop_grace_s:g}s" if k
                 else f"{c.label} exited with {_describe(c.process.returncode)}" for c, k in zip(children, killed)]
        _say(f"stopped by {name}: {', '.join(ended)}")
        return 128 + self._signal


def _say(line: str) -> None:
    """A line on stderr, if there still is one: after SIGHUP the terminal may be gone, and the stop goes on."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def _describe(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    if code - 128 in STOP_SIGNALS:  # how launch/node.py exits when a signal stops it
        return f"exit code {code} (stopped by {signal.Signals(code - 128).name})"
    return f"exit code {code}"
