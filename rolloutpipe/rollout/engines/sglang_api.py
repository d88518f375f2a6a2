"""SGLang's HTTP API as RolloutPipe speaks it: the one module that knows its request and response shapes.

Pinned release: sglang 0.5.23 (``pip install -e ".[sglang]"``). ``tests/unit/test_sglang_contract.py`` reads that
release's own source (``srt/managers/io_struct.py``, ``srt/entrypoints/http_server.py`` and the ``/generate`` schema
in ``api/v1/api_types.py``) and checks that every route called and every field sent or read here exists there.
When the pin moves, that test says what changed; fix it here and nowhere else.

Both ends use this module, the client (``http_client.SGLangEngine``) and the embedded engine's server
(``http_server``), so one client drives a real SGLang server and the embedded CPU engine alike.

Facts about 0.5.23 that shape this module (read in its source):

- ``/generate`` bodies are checked against a schema; ``sampling_params`` rejects unknown keys (HTTP 400).
  ``sampling_seed`` is a per-request seed in [-2**63, 2**63). We always send ``top_k=-1``: with the default
  ``--sampling-defaults model`` an unset top_k would come from the model's generation_config (Qwen3: 20), and the
  engine would sample from a distribution the trainer does not compute.
- Only ``--enable-deterministic-inference`` servers use ``sampling_seed``: the sampler engines/sampler.py reproduces.
- Output log-probs (``meta_info.output_token_logprobs``, entries ``[logprob, token_id, text]``) are
  log softmax(logits / temperature) of the sampled token unless the server runs with
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: the convention of ``GenerationResult.output_logprobs``.
- ``meta_info.finish_reason`` is ``{"type": "stop" | "length" | "abort", ...}``. A request aborted by
  ``/abort_request`` comes back with HTTP 200, type ``abort`` and its partial output.
- ``/abort_request`` with a rid the server has not registered yet is silently ignored: callers must re-send an
  abort until the request comes back (``SGLangEngine`` does). It aborts every request whose rid *starts with* the
  one given (``req.rid.startswith(recv_req.rid)`` in the scheduler), so the rid we send is the request id with
  ``RID_END`` appended (``engine_rid``): no rid is then a prefix of another, and aborting ``.../sample=1`` leaves
  ``.../sample=10`` alone. Everywhere else (logs, results, store keys) the id stays ``step=<k>/group=<g>/sample=<s>``.
- A second in-flight request with the same rid is refused with HTTP 400 ("Duplicate request ID detected").
- ``priority`` is honoured only with ``--enable-priority-scheduling``; RolloutPipe's convention (lower first) needs
  ``--schedule-low-priority-values-first`` too. A request *without* ``priority`` then gets the largest value
  (``sys.maxsize``, ``Scheduler._set_or_validate_priority``): it runs last. So ``priority`` is always sent, 0
  included (FGD's frontier group is group 0), and servers start with ``--default-priority-value MISSING_PRIORITY``
  so that whatever another client sends without one goes last too, as the scheduler would place it anyway.
- HTTP 4xx from ``/generate`` is about the request (e.g. "Requested token count exceeds the model's maximum context
  length"): the same request fails the same way on any engine. 5xx and lost connections are about the server.
  ``SGLangError.status`` tells them apart.
- Weight updates: ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` answer 400 outside
  ``/begin_weight_update`` ... ``/end_weight_update``. ``/update_weights_from_disk`` does not check, but the session
  is where in-place-packed weights are restored and re-packed, so it is wrapped the same way. The version is a
  string (``weight_version``), carried by the update, reported by ``/model_info`` and by every ``/generate``
  response's ``meta_info``; we use ``str(policy_version)``.
- ``/init_weights_update_group`` (InitWeightsUpdateGroupReqInput: master_address, master_port, rank_offset,
  world_size, group_name, backend) makes the server's tensor-parallel rank r join a torch process group as rank
  ``rank_offset + r``; it answers once every member has joined. ``/update_weights_from_distributed``
  (names, dtypes, shapes, group_name, flush_cache, weight_version, load_format) receives the tensors as one flat
  broadcast (``flattened_bucket``) and loads them; its MAC goes in a header of ours (buckets.py ``MAC_HEADER``)
  that SGLang ignores. Both answer ``{"success", "message"}``, HTTP 400 on failure (distributed.py: the trainer).
  ``/destroy_weights_update_group`` (group_name) leaves a group; the scheduler runs it after a broadcast in progress.
- ``/update_weights_from_disk`` takes a *directory* (``model_path``) and loads every ``*.safetensors`` in it;
  ``model_dir_for`` turns the trainer's one-file-per-version layout into that. A load that fails takes the server
  down (its rollback reloads from the bad path), so the rollout node hands it only a file that is there complete
  with the size the trainer published (control/weights/disk.py ``Receiver.visible_file``).
"""

