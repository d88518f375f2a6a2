"""The environment contract between a launcher and a node-group process.

Every launcher (local processes, Slurm, TorchX) starts the same entry point,
``python -m rolloutpipe.launch.node``, with these variables:

    RP_ROLE          rollout | trainer
    RP_RANK          rank within the node group (rollout: 0 is the rollout manager, every rank the engine
                     host of its node: rollout/engines/hosts.py)
    RP_WORLD_SIZE    processes in the node group
    RP_STORE_HOST    host of the TCPStore (hosted by rollout rank 0)
    RP_STORE_HOST_VAR  instead of RP_STORE_HOST: the name of a variable that holds the host or a Slurm
                     node list whose first host it is (TorchX's ``rank0_env``)
    RP_STORE_PORT
    RP_RUN_ID        names the run's store keys
    RP_RUN_SECRET    hex; the key of each attempt derives from it (control/attempt.py), which seals every
                     store record and derives the engines' API key. Never written to disk by RolloutPipe,
                     never printed; ``NodeEnv.take`` removes it from the process's environment, so no child
                     process (engine servers, reward workers) inherits it
    RP_RUN_DIR       the run directory, shared by both node groups
    RP_CPUS          optional, e.g. "0,1": CPUs this process is pinned to
    RP_PARENT_PID    optional (the local launcher sets it): the process dies with its parent (control/lifetime.py)
    SLURM_RESTART_COUNT  set by Slurm in a requeued job: the process resumes from the last checkpoint, and the
                     attempt's key differs from every earlier attempt's

Inside one step of a Slurm heterogeneous job (``srun --het-group=0 ... : --het-group=1 ...``) the
launcher sets only RP_RUN_ID, RP_RUN_SECRET, RP_RUN_DIR (and optionally RP_STORE_PORT) and the rest
comes from Slurm, because no Slurm variable names a task's het group:

    het group 0       the rollout node group; its first task (SLURM_PROCID 0) hosts the store
    het groups 1..    the trainer node group, ranks in SLURM_PROCID order
    role, rank        SLURM_PROCID < SLURM_NTASKS_HET_GROUP_0: rollout rank SLURM_PROCID, else
                      trainer rank SLURM_PROCID - SLURM_NTASKS_HET_GROUP_0
    world sizes       SLURM_NTASKS_HET_GROUP_0 and SLURM_STEP_NUM_TASKS - SLURM_NTASKS_HET_GROUP_0
    store host        the first host of SLURM_JOB_NODELIST_HET_GROUP_0 (tasks are placed in block order)
    store port        RP_STORE_PORT, else 20000 + SLURM_JOB_ID mod 10000 (SLURM_JOB_ID is the het job's
                      id in every task), so that two jobs sharing a node do not collide
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import random
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHER_VARS = ("RP_RUN_ID", "RP_RUN_SECRET", "RP_RUN_DIR")
"""What every launcher passes, on Slurm too: the run's identity, its secret and where it writes."""


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
    secret: bytes = field(repr=False)
    run_dir: Path
    cpus: list[int] | None = None
    restart_count: int = 0
    """How often Slurm requeued the job (SLURM_RESTART_COUNT): > 0 means resume from the last checkpoint."""

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def hosts_store(self) -> bool:
        """Rollout rank 0 hosts the run's TCPStore; everyone else connects to it."""
        return self.role is Role.rollout and self.rank == 0

    @property
    def attempt_key(self) -> bytes:
        """What seals this attempt's records and signs its handles (control/attempt.py): no record of an earlier
        attempt of a requeued job passes in this one."""
        return attempt_key(self.secret, self.run_id, self.restart_count)

    @property
    def engine_api_key(self) -> str:
        """The API key of the engine servers the rollout node starts (``--api-key``): derived from the attempt's
        key, so it is this attempt's own and the secret itself never leaves the node process."""
        return hmac.new(self.attempt_key, b"rolloutpipe engine api key", hashlib.sha256).hexdigest()

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
    def take(cls) -> NodeEnv:
        """This process's NodeEnv, with the secret removed from ``os.environ`` before any child process starts."""
        env = cls.from_environ()
        os.environ.pop("RP_RUN_SECRET", None)
        return env

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> NodeEnv:
        """The explicit RP_* contract if RP_ROLE is set, else the Slurm het-job derivation."""
        environ = dict(os.environ if environ is None else environ)
        if "RP_ROLE" not in environ and "SLURM_HET_SIZE" in environ:
            return cls.from_slurm(environ)
        host_var = environ.get("RP_STORE_HOST_VAR")
        if "RP_STORE_HOST" not in environ and host_var:
            if not environ.get(host_var):
                raise RuntimeError(f"RP_STORE_HOST_VAR names {host_var}, which is not set in this process.")
            environ["RP_STORE_HOST"] = expand_hostlist(environ[host_var])[0]
        _require(environ, ("RP_ROLE", "RP_RANK", "RP_WORLD_SIZE", "RP_STORE_HOST", "RP_STORE_PORT", *LAUNCHER_VARS))
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
            restart_count=int(environ.get("SLURM_RESTART_COUNT") or 0),
        )

    @classmethod
    def from_slurm(cls, environ: dict[str, str]) -> NodeEnv:
        """Role, rank and store address of a task in a het-job step (see the module docstring)."""
        _require(environ, LAUNCHER_VARS)
        _require(environ, ("SLURM_HET_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_JOB_ID",
                           "SLURM_NTASKS_HET_GROUP_0", "SLURM_JOB_NODELIST_HET_GROUP_0"))
        proc_id, num_tasks = int(environ["SLURM_PROCID"]), int(environ["SLURM_STEP_NUM_TASKS"])
        num_rollout = int(environ["SLURM_NTASKS_HET_GROUP_0"])
        if int(environ["SLURM_HET_SIZE"]) < 2 or num_tasks <= num_rollout:
            raise RuntimeError(
                f"this Slurm step has {num_tasks} tasks and het group 0 has {num_rollout}: the step must span het "
                "group 0 (the rollout node group) and the trainer's het groups, e.g. "
                "srun --het-group=0 ... : --het-group=1 ... (see slurm/rolloutpipe.sbatch)."
            )
        is_rollout = proc_id < num_rollout
        return cls(
            role=Role.rollout if is_rollout else Role.trainer,
            rank=proc_id if is_rollout else proc_id - num_rollout,
            world_size=num_rollout if is_rollout else num_tasks - num_rollout,
            store_host=expand_hostlist(environ["SLURM_JOB_NODELIST_HET_GROUP_0"])[0],
            store_port=int(environ.get("RP_STORE_PORT") or slurm_store_port(int(environ["SLURM_JOB_ID"]))),
            run_id=environ["RP_RUN_ID"],
            secret=bytes.fromhex(environ["RP_RUN_SECRET"]),
            run_dir=Path(environ["RP_RUN_DIR"]),
            restart_count=int(environ.get("SLURM_RESTART_COUNT") or 0),
        )


