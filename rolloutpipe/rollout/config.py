"""The rollout node group's config (``rollout.*``): which engines, how many, and how requests are admitted."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rolloutpipe.model import ModelConfig
from rolloutpipe.rollout.admission import AdmissionPolicy


class EngineKind(enum.Enum):
    embedded = "embedded"
    """The embedded CPU engine (a small request scheduler over the transformers model), in this process."""
    embedded_http = "embedded_http"
    """The embedded engine in its own process behind SGLang's HTTP API (engines/http_server.py), driven by the
    SGLang client: the rollout node as on a cluster, on CPU."""
    sglang = "sglang"
    """SGLang servers: one ``python -m sglang.launch_server`` per engine on this node, or ``engine_urls``."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: EngineKind = EngineKind.embedded
    num_engines: int | None = None
    """Engines in all. Null: launcher.rollout.nodes x engines_per_node (one per node when that is null too)."""
    engines_per_node: int | None = None
    """Engine servers each rollout node starts (rollout/engines/hosts.py): on GPU nodes its GPUs /
    sglang_gpus_per_engine. Null: num_engines / launcher.rollout.nodes. With rollout.engine=embedded (in-process) the
    group is one node."""
    min_engines: int = 1
    """Engines that must stay in service: a lost engine host takes its engines out (their requests go to the
    others) and the run goes on while at least this many remain; below it the run stops."""
    concurrency: int = 64
    """Requests one engine runs at once (SGLang's max_running_requests)."""
    admission: AdmissionPolicy = AdmissionPolicy.fifo
    filter_zero_variance: bool = False
    """Dynamic sampling (DAPO): drop groups whose rewards are all equal and admit replacements."""
    over_sampling_groups: int = 0
    """Extra groups admitted at the start of each step when filtering, so replacements are already running (not for
    reward timeouts: they are rare, and their replacement is admitted when one happens)."""
    max_groups_per_step: int | None = None
    """The most groups a step may admit, replacements of dropped ones included (zero variance, or a reward timeout
    under reward.on_timeout=drop_group); past it the run stops with the share of each. Null: 10 x rollout_batch_size."""
    engine_urls: list[str] = field(default_factory=list)
    """With ``engine: sglang`` or ``embedded_http``: attach to these running servers (one per engine, started with
    ``--weight-version 0`` and model.path's weights) instead of starting them. Empty: start them."""
    engine_api_key_file: str | None = None
    """With ``engine_urls``: a file (mode 600) whose first line is the ``--api-key`` the attached servers were
    started with; every call sends it. None: they are called without a key (a warning says so at start). Servers
    RolloutPipe starts always get a key of the run's own (derived from the run's secret)."""
    sglang_launch_args: list[str] = field(default_factory=list)
    """Extra arguments for every ``sglang.launch_server``, e.g. ``[--mem-fraction-static, "0.8"]``."""
    batch_invariant: bool | None = None
    """The embedded engine (embedded, embedded_http): a request's logits, tokens and log-probs are the same bits
    whatever its batch-mates and row, in every dtype (attention per row, linear layers in calls of 16 rows:
    engines/row_attention.py), so sync and cgp sample identically in float32 and bfloat16 too. It costs decode
    throughput: 0.51-0.76 of the padded path's at concurrency 8-32 on a 2-core CPU (bench/batch_invariance.py).
    False: one padded attention call per layer, equal up to float rounding (exact in float64). Null: true with
    ``speculative`` (only this engine verifies a draft to the bit: engines/verify.py), else false."""
    speculative: bool = False
    """Speculative next-step rollout (rollout/drafts.py): once a step's rollout is done, the engines draft the next
    step's first requests under the current policy while the trainer trains; the next step's engine keeps of each
    draft only the prefix its own seeded sampler reproduces under the new policy, so every sample is exactly the
    one it makes without drafts, to the bit in float64, float32 and bfloat16 (with ``batch_invariant``, which it
    turns on). Embedded engine only (SGLang lacks per-position seeded verification: docs/speculative.md)."""
    sglang_deterministic_inference: bool = True
    """Start SGLang servers with ``--enable-deterministic-inference``: only with it does SGLang honour each request's
    ``sampling_seed`` (its per-request seeded sampler), which makes samples reproducible: the same seed gives the same
    sample on any engine, a retried request after an engine failure regenerates the sample it lost, and sync and cgp
    train on identical samples. It is also what makes SGLang sample as the embedded engine does (engines/sampler.py,
    at top_p 1). It costs throughput (batch-invariant kernels; SGLang quotes tens of percent), and
    needs an attention backend that supports it (flashinfer, fa3 or triton on GPU). False: faster, and every sample
    differs from run to run. Attached servers are asked (/server_info) and a warning says when seeds will be ignored."""
    sglang_gpus_per_engine: int = 1
    """GPUs each started SGLang server uses (its --tp-size times --dp-size); a node's engine j starts at GPU
    j * this."""
    server_start_timeout_s: float = 900.0
    """How long to wait for a started engine server to answer /health."""
    max_engine_failures: int = 3
    """Failures (crash, server exit, timeout) each engine may have in a run; every one is survived by resubmitting
    its unfinished requests and restarting it (supervisor.py). One more stops the run. 0: stop at the first."""
    request_timeout_s: float | None = None
    """An engine that holds requests and hands none back for this long is hung and fails like a crashed one.
    None: no timeout. Set it well above the longest single generation (max response length at full batch)."""

    def place_engines(self, num_nodes: int) -> None:
        """Derive ``num_engines`` and ``engines_per_node`` for ``num_nodes`` rollout nodes (launcher.rollout.nodes),
        or check the two against each other when both are given. Engine i runs on node i // engines_per_node."""
        if num_nodes > 1 and (self.engine is EngineKind.embedded or self.engine_urls):
            raise ValueError(
                f"launcher.rollout.nodes={num_nodes}, but rollout.engine=embedded runs its engines inside rollout "
                "rank 0 and rollout.engine_urls attaches servers nobody starts: engines on several rollout nodes "
                "need rollout.engine=embedded_http or sglang without engine_urls (each node starts its own).")
        if self.engines_per_node is None:
            total = self.num_engines or num_nodes
            if total % num_nodes:
                raise ValueError(f"rollout.num_engines={total} does not split evenly over launcher.rollout.nodes="
                                 f"{num_nodes}; set rollout.engines_per_node instead (num_engines is derived).")
            self.num_engines, self.engines_per_node = total, total // num_nodes
        elif self.num_engines is None:
            self.num_engines = num_nodes * self.engines_per_node
        elif self.num_engines != num_nodes * self.engines_per_node:
            raise ValueError(f"rollout.num_engines={self.num_engines} but launcher.rollout.nodes x "
                             f"rollout.engines_per_node = {num_nodes} x {self.engines_per_node}; drop num_engines "
                             "(it is derived), or set rollout.engines_per_node (a preset may set it).")
        if self.engine_urls and len(self.engine_urls) != self.num_engines:
            raise ValueError(f"rollout.engine_urls has {len(self.engine_urls)} URLs but rollout.num_engines="
                             f"{self.num_engines}; give one URL per engine.")
        if self.min_engines > self.num_engines:
            raise ValueError(f"rollout.min_engines={self.min_engines} exceeds the run's {self.num_engines} engines.")

    @property
    def ranks_per_engine(self) -> int:
        """Ranks one engine takes in the weight-update process group (control/weights/distributed.py): one per
        tensor-parallel rank of an SGLang server (its GPUs, assuming --dp-size 1), one for the embedded engine."""
        return self.sglang_gpus_per_engine if self.engine is EngineKind.sglang else 1

    @property
    def engines_on_gpus(self) -> bool:
        return self.engine is EngineKind.sglang

    def __post_init__(self) -> None:
        for key in ("num_engines", "engines_per_node"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"rollout.{key}={getattr(self, key)} must be >= 1 (or null: derived).")
        if self.min_engines < 1:
            raise ValueError(f"rollout.min_engines={self.min_engines} must be >= 1.")
        if self.concurrency < 1:
            raise ValueError(
                f"rollout.concurrency={self.concurrency} must be >= 1: it is how many requests an engine runs at once."
            )
        if self.over_sampling_groups < 0:
            raise ValueError(f"rollout.over_sampling_groups={self.over_sampling_groups} must be >= 0.")
        if self.engine_urls and self.engine is EngineKind.embedded:
            raise ValueError("rollout.engine_urls is set but rollout.engine=embedded runs in-process; "
                             "use rollout.engine=sglang (or embedded_http) to attach to servers.")
        if self.engine_api_key_file is not None and not self.engine_urls:
            raise ValueError("rollout.engine_api_key_file is set but rollout.engine_urls is empty: the servers "
                             "RolloutPipe starts get the run's own key; the file is for attached servers only.")
        if self.max_engine_failures < 0:
            raise ValueError(f"rollout.max_engine_failures={self.max_engine_failures} must be >= 0 (0 stops the run "
                             "at an engine's first failure).")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"rollout.request_timeout_s={self.request_timeout_s} must be > 0, or null for no "
                             "timeout.")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSetup:
    """What the engine parts (engines/factory.py, hosts.py) read of the job's config: ``rollout.*`` and ``model.*``,
    and the few job-wide values they need. The node modules build it (config.py ``Config.engine_setup``)."""

    rollout: RolloutConfig
    model: ModelConfig
    seed: int
    num_hosts: int
    """launcher.rollout.nodes: the rollout nodes that start engine servers."""
    run_dir: str | None
    """run.dir (engine logs go under it)."""
    connect_timeout_s: float
    peer_timeout_s: float
