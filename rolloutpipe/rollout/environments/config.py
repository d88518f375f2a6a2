"""``environment.*``: which environment drives multi-turn episodes, and its limits (null name: one response per
sample, no environment)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class EnvironmentConfig:
    name: str | None = None
    """A registered environment: ``lookup`` (ours), ``gymnasium`` or ``verifiers`` (adapters, each an extra), or one
    registered by ``import_modules``. Null: no environment, each sample is one response scored by ``reward.name``.
    With an environment, a sample is an episode and its reward is the environment's (``reward.name`` is unused)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Handed to the environment's factory for every episode (e.g. the gymnasium adapter's ``id``)."""
    import_modules: list[str] = field(default_factory=list)
    """Modules each environment worker imports, so that their @register_environment environments exist."""
    num_workers: int = 4
    """Worker processes running environment calls; an episode stays on one worker (its state lives there)."""
    timeout_s: float = 30.0
    """An environment call (``reset`` or ``step``) running longer is stopped (its worker is replaced) and its
    episode ends with reward 0, a timeout, which ``reward.on_timeout`` treats as it treats a reward's."""
    max_turns: int = 8
    """Model turns per episode; the episode ends after the last one whatever the environment says."""
    max_turn_tokens: int | None = None
    """New tokens of one model turn. Null: what is left of the episode's budget, ``rollout_max_response_len``
    tokens after the prompt, the model's and the environment's together (verl's response_length)."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"environment.num_workers={self.num_workers} must be at least 1.")
        if not self.timeout_s > 0:
            raise ValueError(f"environment.timeout_s={self.timeout_s} must be positive (seconds per call).")
        if self.max_turns < 1:
            raise ValueError(f"environment.max_turns={self.max_turns} must be at least 1 (model turns per episode).")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"environment.max_turn_tokens={self.max_turn_tokens} must be at least 1, or null (the "
                             "rest of the episode's rollout_max_response_len).")
