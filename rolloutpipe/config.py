"""The job's typed configuration: Hydra YAML binds to these dataclasses, checked once at startup.

Each component's own settings live beside it (``rollout/config.py: RolloutConfig``, ``trainer/config.py:
TrainerConfig``, ``rollout/data.py: DataConfig``, ``launch/config.py: LauncherConfig``, ...), in modules that
import nothing that imports this one; this module assembles them and checks what spans components: the batch
arithmetic, with Slime's knob names at the top level so that a Slime user types what they know:

    rollout_batch_size * n_samples_per_prompt == global_batch_size * num_steps_per_rollout

``load_config`` is the only place a DictConfig becomes a Config; everything inward sees typed objects.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from rolloutpipe.control.run import PipelineConfig, PipelineMode, ResumeMode, RunConfig
from rolloutpipe.control.weights import WeightSync, WeightSyncSettings
from rolloutpipe.control.weights import choose as choose_weight_sync
from rolloutpipe.launch.config import LauncherConfig
from rolloutpipe.model import ModelConfig
from rolloutpipe.observe.tracking import WandbConfig
from rolloutpipe.rollout.config import EngineKind, EngineSetup, RolloutConfig
from rolloutpipe.rollout.data import DataConfig
from rolloutpipe.rollout.environments.base import ADAPTERS, BUILT_IN, missing_extra
from rolloutpipe.rollout.environments.config import EnvironmentConfig
from rolloutpipe.rollout.evaluation import EvalConfig
from rolloutpipe.rollout.rewards import RewardConfig
from rolloutpipe.trainer.config import GRPOConfig, TrainerConfig


class ConfigError(ValueError):
    pass


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
    """Samples per forward/backward (when max_tokens_per_micro_batch is 0)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward/backward (Slime's --use-dynamic-batch-size --max-tokens-per-gpu): a rank packs
    the samples of the groups that have arrived into micro-batches of at most this many tokens, first fit. A token
    is a padded slot: rows x the micro-batch's longest prompt + response, what memory scales with. A longer sample
    trains alone (with a warning). 0: fixed micro_batch_size samples (trainer/batching.py)."""
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
    eval: EvalConfig = field(default_factory=EvalConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes (rollout/environments/): null name, one response per sample."""

    def check_resumable(self) -> None:
        """Refuse a resume this config cannot make exactly: at launch with run.resume=auto, and in every requeued
        attempt of a Slurm job (pipeline.run_node), which resumes by itself."""
        if self.pipeline.mode is PipelineMode.async_one_step:
            raise ValueError(
                "run.resume=auto is not supported with pipeline.mode=async_one_step yet (its rollout runs a step "
                "ahead on the previous weights, which a checkpoint does not keep); use sync or cgp."
            )
        if self.trainer.megatron.tensor_parallel_size > 1:
            raise ValueError(
                "run.resume=auto is not supported with trainer.megatron.tensor_parallel_size > 1 yet (checkpoints "
                "keep the optimizer state of trainer rank 0 only); resume with tensor_parallel_size=1."
            )

    def __post_init__(self) -> None:
        for key in ("num_rollout", "rollout_batch_size", "global_batch_size", "micro_batch_size",
                    "rollout_max_response_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1.")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 0: 0 for micro-batches of "
                "micro_batch_size samples, or a budget of padded tokens (rows x longest prompt + response) per "
                "forward/backward."
            )
        if self.n_samples_per_prompt < 2:
            raise ValueError(
                f"n_samples_per_prompt={self.n_samples_per_prompt}: GRPO needs at least 2 samples per prompt "
                "(advantages compare a sample with its group); use 4 to 16."
            )
        if not 0.0 < self.rollout_temperature:
            raise ValueError(
                f"rollout_temperature={self.rollout_temperature} must be > 0 for policy-gradient training."
            )
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
        if self.run.resume is ResumeMode.auto:
            self.check_resumable()
        if self.pipeline.weight_sync is None:  # (config.yaml records the way chosen)
            self.pipeline.weight_sync = self.weight_sync_choice()[0]
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
        if self.rollout.speculative and self.rollout.engine is not EngineKind.embedded:
            raise ValueError(
                f"rollout.speculative=true needs rollout.engine=embedded (not {self.rollout.engine.value}): only the "
                "in-process embedded engine verifies drafts; SGLang's API cannot verify one exactly against its "
                "seeded sampler (docs/speculative.md says what it lacks). Set rollout.speculative=false."
            )
        if self.rollout.batch_invariant is None:  # (speculation is exact only batch invariant: engines/verify.py)
            self.rollout.batch_invariant = self.rollout.speculative
        if self.rollout.speculative and not self.rollout.batch_invariant:
            raise ValueError(
                f"rollout.speculative=true with rollout.batch_invariant=false: in {self.model.dtype.value} a padded "
                "prefill verifies a draft with other bits than decoding gives, so tokens and log-probs could differ "
                "from the run without drafts; drop rollout.batch_invariant=false (null turns it on with speculation; "
                "docs/speculative.md)."
            )
        if self.rollout.speculative and self.pipeline.mode is PipelineMode.async_one_step:
            raise ValueError(
                "rollout.speculative=true with pipeline.mode=async_one_step: that mode already generates step k+1 "
                "under policy k, so there is no tail to draft in. Use pipeline.mode=cgp (or sync), or drop "
                "rollout.speculative."
            )
        if self.environment.name is not None:
            self._check_environment()
        initial = self.rollout_batch_size + self.rollout.over_sampling_groups
        if self.rollout.max_groups_per_step is not None and self.rollout.max_groups_per_step < initial:
            raise ValueError(
                f"rollout.max_groups_per_step={self.rollout.max_groups_per_step} is below what a step admits at "
                f"its start, rollout_batch_size + rollout.over_sampling_groups = {initial}; raise it (or leave it "
                "null: 10 x rollout_batch_size)."
            )
        self.rollout.place_engines(self.launcher.rollout.nodes)
        gpus = self.launcher.rollout.gpus_per_node
        per_node = self.rollout.engines_per_node * self.rollout.sglang_gpus_per_engine
        if self.rollout.engines_on_gpus and gpus and per_node > gpus:
            raise ValueError(
                f"rollout.engines_per_node={self.rollout.engines_per_node} x rollout.sglang_gpus_per_engine="
                f"{self.rollout.sglang_gpus_per_engine} GPUs do not fit a rollout node's launcher.rollout."
                f"gpus_per_node={gpus}; use {gpus // self.rollout.sglang_gpus_per_engine or 1} engines per node or "
                "more launcher.rollout.nodes."
            )
        if self.rollout.num_engines > self.rollout_batch_size:
            raise ValueError(
                f"rollout.num_engines={self.rollout.num_engines} exceeds rollout_batch_size={self.rollout_batch_size}; "
                "engines would idle."
            )

    def _check_environment(self) -> None:
        """What an environment run cannot do yet, or needs, said before any process starts."""
        name = self.environment.name
        if (error := missing_extra(name)) is not None:
            raise ValueError(error)
        if name not in BUILT_IN and name not in ADAPTERS and not self.environment.import_modules:
            raise ValueError(f"environment.name={name} is not one of ours ({sorted({*BUILT_IN, *ADAPTERS})}); list the "
                             "module that registers it (@register_environment) in environment.import_modules.")
        if self.rollout.speculative:
            raise ValueError("rollout.speculative=true with an environment (environment.name): a draft is one "
                             "response, not an episode whose turns depend on the environment's replies; set "
                             "rollout.speculative=false.")

    def engine_setup(self) -> EngineSetup:
        """What the engine parts read (rollout/engines/factory.py, rollout/engines/hosts.py)."""
        return EngineSetup(rollout=self.rollout, model=self.model, seed=self.seed,
                           num_hosts=self.launcher.rollout.nodes, run_dir=self.run.dir,
                           connect_timeout_s=self.pipeline.connect_timeout_s,
                           peer_timeout_s=self.pipeline.peer_timeout_s)

    def weight_sync_choice(self) -> tuple[WeightSync, str]:
        """What ``pipeline.weight_sync=null`` resolves to for this run, and why (control/weights ``choose``)."""
        return choose_weight_sync(sglang_started=self.rollout.engine is EngineKind.sglang,
                                  attached=bool(self.rollout.engine_urls),
                                  overlapped=self.pipeline.mode is PipelineMode.async_one_step)

    def weight_sync(self) -> WeightSyncSettings:
        """What both sides of weight sync read (control/weights/), from ``pipeline.*`` and the engines' layout."""
        pipeline, rollout = self.pipeline, self.rollout
        return WeightSyncSettings(
            way=pipeline.weight_sync, bucket_bytes=int(pipeline.weight_sync_bucket_mb * 2**20),
            visible_timeout_s=pipeline.weights_visible_timeout_s,
            join_timeout_s=rollout.server_start_timeout_s + pipeline.connect_timeout_s,
            num_engine_ranks=rollout.num_engines * rollout.ranks_per_engine, ranks_per_engine=rollout.ranks_per_engine,
            engines_on_gpus=rollout.engines_on_gpus, engines_check_buckets=rollout.engine is EngineKind.embedded_http)

    @property
    def groups_per_batch(self) -> int:
        return self.global_batch_size // self.n_samples_per_prompt

    @property
    def max_groups_per_step(self) -> int:
        """``rollout.max_groups_per_step``, or 10 rollout batches' worth (veRL's max_num_gen_batches default)."""
        return self.rollout.max_groups_per_step or 10 * self.rollout_batch_size


