"""The environment contract between a launcher and a node-group process.

Every launcher (local processes, Slurm, TorchX) starts the same entry point,
``python -m rolloutpipe.node``, with these variables:

    RP_ROLE          rollout | trainer
    RP_RANK          rank within the node group
    RP_WORLD_SIZE    processes in the node group
    RP_STORE_HOST    host of the TCPStore (hosted by rollout rank 0)
    RP_STORE_PORT
    RP_RUN_ID        names the run's store keys
    RP_RUN_SECRET    hex; signs group handles (never written to disk by RolloutPipe)
    RP_RUN_DIR       the run directory, shared by both node groups
    RP_CPUS          optional, e.g. "0,1": CPUs this process is pinned to
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path


class Role(enum.Enum):
    rollout = "rollout"
    trainer = "trainer"


@dataclass(kw_only=True, slots=True)
class NodeEnv:
    role: Role
    rank: int
    world_size: int
    store_host: str
    store_port: int
    run_id: str
    secret: bytes
    run_dir: Path
    cpus: list[int] | None = None

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.yaml"

    def to_environ(self) -> dict[str, str]:
        env = {
            "RP_ROLE": self.role.value,
            "RP_RANK": str(self.rank),
            "RP_WORLD_SIZE": str(self.world_size),
            "RP_STORE_HOST": self.store_host,
            "RP_STORE_PORT": str(self.store_port),
            "RP_RUN_ID": self.run_id,
            "RP_RUN_SECRET": self.secret.hex(),
            "RP_RUN_DIR": str(self.run_dir),
        }
        if self.cpus:
            env["RP_CPUS"] = ",".join(map(str, self.cpus))
        return env

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> NodeEnv:
        environ = dict(os.environ if environ is None else environ)
        missing = [k for k in ("RP_ROLE", "RP_RANK", "RP_WORLD_SIZE", "RP_STORE_HOST", "RP_STORE_PORT", "RP_RUN_ID",
                               "RP_RUN_SECRET", "RP_RUN_DIR") if k not in environ]
        if missing:
            raise RuntimeError(
                f"rolloutpipe.node needs {', '.join(missing)} in its environment; start it through a launcher "
                "(python launch.py, or the Slurm and TorchX launchers), not by hand."
            )
        cpus = environ.get("RP_CPUS")
        return cls(
            role=Role(environ["RP_ROLE"]),
            rank=int(environ["RP_RANK"]),
            world_size=int(environ["RP_WORLD_SIZE"]),
            store_host=environ["RP_STORE_HOST"],
            store_port=int(environ["RP_STORE_PORT"]),
            run_id=environ["RP_RUN_ID"],
            secret=bytes.fromhex(environ["RP_RUN_SECRET"]),
            run_dir=Path(environ["RP_RUN_DIR"]),
            cpus=[int(c) for c in cpus.split(",")] if cpus else None,
        )
