"""Engine hosts: every rollout node starts the engine servers of its own node; the rollout manager drives them all.

The rollout node group (het group 0) runs one process per node:

    rank 0        the rollout manager (rollout/node.py: store host, prompts, admission over every engine, rewards,
                  dispatcher, supervisor), and the engine host of its own node
    rank 1..N-1   engine hosts only (``EngineHost.run``)

Engine i runs on rollout rank ``i // rollout.engines_per_node`` as that node's engine ``j = i % engines_per_node``:
SGLang on the node's GPUs from ``j * rollout.sglang_gpus_per_engine``, the embedded engine's server with its share
of the node's CPUs (``NodeServers``). A host starts its servers, waits until each answers /health, and registers
each: a sealed record ``engines/host=<r>/<name>`` with its URL, host name, GPUs and log path. The manager waits
for every registration (``RemoteEngines.engines``) and drives each server through the one SGLang client; both
ends derive the servers' API key from the run's secret. Servers listen on their node's own address
(control/env.node_address: loopback when the job is on one machine) and die with their host (server_process.py).

Engine host loop (main thread; nothing else runs in the process besides its heart-beat)
    consumes   restart requests ``engines/host=<r>/restart=<n>`` (n counts the requests to that host), and the
               manager's ``engines/stop``
    produces   registrations: one per engine at start, one per restart (the new name's, or the error)
    waits for  those records, in POLL_S slices; each slice it checks the run (an abort, or the manager's heart-beat
               stopping, ends it non-zero after its servers are stopped)
    shuts down on ``engines/stop`` (written by the manager once the trainer is done): stops its servers, one
               final heart-beat that says it finished, exit 0. On SIGTERM (a node drained, a task signalled) it
               stops its servers and exits 143 without aborting the run: the manager treats it as a lost host,
               exactly as if it had been killed

Failures. A failed engine of host r (its server exited, or an HTTP call to it failed) is handled by the
supervisor as on one node: its requests go back in line at once, and a restart is requested from host r; the
supervisor polls for the new registration (``RemoteRestart``) without holding up the rollout loop. A host that
is lost (its heart-beat stops: ``HostWatch``) takes its engines out of service and the run goes on while
``rollout.min_engines`` remain (supervisor.py); if it beats again (it had only stalled), it handles the restart
requests it missed and its engines come back. With ``pipeline.weight_sync=distributed`` the weight-update group is
re-formed without the lost engines at the next step boundary, and with them at a later one once they are back.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutpipe.control.env import NodeEnv, node_address
from rolloutpipe.control.lifetime import call_side_by_side
from rolloutpipe.control.transport import Transport

if TYPE_CHECKING:
    from rolloutpipe.control.liveness import Liveness
    from rolloutpipe.rollout.config import EngineSetup
    from rolloutpipe.rollout.engines.base import Engine, OnResult
    from rolloutpipe.rollout.engines.server_process import ServerProcess

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often an engine host looks for the manager's requests, and the supervisor for a remote restart."""


class HostLost(RuntimeError):
    """The engine host of a remote engine stopped heart-beating: its engines cannot come back."""


@dataclass(kw_only=True, slots=True)
class Registration:
    """One engine server, as its host registers it (sealed, under ``registration_key``)."""

    name: str
    rank: int
    """The rollout rank of its host."""
    host: str
    url: str | None = None
    gpus: list[int] = field(default_factory=list)
    log_path: str = ""
    error: str | None = None
    """Set instead of ``url`` when the host could not start it: why, with the log's tail."""


def registration_key(transport: Transport, rank: int, name: str) -> str:
    return transport.key("engines", f"host={rank}", name)


def restart_key(transport: Transport, rank: int, num: int) -> str:
    return transport.key("engines", f"host={rank}", f"restart={num}")


def stop_key(transport: Transport) -> str:
    return transport.key("engines", "stop")


