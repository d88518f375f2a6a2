"""The launcher's config (``launcher.*``): which launcher, and the Slurm resources of each node group."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class LauncherKind(enum.Enum):
    local = "local"
    slurm = "slurm"
    sbatch = "sbatch"


@dataclass(kw_only=True, slots=True)
class HetGroupConfig:
    """Slurm resources of one node group, i.e. one het group of the job (kind=slurm)."""

    nodes: int = 1
    tasks_per_node: int = 1
    """Processes per node: trainer ranks per node for the trainer (one per GPU on GPU nodes)."""
    cpus_per_task: int | None = None
    """Null: Slurm's default (1 CPU per task)."""
    gpus_per_node: int = 0
    mem_gb: float | None = None
    """Each node's memory (sbatch --mem, in GiB), which the host memory plan checks the node's estimate against
    (launch/host_memory.py: a warning at launch). Null: the partition's default, not checked."""
    partition: str | None = None
    """Null: launcher.partition."""
    sbatch: list[str] = field(default_factory=list)
    """More options for this het group, e.g. ['--constraint=h100', '--exclusive']: one option each, written quoted
    as one #SBATCH line."""

    @property
    def num_tasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(kw_only=True, slots=True)
class LauncherConfig:
    kind: LauncherKind = LauncherKind.local
    job_name: str = "rolloutpipe"
    """The Slurm job's name (kind=slurm); the keys below are for kind=slurm too."""
    partition: str | None = None
    account: str | None = None
    time_min: int = 60
    """Time limit of both het groups, in minutes."""
    rollout: HetGroupConfig = field(default_factory=HetGroupConfig)
    """Het group 0: one process per node, each the engine host of its node (rollout.engines_per_node engine
    servers); the first also the rollout manager, which hosts the store. kind=local: ``nodes`` rollout processes
    on this machine, standing in for nodes."""
    trainer: HetGroupConfig = field(default_factory=HetGroupConfig)
    """Het group 1: nodes * tasks_per_node must equal trainer.num_ranks."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the batch script runs before the step, e.g. ['module load cuda', 'source .venv/bin/activate'],
    written as they are (they are commands), one line each."""
    store_port: int | None = None
    """Null: 20000 + job id mod 10000 (see control/env.py)."""
    poll_s: float = 10.0
    """How often the launcher asks sacct about the job."""
    dry_run: bool = False
    """Print the batch script and stop, submitting nothing."""
    requeue_grace_s: int = 120
    """kind=slurm and sbatch: Slurm warns the job this many seconds before its time limit (``--signal=B:USR1@``);
    the run stops after the step in progress and its checkpoint if that ends well within it (else it drops the
    step), and the job requeues itself (``scontrol requeue``): the requeued job resumes from the checkpoint, with
    the same run id and directory (launch/requeue.py). Make it longer than a step and a checkpoint write."""
    max_requeues: int = 3
    """How often the job may requeue itself at the time limit; past it, it stops at the checkpoint and the run is
    resumed by hand (``run.resume=auto``). 0: the job is not requeueable. A preemption or an ``scontrol requeue``
    from outside is Slurm's own requeue, and resumes the same way."""
    stop_grace_s: float = 10.0
    """kind=local, on SIGTERM / SIGINT / SIGHUP (or a failed run): how long each node process gets to stop its
    engine servers and reward workers and exit after its SIGTERM, before its process group is SIGKILLed."""

    def __post_init__(self) -> None:
        if self.rollout.tasks_per_node != 1:
            raise ValueError(
                f"launcher.rollout.tasks_per_node={self.rollout.tasks_per_node}: a rollout node runs one process (its "
                "engine host, which starts the node's rollout.engines_per_node engine servers); keep it 1 and set "
                "launcher.rollout.nodes for more rollout nodes."
            )
        for name, group in (("rollout", self.rollout), ("trainer", self.trainer)):
            for key in ("nodes", "tasks_per_node"):
                if getattr(group, key) < 1:
                    raise ValueError(f"launcher.{name}.{key}={getattr(group, key)} must be >= 1.")
        if self.time_min < 1 or self.poll_s <= 0:
            raise ValueError(f"launcher.time_min={self.time_min} must be >= 1 and launcher.poll_s={self.poll_s} > 0.")
        if self.requeue_grace_s < 10 or self.max_requeues < 0:
            raise ValueError(f"launcher.requeue_grace_s={self.requeue_grace_s} must be >= 10 (seconds before the time "
                             f"limit) and launcher.max_requeues={self.max_requeues} >= 0.")
        if self.stop_grace_s <= 0:
            raise ValueError(f"launcher.stop_grace_s={self.stop_grace_s} must be > 0: the seconds each node process "
                             "gets to stop its engine servers and exit before it is killed (default 10).")
        if self.store_port is not None and not 1024 <= self.store_port < 65536:
            raise ValueError(f"launcher.store_port={self.store_port} must be in [1024, 65536) or null.")
