"""Rollout engines: the ``Engine`` protocol (base.py) and its implementations.

``build_engines`` is the one place the rollout node turns ``rollout.engine`` into engines:

- ``embedded``: EmbeddedEngine threads in the rollout process.
- ``embedded_http``: one embedded-engine server process per engine (engine/http_server.py), or the servers of
  ``rollout.engine_urls``, each driven by the SGLang client (http_client.SGLangEngine).
- ``sglang``: one ``python -m sglang.launch_server`` per engine on this node (engine/server_process.py), or the
  servers of ``rollout.engine_urls``, driven by the same client. Untested here (no GPU); tools/gpu_check.py.

Servers the rollout node started are stopped by their engine's ``shutdown``; attached servers are left running.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutpipe.config import Config
    from rolloutpipe.engine.base import Engine, OnResult


def build_engines(cfg: Config, *, vocab_size: int, on_result: OnResult) -> list[Engine]:
    """The rollout node's engines, all serving policy_version 0 (the model of ``cfg.model``)."""
    from rolloutpipe.rollout import EngineKind

    if cfg.rollout.engine is EngineKind.embedded:
        from rolloutpipe.engine.embedded import EmbeddedEngine
        from rolloutpipe.model import load_model

        return [
            EmbeddedEngine(name=f"engine{i}", model=load_model(cfg.model, vocab_size),
                           concurrency=cfg.rollout.concurrency, on_result=on_result)
            for i in range(cfg.rollout.num_engines)
        ]
    return _http_engines(cfg, on_result)


def _http_engines(cfg: Config, on_result: OnResult) -> list[Engine]:
    from omegaconf import OmegaConf

    from rolloutpipe.engine import server_process, sglang_api
    from rolloutpipe.engine.http_client import SGLangEngine
    from rolloutpipe.rollout import EngineKind

    rollout, names = cfg.rollout, [f"engine{i}" for i in range(cfg.rollout.num_engines)]
    if rollout.engine_urls:
        for url in rollout.engine_urls:
            sglang_api.wait_healthy(url, timeout_s=rollout.server_start_timeout_s)
            sglang_api.check_serves(url, 0, hint="Start attached servers with --weight-version 0 and model.path's "
                                               "weights: policy_version 0 is model.path.")
        return [SGLangEngine(name=n, url=u, concurrency=rollout.concurrency, on_result=on_result)
                for n, u in zip(names, rollout.engine_urls)]

    log_dir = Path(cfg.run.dir) / "engines" if cfg.run.dir else Path(tempfile.mkdtemp(prefix="rolloutpipe-engines-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if rollout.engine is EngineKind.embedded_http:
        model_yaml = log_dir / "model.yaml"
        model_yaml.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg.model)))
        num_threads = max(1, len(os.sched_getaffinity(0)) // len(names))
        servers = [server_process.embedded_server(name=n, model_config_yaml=model_yaml,
                                                  concurrency=rollout.concurrency, log_dir=log_dir,
                                                  num_threads=num_threads) for n in names]
    else:
        if cfg.model.path is None:
            raise ValueError("rollout.engine=sglang needs model.path (an HF model directory): the embedded tiny "
                             "model exists only inside RolloutPipe. Save it with save_hf_checkpoint and pass its "
                             "directory, or use rollout.engine=embedded_http.")
        servers = [server_process.sglang_server(
            name=n, model_path=cfg.model.path, dtype=cfg.model.dtype.value, concurrency=rollout.concurrency,
            seed=cfg.seed, base_gpu_id=i * rollout.sglang_gpus_per_engine, priority_scheduling=False,
            extra_args=rollout.sglang_launch_args, log_dir=log_dir) for i, n in enumerate(names)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout_s=rollout.server_start_timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return [SGLangEngine(name=n, url=s.url, concurrency=rollout.concurrency, on_result=on_result,
                         server_error=s.exit_reason, stop_server=s.stop) for n, s in zip(names, servers)]