def _must_set(key: str, what: str) -> str:
    raise ConfigError(f"{key} must be set for this experiment: {what}. Add {key}=... to the command line.")


OmegaConf.register_new_resolver("must_set", _must_set, replace=True)
"""Presets write ``path: ${must_set:model.path,an HF model directory}`` for what the user has to give."""


LISTED_BY = "python launch.py --cfg job"
"""The command that lists every key of the job and its default (unknown-key messages point at it)."""


def register_hydra_schema(name: str = "base_config", schema: type = Config) -> None:
    """Make ``name``, the defaults of ``schema``, available to a defaults list (conf/config.yaml's ``base_config``).

    As plain values, not the dataclass: Hydra then merges presets and ``+key=`` overrides without checking them,
    and ``bind`` checks everything once, with the key's name and the fix. (Against the dataclass Hydra stops an
    unknown key with its own advice to add ``+``, and ``+key=`` then fails later with a traceback.)
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=OmegaConf.to_container(OmegaConf.structured(schema),
                                                                          enum_to_str=True))


def load_config(raw: DictConfig | dict) -> Config:
    """Bind and validate the job's config; every error names the key and the fix."""
    return bind(Config, raw)


def bind(schema: type, raw: DictConfig | dict, *, listed_by: str = LISTED_BY):
    """``raw`` (Hydra's composition, a YAML file, a dict) as a ``schema`` object, checked: the one place untyped
    config becomes typed. Raises ConfigError with one line that names the key and the fix."""
    try:
        plain = OmegaConf.to_container(raw, resolve=False) if isinstance(raw, DictConfig) else raw
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), plain))
    except ConfigError:
        raise
    except InterpolationResolutionError as err:
        raise ConfigError(str(err).splitlines()[0].split("resolving interpolation: ", 1)[-1]) from None
    except ConfigKeyError as err:
        full_key = err.full_key or ""
        if err.parent_node is not None and err.parent_node._get_parent() is None:  # inside a list (eval.sets.0)
            full_key = _path_in_lists(plain, str(err.key)) or full_key
        raise ConfigError(unknown_key_message(schema, full_key, listed_by)) from None
    except OmegaConfBaseException as err:
        where = f" at {err.full_key}" if err.full_key else ""
        raise ConfigError(f"bad config value{where}: {str(err.msg).splitlines()[0]}") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _path_in_lists(node, key: str, prefix: str = "", in_list: bool = False) -> str | None:
    """The dotted path of ``key`` in a list element of ``node`` (OmegaConf names only the key itself there)."""
    if isinstance(node, dict):
        if in_list and key in node:
            return prefix + key
        children = node.items()
    elif isinstance(node, list):
        children, in_list = ((str(i), v) for i, v in enumerate(node)), True
    else:
        return None
    for name, child in children:
        if (found := _path_in_lists(child, key, f"{prefix}{name}.", in_list)) is not None:
            return found
    return None


