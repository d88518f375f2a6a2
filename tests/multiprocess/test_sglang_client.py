"""The SGLang client against the embedded engine's HTTP server, end to end, and a whole run with embedded_http.

One server process (float64, so log-probs match the in-process engine to ~1e-12) serves every client test; the
weight-update test runs last because it changes the served policy.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.observe.metrics import read_spans
from rolloutpipe.rollout.engines import server_process, sglang_api
from rolloutpipe.rollout.engines.http_client import SGLangEngine
from rolloutpipe.types import FinishReason
from tests.conftest import SMALL, read_metrics, run_job
from tests.helpers.http_engine import API_KEY, CONCURRENCY, MODEL, VOCAB_SIZE, Results, in_process, request


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("engines")
    model_yaml = log_dir / "model.yaml"
    model_yaml.write_text(OmegaConf.to_yaml(OmegaConf.structured(MODEL)))
    proc = server_process.embedded_server(name="engine0", model_config_yaml=model_yaml, concurrency=CONCURRENCY,
                                          log_dir=log_dir, num_threads=1, api_key=API_KEY).start()
    proc.wait_ready(timeout_s=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    results = Results()
    engine = SGLangEngine(name="engine0", endpoint=server.endpoint, concurrency=CONCURRENCY, on_result=results,
                          server_error=server.exit_reason)
    engine.results = results
    yield engine
    engine.shutdown()


def test_client_returns_the_in_process_engines_tokens_and_logprobs(client):
    requests = [request(i, stop_token_ids=[1]) for i in range(6)]  # 6 > concurrency: some wait in the client
    for r in requests:
        client.submit(r)
    remote = client.results.wait_for(len(requests))
    local = in_process(MODEL, requests)
    for r in requests:
        got, want = remote[r.request_id], local[r.request_id]
        assert got.output_ids == want.output_ids
        assert got.finish_reason is want.finish_reason
        assert got.policy_version == 0
        torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs),
                                   rtol=0, atol=1e-10)
        assert got.submitted_s <= got.started_s <= got.finished_s
    assert client.num_in_flight() == 0


def test_same_request_same_seed_same_tokens(client, server):
    twin = request(2, max_new_tokens=20)
    client.submit(twin)
    first = client.results.wait_for(1)[twin.request_id]
    again = sglang_api.generate(server.endpoint, twin, timeout_s=30)
    assert again.output_ids == first.output_ids
    other_seed = sglang_api.generate(server.endpoint, request(2, max_new_tokens=20, sampling_seed=5), timeout_s=30)
    assert other_seed.output_ids != first.output_ids


def test_abort_returns_a_running_request_early_and_a_waiting_one_at_once(server):
    results = Results()
    engine = SGLangEngine(name="engine0", endpoint=server.endpoint, concurrency=1, on_result=results)
    try:
        # greedy: this prompt never reaches the model's EOS id (which ends a request), so it runs until aborted
        long, queued = request(0, max_new_tokens=480, temperature=0.0), request(1, max_new_tokens=480)
        engine.submit(long)
        engine.submit(queued)  # concurrency 1: waits in the client, never sent
        engine.abort(queued.request_id)
        assert results.wait_for(1, timeout_s=1)[queued.request_id].output_ids == []
        time.sleep(0.2)
        engine.abort(long.request_id)
        aborted = results.wait_for(2)[long.request_id]
        assert aborted.finish_reason is FinishReason.ABORT
        assert 0 < len(aborted.output_ids) < long.max_new_tokens
        assert len(aborted.output_logprobs) == len(aborted.output_ids)
        assert engine.num_in_flight() == 0
    finally:
        engine.shutdown()


def test_weight_update_outside_a_session_is_refused_as_sglang_0_5_23_does(server, tmp_path):
    with pytest.raises(sglang_api.SGLangError, match="HTTP 400"):
        sglang_api.call(server.endpoint, sglang_api.UPDATE_WEIGHTS_FROM_DISK,
                        sglang_api.update_weights_from_disk_body(str(tmp_path), 9))
    assert sglang_api.served_weight_version(sglang_api.call(server.endpoint, sglang_api.MODEL_INFO)) == "0"


def test_a_process_without_the_runs_key_can_neither_update_nor_steer_the_server(server, tmp_path):
    """An outsider on the same machine (no key, or a wrong one) gets 401 on every route but /health, and the
    server still serves policy_version 0; the refusal is in the server's log."""
    state = load_model(ModelConfig(dtype=DType.float64, init_seed=7), VOCAB_SIZE).state_dict()
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
              str(tmp_path / "evil.safetensors"))
    group = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "group_name": "g", "backend": "gloo"}
    calls = [(sglang_api.PAUSE_GENERATION, sglang_api.pause_body()),
             (sglang_api.BEGIN_WEIGHT_UPDATE, {}),
             (sglang_api.UPDATE_WEIGHTS_FROM_DISK, sglang_api.update_weights_from_disk_body(str(tmp_path), 5)),
             (sglang_api.INIT_WEIGHTS_UPDATE_GROUP, {**group, "rank_offset": 1}),
             (sglang_api.DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": "g"}),
             (sglang_api.ABORT_REQUEST, sglang_api.abort_all_body()),
             (sglang_api.GENERATE, sglang_api.generate_body(request(0)))]
    for key in (None, "not-the-key"):
        outsider = sglang_api.Endpoint(server.url, key)
        for route, body in calls:
            with pytest.raises(sglang_api.SGLangError, match=r"HTTP 401: \{\"error\": \"Unauthorized\"\}"):
                sglang_api.call(outsider, route, body)
        with pytest.raises(sglang_api.SGLangError, match="HTTP 401"):
            sglang_api.call(outsider, sglang_api.MODEL_INFO)
        assert sglang_api.is_healthy(outsider)
    assert sglang_api.served_weight_version(sglang_api.call(server.endpoint, sglang_api.MODEL_INFO)) == "0"
    assert "refused POST /update_weights_from_disk" in server.log_path.read_text()


def test_unreachable_server_is_an_engine_error_naming_its_url():
    url = f"http://127.0.0.1:{server_process.free_port()}"
    results = Results()
    engine = SGLangEngine(name="engine9", endpoint=sglang_api.Endpoint(url), concurrency=1, on_result=results)
    engine.submit(request(0))
    deadline = time.monotonic() + 10
    while engine.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert url in str(engine.error)
    with pytest.raises(RuntimeError, match="engine9 crashed"):
        engine.submit(request(1))
    assert results.by_id == {}
    engine.shutdown()



def test_a_probe_finds_a_server_gone_while_the_engine_held_nothing(client):
    """Between steps (distributed weight sync: supervisor.py ``next_group_size``) nothing is in flight, so no call
    fails: the probe's /health is what finds a server that is gone (here a port nobody listens on, a server on
    another node whose host lives)."""
    client.probe()
    assert client.error is None, "the live server answers"
    url = f"http://127.0.0.1:{server_process.free_port()}"
    gone = SGLangEngine(name="engine6", endpoint=sglang_api.Endpoint(url), concurrency=1, on_result=Results())
    assert gone.error is None
    gone.probe()
    assert f"engine engine6: the server at {url} did not answer /health" in str(gone.error)
    gone.shutdown()

def test_a_weight_load_on_a_vanished_node_is_given_up_when_its_host_is_lost(tmp_path):
    """A node that vanished answers nothing: a socket that takes the connection and never replies stands in for it.
    The weight load (10 minutes of timeout) is given up once the host watch says its engine host is lost, with that
    reason, instead of holding the rollout until the timeout."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: the client's request is sent, no answer ever comes
    lost = threading.Event()
    engine = SGLangEngine(name="engine5", endpoint=sglang_api.Endpoint(f"http://127.0.0.1:{silent.getsockname()[1]}"),
                          concurrency=1, on_result=Results(), weight_update_timeout_s=600,
                          server_error=lambda: ("its engine host (rollout rank 1) is lost: test"
                                                if lost.is_set() else None))
    threading.Timer(1.0, lost.set).start()  # the host watch notices (after pipeline.peer_timeout_s)
    try:
        with pytest.raises(RuntimeError, match=r"engine5: update_weights_from_disk given up: .* its engine host "
                                               r"\(rollout rank 1\) is lost"):
            engine.update_weights_from_disk(str(tmp_path / "policy_v1.safetensors"), 1)
    finally:
        silent.close()


def test_a_server_shutting_down_answers_503_so_the_client_fails_the_engine_not_the_run():
    """A request that reaches a server whose engine is already shut down (SIGTERM: the server is stopping) is the
    server's trouble, not the request's: 503, which fails the engine and sends the request elsewhere. A 400 would be
    a RequestRefused, which stops the run (seen when an engine host was stopped by SIGTERM mid-step)."""
    from rolloutpipe.rollout.engines.embedded import EmbeddedEngine
    from rolloutpipe.rollout.engines.http_server import EmbeddedServer

    model_cfg = ModelConfig(dtype=DType.float64)
    model = load_model(model_cfg, len(build_tiny_tokenizer()))
    stopping = EmbeddedServer(engine_factory=lambda on_result: EmbeddedEngine(
        name="http:0", model=model, concurrency=2, on_result=on_result), model_path="embedded-tiny",
        host="127.0.0.1", port=0)
    threading.Thread(target=stopping.httpd.serve_forever, daemon=True).start()
    try:
        stopping.engine.shutdown()  # what the server's SIGTERM handler does first
        results = Results()
        engine = SGLangEngine(name="engine7", endpoint=sglang_api.Endpoint(f"http://127.0.0.1:{stopping.port}"),
                              concurrency=1, on_result=results)
        engine.submit(request(0))
        deadline = time.monotonic() + 30
        while engine.error is None and engine.request_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.request_error is None and "503" in str(engine.error), (engine.error, engine.request_error)
        engine.shutdown()
    finally:
        stopping.httpd.shutdown()
        stopping.httpd.server_close()


def test_a_server_that_dies_is_reported_with_its_log(tmp_path):
    dying = server_process.ServerProcess(name="engine3", command=[sys.executable, "-c", "print('boom'); exit(3)"],
                                         log_path=tmp_path / "engine3.log", url="http://127.0.0.1:9",
                                         api_key=None).start()
    with pytest.raises(RuntimeError, match=r"engine3 .* exited with code 3(.|\n)*boom"):
        dying.wait_ready(timeout_s=30)


def test_weight_update_serves_the_new_policy_version_and_weights(client, server, tmp_path):
    """Last: the server serves policy_version 1 afterwards."""
    new_cfg = ModelConfig(dtype=DType.float64, init_seed=1)
    state = load_model(new_cfg, VOCAB_SIZE).state_dict()
    state.pop("lm_head.weight")  # tied, as the trainer writes it
    path = tmp_path / "weights" / "policy_v1.safetensors"
    path.parent.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    (path.parent / "policy_v0.safetensors").write_bytes(b"stale")  # the previous version sits beside it

    client.update_weights_from_disk(str(path), 1)
    assert client.policy_version == 1
    assert sglang_api.served_weight_version(sglang_api.call(server.endpoint, sglang_api.MODEL_INFO)) == "1"
    requests = [request(i) for i in range(3)]
    for r in requests:
        client.submit(r)
    remote = client.results.wait_for(len(requests))
    local = in_process(new_cfg, requests, policy_version=1)
    for r in requests:
        assert remote[r.request_id].policy_version == 1
        assert remote[r.request_id].output_ids == local[r.request_id].output_ids


def test_embedded_http_run_trains_through_the_server_and_stops_it(job_dir):
    run_dir = job_dir("embedded_http")
    proc = run_job(run_dir, *SMALL, "rollout.engine=embedded_http", "run.checkpoint_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1]
    versions = {(s.step, s.attrs["policy_version"]) for s in read_spans(run_dir) if s.name == "rollout/request"}
    assert versions == {(0, 0), (1, 1)}  # step 1 was generated after the weight update over HTTP
    port = int((run_dir / "engines" / "engine0.port").read_text())
    # the run stopped its server
    assert not sglang_api.is_healthy(sglang_api.Endpoint(f"http://127.0.0.1:{port}"), timeout_s=1)


def test_fgd_reaches_sglang_as_group_order_priorities(tmp_path):
    from rolloutpipe.config import load_config
    from rolloutpipe.rollout.engines.hosts import NodeServers
    from rolloutpipe.rollout.samples import make_requests
    from rolloutpipe.types import Prompt

    (tmp_path / "config.json").write_text("{}")
    for admission, scheduled in (("fifo", False), ("fgd", True)):
        cfg = load_config({"model": {"path": str(tmp_path)}, "run": {"dir": str(tmp_path / admission)},
                           "rollout": {"engine": "sglang", "admission": admission}})
        servers = NodeServers(cfg.engine_setup(), rank=0, bind_host="127.0.0.1", api_key=API_KEY, log_dir=tmp_path)
        command = servers._server(0, "engine0").command
        assert "--enable-deterministic-inference" in command, "per-request seeds are honoured only with it"
        assert ("--enable-priority-scheduling" in command) is scheduled, admission
        assert ("--schedule-low-priority-values-first" in command) is scheduled, admission
    prompt = Prompt(index=0, text="abc", input_ids=[5, 6], label="cba")
    requests = make_requests(step=0, group=7, prompt=prompt, n_samples=2, run_seed=1, max_new_tokens=4,
                             temperature=1.0, top_p=1.0, stop_token_ids=[1], priority=7)
    assert [sglang_api.generate_body(r).get("priority") for r in requests] == [7, 7]
    assert [r.sampling_seed for r in requests] == [r.sampling_seed for r in make_requests(
        step=0, group=7, prompt=prompt, n_samples=2, run_seed=1, max_new_tokens=4, temperature=1.0, top_p=1.0,
        stop_token_ids=[1])], "the priority must not change the samples"


def test_attaching_asks_whether_the_server_honours_seeds(server, tmp_path):
    """SGLang samples with a request's sampling_seed only under --enable-deterministic-inference (/server_info)."""
    from rolloutpipe.config import load_config
    from rolloutpipe.rollout.engines.hosts import NodeServers

    assert sglang_api.honours_seeds(server.endpoint) is True  # the embedded engine always does
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config({"model": {"path": str(tmp_path)}, "run": {"dir": str(tmp_path / "run")},
                       "rollout": {"engine": "sglang", "sglang_deterministic_inference": False}})
    servers = NodeServers(cfg.engine_setup(), rank=0, bind_host="127.0.0.1", api_key=API_KEY, log_dir=tmp_path)
    command = servers._server(0, "e").command
    assert "--enable-deterministic-inference" not in command
