"""The job's typed configuration: Hydra YAML binds to these dataclasses, checked once at startup.

Each component's own settings live beside it (``rollout/config.py: RolloutConfig``, ``trainer/config.py:
TrainerConfig``, ``rollout/data.py: DataConfig``, ``launch/config.py: LauncherConfig``, ...), in modules that
import nothing that imports this one; this module assembles them and checks what spans components: the batch
arithmetic, with Slime's knob names at the top level so that a Slime user types what they know:

    rollout_batch_size * n_samples_per_prompt == global_batch_size * num_steps_per_rollout

``load_config`` is the only place a DictConfig becomes a Config; everything inward sees typed objects.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from rolloutpipe.control.weight_sync import WeightSync
from rolloutpipe.launch.config import LauncherConfig
from rolloutpipe.model import ModelConfig
from rolloutpipe.observe.tracking import WandbConfig
from rolloutpipe.rollout.config import EngineKind, RolloutConfig
from rolloutpipe.rollout.data import DataConfig
from rolloutpipe.rollout.rewards import RewardConfig
from rolloutpipe.trainer.config import TrainerConfig
from rolloutpipe.trainer.grpo import GRPOConfig


class ConfigError(ValueError):
    pass


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
    weight_sync: WeightSync = WeightSync.disk
    """How policy k+1 reaches the engines (control/weight_sync.py): ``disk`` (a safetensors file under run_dir/weights,
    any engine) or ``distributed`` (trainer rank 0 broadcasts to the engines; HTTP engines only)."""
    weight_sync_bucket_mb: float = 512.0
    """With ``weight_sync=distributed``: tensors per /update_weights_from_distributed call, up to this size."""

    def __post_init__(self) -> None:
        if self.weight_sync_bucket_mb <= 0:
            raise ValueError(f"pipeline.weight_sync_bucket_mb={self.weight_sync_bucket_mb} must be > 0.")
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
    resume: ResumeMode = ResumeMode.never
    """``auto``: continue from the run directory's last complete checkpoint (start fresh if there is none)."""
    checkpoint_every: int = 100
    """Write a step-atomic checkpoint every N steps (and after the last); 0: only the final weights."""
    keep_last_checkpoints: int = 2

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.keep_last_checkpoints < 1:
            raise ValueError("run.checkpoint_every must be >= 0 and run.keep_last_checkpoints >= 1.")