def compose_config(overrides: list[str], conf_dir: Path, *, config_name: str = "config") -> Config:
    """The job's Config from ``conf_dir``'s Hydra configs and command-line ``overrides``, as ``python launch.py``
    composes it (for callers outside ``hydra.main``: TorchX's component, tools/memory_plan.py). An unknown key
    stops first, with its name, before anything is composed."""
    from hydra import compose, initialize_config_dir

    check_overrides(overrides, groups=config_groups(conf_dir))
    register_hydra_schema()
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        return load_config(compose(config_name, overrides=overrides))


def check_overrides(overrides: list[str], schema: type = Config, *, groups: frozenset[str] = frozenset(),
                    listed_by: str = LISTED_BY) -> None:
    """Stop on a command-line override (``key=v``, ``+key=v``, a sweep's ``key=a,b``) whose key ``schema`` does not
    have, before Hydra composes anything. ``groups`` are the config groups (``launcher``, ``experiment``): choosing
    one is not a key. Syntax errors are left to Hydra, whose messages say what is wrong."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return
    root = OmegaConf.structured(schema)
    for override in parsed:
        key = override.key_or_group
        if override.is_hydra_override() or override.is_delete() or override.package is not None or key in groups:
            continue
        unknown = _first_unknown(root, key.split("."))
        if unknown is not None:
            raise ConfigError(unknown_key_message(schema, key, listed_by, unknown=unknown))


def check_command_line(argv: list[str], schema: type, conf_dir: Path, *, listed_by: str = LISTED_BY) -> None:
    """``check_overrides`` on the overrides of a Hydra command line (its flags, ``-m``, ``--cfg job``, are skipped),
    the config groups being the folders of YAML files under ``conf_dir`` (``launcher``, ``sim/hardware``)."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    check_overrides(args.overrides, schema, groups=config_groups(conf_dir), listed_by=listed_by)