from __future__ import annotations

import hmac
import json
import random
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutpipe.control.weights.buckets import MAC_HEADER
from rolloutpipe.types import FinishReason, GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from rolloutpipe.control.weights.buckets import Bucket, BucketMac, WeightGroup

PINNED_VERSION = "0.5.23"

GENERATE = "/generate"
HEALTH = "/health"
MODEL_INFO = "/model_info"
SERVER_INFO = "/server_info"
ABORT_REQUEST = "/abort_request"
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
FLUSH_CACHE = "/flush_cache"
BEGIN_WEIGHT_UPDATE = "/begin_weight_update"
UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
END_WEIGHT_UPDATE = "/end_weight_update"
INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
ROUTES = (GENERATE, HEALTH, MODEL_INFO, ABORT_REQUEST, PAUSE_GENERATION, CONTINUE_GENERATION, FLUSH_CACHE,
          BEGIN_WEIGHT_UPDATE, UPDATE_WEIGHTS_FROM_DISK, END_WEIGHT_UPDATE, INIT_WEIGHTS_UPDATE_GROUP,
          UPDATE_WEIGHTS_FROM_DISTRIBUTED, DESTROY_WEIGHTS_UPDATE_GROUP)

API_KEY_ENV = "RP_ENGINE_API_KEY"
"""How a server this node starts gets its API key: in its environment (never on its command line, which any user
of the machine can read), taken out before it starts children (http_server.py, sglang_launch.py)."""

UNAUTHORIZED = {"error": "Unauthorized"}

CONTROL_TIMEOUT_S = 60.0
"""Every call but /generate and the weight load: these answer at once on a healthy server."""


MISSING_PRIORITY = 2**63 - 1
"""The priority SGLang 0.5.23 gives a request without one under low-values-first priority scheduling (sys.maxsize:
last), and the ``--default-priority-value`` RolloutPipe starts servers with. The embedded server does the same."""

RID_END = "#"
"""Appended to every request id sent as a rid; ``#`` never occurs in RolloutPipe's ids (``engine_rid``)."""


