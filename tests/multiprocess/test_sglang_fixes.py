"""Where RolloutPipe differed from the real SGLang 0.5.23 server (issue 15), each pinned by a test.

The embedded engine's server runs in this process (one tiny float32 model, a thread serving HTTP), so each test
drives it over real HTTP in well under a second: the SGLang client where RolloutPipe talks to it, plain urllib
where another tool (SGLang's bench_serving) would.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request

import pytest

from rolloutpipe.model import build_tiny_tokenizer
from rolloutpipe.rollout.engines import http_client, server_process, sglang_api
from rolloutpipe.rollout.engines.embedded import EmbeddedEngine, model_eos_token_ids
from rolloutpipe.rollout.engines.http_client import RequestRefused, SGLangEngine
from rolloutpipe.rollout.engines.http_server import V1_MODELS, EmbeddedServer
from rolloutpipe.types import FinishReason, GenerationRequest
from tests.helpers.embedded import Results, request, tiny_model

CONCURRENCY = 2
LONG = 160
"""New tokens of a request that must still run while the test acts on it (the tiny model's context is 512)."""


def start_server(*, tokenizer=True) -> EmbeddedServer:
    """A server whose model has no EOS id, so that a request runs to max_new_tokens unless aborted."""
    model = tiny_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    server = EmbeddedServer(
        engine_factory=lambda on_result: EmbeddedEngine(name="http", model=model, concurrency=CONCURRENCY,
                                                        on_result=on_result),
        model_path="embedded-tiny", host="127.0.0.1", port=0, tokenizer=build_tiny_tokenizer() if tokenizer else None)
    threading.Thread(target=server.httpd.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def server():
    server = start_server()
    yield server
    server.close()


@pytest.fixture
def client(server):
    results = Results()
    engine = SGLangEngine(name="engine0", endpoint=sglang_api.Endpoint(f"http://127.0.0.1:{server.port}"),
                          concurrency=CONCURRENCY, on_result=results)
    engine.results = results
    yield engine
    engine.shutdown()


def post(server: EmbeddedServer, route: str, body: dict | None = None, *, timeout_s: float = 60.0):
    """(status, raw answer) of a plain HTTP call, as a tool other than RolloutPipe's client makes it."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{route}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def sample(s: int, **kw) -> GenerationRequest:
    return request(0, request_id=f"step=0/group=0/sample={s}", **kw)


# --- FGD priorities ----------------------------------------------------------------------------------------------


def test_priority_zero_is_sent_and_a_request_without_one_runs_last(tmp_path):
    """FGD's frontier group is group 0: SGLang with low-values-first scheduling gives a request that omits its
    priority the largest value, so a priority of 0 left out ran the frontier last."""
    assert sglang_api.generate_body(sample(0, priority=0))["priority"] == 0
    without = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    assert sglang_api.parse_generate_body(without).request.priority == sglang_api.MISSING_PRIORITY
    command = server_process.sglang_server(name="e", model_path="/m", dtype="bfloat16", concurrency=8, seed=1,
                                           base_gpu_id=0, priority_scheduling=True, extra_args=[], log_dir=tmp_path,
                                           api_key=None).command
    at = command.index("--default-priority-value")
    assert int(command[at + 1]) == sglang_api.MISSING_PRIORITY


# --- request ids -------------------------------------------------------------------------------------------------


def test_aborting_sample_1_leaves_sample_10_running_and_results_keep_their_ids(server, client):
    """SGLang aborts every rid that starts with the one given; sample=1 is a prefix of sample=10."""
    one, ten = sample(1, max_new_tokens=LONG), sample(10, max_new_tokens=LONG)
    client.submit(one)
    client.submit(ten)
    wait_until(lambda: len(server._waiters) == 2, "both requests to run on the server")
    client.abort(one.request_id)
    results = client.results.wait_for(2, timeout_s=60)
    assert set(results) == {one.request_id, ten.request_id}  # the engine rid never leaks into a result
    assert results[one.request_id].finish_reason is FinishReason.ABORT
    assert results[ten.request_id].finish_reason is FinishReason.LENGTH
    assert len(results[ten.request_id].output_ids) == LONG


def test_a_duplicate_in_flight_rid_is_refused_and_the_first_request_completes(server):
    body = {"rid": "same", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": LONG}}
    first: list = []
    thread = threading.Thread(target=lambda: first.append(post(server, sglang_api.GENERATE, body, timeout_s=60)))
    thread.start()
    wait_until(lambda: "same" in server._waiters, "the first request to run")
    status, answer = post(server, sglang_api.GENERATE, body)
    assert status == 400 and "Duplicate request ID detected: same" in answer
    thread.join(timeout=60)
    assert first and first[0][0] == 200, first
    assert json.loads(first[0][1])["meta_info"]["completion_tokens"] == LONG


# --- HTTP errors -------------------------------------------------------------------------------------------------


def test_a_4xx_fails_the_request_not_the_engine_and_names_the_fix_once(server, client, caplog):
    too_long = sample(1, max_new_tokens=600)  # 6 prompt tokens + 600 > the model's 512
    fine = sample(2, max_new_tokens=4)
    with caplog.at_level(logging.DEBUG, logger=http_client.__name__):
        client.submit(too_long)
        client.submit(fine)
        assert client.results.wait_for(1)[fine.request_id].finish_reason is FinishReason.LENGTH
        wait_until(lambda: client.request_error is not None, "the refusal to be kept")
    assert client.error is None, "a refused request is not an engine failure: restarting would not help"
    message = str(client.request_error)
    assert "HTTP 400" in message and too_long.request_id in message
    assert "exceeds the model's maximum context length of 512 tokens" in message
    assert "rollout_max_response_len" in message  # the fix
    with pytest.raises(RequestRefused, match="maximum context length"):
        client.submit(sample(3))
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]


@pytest.mark.parametrize("status", [503, None], ids=["5xx", "lost_connection"])
def test_5xx_and_lost_connections_fail_the_engine_logged_once(monkeypatch, caplog, status):
    everyone_in = threading.Barrier(4, timeout=20)

    def generate(server, request, *, timeout_s):
        everyone_in.wait()  # every request is in flight when the server fails
        raise sglang_api.SGLangError(f"{server.url}/generate: HTTP {status}" if status else "cannot reach it",
                                     status=status)

    monkeypatch.setattr(sglang_api, "generate", generate)
    engine = SGLangEngine(name="engine0", endpoint=sglang_api.Endpoint("http://127.0.0.1:9"), concurrency=4,
                          on_result=Results())
    with caplog.at_level(logging.DEBUG, logger=http_client.__name__):
        for s in range(4):
            engine.submit(sample(s))
        wait_until(lambda: engine.error is not None and not any(t.is_alive() for t in engine._threads),
                   "every request thread to fail and exit")
    assert engine.request_error is None
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].exc_info is None, "one failure, one line; not a traceback per request"
    engine.shutdown()


# --- EOS -----------------------------------------------------------------------------------------------------------


def test_the_embedded_engine_stops_on_the_models_eos_ids_like_sglang():
    """SGLang stops on the model's config and generation-config eos_token_id, not only on stop_token_ids."""
    model = tiny_model()

    def run(**kw):
        results = Results()
        engine = EmbeddedEngine(name="eos", model=model, concurrency=1, on_result=results)
        engine.submit(sample(0, max_new_tokens=24, temperature=0.0), **kw)
        (result,) = results.wait_for(1).values()
        engine.shutdown()
        return result

    free = run(ignore_eos=True).output_ids
    assert len(free) == 24
    model.generation_config.eos_token_id = [free[5]]
    eos = {model.config.eos_token_id, free[5]}
    assert model_eos_token_ids(model) == eos
    stop_at = next(i for i, t in enumerate(free) if t in eos)
    stopped = run()  # stop_token_ids=[]
    assert stopped.output_ids == free[:stop_at + 1] and stopped.finish_reason is FinishReason.STOP


# --- what bench_serving --backend sglang sends -------------------------------------------------------------------


def bench_request(prompt, max_new_tokens: int) -> dict:
    """The body of sglang.benchmark.serving.async_request_sglang_generate (0.5.23) with its default flags."""
    return {"text" if isinstance(prompt, str) else "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
            "logprob_start_len": -1}


def read_stream(raw: str) -> list[dict]:
    """bench_serving's reading of a streamed answer: ``data: `` lines up to ``data: [DONE]``."""
    events = [line.strip().removeprefix("data: ") for line in raw.splitlines() if line.strip()]
    assert events[-1] == "[DONE]", raw
    return [json.loads(e) for e in events[:-1]]


def test_bench_serving_sglang_backend_runs_with_correct_token_counts(server):
    status, models = post(server, V1_MODELS)
    assert status == 200 and json.loads(models)["data"][0]["id"] == "embedded-tiny"
    tokenizer = build_tiny_tokenizer()
    for prompt in ("reverse abc", tokenizer.encode("reverse abc")):
        status, raw = post(server, sglang_api.GENERATE, bench_request(prompt, 9))
        assert status == 200, raw
        last = read_stream(raw)[-1]
        assert last["meta_info"]["completion_tokens"] == len(last["output_ids"]) == 9  # ignore_eos: every token
        assert last["meta_info"]["prompt_tokens"] == len(tokenizer.encode("reverse abc"))
        assert last["text"] == tokenizer.decode(last["output_ids"], skip_special_tokens=True)
    status, raw = post(server, sglang_api.GENERATE, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and len(json.loads(raw)["output_ids"]) <= 3  # rid, seed, top_p, stop ids all optional


def test_text_without_a_tokenizer_is_refused_saying_to_send_input_ids():
    server = start_server(tokenizer=False)
    try:
        status, raw = post(server, sglang_api.GENERATE, bench_request("abc", 3))
        assert status == 400 and "send input_ids" in json.loads(raw)["error"]["message"]
    finally:
        server.close()