def config_groups(conf_dir: Path) -> frozenset[str]:
    """The config groups under ``conf_dir``: its folders of YAML files (``launcher``, ``sim/hardware``)."""
    return frozenset(d.relative_to(conf_dir).as_posix() for d in conf_dir.rglob("*")
                     if d.is_dir() and any(d.glob("*.yaml")))


def _schema_node(node, parts: list[str]):
    """The node at ``parts``; an index of a list of schemas (``eval.sets.0``) gives that schema's defaults."""
    for part in parts:
        if isinstance(node, ListConfig) and part.isdigit() and dataclasses.is_dataclass(node._metadata.element_type):
            node = OmegaConf.structured(node._metadata.element_type)
        elif isinstance(node, DictConfig) and part in node:
            node = node._get_node(part)
        else:
            return None
    return node


def _first_unknown(node, parts: list[str]) -> str | None:
    """The shortest prefix of the key ``parts`` that ``node`` does not have (free-form dicts take any key)."""
    for i, part in enumerate(parts):
        if isinstance(node, ListConfig) and part.isdigit():  # eval.sets.0.path: an element of a list of schemas
            element = node._metadata.element_type
            if not dataclasses.is_dataclass(element):
                return None
            node = OmegaConf.structured(element)
            continue
        if not isinstance(node, DictConfig):
            return ".".join(parts[: i + 1])
        if not _is_schema(node):
            return None
        if part not in node:
            return ".".join(parts[: i + 1])
        node = node._get_node(part)
    return None


def unknown_key_message(schema: type, full_key: str, listed_by: str = LISTED_BY, *, unknown: str | None = None) -> str:
    """``unknown config key 'trainer.lrr'. Did you mean 'trainer.lr'? Every key and its default: <listed_by>``.
    ``unknown``: the first part of ``full_key`` that ``schema`` lacks (``triner`` of ``triner.lr``), if not all."""
    unknown = unknown or full_key
    rest = full_key[len(unknown):]
    parent, _, name = unknown.rpartition(".")
    root = OmegaConf.structured(schema)
    node = _schema_node(root, parent.split(".")) if parent else root
    siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    close = [f"{parent}.{k}" if parent else k for k in difflib.get_close_matches(name, siblings, n=3, cutoff=0.75)]
    if not close:  # the right name in the wrong place (lr=1 for trainer.lr=1)
        close = [k for k in _keys(root) if k.rpartition(".")[2] == name][:3]
    if not close:
        close = [f"{parent}.{k}" if parent else k for k in difflib.get_close_matches(name, siblings, n=3)]
    hint = f" Did you mean {' or '.join(repr(c + rest) for c in close)}?" if close else ""
    return f"unknown config key '{full_key}'.{hint} Every key and its default: {listed_by}"


def _keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Every key of a structured config, dotted, parents before children."""
    out = []
    for key in node.keys():
        out.append(prefix + str(key))
        child = node._get_node(key)
        if isinstance(child, DictConfig) and _is_schema(child):
            out.extend(_keys(child, f"{prefix}{key}."))
    return out


def _is_schema(node: DictConfig) -> bool:
    """A dataclass's node (its keys are fixed), not a free-form dict's (``sweep``: any key)."""
    return dataclasses.is_dataclass(OmegaConf.get_type(node))


def save_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def read_config(path: Path) -> Config:
    return load_config(OmegaConf.load(path))