class SGLangError(RuntimeError):
    """A server answered with an error, or could not be reached; the message names the URL and the route.

    ``status`` is the HTTP status (None: no answer), ``detail`` the server's own message."""

    def __init__(self, message: str, *, status: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail

    @property
    def is_request_error(self) -> bool:
        """HTTP 4xx: the request (or the run's configuration) is wrong, not the server."""
        return self.status is not None and 400 <= self.status < 500


def engine_rid(request_id: str) -> str:
    """The rid a server sees for ``request_id``: with ``RID_END`` appended, no rid is a prefix of another (SGLang
    aborts by prefix), since ``RID_END`` occurs in a rid only as its last character."""
    return request_id + RID_END


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An engine server: its base URL, and the API key it was started with (``--api-key``; None: it takes calls
    without one). Every call sends the key as ``Authorization: Bearer <key>``; a server started with a key
    answers 401 ``{"error": "Unauthorized"}`` to a call without it, except ``/health`` (SGLang's rule)."""

    url: str
    api_key: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return self.url


# --- /generate -------------------------------------------------------------------------------------------------


def generate_body(request: GenerationRequest) -> dict[str, Any]:
    """GenerateReqInput for one request, token ids in and out (the server runs with --skip-tokenizer-init)."""
    return {
        "rid": engine_rid(request.request_id),
        "input_ids": request.input_ids,
        "sampling_params": {
            "max_new_tokens": request.max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": -1,
            "stop_token_ids": request.stop_token_ids,
            "sampling_seed": request.sampling_seed,
        },
        "return_logprob": True,
        "priority": request.priority,  # always: a missing one runs last (module docstring)
    }


@dataclass(kw_only=True, slots=True)
class GenerateCall:
    """One /generate body as the embedded server reads it: the request, and how to answer."""

    request: GenerationRequest
    stream: bool = False
    """Answer as server-sent events (``data: {...}`` then ``data: [DONE]``), as SGLang does for ``stream: true``."""
    ignore_eos: bool = False
    """SGLang's sampling param: neither the model's EOS ids nor ``stop_token_ids`` end the request."""


def parse_generate_body(body: dict[str, Any], *, encode: Callable[[str], list[int]] | None = None) -> GenerateCall:
    """The server side of ``generate_body`` (the embedded engine's server), with SGLang 0.5.23's defaults for
    every field ``generate_body`` sends and others may leave out (``SamplingParams``, ``GenerateReqInput``): a
    fresh random rid and seed, top_p 1, no stop ids, 128 new tokens, temperature 1, and ``MISSING_PRIORITY``.
    ``text`` needs ``encode`` (the server's tokenizer); a ValueError says what is wrong with the body."""
    params = body.get("sampling_params") or {}
    if body.get("input_ids") is not None:
        input_ids = list(body["input_ids"])
    elif body.get("text") is not None:
        if encode is None:
            raise ValueError("this server has no tokenizer, so it takes input_ids, not text: tokenize the prompt "
                             "yourself and send input_ids")
        input_ids = encode(body["text"])
    else:
        raise ValueError("the body has neither input_ids nor text")
    seed = params.get("sampling_seed")
    request = GenerationRequest(
        request_id=body.get("rid") or uuid.uuid4().hex,
        input_ids=input_ids,
        max_new_tokens=_or(params.get("max_new_tokens"), 128),
        temperature=_or(params.get("temperature"), 1.0),
        top_p=_or(params.get("top_p"), 1.0),
        sampling_seed=random.getrandbits(63) if seed is None else seed,
        stop_token_ids=list(params.get("stop_token_ids") or []),
        priority=_or(body.get("priority"), MISSING_PRIORITY),
    )
    return GenerateCall(request=request, stream=bool(body.get("stream")), ignore_eos=bool(params.get("ignore_eos")))


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


@dataclass(kw_only=True, slots=True)
class Generated:
    """What RolloutPipe reads back from one /generate response."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_version: str


def parse_generate_response(body: dict[str, Any]) -> Generated:
    meta = body["meta_info"]
    entries = meta["output_token_logprobs"] or []  # [logprob, token_id, text] per output token
    return Generated(
        output_ids=list(body["output_ids"]),
        output_logprobs=[float(e[0]) for e in entries],
        finish_reason=FinishReason(meta["finish_reason"]["type"]),
        weight_version=meta["weight_version"],
    )


def generate_response(result: GenerationResult, *, num_prompt_tokens: int,
                      text: str | None = None) -> dict[str, Any]:
    """The server side of ``parse_generate_response``: a subset of what SGLang returns for an input_ids request
    (with ``text``, the output decoded, when the server has a tokenizer); one event of a stream is the same dict."""
    reason: dict[str, Any] = {"type": result.finish_reason.value}
    if result.finish_reason is FinishReason.STOP:
        reason["matched"] = result.output_ids[-1]
    elif result.finish_reason is FinishReason.LENGTH:
        reason["length"] = len(result.output_ids)
    body: dict[str, Any] = {} if text is None else {"text": text}
    return body | {
        "output_ids": result.output_ids,
        "meta_info": {
            "id": result.request_id,
            "finish_reason": reason,
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": len(result.output_ids),
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(result.output_logprobs, result.output_ids)],
            "weight_version": str(result.policy_version),
        },
    }


# --- control routes: bodies --------------------------------------------------------------------------------------


def abort_body(request_id: str) -> dict[str, Any]:
    return {"rid": engine_rid(request_id)}


def abort_all_body() -> dict[str, Any]:
    return {"abort_all": True}


def pause_body() -> dict[str, Any]:
    # "abort": whatever is still running comes back aborted. Between steps nothing is, so this only makes the
    # server hold new requests until /continue_generation.
    return {"mode": "abort"}


def update_weights_from_disk_body(model_dir: str, policy_version: int) -> dict[str, Any]:
    return {"model_path": model_dir, "weight_version": str(policy_version), "flush_cache": True}


def parse_update_weights_from_disk_body(body: dict[str, Any]) -> tuple[str, int]:
    """(model_path, policy_version): the server side of ``update_weights_from_disk_body``."""
    return body["model_path"], int(body["weight_version"])


def init_weights_update_group_body(group: WeightGroup, rank_offset: int) -> dict[str, Any]:
    return {"master_address": group.master_address, "master_port": group.master_port, "rank_offset": rank_offset,
            "world_size": group.world_size, "group_name": group.group_name, "backend": group.backend}


def parse_init_weights_update_group_body(body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(WeightGroup fields, rank_offset): the server side of ``init_weights_update_group_body``."""
    group = {k: body[k] for k in ("master_address", "master_port", "world_size", "group_name", "backend")}
    return group, body["rank_offset"]


def update_weights_from_distributed_body(bucket: Bucket, group_name: str,
                                         policy_version: int | None) -> dict[str, Any]:
    """One bucket, sent as one flat broadcast (buckets.py ``pack``); ``policy_version`` on the last one only."""
    body: dict[str, Any] = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                            "group_name": group_name, "flush_cache": policy_version is not None,
                            "load_format": "flattened_bucket"}
    if policy_version is not None:
        body["weight_version"] = str(policy_version)
    return body


def parse_update_weights_from_distributed_body(body: dict[str, Any]) -> tuple[dict[str, Any], str, int | None]:
    """(Bucket fields, group_name, policy_version or None): the server side of the body above."""
    version = body.get("weight_version")
    bucket = {"names": list(body["names"]), "dtypes": list(body["dtypes"]),
              "shapes": [list(s) for s in body["shapes"]]}
    return bucket, body["group_name"], None if version is None else int(version)


def served_weight_version(model_info: dict[str, Any]) -> str:
    return model_info["weight_version"]


def model_dir_for(weights_path: str) -> str:
    """A directory whose only ``*.safetensors`` is ``weights_path`` (a file), for /update_weights_from_disk.

    The trainer writes ``weights/policy_v<k>.safetensors`` beside the previous version, so the ``weights``
    directory itself would load both. ``weights/policy_v<k>.model/model.safetensors`` is a relative symlink to the
    file: it costs nothing and keeps no data alive once the trainer deletes the version.
    """
    path = Path(weights_path)
    if path.is_dir():
        return str(path)
    directory = path.with_suffix(".model")
    directory.mkdir(exist_ok=True)
    link = directory / "model.safetensors"
    if not link.is_symlink():
        link.symlink_to(Path("..") / path.name)
    for stale in path.parent.glob("*.model"):  # earlier versions whose file the trainer has deleted
        if (stale != directory and (stale / "model.safetensors").is_symlink()
                and not (stale / "model.safetensors").exists()):
            (stale / "model.safetensors").unlink()
            stale.rmdir()
    return str(directory)


def authorized(path: str, authorization: str | None, api_key: str | None) -> bool:
    """Whether a server started with ``api_key`` takes a call to ``path``: SGLang 0.5.23's rule for the routes
    RolloutPipe uses (``srt/utils/auth.py``, routes of level normal or admin-optional without an admin key):
    /health, /ready and /metrics always, everything else with ``Authorization: Bearer <api_key>``."""
    if api_key is None or path.startswith(("/health", "/ready", "/metrics")):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


# --- HTTP --------------------------------------------------------------------------------------------------------


def call(server: Endpoint, route: str, body: dict[str, Any] | None = None, *, timeout_s: float = CONTROL_TIMEOUT_S,
         method: str | None = None, headers: dict[str, str] | None = None) -> Any:
    """POST ``body`` as JSON (GET when None), with the server's API key and ``headers``; returns the decoded JSON
    answer, or its text, or None when empty.

    Raises SGLangError naming the URL and route on an HTTP error status or when the server cannot be reached.
    """
    url = server.url.rstrip("/") + route
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    if server.api_key is not None:
        headers["Authorization"] = f"Bearer {server.api_key}"
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace").strip()
        raise SGLangError(f"{url} answered HTTP {err.code}: {detail[:2000]}", status=err.code,
                          detail=_error_message(detail)[:2000]) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise SGLangError(f"cannot reach the engine server at {url}: {reason}") from err
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode(errors="replace")


def _error_message(detail: str) -> str:
    """The message in SGLang's error bodies (``{"error": {"message": ...}}``, or ``{"error": "..."}``), else all."""
    try:
        error = json.loads(detail).get("error")
    except (json.JSONDecodeError, AttributeError):
        return detail
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) else detail


