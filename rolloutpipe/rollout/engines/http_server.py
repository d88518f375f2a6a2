"""The embedded CPU engine served over the subset of SGLang's HTTP API that RolloutPipe uses.

    python -m rolloutpipe.rollout.engines.http_server --model-config model.yaml --port 0 --port-file port.txt

``--model-config`` is a YAML ``ModelConfig`` (the ``model`` section of a RolloutPipe config); ``--port 0`` takes a
free port and writes it to ``--port-file`` once the server listens. With ``RP_ENGINE_API_KEY`` in its environment
it takes calls only with that key, as SGLang does with ``--api-key`` (``sglang_api.authorized``).
``rollout.engine=embedded_http`` starts one per engine (engine/__init__.py), so the rollout node drives the
embedded engine exactly as it drives SGLang servers: through ``SGLangEngine`` and ``sglang_api``, which parses
every request and builds every response here too.

What it mimics of SGLang 0.5.23, and only that: /generate (token ids in and out, per-request seed, log-probs,
priority; a missing one runs last, as under SGLang's low-values-first priority scheduling; a duplicate in-flight
rid refused with 400; SGLang's defaults for the optional fields; ``text`` in and out when the server has a
tokenizer; ``stream: true`` answered as server-sent events, one event with the whole result since the engine hands
back finished requests only: enough for ``sglang.bench_serving --backend sglang`` and its token counts),
/v1/models, /health, /model_info (``weight_version``), /abort_request (all, or every rid that *starts with* the
one given, as SGLang matches; an unknown rid is ignored),
/pause_generation (aborts what runs, holds new requests) and /continue_generation, /flush_cache (400 while
requests run), /begin_weight_update and /end_weight_update around /update_weights_from_disk (400 outside a
session, as 0.5.23 does for its other weight-update routes) and /update_weights_from_distributed (400 outside a
session, as in 0.5.23), after /init_weights_update_group (gloo only: this engine runs on CPU; the group is formed
as SGLang forms it, see rolloutpipe/control/weights/group.py). A bucket's tensors are loaded as they
arrive, once they match the bucket's MAC (the ``X-RolloutPipe-Bucket-MAC`` header, which SGLang does not have: a
bucket without one, or whose bytes do not match it, is refused with 400, and the server then answers /generate with
503 until a weight-update session loads a whole policy); the version changes with the bucket that carries
``weight_version``. /destroy_weights_update_group leaves a group, and gives up a broadcast in progress on it (another
member died during it: it would wait until the group's timeout); the server then serves nothing until a whole policy
loads, as after a refused bucket.

Threads: ``ThreadingHTTPServer`` runs one thread per connection; a /generate thread submits to the engine and waits
for its result, which the engine's scheduler thread hands over through ``_Waiter``. The process stops on SIGTERM
or SIGINT: the engine aborts what is left and the server closes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from rolloutpipe.control.weights.buckets import MAC_HEADER, Bucket, BucketMac, WeightGroup
from rolloutpipe.control.weights.distributed import check_bucket
from rolloutpipe.control.weights.group import BroadcastBroken, join_group, receive_bucket
from rolloutpipe.rollout.engines import server_process, sglang_api
from rolloutpipe.rollout.engines.embedded import EmbeddedEngine
from rolloutpipe.types import GenerationResult

log = logging.getLogger(__name__)

V1_MODELS = "/v1/models"
"""Served for tools that speak the OpenAI side of SGLang's API (bench_serving); RolloutPipe's client never calls it."""

JOIN_TIMEOUT_S = 600.0
"""How long /init_weights_update_group waits for the other members of the group."""


class _Waiter:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: GenerationResult | None = None


class _Events(str):
    """A server-sent-events body (``text/event-stream``)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048  # the listen backlog; socketserver's 5 resets connections a client opens at once


