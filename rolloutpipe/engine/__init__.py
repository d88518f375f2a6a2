"""Rollout engines: the ``Engine`` protocol (base.py) and its implementations.

``build_engines`` is the one place the rollout node turns ``rollout.engine`` into engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutpipe.config import Config
    from rolloutpipe.engine.base import Engine, OnResult


def build_engines(cfg: Config, *, vocab_size: int, on_result: OnResult) -> list[Engine]:
    """The rollout node's engines, all serving policy_version 0 (the model of ``cfg.model``)."""
    from rolloutpipe.engine.embedded import EmbeddedEngine
    from rolloutpipe.model import load_model

    return [
        EmbeddedEngine(name=f"engine{i}", model=load_model(cfg.model, vocab_size),
                       concurrency=cfg.rollout.concurrency, on_result=on_result)
        for i in range(cfg.rollout.num_engines)
    ]
