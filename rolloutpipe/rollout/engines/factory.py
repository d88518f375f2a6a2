"""Rollout engines: the ``Engine`` protocol (base.py) and its implementations.

``EngineFactory`` is the one place the rollout node turns ``rollout.engine`` into engines (``build_all``):

- ``embedded``: EmbeddedEngine threads in the rollout process.
- ``embedded_http``: one embedded-engine server process per engine (http_server.py), or the servers of
  ``rollout.engine_urls``, each driven by the SGLang client (http_client.SGLangEngine).
- ``sglang``: one ``python -m sglang.launch_server`` per engine (server_process.py), or the servers of
  ``rollout.engine_urls``, driven by the same client. Untested here (no GPU); tools/gpu_check.py.

Started servers run on every rollout node, ``rollout.engines_per_node`` each (rollout/engines/hosts.py: this node's,
and the other nodes' through their engine hosts).

Servers the rollout node started are stopped by their engine's ``shutdown``; attached servers are left running.
``restart`` builds one engine again after a failure (supervisor.py decides when).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutpipe.control.transport import Transport
    from rolloutpipe.rollout.config import EngineSetup
    from rolloutpipe.rollout.engines.base import Engine, OnResult
    from rolloutpipe.rollout.engines.hosts import NodeServers, RemoteEngines, RemoteRestart
    from rolloutpipe.rollout.engines.server_process import ServerProcess

log = logging.getLogger(__name__)


class EngineFactory:
    """Builds the rollout node's engines (``build_all``), and one again after a failure (``restart``).

    Engine i is named ``engine<i>``; its k-th restart ``engine<i>-restart<k>``, so a result names the
    incarnation that made it (Admission ignores late results of a failed one) and a restarted server logs to a
    file of its own. With several rollout nodes (rollout/engines/hosts.py) engines 0 .. engines_per_node - 1 are this
    node's servers and the others' come from their hosts' registrations; a restart of one of those is a request
    to its host, which ``restart`` returns unfinished (a ``RemoteRestart`` the supervisor polls).
    """

    def __init__(self, cfg: EngineSetup, *, vocab_size: int, on_result: OnResult, api_key: str | None,
                 transport: Transport | None = None, run_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.api_key = api_key
        """The run's engine API key: every server a rollout node starts requires it (NodeEnv.engine_api_key)."""
        self.vocab_size = vocab_size
        self.on_result = on_result
        self.run_dir = run_dir
        self.transport = transport
        from rolloutpipe.rollout.config import EngineKind

        self._in_process = cfg.rollout.engine is EngineKind.embedded
        self._node: NodeServers | None = None
        """This node's servers (not for in-process engines or attached servers)."""
        self.remote: RemoteEngines | None = None
        """The other rollout nodes' engines (launcher.rollout.nodes > 1)."""

    def build_all(self) -> list[Engine]:
        """The rollout group's engines, all serving policy_version 0 (the model of ``cfg.model``)."""
        names = [f"engine{i}" for i in range(self.cfg.rollout.num_engines)]
        if self._in_process:
            return [self._embedded(name) for name in names]
        if self.cfg.rollout.engine_urls:
            return self._attached(names, self.cfg.rollout.engine_urls)
        from rolloutpipe.control.env import node_address
        from rolloutpipe.rollout.engines.hosts import NodeServers, RemoteEngines, engine_log_dir

        host = "127.0.0.1" if self.transport is None else node_address(self.transport.address.host)
        self._node = NodeServers(self.cfg, rank=0, bind_host=host, api_key=self.api_key,
                                 log_dir=engine_log_dir(self._run_dir(), 0))
        own = self._clients(self._node.start(list(enumerate(names[:self.cfg.rollout.engines_per_node]))))
        if self.cfg.num_hosts == 1:
            return own
        assert self.transport is not None, "engines on several rollout nodes register in the store"
        self.remote = RemoteEngines(self.cfg, self.transport, api_key=self.api_key, on_result=self.on_result)
        try:
            return own + self.remote.engines()
        except BaseException:
            self._node.stop_all()
            raise

    def restart(self, index: int, name: str, failed: Engine) -> Engine | RemoteRestart:
        """A fresh engine ``name`` in slot ``index`` serving policy_version 0 (the caller loads the current weights).

        A server this node started for ``failed`` is killed first (it failed; its accelerators are needed); one on
        another node is restarted by its host: the returned RemoteRestart says when it is ready.
        """
        if self._in_process:
            return self._embedded(name)
        if self.cfg.rollout.engine_urls:
            raise RuntimeError(f"{failed.name} is the server at {self.cfg.rollout.engine_urls[index]}, attached "
                               "through rollout.engine_urls; RolloutPipe did not start it and cannot restart it.")
        if self.remote is not None and failed.name in self.remote.registrations:
            return self.remote.restart(failed, name)
        return self._clients([self._node.restart(failed.name, name)])[0]

    def where_to_look(self, engine: Engine) -> str:
        """Where an engine's own messages are, for error messages."""
        if self._in_process:
            return (f"{engine.name} runs inside the rollout process: its traceback is in rollout rank 0's output "
                    "(stderr)")
        if self._node is not None and engine.name in self._node.servers:
            return f"its server's log: {self._node.servers[engine.name].log_path}"
        if self.remote is not None and (where := self.remote.where_to_look(engine.name)) is not None:
            return where
        return f"the log of the server at {engine.url} (attached through rollout.engine_urls)"

    def host_of(self, name: str) -> str | None:
        """Where engine ``name`` runs, as ``rollout rank <r> (<host>)``, when the engines span several rollout
        nodes (request spans carry it: the trace and timeline group engines by host); None on one node."""
        if self.remote is None:
            return None
        registration = self.remote.registrations.get(name)
        rank, host = (registration.rank, registration.host) if registration else (0, self.remote.own_host)
        return f"rollout rank {rank} ({host})"

    def stop_hosts(self) -> None:
        """The run is over: the other rollout nodes stop their servers (see rollout/engines/hosts.py)."""
        if self.remote is not None:
            self.remote.stop()

    def _embedded(self, name: str) -> Engine:
        from rolloutpipe.model import load_model
        from rolloutpipe.rollout.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(name=name, model=load_model(self.cfg.model, self.vocab_size),
                              concurrency=self.cfg.rollout.concurrency, on_result=self.on_result,
                              batch_invariant=self.cfg.rollout.batch_invariant)

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
            if sglang_api.honours_seeds(endpoint) is False:
                log.warning("the server at %s ignores the requests' sampling_seed (it was started without "
                            "--enable-deterministic-inference): samples are not reproducible, sync and cgp train on "
                            "different samples, and a request retried after an engine failure gets another sample. "
                            "Start it with --enable-deterministic-inference.", endpoint.url)
        return [SGLangEngine(name=n, endpoint=e, concurrency=rollout.concurrency, on_result=self.on_result)
                for n, e in zip(names, endpoints)]

    def _clients(self, servers: list[ServerProcess]) -> list[Engine]:
        """The SGLang client of each server this node started."""
        from rolloutpipe.rollout.engines.http_client import SGLangEngine

        return [SGLangEngine(name=s.name, endpoint=s.endpoint, concurrency=self.cfg.rollout.concurrency,
                             on_result=self.on_result, server_error=s.exit_reason, stop_server=s.stop)
                for s in servers]

    def _run_dir(self) -> Path:
        if self.run_dir is None:
            run_dir = self.cfg.run_dir
            self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="rolloutpipe-engines-"))
        return self.run_dir


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