class EmbeddedServer:
    """The API's state around one EmbeddedEngine; ``serve_forever`` answers requests until ``close``."""

    def __init__(self, *, engine_factory, model_path: str, host: str, port: int, api_key: str | None = None,
                 tokenizer=None) -> None:
        self.model_path = model_path
        self.tokenizer = tokenizer
        """Takes ``text`` prompts and answers with ``text`` when set (SGLang without --skip-tokenizer-init)."""
        self.api_key = api_key
        """Every route but /health needs ``Authorization: Bearer <api_key>`` (SGLang's --api-key); None: open."""
        self._lock = threading.Lock()
        self._resumed = threading.Condition(self._lock)
        self._waiters: dict[str, _Waiter] = {}
        self._paused = False
        self._session_open = False
        self._groups: dict[str, tuple[Any, threading.Event]] = {}
        """Weight-update process groups by name (/init_weights_update_group), each with the event that
        /destroy_weights_update_group sets to give up a broadcast in progress."""
        self._inbox = torch.empty(0, dtype=torch.uint8)
        """The buffer buckets are received into, grown to the largest; a bucket is loaded (copied) before the next
        arrives. A fresh one per bucket would fault in every page of every policy again."""
        self._torn: str | None = None
        """Why the weights are part old, part new (a refused bucket), until a session loads a whole policy."""
        self._refused_in_session = False
        self.engine: EmbeddedEngine = engine_factory(self._on_result)
        self.httpd = _Server((host, port), _handler_for(self))

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        self.engine.shutdown()  # hands back every request as aborted, so no /generate thread waits forever
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- routes: each returns (status, JSON-able body or None) ---------------------------------------------------

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        encode = None if self.tokenizer is None else self.tokenizer.encode
        try:
            call = sglang_api.parse_generate_body(body, encode=encode)
        except ValueError as err:
            return HTTPStatus.BAD_REQUEST, {"error": {"message": str(err)}}
        request = call.request
        waiter = _Waiter()
        with self._lock:
            self._resumed.wait_for(lambda: not self._paused)
            if self._torn is not None:
                return HTTPStatus.SERVICE_UNAVAILABLE, {"error": {"message": self._torn}}
            if request.request_id in self._waiters:  # SGLang's check and words (TokenizerManager)
                return HTTPStatus.BAD_REQUEST, {"error": {"message": "Duplicate request ID detected: "
                                                                     f"{request.request_id}"}}
            self._waiters[request.request_id] = waiter
        try:
            self.engine.submit(request, ignore_eos=call.ignore_eos)
        except (ValueError, RuntimeError) as err:
            with self._lock:
                self._waiters.pop(request.request_id, None)
            # a bad request is the caller's (400); an engine shut down (the server is stopping) or crashed is the
            # server's (503): the client then fails this engine and retries the request elsewhere
            status = HTTPStatus.BAD_REQUEST if isinstance(err, ValueError) else HTTPStatus.SERVICE_UNAVAILABLE
            return status, {"error": {"message": str(err)}}
        waiter.done.wait()
        if waiter.result is None:
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"engine crashed: {self.engine.error!r}"}}
        text = None if self.tokenizer is None else self.tokenizer.decode(waiter.result.output_ids,
                                                                          skip_special_tokens=True)
        answer = sglang_api.generate_response(waiter.result, num_prompt_tokens=len(request.input_ids), text=text)
        if call.stream:
            return HTTPStatus.OK, _Events(f"data: {json.dumps(answer)}\n\ndata: [DONE]\n\n")
        return HTTPStatus.OK, answer

    def abort_request(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("abort_all"):
            self._abort_all()
        elif rid := body.get("rid"):
            with self._lock:
                ids = [request_id for request_id in self._waiters if request_id.startswith(rid)]
            for request_id in ids:
                self.engine.abort(request_id)
        return HTTPStatus.OK, None

    def pause_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            self._paused = True
        self._abort_all()
        return HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            self._paused = False
            self._resumed.notify_all()
        return HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"}

    def flush_cache(self, body: dict[str, Any]) -> tuple[int, Any]:
        # The embedded engine keeps no cache across requests; like SGLang, refuse while requests run.
        if self.engine.num_in_flight():
            return HTTPStatus.BAD_REQUEST, "Flush cache failed: requests are running or queued.\n"
        return HTTPStatus.OK, "Cache flushed.\n"

    def begin_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            if self._session_open:
                return HTTPStatus.BAD_REQUEST, {"success": False, "message": "a weight-update session is already open"}
            self._session_open, self._refused_in_session = True, False
        return HTTPStatus.OK, {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            if not self._session_open:
                return HTTPStatus.BAD_REQUEST, {"success": False, "message": "no weight-update session is open"}
            self._session_open = False
        return HTTPStatus.OK, {"success": True, "message": "Success"}

    def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, Any]:
        model_path, policy_version = sglang_api.parse_update_weights_from_disk_body(body)
        with self._lock:
            session_open = self._session_open
        if not session_open:
            return HTTPStatus.BAD_REQUEST, {"success": False, "num_paused_requests": 0, "message":
                                            "update_weights_from_disk must run between begin_weight_update() and "
                                            "end_weight_update()"}
        files = sorted(Path(model_path).glob("*.safetensors"))
        if len(files) != 1:
            return HTTPStatus.BAD_REQUEST, {"success": False, "num_paused_requests": 0, "message":
                                            f"{model_path} holds {len(files)} *.safetensors files; the embedded "
                                            "engine loads exactly one"}
        try:
            self.engine.update_weights_from_disk(str(files[0]), policy_version)
        except (RuntimeError, OSError, ValueError) as err:
            return HTTPStatus.BAD_REQUEST, {"success": False, "num_paused_requests": 0, "message": str(err)}
        self.model_path = model_path
        return HTTPStatus.OK, {"success": True, "num_paused_requests": 0,
                               "message": f"Succeeded to update model weights. Weight version updated to "
                                          f"{policy_version}."}

    def init_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        fields, rank_offset = sglang_api.parse_init_weights_update_group_body(body)
        group = WeightGroup(**fields)
        if group.backend != "gloo":
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": f"backend {group.backend!r}: the embedded "
                                            "engine runs on CPU and joins weight-update groups over gloo only"}
        try:
            self._groups[group.group_name] = (join_group(group, rank_offset, timeout_s=JOIN_TIMEOUT_S),
                                              threading.Event())
        except (RuntimeError, ValueError) as err:
            return HTTPStatus.BAD_REQUEST, {"success": False,
                                            "message": f"Failed to initialize custom process group: {err}."}
        return HTTPStatus.OK, {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict[str, Any], mac: str | None) -> tuple[int, Any]:
        """Receive one bucket and load it if its bytes match ``mac`` (the MAC_HEADER value)."""
        bucket, group_name, policy_version = sglang_api.parse_update_weights_from_distributed_body(body)
        with self._lock:
            session_open = self._session_open
        if not session_open:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": "update_weights_from_distributed must run "
                                            "between begin_weight_update() and end_weight_update()"}
        if (joined := self._groups.get(group_name)) is None:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": f"Group {group_name} not in "
                                            f"{list(self._groups)}. Please call `init_weights_update_group` first."}
        bucket = Bucket(**bucket)
        if self._inbox.numel() < bucket.num_bytes:
            self._inbox = torch.empty(bucket.num_bytes, dtype=torch.uint8)
        try:  # first: the broadcast waits for all
            tensors = receive_bucket(joined[0], bucket, self._inbox, abandoned=joined[1])
        except BroadcastBroken as err:
            why = f"the broadcast on {group_name} broke ({err}); this engine serves nothing until a whole policy loads"
            with self._lock:
                self._torn, self._refused_in_session = why, True
                self._inbox = torch.empty(0, dtype=torch.uint8)  # the broken receive may still write the old one
            self._groups.pop(group_name, None)  # (a broken group cannot serve again)
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": f"Failed to update parameter online: {why}"}
        try:
            genuine = mac is not None and check_bucket(bucket, tensors, BucketMac.parse(mac))
        except ValueError:
            genuine = False
        if not genuine:
            why = (f"the bucket of {bucket.names[0]} and {len(bucket.names) - 1} more tensors "
                   f"{'came without' if mac is None else 'does not match'} its MAC ({MAC_HEADER}): its bytes are not "
                   "the ones trainer rank 0 sent, so it was not loaded, and this engine serves nothing until a "
                   "weight-update session loads a whole policy. Whoever reached the weight-update group's ports "
                   "changed them: keep those ports within the run's nodes (docs/faults-and-security.md)")
            with self._lock:
                self._torn, self._refused_in_session = why, True
            log.error("refused a weight bucket: %s", why)
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": f"Failed to update parameter online: {why}"}
        try:
            self.engine.load_weights(tensors, policy_version, complete=False)
        except (RuntimeError, ValueError) as err:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": f"Failed to update parameter online: {err}"}
        if policy_version is not None:
            with self._lock:
                if not self._refused_in_session:
                    self._torn = None
        return HTTPStatus.OK, {"success": True, "message": "Succeeded to update parameter online."}

    def destroy_weights_update_group(self, body: dict[str, Any]) -> tuple[int, Any]:
        group_name = body["group_name"]
        if (joined := self._groups.pop(group_name, None)) is None:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": f"Group {group_name} not in groups."}
        joined[1].set()  # a receive in progress gives up (the group's gloo work ends on its timeout, unread)
        return HTTPStatus.OK, {"success": True, "message": "Succeeded to destroy custom process group."}

    def model_info(self) -> tuple[int, Any]:
        return HTTPStatus.OK, {"model_path": self.model_path, "is_generation": True,
                               "weight_version": str(self.engine.policy_version)}

    def server_info(self) -> tuple[int, Any]:
        """The part of SGLang's /server_info a client reads: this engine always samples with the request's seed."""
        return HTTPStatus.OK, {"model_path": self.model_path, "enable_deterministic_inference": True,
                               "max_running_requests": self.engine.concurrency}

    def models(self) -> tuple[int, Any]:
        """OpenAI's model list, as SGLang serves it (bench_serving reads the model id and waits on it)."""
        card = {"id": self.model_path, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": self.model_path, "parent": None, "max_model_len": self.engine.context_len}
        return HTTPStatus.OK, {"object": "list", "data": [card]}

    def health(self) -> tuple[int, Any]:
        if self.engine.error is not None:
            return HTTPStatus.SERVICE_UNAVAILABLE, None
        return HTTPStatus.OK, None

    # --- engine side ---------------------------------------------------------------------------------------------

    def _on_result(self, result: GenerationResult) -> None:
        with self._lock:
            waiter = self._waiters.pop(result.request_id, None)
        if waiter is not None:
            waiter.result = result
            waiter.done.set()

    def _abort_all(self) -> None:
        with self._lock:
            ids = list(self._waiters)
        for request_id in ids:
            self.engine.abort(request_id)


def _handler_for(server: EmbeddedServer) -> type[BaseHTTPRequestHandler]:
    posts = {
        sglang_api.GENERATE: server.generate,
        sglang_api.ABORT_REQUEST: server.abort_request,
        sglang_api.PAUSE_GENERATION: server.pause_generation,
        sglang_api.CONTINUE_GENERATION: server.continue_generation,
        sglang_api.FLUSH_CACHE: server.flush_cache,
        sglang_api.BEGIN_WEIGHT_UPDATE: server.begin_weight_update,
        sglang_api.END_WEIGHT_UPDATE: server.end_weight_update,
        sglang_api.UPDATE_WEIGHTS_FROM_DISK: server.update_weights_from_disk,
        sglang_api.INIT_WEIGHTS_UPDATE_GROUP: server.init_weights_update_group,
        sglang_api.UPDATE_WEIGHTS_FROM_DISTRIBUTED: server.update_weights_from_distributed,
        sglang_api.DESTROY_WEIGHTS_UPDATE_GROUP: server.destroy_weights_update_group,
    }
    with_mac = {server.update_weights_from_distributed}
    gets = {sglang_api.HEALTH: server.health, sglang_api.MODEL_INFO: server.model_info, V1_MODELS: server.models,
            sglang_api.SERVER_INFO: server.server_info}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if not self._authorized():
                return
            route = gets.get(self.path.split("?")[0])
            self._answer(*(route() if route else (HTTPStatus.NOT_FOUND, {"detail": "Not Found"})))

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self._authorized():
                return
            route = posts.get(self.path.split("?")[0])
            if route is None:
                self._answer(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
                return
            try:
                body = json.loads(raw) if raw else {}
                answer = route(body, self.headers.get(MAC_HEADER)) if route in with_mac else route(body)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                answer = HTTPStatus.BAD_REQUEST, {"error": {"message": f"bad request body: {err!r}"}}
            self._answer(*answer)

        def _authorized(self) -> bool:
            path = self.path.split("?")[0]
            if sglang_api.authorized(path, self.headers.get("Authorization"), server.api_key):
                return True
            log.warning("refused %s %s from %s: no or wrong API key (the run's engines take calls from the "
                        "rollout node only)", self.command, path, self.address_string())
            self._answer(HTTPStatus.UNAUTHORIZED, sglang_api.UNAUTHORIZED)
            return False

        def _answer(self, status: int, body: Any) -> None:
            if body is None:
                data, kind = b"", "text/plain"
            elif isinstance(body, str):
                data, kind = body.encode(), "text/event-stream" if isinstance(body, _Events) else "text/plain"
            else:
                data, kind = json.dumps(body).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", required=True, help="YAML of a ModelConfig (the config's model section)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port, written to --port-file")
    parser.add_argument("--port-file", help="where to write the port once the server listens")
    parser.add_argument("--concurrency", type=int, default=64, help="requests run at once (max_running_requests)")
    parser.add_argument("--weight-version", type=int, default=0, help="the policy_version of the initial weights")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--batch-invariant", action="store_true", help="rollout.batch_invariant (embedded.py)")
    args = parser.parse_args(argv)
    server_process.die_with_the_rollout_node()
    api_key = os.environ.pop(sglang_api.API_KEY_ENV, None)

    import torch
    from omegaconf import OmegaConf

    from rolloutpipe.model import ModelConfig, load_model, load_tokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_cfg: ModelConfig = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(args.model_config)))
    tokenizer = load_tokenizer(model_cfg)
    model = load_model(model_cfg, len(tokenizer))
    server = EmbeddedServer(
        engine_factory=lambda on_result: EmbeddedEngine(name=f"http:{args.port}", model=model,
                                                        concurrency=args.concurrency, on_result=on_result,
                                                        policy_version=args.weight_version,
                                                        batch_invariant=args.batch_invariant),
        model_path=model_cfg.path or "embedded-tiny", host=args.host, port=args.port, api_key=api_key,
        tokenizer=tokenizer,
    )

    def stop(signum, frame) -> None:
        threading.Thread(target=server.close, daemon=True).start()  # shutdown() must not run on the serving thread

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if args.port_file:  # written atomically: whoever polls it never reads half a number
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(server.port))
        os.replace(tmp, args.port_file)
    log.info("embedded engine server listening on http://%s:%d", args.host, server.port)
    server.httpd.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
