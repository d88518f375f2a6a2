"""The rollout node group's config (``rollout.*``): which engines, how many, and how requests are admitted."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    num_engines: int = 1
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
    sglang_gpus_per_engine: int = 1
    """GPUs each started SGLang server uses (its --tp-size times --dp-size); engine i starts at GPU i * this."""
    server_start_timeout_s: float = 900.0
    """How long to wait for a started engine server to answer /health."""
    max_engine_failures: int = 3
    """Failures (crash, server exit, timeout) each engine may have in a run; every one is survived by resubmitting
    its unfinished requests and restarting it (supervisor.py). One more stops the run. 0: stop at the first."""
    request_timeout_s: float | None = None
    """An engine that holds requests and hands none back for this long is hung and fails like a crashed one.
    None: no timeout. Set it well above the longest single generation (max response length at full batch)."""

    @property
    def ranks_per_engine(self) -> int:
        """Ranks one engine takes in the weight-update process group (control/weight_sync.py): one per
        tensor-parallel rank of an SGLang server (its GPUs, assuming --dp-size 1), one for the embedded engine."""
        return self.sglang_gpus_per_engine if self.engine is EngineKind.sglang else 1

    @property
    def engines_on_gpus(self) -> bool:
        return self.engine is EngineKind.sglang

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be >= 1.")
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
        if self.engine_urls and len(self.engine_urls) != self.num_engines:
            raise ValueError(f"rollout.engine_urls has {len(self.engine_urls)} URLs but rollout.num_engines="
                             f"{self.num_engines}; give one URL per engine.")
        if self.max_engine_failures < 0:
            raise ValueError(f"rollout.max_engine_failures={self.max_engine_failures} must be >= 0 (0 stops the run "
                             "at an engine's first failure).")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"rollout.request_timeout_s={self.request_timeout_s} must be > 0, or null for no "
                             "timeout.")