def attempt_key(secret: bytes, run_id: str, attempt: int) -> bytes:
    """The key every record, handle and engine API key of attempt ``attempt`` (SLURM_RESTART_COUNT) derives from
    (control/attempt.py)."""
    return hmac.new(secret, f"rolloutpipe attempt\n{run_id}\n{attempt}".encode(), hashlib.sha256).digest()


def free_port() -> int:
    """A port free now, chosen in 30000-32767: below Linux's ephemeral range (32768+), so no outgoing connection
    takes it before the store binds it (on Slurm that can be minutes later), and above the ports Slurm jobs
    derive from their id (slurm_store_port: 20000-29999). Falls back to one the kernel picks."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(30000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_address(store_host: str) -> str:
    """Where the job's other processes reach this one (trainer rank 0's weight-update group, a node's engine
    servers): loopback when the whole job is on this host (the store is on loopback), else this node's name."""
    if store_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return socket.getfqdn()


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on the address ``host`` names (loopback for 127.0.0.1 or localhost, the node's own
    address for its host name), never on every interface; port 0 takes a free one. For the stores RolloutPipe
    hosts (``TCPStore(master_listen_fd=...)``), which would otherwise listen on all interfaces."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux), for ``GLOO_SOCKET_IFNAME`` in a run on one machine."""
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def slurm_store_port(job_id: int) -> int:
    """Below Linux's ephemeral range (32768+), and different for jobs whose ids differ by < 10000."""
    return 20000 + job_id % 10000


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, e.g. ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1.

    One bracket per host name, as Slurm writes node lists for names with one number in them.
    """
    hosts: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", hostlist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}{suffix}")
    return hosts


def _require(environ: dict[str, str], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in environ]
    if missing:
        raise RuntimeError(
            f"rolloutpipe.launch.node needs {', '.join(missing)} in its environment; start it through a launcher "
            "(python launch.py, slurm/rolloutpipe.sbatch, or the TorchX component), not by hand. On Slurm the "
            "launcher's variables reach the tasks through sbatch's environment (--export=ALL)."
        )


def trainer_process_group_backend() -> str:
    """Bind this trainer rank to its GPU (the node-local task id picks it) and name the process-group backend:
    gloo on CPU; on GPU NCCL for CUDA tensors (Megatron's gradients) and gloo for the CPU tensors of the
    per-step metric reduction. Untested on GPU here (no GPU was available); tools/gpu_check.py exercises it."""
    import torch

    if not torch.cuda.is_available():
        return "gloo"
    local = int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)
    torch.cuda.set_device(local % torch.cuda.device_count())
    return "cpu:gloo,cuda:nccl"