@dataclass(kw_only=True, slots=True)
class Config:
    seed: int = 1234
    num_rollout: int = 300
    """RL steps to run (Slime's --num-rollout)."""
    rollout_batch_size: int = 16
    """Prompts per step."""
    n_samples_per_prompt: int = 8
    global_batch_size: int = 128
    """Samples per optimizer step."""
    micro_batch_size: int = 32
    """Samples per forward/backward."""
    num_steps_per_rollout: int | None = None
    """Optimizer steps per RL step. Null: derived from the batch arithmetic."""
    rollout_max_response_len: int = 8
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    run: RunConfig = field(default_factory=RunConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        for key in ("num_rollout", "rollout_batch_size", "global_batch_size", "micro_batch_size",
                    "rollout_max_response_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1.")
        if self.n_samples_per_prompt < 2:
            raise ValueError(
                f"n_samples_per_prompt={self.n_samples_per_prompt}: GRPO needs at least 2 samples per prompt "
                "(advantages compare a sample with its group); use 4 to 16."
            )
        if not 0.0 < self.rollout_temperature:
            raise ValueError(f"rollout_temperature={self.rollout_temperature} must be > 0 for policy-gradient training.")
        if not 0.0 < self.rollout_top_p <= 1.0:
            raise ValueError(f"rollout_top_p={self.rollout_top_p} must be in (0, 1].")
        if self.global_batch_size % self.n_samples_per_prompt:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} must be a multiple of n_samples_per_prompt="
                f"{self.n_samples_per_prompt}: training batches are made of whole groups."
            )
        num_samples = self.rollout_batch_size * self.n_samples_per_prompt
        if num_samples % self.global_batch_size:
            raise ValueError(
                f"rollout_batch_size * n_samples_per_prompt = {num_samples} samples per step is not a multiple of "
                f"global_batch_size={self.global_batch_size}; set global_batch_size to a divisor of {num_samples}."
            )
        derived = num_samples // self.global_batch_size
        if self.num_steps_per_rollout is None:
            self.num_steps_per_rollout = derived
        elif self.num_steps_per_rollout != derived:
            raise ValueError(
                f"num_steps_per_rollout={self.num_steps_per_rollout} but rollout_batch_size * n_samples_per_prompt "
                f"/ global_batch_size = {derived}; drop num_steps_per_rollout (it is derived) or fix the batch sizes."
            )
        if self.run.resume is ResumeMode.auto and self.pipeline.mode is PipelineMode.async_one_step:
            raise ValueError(
                "run.resume=auto is not supported with pipeline.mode=async_one_step yet (its rollout runs a step "
                "ahead on the previous weights, which a checkpoint does not keep); use sync or cgp."
            )
        if self.run.resume is ResumeMode.auto and self.trainer.megatron.tensor_parallel_size > 1:
            raise ValueError(
                "run.resume=auto is not supported with trainer.megatron.tensor_parallel_size > 1 yet (checkpoints "
                "keep the optimizer state of trainer rank 0 only); resume with tensor_parallel_size=1."
            )
        if self.pipeline.weight_sync is WeightSync.distributed:
            if self.rollout.engine is EngineKind.embedded:
                raise ValueError(
                    "pipeline.weight_sync=distributed needs engines behind SGLang's HTTP API, which join the "
                    "trainer's broadcast: set rollout.engine=embedded_http (CPU) or rollout.engine=sglang, or use "
                    "pipeline.weight_sync=disk with rollout.engine=embedded."
                )
            if self.pipeline.mode is PipelineMode.async_one_step:
                raise ValueError(
                    "pipeline.weight_sync=distributed is not supported with pipeline.mode=async_one_step: trainer "
                    "rank 0's broadcast would wait for the rollout's step boundary, removing the overlap that mode "
                    "exists for. Use pipeline.weight_sync=disk (or pipeline.mode=sync or cgp)."
                )
        if self.rollout.num_engines > self.rollout_batch_size:
            raise ValueError(
                f"rollout.num_engines={self.rollout.num_engines} exceeds rollout_batch_size={self.rollout_batch_size}; "
                "engines would idle."
            )

    @property
    def groups_per_batch(self) -> int:
        return self.global_batch_size // self.n_samples_per_prompt


def _must_set(key: str, what: str) -> str:
    raise ConfigError(f"{key} must be set for this experiment: {what}. Add {key}=... to the command line.")


OmegaConf.register_new_resolver("must_set", _must_set, replace=True)
"""Presets write ``path: ${must_set:model.path,an HF model directory}`` for what the user has to give."""


def register_hydra_schema() -> None:
    """Make ``base_config`` (this schema) available to conf/config.yaml's defaults list."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)


def load_config(raw: DictConfig | dict) -> Config:
    """Bind and validate; every error names the key and the fix."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except InterpolationResolutionError as err:
        raise ConfigError(str(err).splitlines()[0].split("resolving interpolation: ", 1)[-1]) from None
    except ConfigKeyError as err:
        raise ConfigError(_unknown_key_message(err)) from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"bad config value at {err.full_key}: {err.msg}") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None


def save_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def read_config(path: Path) -> Config:
    return load_config(OmegaConf.load(path))


def _unknown_key_message(err: ConfigKeyError) -> str:
    full_key = err.full_key or ""
    parent, _, name = full_key.rpartition(".")
    node = OmegaConf.structured(Config)
    if parent:
        node = OmegaConf.select(node, parent)
    known = list(node.keys()) if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" Did you mean {', '.join(repr(f'{parent}.{c}' if parent else c) for c in close)}?" if close else ""
    where = f"under '{parent}'" if parent else "at the top level"
    return f"unknown config key '{full_key}'.{hint} Known keys {where}: {', '.join(known)}."