def is_healthy(server: Endpoint, timeout_s: float = 5.0) -> bool:
    try:
        call(server, HEALTH, timeout_s=timeout_s)
        return True
    except SGLangError:
        return False


def wait_healthy(server: Endpoint, *, timeout_s: float, check_alive: Callable[[], None] = lambda: None,
                 poll_s: float = 0.5) -> None:
    """Poll /health until it answers 200. ``check_alive`` raises if the server's process has died meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not is_healthy(server):
        check_alive()
        if time.monotonic() > deadline:
            raise SGLangError(f"the engine server at {server} did not answer {HEALTH} within {timeout_s:.0f}s.")
        time.sleep(poll_s)


def generate(server: Endpoint, request: GenerationRequest, *, timeout_s: float) -> Generated:
    return parse_generate_response(call(server, GENERATE, generate_body(request), timeout_s=timeout_s))


def abort(server: Endpoint, request_id: str) -> None:
    call(server, ABORT_REQUEST, abort_body(request_id))


@contextmanager
def weight_update_session(server: Endpoint):
    """pause -> begin_weight_update -> (the body's update calls) -> end_weight_update -> flush_cache -> continue.

    The flush is explicit because radix cache entries computed with the old weights must never serve the new
    policy, whatever the update's flags did. The session is closed and generation resumed even when a call in
    between fails; the flush only after a successful update.
    """
    call(server, PAUSE_GENERATION, pause_body())
    try:
        call(server, BEGIN_WEIGHT_UPDATE, {})  # (this route, END_WEIGHT_UPDATE and CONTINUE_GENERATION: no fields)
        try:
            yield
        finally:
            call(server, END_WEIGHT_UPDATE, {})
        call(server, FLUSH_CACHE, {})
    finally:
        call(server, CONTINUE_GENERATION, {})


def update_weights_from_disk(server: Endpoint, weights_path: str, policy_version: int, *, timeout_s: float) -> None:
    """Serve ``policy_version`` from ``weights_path``, between steps, and check that the server reports it."""
    model_dir = model_dir_for(weights_path)
    with weight_update_session(server):
        answer = call(server, UPDATE_WEIGHTS_FROM_DISK, update_weights_from_disk_body(model_dir, policy_version),
                      timeout_s=timeout_s)
        if not answer["success"]:
            raise SGLangError(f"{server}{UPDATE_WEIGHTS_FROM_DISK} failed: {answer['message']}")
    check_serves(server, policy_version, hint=f"(after loading {model_dir})")


def init_weights_update_group(server: Endpoint, group: WeightGroup, rank_offset: int, *, timeout_s: float) -> None:
    """Make the server join ``group`` from ``rank_offset``; returns once every member has joined."""
    call(server, INIT_WEIGHTS_UPDATE_GROUP, init_weights_update_group_body(group, rank_offset), timeout_s=timeout_s)


def destroy_weights_update_group(server: Endpoint, group_name: str) -> None:
    """Leave ``group_name``, giving up a broadcast in progress where the server can; best effort (errors ignored)."""
    with suppress(SGLangError):
        call(server, DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": group_name})


def update_weights_from_distributed(server: Endpoint, buckets: list[Bucket], group_name: str, policy_version: int, *,
                                    macs: Callable[[int], BucketMac] | None, timeout_s: float) -> None:
    """Receive ``policy_version`` from the trainer's broadcasts, between steps, and check the version served. Bucket
    i's call carries its MAC, ``macs(i)`` (which may wait for the trainer). Every engine of the group makes these
    calls at the same time: each broadcast waits for all of them."""
    with weight_update_session(server):
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            call(server, UPDATE_WEIGHTS_FROM_DISTRIBUTED,
                 update_weights_from_distributed_body(bucket, group_name, policy_version if last else None),
                 timeout_s=timeout_s, headers=None if macs is None else {MAC_HEADER: macs(i).header()})
    check_serves(server, policy_version, hint=f"(after {len(buckets)} broadcast buckets)")


def honours_seeds(server: Endpoint) -> bool | None:
    """Whether the server samples with each request's ``sampling_seed``: SGLang only with
    ``--enable-deterministic-inference`` (``/server_info``'s ``enable_deterministic_inference``); None: it does not
    say."""
    try:
        info = call(server, SERVER_INFO)
    except SGLangError:
        return None
    value = info.get("enable_deterministic_inference") if isinstance(info, dict) else None
    return value if isinstance(value, bool) else None


def check_serves(server: Endpoint, policy_version: int, *, hint: str = "") -> None:
    """Raise unless /model_info reports ``str(policy_version)`` as the server's weight version."""
    served = served_weight_version(call(server, MODEL_INFO))
    if served != str(policy_version):
        raise SGLangError(f"the engine server at {server} reports weight_version {served!r}, expected "
                          f"{str(policy_version)!r}. {hint}".strip())
