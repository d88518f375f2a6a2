"""Rollout engines: the ``Engine`` protocol (base.py) and its implementations.

``EngineFactory`` is the one place the rollout node turns ``rollout.engine`` into engines (``build_all``):

- ``embedded``: EmbeddedEngine threads in the rollout process.
- ``embedded_http``: one embedded-engine server process per engine (http_server.py), or the servers of
  ``rollout.engine_urls``, each driven by the SGLang client (http_client.SGLangEngine).
- ``sglang``: one ``python -m sglang.launch_server`` per engine on this node (server_process.py), or the
  servers of ``rollout.engine_urls``, driven by the same client. Untested here (no GPU); tools/gpu_check.py.

Servers the rollout node started are stopped by their engine's ``shutdown``; attached servers are left running.
``restart`` builds one engine again after a failure (supervisor.py decides when).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutpipe.config import Config
    from rolloutpipe.rollout.engines.base import Engine, OnResult
    from rolloutpipe.rollout.engines.server_process import ServerProcess

log = logging.getLogger(__name__)


class EngineFactory:
    """Builds the rollout node's engines (``build_all``), and one again after a failure (``restart``).

    Engine i is named ``engine<i>``; its k-th restart ``engine<i>-restart<k>``, so a result names the
    incarnation that made it (Admission ignores late results of a failed one) and a restarted server logs to a
    file of its own.
    """

    def __init__(self, cfg: Config, *, vocab_size: int, on_result: OnResult, api_key: str | None) -> None:
        self.cfg = cfg
        self.api_key = api_key
        """The run's engine API key: every server this node starts requires it (NodeEnv.engine_api_key)."""
        self.vocab_size = vocab_size
        self.on_result = on_result
        self._servers: dict[str, ServerProcess] = {}
        """The servers this node started, by engine name."""
        self._log_dir: Path | None = None
        from rolloutpipe.rollout.config import EngineKind

        self._in_process = cfg.rollout.engine is EngineKind.embedded
        self._embedded_server = cfg.rollout.engine is EngineKind.embedded_http

    def build_all(self) -> list[Engine]:
        """The rollout node's engines, all serving policy_version 0 (the model of ``cfg.model``)."""
        names = [f"engine{i}" for i in range(self.cfg.rollout.num_engines)]
        if self._in_process:
            return [self._embedded(name) for name in names]
        if self.cfg.rollout.engine_urls:
            return self._attached(names, self.cfg.rollout.engine_urls)
        return self._started(list(enumerate(names)))

    def restart(self, index: int, name: str, failed: Engine) -> Engine:
        """A fresh engine ``name`` in slot ``index`` serving policy_version 0 (the caller loads the current weights).

        A server this node started for ``failed`` is killed first (it failed; its accelerators are needed).
        """
        if self._in_process:
            return self._embedded(name)
        if self.cfg.rollout.engine_urls:
            raise RuntimeError(f"{failed.name} is the server at {self.cfg.rollout.engine_urls[index]}, attached "
                               "through rollout.engine_urls; RolloutPipe did not start it and cannot restart it.")
        self._servers.pop(failed.name).kill()
        return self._started([(index, name)])[0]

    def where_to_look(self, engine: Engine) -> str:
        """Where an engine's own messages are, for error messages."""
        if self._in_process:
            return (f"{engine.name} runs inside the rollout process: its traceback is in rollout rank 0's output "
                    "(stderr)")
        if engine.name in self._servers:
            return f"its server's log: {self._servers[engine.name].log_path}"
        return f"the log of the server at {engine.url} (attached through rollout.engine_urls)"

    def _embedded(self, name: str) -> Engine:
        from rolloutpipe.model import load_model
        from rolloutpipe.rollout.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(name=name, model=load_model(self.cfg.model, self.vocab_size),
                              concurrency=self.cfg.rollout.concurrency, on_result=self.on_result)

    def _attached(self, names: list[str], urls: list[str]) -> list[Engine]:
        from rolloutpipe.rollout.engines import sglang_api
        from rolloutpipe.rollout.engines.http_client import SGLangEngine

        rollout = self.cfg.rollout
        api_key = attached_api_key(rollout.engine_api_key_file)
        endpoints = [sglang_api.Endpoint(url, api_key) for url in urls]
        for endpoint in endpoints:
            sglang_api.wait_healthy(endpoint, timeout_s=rollout.server_start_timeout_s)
            sglang_api.check_serves(endpoint, 0, hint="Start attached servers with --weight-version 0 and "
                                                    "model.path's weights: policy_version 0 is model.path.")
        return [SGLangEngine(name=n, endpoint=e, concurrency=rollout.concurrency, on_result=self.on_result)
                for n, e in zip(names, endpoints)]

    def _started(self, engines: list[tuple[int, str]]) -> list[Engine]:
        """Start one server per (index, name), wait until all answer /health, and drive each with the client."""
        from rolloutpipe.rollout.engines.http_client import SGLangEngine

        rollout = self.cfg.rollout
        servers = [self._server(i, name) for i, name in engines]
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait_ready(timeout_s=rollout.server_start_timeout_s)
        except BaseException:
            for server in servers:
                server.stop()
            raise
        self._servers.update((s.name, s) for s in servers)
        return [SGLangEngine(name=s.name, endpoint=s.endpoint, concurrency=rollout.concurrency,
                             on_result=self.on_result,
                             server_error=s.exit_reason, stop_server=s.stop) for s in servers]

    def _server(self, index: int, name: str) -> ServerProcess:
        from omegaconf import OmegaConf

        from rolloutpipe.rollout.admission import AdmissionPolicy
        from rolloutpipe.rollout.engines import server_process

        cfg, rollout, log_dir = self.cfg, self.cfg.rollout, self._engine_dir()
        if self._embedded_server:
            model_yaml = log_dir / "model.yaml"
            if not model_yaml.exists():
                model_yaml.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg.model)))
            num_threads = max(1, len(os.sched_getaffinity(0)) // rollout.num_engines)
            return server_process.embedded_server(name=name, model_config_yaml=model_yaml,
                                                  concurrency=rollout.concurrency, log_dir=log_dir,
                                                  num_threads=num_threads, api_key=self.api_key)
        if cfg.model.path is None:
            raise ValueError("rollout.engine=sglang needs model.path (an HF model directory): the embedded tiny "
                             "model exists only inside RolloutPipe. Save it with save_hf_checkpoint and pass its "
                             "directory, or use rollout.engine=embedded_http.")
        return server_process.sglang_server(
            name=name, model_path=cfg.model.path, dtype=cfg.model.dtype.value, concurrency=rollout.concurrency,
            seed=cfg.seed, base_gpu_id=index * rollout.sglang_gpus_per_engine,
            priority_scheduling=rollout.admission is AdmissionPolicy.fgd,  # FGD's group order reaches the engine
            extra_args=rollout.sglang_launch_args, log_dir=log_dir, api_key=self.api_key)

    def _engine_dir(self) -> Path:
        if self._log_dir is None:
            run_dir = self.cfg.run.dir
            self._log_dir = (Path(run_dir) / "engines" if run_dir
                             else Path(tempfile.mkdtemp(prefix="rolloutpipe-engines-")))
            self._log_dir.mkdir(parents=True, exist_ok=True)
        return self._log_dir



def attached_api_key(path: str | None) -> str | None:
    """The API key of the servers of ``rollout.engine_urls``: the first line of ``rollout.engine_api_key_file``
    (they were started with ``--api-key`` and that key), or None: they take calls without one."""
    if path is None:
        log.warning("rollout.engine_urls: the attached servers are called without an API key, so any process that "
                    "reaches them can load weights into them. Start them with --api-key and set "
                    "rollout.engine_api_key_file to a file (mode 600) that holds the key.")
        return None
    try:
        key = Path(path).read_text().strip()
    except OSError as err:
        raise ValueError(f"rollout.engine_api_key_file={path}: cannot read it ({err.strerror}).") from None
    if not key:
        raise ValueError(f"rollout.engine_api_key_file={path} is empty; it must hold the servers' --api-key.")
    return key
