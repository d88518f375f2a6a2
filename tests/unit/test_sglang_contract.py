"""The SGLang client's contract with the pinned SGLang release, read from that release's own source.

The wheel of ``sglang==sglang_api.PINNED_VERSION`` is downloaded once (``pip download --no-deps``) into
``~/.cache/rolloutpipe/`` (or ``$ROLLOUTPIPE_CACHE``) and read as text, never imported or installed:

- ``srt/entrypoints/http_server.py``: the routes, their HTTP methods and the request class each one parses;
- ``srt/managers/io_struct.py``: the fields of those request classes;
- ``api/v1/api_types.py``: the schema ``/generate`` bodies are checked against (unknown ``sampling_params`` keys
  are rejected) and the fields of its response;
- ``srt/arg_groups/fields/*.py``: the server flags ``sglang.launch_server`` accepts;
- ``srt/model_executor/model_runner_components/weight_updater.py``: how a server joins the weight-update group and
  receives the broadcast tensors (rolloutpipe/control/weights/distributed.py is the other end).

The client's calls are recorded, not declared: the tests run ``sglang_api``'s real functions against a fake
``urlopen`` and check every route called, every field sent and every response field read.
Without network access to PyPI the tests skip and say so; CI reaches PyPI.
"""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from rolloutpipe.control.weights.buckets import BucketMac, WeightGroup, plan_buckets
from rolloutpipe.rollout.engines import server_process, sglang_api
from rolloutpipe.types import FinishReason, GenerationRequest, GenerationResult

CACHE = Path(os.environ.get("ROLLOUTPIPE_CACHE", Path.home() / ".cache" / "rolloutpipe"))


# --- the pinned release's source -----------------------------------------------------------------------------------


def _wheel() -> Path:
    pattern = f"sglang-{sglang_api.PINNED_VERSION}-*.whl"
    if not (found := sorted(CACHE.glob(pattern))):
        CACHE.mkdir(parents=True, exist_ok=True)
        # Any platform's wheel holds the same Python source; ask for the Linux one so this works everywhere.
        command = [sys.executable, "-m", "pip", "download", f"sglang=={sglang_api.PINNED_VERSION}", "--no-deps",
                   "--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
                   "-d", str(CACHE), "-q"]
        try:
            proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"downloading sglang=={sglang_api.PINNED_VERSION} timed out; needs network access to PyPI")
        if proc.returncode != 0 or not (found := sorted(CACHE.glob(pattern))):
            pytest.skip(f"could not download sglang=={sglang_api.PINNED_VERSION} (needs network access to PyPI, "
                        f"or put its wheel in {CACHE}): {proc.stderr.strip()[-500:]}")
    return found[0]


class Source:
    """The parsed source files of the pinned release."""

    def __init__(self, wheel: Path) -> None:
        with zipfile.ZipFile(wheel) as z:
            def tree(name: str) -> ast.Module:
                return ast.parse(z.read(name).decode())

            self.http_server = tree("sglang/srt/entrypoints/http_server.py")
            self.io_struct = tree("sglang/srt/managers/io_struct.py")
            self.api_types = tree("sglang/api/v1/api_types.py")
            self.weight_updater = tree("sglang/srt/model_executor/model_runner_components/weight_updater.py")
            self.common_utils = tree("sglang/srt/utils/common.py")
            self.tensor_bucket = tree("sglang/srt/weight_sync/tensor_bucket.py")
            self.server_flags = {
                "--" + field.replace("_", "-")
                for name in z.namelist() if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py")
                for cls in _classes(tree(name)).values() for field in _fields(cls)
            }
        self.routes = _routes(self.http_server)
        self.io_classes = _classes(self.io_struct)
        self.schema = _classes(self.api_types)

    def io_fields(self, class_name: str) -> set[str]:
        """A request class's fields, with those of its bases in io_struct (BaseReq's rid, ...)."""
        cls = self.io_classes[class_name]
        fields = _fields(cls)
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in self.io_classes:
                fields |= self.io_fields(base.id)
        return fields

    def schema_fields(self, class_name: str) -> set[str]:
        return _fields(self.schema[class_name])


def _classes(module: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}


