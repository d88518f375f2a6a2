"""The settings of the run as a whole that both node groups read: the pipeline mode and its plane, resuming.

``pipeline.*`` (PipelineConfig: sync, cgp or async_one_step, the store's timeouts, weight sync) and ``run.*``
(RunConfig: outputs, resume, checkpoints). config.py binds them into the job's Config with every other section.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rolloutpipe.control.weights import WeightSync


class PipelineMode(enum.Enum):
    sync = "sync"
    """Train only once the whole rollout batch is in (Slime's behaviour; the baseline)."""
    cgp = "cgp"
    """Complete-group pipelining: train each group as soon as all its samples are rewarded."""
    async_one_step = "async_one_step"
    """A baseline, not a default: step k+1 is generated with policy k while step k trains (one step stale,
    like Slime's train_async.py and veRL's one-step-off policy); groups are released as in cgp."""

    def policy_version_for(self, step: int) -> int:
        """The weights that generate step ``step``'s samples."""
        return max(step - 1, 0) if self is PipelineMode.async_one_step else step


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    mode: PipelineMode = PipelineMode.cgp
    inline_payload_max_bytes: int = 1 << 20
    """Group payloads up to this size travel inside the store; larger ones through run_dir/payloads."""
    connect_timeout_s: float = 120.0
    """How long a component waits for the store and for the other components to show up."""
    peer_timeout_s: float = 30.0
    """A process whose heart-beat stops this long is declared dead, and the run stops."""
    heartbeat_s: float = 1.0
    weight_sync: WeightSync | None = WeightSync.disk
    """How policy k+1 reaches the engines (control/weights/): ``disk`` (a safetensors file under run_dir/weights,
    any engine) or ``distributed`` (trainer rank 0 broadcasts to the engines; HTTP engines only). Null (the GPU
    presets): ``distributed`` where it can serve, else ``disk`` (control/weights ``choose``), resolved at load."""
    weight_sync_bucket_mb: float = 512.0
    """With ``weight_sync=distributed``: tensors per /update_weights_from_distributed call, up to this size."""
    weights_visible_timeout_s: float = 120.0
    """With ``weight_sync=disk``: how long the rollout node waits for a policy file the trainer wrote to show up
    complete on its side of a shared file system (NFS and Lustre can lag behind the writer) before it stops the run.
    The engines are never asked to load a file that is missing, short or not the one the trainer wrote (SGLang's
    /update_weights_from_disk takes the server down when the load fails)."""

    def __post_init__(self) -> None:
        if self.weight_sync_bucket_mb <= 0:
            raise ValueError(f"pipeline.weight_sync_bucket_mb={self.weight_sync_bucket_mb} must be > 0.")
        if self.weights_visible_timeout_s < 0:
            raise ValueError(f"pipeline.weights_visible_timeout_s={self.weights_visible_timeout_s} must be >= 0.")
        if self.peer_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"pipeline.peer_timeout_s={self.peer_timeout_s} must exceed twice pipeline.heartbeat_s="
                f"{self.heartbeat_s}, or healthy processes would be declared dead."
            )


class ResumeMode(enum.Enum):
    never = "never"
    auto = "auto"


@dataclass(kw_only=True, slots=True)
class RunConfig:
    dir: str | None = None
    """Where outputs go. Null: Hydra's output directory."""
    id: str | None = None
    """Names the run's store keys. Null: derived from the run directory plus a random suffix."""
    save_samples: bool = False
    """Write every sample of every step to run_dir/rollouts/step=<k>.jsonl."""
    draw_timeline: bool = True
    """Draw run_dir/timeline.png (and W&B's timeline/picture) at the end of the run: about a second of trainer rank
    0 (matplotlib, the viz extra). false: trace.json, lifecycle.jsonl and the W&B tables only; tools/timeline.py
    draws the picture afterwards."""
    resume: ResumeMode = ResumeMode.never
    """``auto``: continue from the run directory's last complete checkpoint (start fresh if there is none)."""
    checkpoint_every: int = 100
    """Write a step-atomic checkpoint every N steps (and after the last); 0: only the final weights."""
    keep_last_checkpoints: int = 2

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.keep_last_checkpoints < 1:
            raise ValueError("run.checkpoint_every must be >= 0 and run.keep_last_checkpoints >= 1.")