def host_name() -> str:
    """This node's name as Slurm knows it (the local cluster's virtual nodes share one machine), else its host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class NodeServers:
    """The engine servers of one node (rollout rank ``rank``): start, restart after a failure, stop.

    Used by every engine host, the manager's own node included. Engine ``name`` at node index ``j`` gets the
    node's GPUs from ``j * rollout.sglang_gpus_per_engine``, or (embedded server) 1 / engines_per_node of its CPUs.
    """

    def __init__(self, cfg: EngineSetup, *, rank: int, bind_host: str, api_key: str | None, log_dir: Path) -> None:
        self.cfg = cfg
        self.rank = rank
        self.bind_host = bind_host
        self.api_key = api_key
        self.log_dir = log_dir
        self.servers: dict[str, ServerProcess] = {}
        """The running servers, by engine name."""
        self._local: dict[str, int] = {}
        """Each name's index on this node (a restart keeps its GPUs)."""

    def start(self, engines: list[tuple[int, str]]) -> list[ServerProcess]:
        """Start one server per (index on this node, name), and wait until all answer /health; on any failure stop
        them all and raise with the failing server's log."""
        servers = [self._server(j, name) for j, name in engines]
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait_ready(timeout_s=self.cfg.rollout.server_start_timeout_s)
        except BaseException:
            call_side_by_side({server.name: server.stop for server in servers})
            raise
        self.servers.update((s.name, s) for s in servers)
        self._local.update((name, j) for j, name in engines)
        return servers

    def restart(self, failed: str, name: str) -> ServerProcess:
        """Kill ``failed``'s server (it failed; its accelerators are needed) and start ``name`` in its place."""
        j = self._local[failed]
        if (server := self.servers.pop(failed, None)) is not None:
            server.kill()
        return self.start([(j, name)])[0]

    def gpus(self, name: str) -> list[int]:
        if not self.cfg.rollout.engines_on_gpus:
            return []
        per_engine = self.cfg.rollout.sglang_gpus_per_engine
        return list(range(self._local[name] * per_engine, (self._local[name] + 1) * per_engine))

    def stop_all(self) -> None:
        call_side_by_side({name: server.stop for name, server in self.servers.items()})

    def _server(self, j: int, name: str) -> ServerProcess:
        from omegaconf import OmegaConf

        from rolloutpipe.rollout.admission import AdmissionPolicy
        from rolloutpipe.rollout.config import EngineKind
        from rolloutpipe.rollout.engines import server_process

        cfg, rollout = self.cfg, self.cfg.rollout
        if rollout.engine is EngineKind.embedded_http:
            model_yaml = self.log_dir / "model.yaml"
            if not model_yaml.exists():
                model_yaml.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg.model)))
            num_threads = max(1, len(os.sched_getaffinity(0)) // rollout.engines_per_node)
            return server_process.embedded_server(name=name, model_config_yaml=model_yaml, host=self.bind_host,
                                                  concurrency=rollout.concurrency, log_dir=self.log_dir,
                                                  num_threads=num_threads, api_key=self.api_key,
                                                  batch_invariant=rollout.batch_invariant)
        if cfg.model.path is None:
            raise ValueError("rollout.engine=sglang needs model.path (an HF model directory): the embedded tiny "
                             "model exists only inside RolloutPipe. Save it with save_hf_checkpoint and pass its "
                             "directory, or use rollout.engine=embedded_http.")
        return server_process.sglang_server(
            name=name, model_path=cfg.model.path, host=self.bind_host, dtype=cfg.model.dtype.value,
            concurrency=rollout.concurrency, seed=cfg.seed, base_gpu_id=j * rollout.sglang_gpus_per_engine,
            priority_scheduling=rollout.admission is AdmissionPolicy.fgd,  # FGD's group order reaches the engine
            extra_args=rollout.sglang_launch_args, log_dir=self.log_dir, api_key=self.api_key,
            deterministic=rollout.sglang_deterministic_inference)


def engine_log_dir(run_dir: Path, rank: int) -> Path:
    """Where rollout rank ``rank``'s engine servers log: ``<run>/engines`` on the manager's node (as on one node),
    ``<run>/engines/host=<r>`` on the others; the user's alone (0700), as the logs are (server_process.py)."""
    path = run_dir / "engines" if rank == 0 else run_dir / "engines" / f"host={rank}"
    path.mkdir(parents=True, exist_ok=True)
    for private in {run_dir / "engines", path}:
        private.chmod(0o700)
    return path


class EngineHost:
    """A rollout rank > 0: starts and registers its node's engine servers, restarts them when the manager asks,
    stops them when the run ends (module docstring: its loop)."""

    def __init__(self, cfg: EngineSetup, env: NodeEnv, transport: Transport) -> None:
        self.cfg, self.env, self.transport = cfg, env, transport
        self.servers = NodeServers(cfg, rank=env.rank, bind_host=node_address(env.store_host),
                                   api_key=env.engine_api_key, log_dir=engine_log_dir(env.run_dir, env.rank))
        self.host = host_name()

    def run(self) -> None:
        per_node = self.cfg.rollout.engines_per_node
        first = self.env.rank * per_node
        try:
            self._start([(j, f"engine{first + j}") for j in range(per_node)])
            num_requests = 0
            while self.transport.read_record(stop_key(self.transport)) is None:
                self.transport.liveness.check(waiting_for="the rollout manager's requests")
                request = self.transport.read_record(restart_key(self.transport, self.env.rank, num_requests))
                if request is None:
                    time.sleep(POLL_S)
                    continue
                num_requests += 1
                log.warning("rollout rank %d: restarting engine %s as %s (the rollout manager asked)",
                            self.env.rank, request["failed"], request["name"])
                self._restart(request["failed"], request["name"])
        finally:
            self.servers.stop_all()

    def _start(self, engines: list[tuple[int, str]]) -> None:
        """Start the node's servers and register each; if one cannot start, register the error for all (the
        manager stops the run before its first step with it) and fail."""
        try:
            started = self.servers.start(engines)
        except Exception as err:
            for _, name in engines:
                self._register(self._failed(name, err))
            raise
        for server in started:
            self._register(self._registration(server))

    def _restart(self, failed: str, name: str) -> None:
        """Restart one server as ``name`` and register it, or the error (the manager decides what to do with it)."""
        try:
            self._register(self._registration(self.servers.restart(failed, name)))
        except Exception as err:  # noqa: BLE001 - reported to the manager, which stops the run with it
            self._register(self._failed(name, err))

    def _registration(self, server: ServerProcess) -> Registration:
        return Registration(name=server.name, rank=self.env.rank, host=self.host, url=server.url,
                            gpus=self.servers.gpus(server.name), log_path=str(server.log_path))

    def _failed(self, name: str, err: Exception) -> Registration:
        return Registration(name=name, rank=self.env.rank, host=self.host, error=f"{type(err).__name__}: {err}")

    def _register(self, registration: Registration) -> None:
        self.transport.put_record(registration_key(self.transport, self.env.rank, registration.name),
                                  asdict(registration))


class HostWatch:
    """The manager's view of the other engine hosts' heart-beats (not fatal peers: a lost host loses its engines,
    not the run). A host is lost while its beat is silent for pipeline.peer_timeout_s, and back once it beats again
    (a stall, not a death: the supervisor then puts its engines back). ``lost`` is read by the engines' error check
    from any thread, so it re-reads at most every POLL_S."""

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness
        self._lost: dict[int, str | None] = {}
        """Each host's last reading: why it is lost, or None."""
        self._read_s: dict[int, float] = {}
        self._lock = threading.Lock()

    def lost(self, rank: int) -> str | None:
        with self._lock:
            now = time.monotonic()
            if now - self._read_s.get(rank, float("-inf")) < POLL_S:
                return self._lost.get(rank)
            self._read_s[rank] = now
        reason = self.liveness.lost(("rollout", rank))
        with self._lock:
            self._lost[rank] = None if reason is None else f"its engine host (rollout rank {rank}) is lost: {reason}"
            return self._lost[rank]


class RemoteEngines:
    """The manager's side of the other hosts: their registered engines, restart requests, the stop at the end."""

    def __init__(self, cfg: EngineSetup, transport: Transport, *, api_key: str | None, on_result: OnResult) -> None:
        self.cfg, self.transport, self.api_key, self.on_result = cfg, transport, api_key, on_result
        self.num_hosts = cfg.num_hosts
        self.own_host = host_name()
        """The manager's own node (its engines have no registration)."""
        self.watch = HostWatch(transport.liveness)
        self.registrations: dict[str, Registration] = {}
        self._num_requests = [0] * self.num_hosts

    def engines(self) -> list[Engine]:
        """Every engine of ranks 1.., once its host registered it (in engine order); a host that reports an error
        or is lost before it registers stops the run here, before the first step."""
        per_node = self.cfg.rollout.engines_per_node
        return [self._wait(rank, f"engine{rank * per_node + j}")
                for rank in range(1, self.num_hosts) for j in range(per_node)]

    def restart(self, failed: Engine, name: str) -> RemoteRestart:
        rank = self.registrations[failed.name].rank
        num = self._num_requests[rank]
        self._num_requests[rank] += 1
        self.transport.put_record(restart_key(self.transport, rank, num), {"failed": failed.name, "name": name})
        return RemoteRestart(self, rank, name)

    def where_to_look(self, name: str) -> str | None:
        if (r := self.registrations.get(name)) is None:
            return None
        return f"its server's log on {r.host} (rollout rank {r.rank}): {r.log_path}"

    def stop(self) -> None:
        """Tell every host the run is over, and wait for each live one to finish (one in the middle of a restart
        finishes it first: up to rollout.server_start_timeout_s), so that none outlives the store it reads."""
        self.transport.put_record(stop_key(self.transport), {"stop": True})
        deadline = time.monotonic() + self.cfg.rollout.server_start_timeout_s + self.cfg.peer_timeout_s
        waiting = set(range(1, self.num_hosts))
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting
                       if self.watch.lost(r) is None and not self.watch.liveness.finished(("rollout", r))}
            time.sleep(POLL_S)
        if waiting:
            log.warning("engine hosts %s did not confirm the stop within rollout.server_start_timeout_s + "
                        "pipeline.peer_timeout_s", sorted(waiting))

    def _wait(self, rank: int, name: str) -> Engine:
        key = registration_key(self.transport, rank, name)
        deadline = time.monotonic() + self.cfg.rollout.server_start_timeout_s + self.cfg.connect_timeout_s
        while (record := self.transport.read_record(key)) is None:
            self.transport.liveness.check(waiting_for=f"rollout rank {rank} to register {name}")
            if (lost := self.watch.lost(rank)) is not None:
                raise HostLost(f"{name} cannot start: {lost}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout rank {rank} did not register {name} within rollout.server_start_timeout_s"
                                   " + pipeline.connect_timeout_s; see its log and its engines' logs under "
                                   f"{engine_log_dir(self.transport.run_dir, rank)}")
            time.sleep(POLL_S)
        return self._engine(Registration(**record))

    def _engine(self, registration: Registration) -> Engine:
        from rolloutpipe.rollout.engines import sglang_api
        from rolloutpipe.rollout.engines.http_client import SGLangEngine

        if registration.error is not None:
            raise RuntimeError(f"rollout rank {registration.rank} ({registration.host}) could not start "
                               f"{registration.name}: {registration.error}")
        self.registrations[registration.name] = registration
        rank = registration.rank
        return SGLangEngine(name=registration.name, endpoint=sglang_api.Endpoint(registration.url, self.api_key),
                            concurrency=self.cfg.rollout.concurrency, on_result=self.on_result,
                            server_error=lambda: self.watch.lost(rank))


class RemoteRestart:
    """A restart requested from an engine host; ``poll`` returns the fresh engine once the host registered it."""

    def __init__(self, remote: RemoteEngines, rank: int, name: str) -> None:
        self.remote, self.rank, self.name = remote, rank, name

    def poll(self) -> Engine | None:
        """The fresh engine (serving policy_version 0), None while the host works on it; raises ``HostLost`` when
        the host is gone, RuntimeError when it could not start the server."""
        if (lost := self.remote.watch.lost(self.rank)) is not None:
            raise HostLost(lost)
        record = self.remote.transport.read_record(registration_key(self.remote.transport, self.rank, self.name))
        return None if record is None else self.remote._engine(Registration(**record))