def _fields(cls: ast.ClassDef) -> set[str]:
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _routes(module: ast.Module) -> dict[str, tuple[set[str], str | None, str]]:
    """route -> (HTTP methods, the request class its handler parses from the body or None, the handler's name)."""
    routes = {}
    for fn in module.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_class = None
        for arg in fn.args.args:
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
                ann = ann.slice.elts[0]
            if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req")):
                body_class = ann.id
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                continue
            if dec.func.attr in ("get", "post", "put"):
                methods = {dec.func.attr.upper()}
            elif dec.func.attr == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = {e.value for e in kw["methods"].elts} if "methods" in kw else {"GET"}
            else:
                continue
            routes[dec.args[0].value] = (methods, body_class, fn.name)
    return routes


@pytest.fixture(scope="module")
def sglang() -> Source:
    return Source(_wheel())


# --- the client's calls, recorded ----------------------------------------------------------------------------------


class Reads(dict):
    """A JSON object that records the path of every key read from it (nested objects record into the same set)."""

    def __init__(self, data: dict, reads: set[str], prefix: str = "") -> None:
        super().__init__(data)
        self._reads, self._prefix = reads, prefix

    def __getitem__(self, key):
        self._reads.add(self._prefix + key)
        value = super().__getitem__(key)
        return Reads(value, self._reads, f"{self._prefix}{key}.") if isinstance(value, dict) else value

    def get(self, key, default=None):
        return self[key] if key in self else (self._reads.add(self._prefix + key) or default)


class FakeServer:
    """Stands in for ``urllib.request.urlopen``: records (method, route, body) and answers as 0.5.23 would.

    Also stands in for sglang_api's ``json`` module, so that every answer the client decodes records the keys read
    from it in ``reads[route]``.
    """

    JSONDecodeError = json.JSONDecodeError
    dumps = staticmethod(json.dumps)

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict | None]] = []
        self.authorization: list[str | None] = []
        """Each call's Authorization header."""
        self.reads: dict[str, set[str]] = {}
        self.weight_version = "0"

    def loads(self, raw):
        value = json.loads(raw)
        route = self.calls[-1][1]
        return Reads(value, self.reads.setdefault(route, set())) if isinstance(value, dict) else value

    def urlopen(self, req, timeout=None):
        route = "/" + req.full_url.split("/", 3)[3]
        body = json.loads(req.data) if req.data else None
        self.calls.append((req.get_method(), route, body))
        self.authorization.append(req.get_header("Authorization"))
        answer = self.answer(route, body)
        return _Response(b"" if answer is None else json.dumps(answer).encode())

    def answer(self, route: str, body: dict | None):
        if route == sglang_api.UPDATE_WEIGHTS_FROM_DISK:
            self.weight_version = body["weight_version"]
            return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        if route == sglang_api.INIT_WEIGHTS_UPDATE_GROUP:
            return {"success": True, "message": "Succeeded to initialize custom process group."}
        if route == sglang_api.DESTROY_WEIGHTS_UPDATE_GROUP:
            return {"success": True, "message": "Succeeded to destroy custom process group."}
        if route == sglang_api.UPDATE_WEIGHTS_FROM_DISTRIBUTED:
            self.weight_version = body.get("weight_version") or self.weight_version
            return {"success": True, "message": "Succeeded to update parameter online."}
        if route == sglang_api.MODEL_INFO:
            return {"model_path": "/m", "weight_version": self.weight_version}
        if route == sglang_api.GENERATE:
            return sglang_api.generate_response(GenerationResult(
                request_id=body["rid"], output_ids=[5, 1], output_logprobs=[-0.5, -0.1],
                finish_reason=FinishReason.STOP, policy_version=int(self.weight_version), submitted_s=0.0,
                started_s=0.0, finished_s=0.0), num_prompt_tokens=len(body["input_ids"]))
        return None


class _Response(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake(monkeypatch) -> FakeServer:
    server = FakeServer()
    monkeypatch.setattr(sglang_api.urllib.request, "urlopen", server.urlopen)
    monkeypatch.setattr(sglang_api, "json", server)
    return server


def drive_the_client(fake: FakeServer, tmp_path: Path) -> None:
    """Every call RolloutPipe makes to an engine server, through sglang_api's real functions."""
    url = sglang_api.Endpoint("http://engine:30000", api_key="the-run-key")
    request = GenerationRequest(request_id="step=0/group=1/sample=2", input_ids=[3, 4], max_new_tokens=8,
                                temperature=1.0, top_p=0.9, sampling_seed=2**63 - 1, stop_token_ids=[1], priority=3)
    assert sglang_api.is_healthy(url)
    sglang_api.check_serves(url, 0)
    generated = sglang_api.generate(url, request, timeout_s=5)
    assert generated.output_ids == [5, 1] and generated.finish_reason is FinishReason.STOP
    sglang_api.abort(url, request.request_id)
    weights = tmp_path / "policy_v1.safetensors"
    weights.write_bytes(b"")
    sglang_api.update_weights_from_disk(url, str(weights), 1, timeout_s=5)
    assert fake.weight_version == "1"
    group = WeightGroup(master_address="10.0.0.1", master_port=29600, world_size=3)
    sglang_api.init_weights_update_group(url, group, 1, timeout_s=5)
    state = {"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.bfloat16), "model.norm.weight": torch.ones(2)}
    mac = BucketMac(key=bytes(32), tags=[bytes(16)])
    sglang_api.update_weights_from_distributed(url, plan_buckets(state, 1), group.group_name, 2, macs=lambda i: mac,
                                               timeout_s=5)
    assert fake.weight_version == "2"
    sglang_api.destroy_weights_update_group(url, group.group_name)  # (a member died during a broadcast)


# --- the checks ----------------------------------------------------------------------------------------------------


def test_every_route_the_client_calls_exists_with_its_method(sglang, fake, tmp_path):
    drive_the_client(fake, tmp_path)
    called = {(method, route) for method, route, _ in fake.calls}
    assert {route for _, route in called} == set(sglang_api.ROUTES)
    missing = [(m, r) for m, r in sorted(called) if r not in sglang.routes or m not in sglang.routes[r][0]]
    assert not missing, f"routes not served by sglang {sglang_api.PINNED_VERSION}: {missing}"


def test_every_field_the_client_sends_exists_in_the_request_class_its_route_parses(sglang, fake, tmp_path):
    drive_the_client(fake, tmp_path)
    problems = []
    for method, route, body in fake.calls:
        if not body:
            continue
        body_class = "GenerateReqInput" if route == sglang_api.GENERATE else sglang.routes[route][1]
        if body_class is None:
            problems.append(f"{route} takes no body but the client sends {sorted(body)}")
            continue
        fields = sglang.io_fields(body_class)
        if unknown := set(body) - fields:
            problems.append(f"{route} ({body_class}) has no field {sorted(unknown)}")
    assert not problems, "\n".join(problems)


def test_generate_bodies_pass_the_schema_check(sglang, fake, tmp_path):
    """0.5.23 checks /generate bodies against api/v1 (GenerateRequest; SamplingParams rejects unknown keys)."""
    drive_the_client(fake, tmp_path)
    (body,) = [b for _, route, b in fake.calls if route == sglang_api.GENERATE]
    assert set(body) <= sglang.schema_fields("GenerateRequest")
    assert set(body["sampling_params"]) <= sglang.schema_fields("SamplingParams")
    assert "priority" in body  # always sent, so the check above covers it


def test_every_response_field_the_client_reads_exists(sglang, fake, tmp_path):
    drive_the_client(fake, tmp_path)
    response, meta = sglang.schema_fields("GenerateResponse"), sglang.schema_fields("GenerateMetaInfo")
    for path in fake.reads[sglang_api.GENERATE]:
        parts = path.split(".")
        if len(parts) == 1:
            assert parts[0] in response, path
        elif len(parts) == 2:
            assert parts[0] == "meta_info" and parts[1] in meta, path
        else:  # finish_reason's tag
            assert parts == ["meta_info", "finish_reason", "type"], path
    assert "meta_info.output_token_logprobs" in fake.reads[sglang_api.GENERATE]
    decode_finish = _source_of(sglang.api_types, "decode_FinishReason")  # tagged by "type"
    assert "raw.get('type')" in decode_finish
    assert all(f"'{reason.value}'" in decode_finish for reason in FinishReason)
    for route, keys in fake.reads.items():  # the other JSON answers: dicts built by the route's handler
        if route != sglang_api.GENERATE:
            handler = sglang.routes[route][2]
            assert keys <= _dict_keys_in(sglang.http_server, handler), (route, keys)
    assert fake.reads[sglang_api.MODEL_INFO] == {"weight_version"}


def test_logprob_entries_are_logprob_first(sglang):
    """The client reads entry[0] of each output_token_logprobs entry as the log-prob."""
    fields = [s.target.id for s in sglang.schema["LogprobEntry"].body if isinstance(s, ast.AnnAssign)]
    assert fields[:2] == ["logprob", "token_id"]


def test_every_launch_flag_exists(sglang, tmp_path):
    server = server_process.sglang_server(name="engine0", model_path="/m", dtype="bfloat16", concurrency=8, seed=1,
                                          base_gpu_id=0, priority_scheduling=True, extra_args=[], log_dir=tmp_path,
                                          api_key="the-run-key")
    assert "the-run-key" not in server.command, "a command line is readable by every user of the machine"
    flags = [a for a in server.command if a.startswith("--")] + ["--api-key"]  # sglang_launch adds the key
    assert not set(flags) - sglang.server_flags, sorted(set(flags) - sglang.server_flags)


def test_every_call_carries_the_api_key_and_no_route_needs_the_admin_key(sglang, fake, tmp_path):
    """Servers run with --api-key: SGLang then wants ``Bearer <key>`` on every route but /health, and routes of
    level ADMIN_FORCE want --admin-api-key instead, which RolloutPipe does not set."""
    drive_the_client(fake, tmp_path)
    assert set(fake.authorization) == {"Bearer the-run-key"}
    handlers = {fn.name: fn for fn in sglang.http_server.body
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for route in {route for _, route, _ in fake.calls}:
        decorators = handlers[sglang.routes[route][2]].decorator_list
        levels = {ast.unparse(d) for d in decorators if "auth_level" in ast.unparse(d)}
        assert levels <= {"auth_level(AuthLevel.ADMIN_OPTIONAL)", "auth_level(AuthLevel.NORMAL)"}, (route, levels)


def test_distributed_update_bodies_carry_every_field_the_broadcast_needs(sglang, fake, tmp_path):
    """The fields without defaults must be sent, and only the last bucket carries the version."""
    drive_the_client(fake, tmp_path)
    init = [b for _, route, b in fake.calls if route == sglang_api.INIT_WEIGHTS_UPDATE_GROUP]
    updates = [b for _, route, b in fake.calls if route == sglang_api.UPDATE_WEIGHTS_FROM_DISTRIBUTED]
    assert len(init) == 1 and len(updates) == 2
    required = {"master_address", "master_port", "rank_offset", "world_size"}
    assert required <= set(init[0]) and {"group_name", "backend"} <= set(init[0])
    assert all({"names", "dtypes", "shapes", "group_name"} <= set(b) for b in updates)
    assert [b.get("weight_version") for b in updates] == [None, "2"]
    assert all(b["load_format"] == "flattened_bucket" for b in updates)  # one flat broadcast per bucket
    assert updates[0]["dtypes"] == ["bfloat16"] and updates[1]["shapes"] == [[2]]


def test_a_server_joins_and_receives_as_the_trainer_side_sends(sglang):
    """weight_sync.join_group / broadcast_bucket mirror these lines of 0.5.23 (read, not imported)."""
    init = _method_source(sglang.weight_updater, "init_weights_update_group")
    assert "rank = rank_offset + self.tp_rank" in init  # engine i's ranks start at its rank_offset
    assert "init_method=na.to_tcp()" in init  # a tcp:// rendezvous, whose rank 0 (the trainer) hosts the store
    group = _source_of(sglang.common_utils, "init_custom_process_group")
    assert "PrefixStore(group_name, store)" in group and "_new_process_group_helper(" in group
    assert "_world.pg_group_ranks[pg] = {i: i for i in range(world_size)}" in group
    receive = _method_source(sglang.weight_updater, "receive_weights_from_distributed")
    assert "if load_format == 'flattened_bucket':" in receive  # the load_format our bodies send
    bucketed = _method_source(sglang.weight_updater, "_receive_bucketed_weights_from_distributed")
    assert "FlattenedTensorBucket.empty(names, dtypes, shapes, self.device)" in bucketed  # one buffer for the bucket
    assert "src=0" in bucketed and bucketed.count("torch.distributed.broadcast(") == 1  # one broadcast, from rank 0
    empty = _method_source(sglang.tensor_bucket, "empty")  # its layout: buckets.pack's, tensor after tensor
    assert "getattr(torch, dtype)" in empty  # dtypes travel as torch attribute names: "bfloat16"
    assert "offset += size" in empty and "if offset % dtype.itemsize:" in empty  # no padding; aligned or refused


def _method_source(module: ast.Module, method: str) -> str:
    return next(ast.unparse(n) for n in ast.walk(module) if isinstance(n, ast.FunctionDef) and n.name == method)


def _source_of(module: ast.Module, function: str) -> str:
    return next(ast.unparse(n) for n in module.body if isinstance(n, ast.FunctionDef) and n.name == function)


def _dict_keys_in(module: ast.Module, function: str) -> set[str]:
    fn = next(n for n in module.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function)
    return {k.value for d in ast.walk(fn) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}
