"""The real SGLang 0.5.23 server: RolloutPipe's client and whole runs against ``sglang.launch_server`` itself.

Marker ``sglang_real``. These tests need SGLang installed (``.ci/run``'s SGLang step makes a virtualenv of its own
for them: tests/sglang_cpu/install.sh) and skip without it; ``RP_REQUIRE_SGLANG=1`` turns the skip into a failure.
On this CPU machine SGLang runs through an unsupported workaround (tests/sglang_cpu/sitecustomize.py: stand-in
``sgl_kernel``/``torchvision`` modules and SGLang's seeded sampler switched on without the rest of deterministic
inference) with ``CPU_ARGS``. On CPU nothing makes SGLang's kernels batch-invariant, so a sample would depend on
which requests share its batch: ``--max-running-requests 1`` runs one request at a time (the FGD test needs a
server that queues anyway), ``--disable-radix-cache`` keeps a prompt's samples from depending on which of them ran
first. On a GPU, ``--enable-deterministic-inference`` gives the same guarantees at full batch (tools/gpu_check.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rolloutpipe.model import ModelConfig, TinyModelConfig, build_tiny_tokenizer, load_model, save_hf_checkpoint
from rolloutpipe.rollout.engines import server_process, sglang_api
from rolloutpipe.rollout.engines.http_client import SGLangEngine
from rolloutpipe.trainer.logprobs import token_logprobs
from rolloutpipe.types import FinishReason, GenerationRequest
from tests import sglang_cpu
from tests.conftest import (
    REPO,
    SMALL,
    final_weights,
    node_environ,
    outputs_of,
    read_metrics,
    read_samples,
    samples,
    start_nodes,
    wait_for,
)
from tests.helpers.http_engine import Results

pytestmark = [pytest.mark.sglang_real, pytest.mark.multiprocess]

CPU_ENVIRON = sglang_cpu.environ(REPO)
CPU_ARGS = [*sglang_cpu.LAUNCH_ARGS, "--max-total-tokens", "4096", "--disable-radix-cache",
            "--max-running-requests", "1"]
START_TIMEOUT_S = 300.0
"""A guard against a hang: SGLang starts in about 25 s here."""
MODEL = ModelConfig(tiny=TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2))
"""float32, head_dim 16 (torch_native attention takes any)."""
API_KEY = "s" * 64
LONG = 500
"""New tokens of a request that must still run while the test acts on it: seconds here (the context is 512)."""
VOCAB = len(build_tiny_tokenizer())


def _sglang_or_skip() -> None:
    if importlib.util.find_spec("sglang") is None:
        not_here = pytest.fail if os.environ.get("RP_REQUIRE_SGLANG") == "1" else pytest.skip
        not_here("SGLang is not installed here: bash tests/sglang_cpu/install.sh <venv> makes a virtualenv with "
                 "SGLang 0.5.23 on CPU torch; run these tests with its python (.ci/run's SGLang step does)")


@pytest.fixture(scope="module", autouse=True)
def cpu_sglang(monkeypatch_module):
    _sglang_or_skip()
    for name, value in CPU_ENVIRON.items():
        monkeypatch_module.setenv(name, value)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-hf")
    save_hf_checkpoint(load_model(MODEL, VOCAB), build_tiny_tokenizer(), directory)
    return directory


def start_sglang(name: str, model_dir: Path, log_dir: Path) -> server_process.ServerProcess:
    server = server_process.sglang_server(
        name=name, model_path=str(model_dir), dtype="float32", concurrency=1, seed=0, base_gpu_id=0,
        priority_scheduling=True, extra_args=CPU_ARGS, log_dir=log_dir, api_key=API_KEY, deterministic=False)
    server.start().wait_ready(timeout_s=START_TIMEOUT_S)
    return server


@pytest.fixture(scope="module")
def no_eos_model_dir(tmp_path_factory) -> Path:
    """The same model without an EOS id: a request runs to max_new_tokens unless aborted."""
    directory = tmp_path_factory.mktemp("tiny-hf-no-eos")
    save_hf_checkpoint(load_model(MODEL, VOCAB), build_tiny_tokenizer(), directory)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        config["eos_token_id"] = None
        (directory / name).write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def server(no_eos_model_dir, tmp_path_factory):
    """One SGLang server for the client tests (the weight update runs last: it changes what the server serves)."""
    server = start_sglang("sglang0", no_eos_model_dir, tmp_path_factory.mktemp("engines"))
    yield server
    server.stop()


@pytest.fixture
def client(server):
    results = Results()
    engine = SGLangEngine(name="sglang0", endpoint=server.endpoint, concurrency=8, on_result=results,
                          server_error=server.exit_reason)
    engine.results = results
    yield engine
    engine.shutdown()


def request(request_id: str, prompt: list[int], *, seed: int = 1, max_new_tokens: int = 8, priority: int = 0,
            temperature: float = 1.0) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, input_ids=prompt, max_new_tokens=max_new_tokens,
                             temperature=temperature, sampling_seed=seed, stop_token_ids=[], priority=priority)


def trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """The trainer's log-probs of ``response`` (trainer/logprobs.token_logprobs on the model's logits)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[:, len(prompt) - 1: -1]
    return token_logprobs(logits, torch.tensor([response]), temperature)[0].tolist()


# --- the client against the server -------------------------------------------------------------------------------


def test_log_probs_match_the_trainers_recompute_and_each_seed_gives_its_own_sample(client):
    requests = [request(f"step=0/group={i}/sample=0", [4 + (i * 5 + j) % 40 for j in range(3 + i)], seed=100 + i,
                        max_new_tokens=16, temperature=0.8 + 0.1 * i) for i in range(4)]
    again = [request(f"step=0/group={i}/sample=1", r.input_ids, seed=r.sampling_seed, max_new_tokens=16,
                     temperature=r.temperature) for i, r in enumerate(requests)]
    other = request("step=0/group=0/sample=2", requests[0].input_ids, seed=999, max_new_tokens=16,
                    temperature=requests[0].temperature)
    for r in [*requests, *again, other]:
        client.submit(r)
    got = client.results.wait_for(len(requests) + len(again) + 1, timeout_s=120)
    model = load_model(MODEL, VOCAB)
    diffs = []
    for r, twin in zip(requests, again):
        result = got[r.request_id]
        assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == 16
        assert result.policy_version == 0
        assert got[twin.request_id].output_ids == result.output_ids, "the same seed must give the same sample"
        want = trainer_logprobs(model, r.input_ids, result.output_ids, r.temperature)
        diffs += [abs(a - b) for a, b in zip(result.output_logprobs, want)]
    assert max(diffs) < 1e-4, max(diffs)  # float32 on both sides, different kernels
    assert got[other.request_id].output_ids != got[requests[0].request_id].output_ids, "another seed, same sample"


def test_the_torch_murmur_hash_is_sglangs_triton_kernel():
    """The seeded sampler's hash (tests/sglang_cpu/sitecustomize.py) against SGLang's own Triton kernel, run by
    Triton's interpreter on the CPU, in a fresh process (TRITON_INTERPRET is read at import)."""
    code = """
import torch, sitecustomize
from sglang.kernels.ops.sampling import murmur_hash
seed = torch.tensor([0, 7, 2**40 + 3, 2**62 + 11], dtype=torch.int64).to(torch.uint64)
positions, cols = torch.tensor([0, 5, 77, 4095]), torch.arange(300)
out = torch.empty((4, 300), dtype=torch.uint32)
murmur_hash.murmur_hash32_kernel[(4, 1)](seed, positions, cols, out, 4, 300, BLOCK_SIZE=512)
assert torch.equal(out.to(torch.int64), sitecustomize.murmur_hash32(seed, positions, cols))
print("same")
"""
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "same" in result.stdout, result.stderr[-2000:]


SAME_PICKS = """
import torch, triton
import sitecustomize  # noqa: F401 - the stand-in sgl_kernel (the seeded-sampler patch is off: no hash replaced)
from sglang.kernels.ops.sampling import murmur_hash
from sglang.srt.layers import sampler as sglang_sampler
from rolloutpipe.rollout.engines.sampler import sample_tokens

@torch.compiler.disable
def triton_hash(seed, positions, cols):  # murmur_hash32's GPU branch: SGLang's Triton kernel, interpreted on the CPU
    n, m = seed.shape[0], cols.shape[0]
    out = torch.empty((n, m), dtype=torch.uint32)
    murmur_hash.murmur_hash32_kernel[(n, triton.cdiv(m, 1024))](seed, positions, cols, out, n, m, BLOCK_SIZE=1024)
    return out

sglang_sampler.murmur_hash32 = triton_hash
g = torch.Generator().manual_seed(0)
n, vocab = 384, 1000
logits = torch.randn(n, vocab, generator=g) * 3
logits[::3] = (logits[::3] * 2).round() / 2  # rows full of exact ties
temperatures = torch.rand(n, generator=g, dtype=torch.float64) * 1.5 + 0.2
seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=g)
positions = torch.randint(0, 40000, (n,), generator=g)
# Sampler.forward's standard path under --enable-deterministic-inference: float32 temperatures, torch.softmax.
probs = torch.softmax(logits / temperatures.float()[:, None], dim=-1)
ones = torch.ones(n, dtype=torch.float64)
theirs = sglang_sampler.sampling_from_probs_torch(probs, seeds, positions).long()
ours, _ = sample_tokens(logits, temperatures, ones, seeds, positions)
assert torch.equal(ours, theirs), f"top_p 1: {(ours != theirs).sum()} of {n} rows differ"
# With top-p / top-k: SGLang's own filter decides the nucleus; its key is torch.log(probs), -inf outside.
top_ps = torch.tensor([1.0, 0.9, 0.5, 0.97])[torch.arange(n) % 4]
top_ks = torch.tensor([1 << 30, 1 << 30, 7, 40], dtype=torch.int32)[torch.arange(n) // 4 % 4]
_, kept, order, _ = sglang_sampler.top_k_top_p_min_p_sampling_from_probs_torch(
    probs.clone(), top_ks, top_ps, torch.zeros(n), False, None, positions, return_filtered_probs=True)
nucleus = torch.zeros(n, vocab, dtype=torch.bool).scatter_(1, order.long(), kept > 0)
theirs = sglang_sampler.multinomial_with_seed(probs.log().masked_fill(~nucleus, -torch.inf), seeds, positions)
ours, _ = sample_tokens(logits, temperatures, top_ps.double(), seeds, positions, top_ks=top_ks)
assert torch.equal(ours, theirs.view(-1)), f"top-p/k: {(ours != theirs.view(-1)).sum()} of {n} rows differ"
rank_keyed = sglang_sampler.top_k_top_p_min_p_sampling_from_probs_torch(
    probs.clone(), top_ks, top_ps, torch.zeros(n), False, seeds, positions).long()
print(f"same; SGLang's rank-keyed top-p/k path picks the same token in {(rank_keyed == ours).sum()} of {n} rows")
"""


def test_the_embedded_sampler_picks_sglangs_tokens_from_the_same_logits():
    """rolloutpipe's sample_tokens against SGLang's own seeded sampler (``sampling_from_probs_torch`` ->
    ``multinomial_with_seed``, torch.compiled as SGLang ships it, its hash the Triton kernel run by Triton's
    interpreter) for 384 rows of the same float32 logits, seeds (negative ones too), positions and temperatures:
    every row picks the same token at top_p 1, and with top-p / top-k masks decided by SGLang's own filter."""
    env = {k: v for k, v in os.environ.items() if k != "RP_SGLANG_CPU_SEEDED_SAMPLER"} | {"TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SAME_PICKS], check=False, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "same" in result.stdout, (result.stdout + result.stderr)[-3000:]
    print(result.stdout.strip())


def waiting_requests(server) -> int:
    """Requests in the SGLang scheduler's waiting queue, as it answers ``GET /v1/loads`` (every data-parallel rank)."""
    return sum(load["num_waiting_reqs"] for load in sglang_api.call(server.endpoint, "/v1/loads?include=core")["loads"])


def test_fgd_priorities_put_the_frontier_group_first_on_a_server_that_queues(server, client, monkeypatch):
    """One request at a time (--max-running-requests 1) and a blocker running: the six queued requests of groups
    2, 1, 0 (submitted in that order) run by priority, the group index, so group 0 (FGD's frontier) ends first.
    Before the fix group 0's requests went without a priority and SGLang ran them last.

    The order is the server's: each response's ``meta_info.response_sent_to_client_ts``, stamped as the server's
    tokenizer manager takes the finished request from the scheduler (one at a time here). The order the client
    reads the six responses in is not it: under load two answers sent milliseconds apart arrive swapped. And the
    check holds only if all six were in the scheduler's waiting queue while the blocker ran (``/v1/loads`` says
    so): on a loaded machine the blocker may end first, and then the round is played again (up to three rounds)
    instead of asserting an order the server never had to choose."""
    sent_s: dict[str, float] = {}  # rid -> when the server answered it
    parse = sglang_api.parse_generate_response

    def parse_and_stamp(body):
        sent_s[body["meta_info"]["id"]] = body["meta_info"]["response_sent_to_client_ts"]
        return parse(body)

    monkeypatch.setattr(sglang_api, "parse_generate_response", parse_and_stamp)
    for step in (10, 11, 12):  # (ids of their own: the module's client has reported others)
        blocker = request(f"step={step}/group=9/sample=0", [5, 6, 7], max_new_tokens=LONG)
        client.submit(blocker)
        queued = [request(f"step={step}/group={g}/sample={s}", [8 + g, 9, 10], seed=g * 2 + s, max_new_tokens=4,
                          priority=g) for g in (2, 1, 0) for s in (0, 1)]
        time.sleep(0.5)  # the blocker runs (for seconds: LONG) while the others queue behind it
        for r in queued:
            client.submit(r)
        blocked = False  # all six waiting: none was admitted yet, so the scheduler chooses among all of them
        while blocker.request_id not in client.results.by_id and not blocked:
            blocked = waiting_requests(server) == len(queued)
            time.sleep(0.05)
        wait_for(lambda: all(r.request_id in client.results.by_id for r in [blocker, *queued]), "the round's results",
                 timeout_s=120)
        if blocked:
            answered = {r.request_id: sent_s[sglang_api.engine_rid(r.request_id)] for r in queued}
            assert [i.split("/")[1] for i in sorted(answered, key=answered.get)] == [
                "group=0", "group=0", "group=1", "group=1", "group=2", "group=2"], answered
            return
    pytest.fail("in three rounds the blocker ended before the six requests reached the server: too loaded to check")


def test_abort_ends_the_request_with_its_partial_output_and_spares_a_longer_rid(client):
    one = request("step=2/group=0/sample=1", [5, 6, 7], max_new_tokens=LONG)
    ten = request("step=2/group=0/sample=10", [5, 6, 7], seed=2, max_new_tokens=LONG)
    client.submit(one)
    client.submit(ten)
    time.sleep(0.5)  # one runs (for seconds: LONG), ten waits behind it
    client.abort(one.request_id)
    got = client.results.wait_for(2, timeout_s=240)
    assert got[one.request_id].finish_reason is FinishReason.ABORT
    assert got[ten.request_id].finish_reason is FinishReason.LENGTH, "aborting sample=1 must spare sample=10"
    assert len(got[ten.request_id].output_ids) == LONG


def test_a_duplicate_in_flight_rid_is_answered_400_and_a_4xx_is_a_request_error(server, client):
    body = {"rid": "dup#", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": LONG}}
    first: list = []
    thread = threading.Thread(target=lambda: first.append(sglang_api.call(server.endpoint, sglang_api.GENERATE, body,
                                                                          timeout_s=240)))
    thread.start()
    time.sleep(0.5)  # the first one runs (for seconds: LONG)
    with pytest.raises(sglang_api.SGLangError, match="Duplicate request ID") as refused:
        sglang_api.call(server.endpoint, sglang_api.GENERATE, body)
    assert refused.value.is_request_error
    thread.join(timeout=240)
    assert first and first[0]["meta_info"]["completion_tokens"] == LONG

    too_long = request("step=3/group=0/sample=0", [5, 6, 7], max_new_tokens=600)  # 3 + 600 > the context of 512
    client.submit(too_long)
    wait_for(lambda: client.request_error is not None, "the 400 to be kept", timeout_s=60)
    assert client.error is None, "a refused request is not an engine failure"
    assert "maximum context length" in str(client.request_error) and "rollout_max_response_len" in str(
        client.request_error)
    assert server.exit_reason() is None


def assert_no_engine_log_holds_a_key(engines: Path, key: str | None = None) -> int:
    """Every engine log under ``engines``: private to the user (directories 0700, files 0600), without ``key``, and
    wherever SGLang wrote its server arguments, the key replaced (it logs ``'api_key': '...'`` at INFO). Returns how
    many of those it saw, so a caller can tell that the check met a logged key."""
    import re
    import stat

    seen = 0
    for path in [engines, *engines.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.is_dir():
            assert mode == 0o700, (path, oct(mode))
            continue
        if path.suffix != ".log":
            continue
        assert mode == 0o600, (path, oct(mode))
        text = path.read_text(errors="replace")
        assert key is None or key not in text, path
        values = re.findall(r"api_key(?:=|': )('[^']*'|None)", text)  # server_args=ServerArgs(...) or {...}
        assert all(v in ("None", f"'{server_process.REDACTED.decode()}'") for v in values), (path, values)
        seen += sum(v != "None" for v in values)
    return seen


def test_no_engine_log_holds_the_api_key(server):
    """SGLang logs its server arguments, the API key among them; the node writes its log with the key replaced, in
    a directory only the user can enter."""
    assert assert_no_engine_log_holds_a_key(server.log_path.parent, API_KEY) >= 1, "SGLang logged no api_key here"


def test_weights_loaded_from_disk_are_served_with_their_version(client, tmp_path):
    """Runs last among the client tests: the server serves policy_version 1 afterwards."""
    new = load_model(ModelConfig(init_seed=5, tiny=MODEL.tiny), VOCAB)
    state = {k: v.contiguous() for k, v in new.state_dict().items() if k != "lm_head.weight"}  # tied
    path = tmp_path / "weights" / "policy_v1.safetensors"
    path.parent.mkdir()
    save_file(state, str(path))
    client.update_weights_from_disk(str(path), 1)
    r = request("step=4/group=0/sample=0", [5, 6, 7, 8], max_new_tokens=12)
    client.submit(r)
    result = client.results.wait_for(1, timeout_s=120)[r.request_id]
    assert result.policy_version == 1
    want = trainer_logprobs(new, r.input_ids, result.output_ids, r.temperature)
    assert max(abs(a - b) for a, b in zip(result.output_logprobs, want)) < 1e-4


def test_sglangs_own_bench_serving_runs_against_the_embedded_engines_server(model_dir, tmp_path):
    """``python -m sglang.benchmark.serving --backend sglang`` (streaming, text in and out, its own token counts)
    against the embedded engine's server: every request succeeds with the token counts it asked for."""
    from omegaconf import OmegaConf

    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(OmegaConf.to_yaml(OmegaConf.structured(MODEL)))
    embedded = server_process.embedded_server(name="embedded", model_config_yaml=model_yaml, concurrency=8,
                                              log_dir=tmp_path, num_threads=1, api_key=None).start()
    try:
        embedded.wait_ready(timeout_s=START_TIMEOUT_S)
        port = embedded.url.rsplit(":", 1)[1]
        result = subprocess.run(
            [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", "127.0.0.1",
             "--port", port, "--dataset-name", "random-ids", "--random-input-len", "8", "--random-output-len", "16",
             "--random-range-ratio", "1.0", "--num-prompts", "8", "--tokenizer", str(model_dir),
             "--output-file", str(tmp_path / "bench.jsonl")],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        embedded.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "bench.jsonl").read_text().splitlines()[-1])
    assert summary["completed"] == 8
    assert summary["total_input_tokens"] == 8 * 8
    assert summary["total_output_tokens"] == summary["total_output_tokens_retokenized"] == 8 * 16


# --- whole runs: the job starts its SGLang servers (rollout.engine=sglang) ---------------------------------------


def workload(model_dir: Path) -> list[str]:
    return [*SMALL, "rollout.engine=sglang", f"model.path={model_dir}", "rollout.concurrency=2",
            "rollout.sglang_deterministic_inference=false", "run.save_samples=true", "pipeline.peer_timeout_s=60",
            "rollout_max_response_len=8", f"rollout.sglang_launch_args=[{','.join(CPU_ARGS)}]",
            "rollout.server_start_timeout_s=300"]


TIS = "grpo.rollout_correction=token_tis"
"""On sync_run and cgp_run: the trainer weighs the loss by its ratio to SGLang's log-probs and reports the gap."""


def launch(run_dir: Path, *overrides: str) -> subprocess.Popen:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(REPO / "launch.py"), f"run.dir={run_dir}", *overrides],
                            cwd=run_dir.parent, env={**node_environ(), **CPU_ENVIRON}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout_s: float = 600) -> str:
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    return stderr


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def sync_run(model_dir, tmp_path_factory) -> Path:
    """sync, with the weights broadcast into SGLang (pipeline.weight_sync=distributed, gloo): compared with cgp_run
    (disk sync), it shows both that cgp trains what sync does and that distributed sync trains what disk sync does."""
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    finish(launch(run_dir, *workload(model_dir), "pipeline.mode=sync", "pipeline.weight_sync=distributed", TIS))
    return run_dir


def server_pid(run_dir: Path) -> int | None:
    """The pid of the SGLang server this run started (there is one engine; its environment names the run)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"rolloutpipe.rollout.engines.sglang_launch" in cmdline and str(run_dir).encode() in environ:
            return int(proc.name)
    return None


@pytest.fixture(scope="module")
def cgp_run(model_dir, tmp_path_factory) -> tuple[Path, str]:
    """cgp with FGD, and engine0's SGLang server SIGKILLed once step 0 is done: the job restarts it and resubmits
    what it held. (Run dir, the launcher's stderr.)"""
    run_dir = tmp_path_factory.mktemp("cgp") / "run"
    proc = launch(run_dir, *workload(model_dir), "pipeline.mode=cgp", "rollout.admission=fgd", TIS)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), "step 0 to finish", running=[proc], timeout_s=600)
        pid = server_pid(run_dir)
        assert pid is not None, "engine0's SGLang server is not running"
        os.kill(pid, signal.SIGKILL)
        return run_dir, finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sync_and_cgp_train_on_the_same_samples_to_the_same_weights(sync_run, cgp_run):
    """sync with distributed weight sync against cgp+fgd with disk sync and an engine killed: the same samples, the
    same weights (a difference in any of the three would show)."""
    cgp_run, _ = cgp_run
    assert [m["step"] for m in read_metrics(cgp_run)] == [0, 1]
    for run_dir in (sync_run, cgp_run):  # both servers, and the one restarted after the kill, logged their keys
        assert assert_no_engine_log_holds_a_key(run_dir / "engines") >= 1
    ours, theirs = samples(sync_run), samples(cgp_run)
    assert len(ours) == 2 * 16 and ours == theirs
    assert max_weight_diff(sync_run, cgp_run) < 1e-5  # float32; only the order of additions differs
    for m in read_metrics(cgp_run):  # SGLang's kernels are not the trainer's: a gap, and TIS weights near 1
        assert 0 < m["train/engine_trainer_logprob_gap"] < 0.1, m
        assert abs(m["train/tis_mean"] - 1) < 0.1 and m["train/tis_max"] > 0 and 0 <= m["train/tis_clipfrac"] < 1


def test_a_killed_sglang_engine_is_restarted_and_its_requests_resubmitted_with_their_seeds(cgp_run):
    """cgp_run's engine0 was SIGKILLed after step 0; test_sync_and_cgp_... shows its samples and weights are those of
    the undisturbed sync run."""
    _, stderr = cgp_run
    assert "unfinished requests resubmitted with their seeds" in stderr, stderr[-3000:]
    assert "engine engine0 restarted as engine0-restart1" in stderr, stderr[-3000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("survivor", ["leaves", "stuck"])
def test_an_sglang_server_killed_mid_broadcast_is_replaced_and_the_policy_sent_again(model_dir, sync_run, tmp_path,
                                                                                     survivor):
    """Two SGLang servers in the weight-update group; one is SIGKILLed as it takes the second bucket of step 0's
    policy (tests/faults/inject.py). Trainer rank 0's broadcast breaks, and it destroys the group; the survivor's
    receive then fails too (gloo: "Connection closed by peer"), so SGLang answers its leave at once and only the
    dead server is replaced. ``stuck``: rank 0 leaves the group open instead (as a broadcast still in flight makes it,
    and as NCCL would hold the survivor whatever rank 0 does), so the survivor stays in the broken broadcast, and the
    supervisor replaces it too once ``LEAVE_GRACE_S`` has passed. Either way the policy goes again to a new group of
    both, and the run trains on sync_run's samples to its weights."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    commands = {"rollout": ["-m", "tests.faults.inject", "engine_server_killed_mid_broadcast", "1"]}
    if survivor == "stuck":
        commands["trainer"] = ["-m", "tests.faults.inject", "weight_group_left_open", "1"]
    procs = start_nodes(run_dir, *workload(model_dir), "pipeline.mode=sync", "pipeline.weight_sync=distributed", TIS,
                        "rollout.num_engines=2", "pipeline.weight_sync_bucket_mb=0.01",  # 10 KiB buckets
                        commands=commands, environ=CPU_ENVIRON)
    outputs = outputs_of(procs, 800)
    for role, p in procs.items():
        assert p.returncode == 0, outputs[role][1][-4000:]
    stderr = outputs["rollout"][1]
    killed = re.search(r"injected: SIGKILL to (engine\d)'s server", stderr)
    assert killed, f"the fault never fired: {stderr[-3000:]}"
    engine = killed.group(1)
    assert f"engine {engine} failed during the broadcast of policy_version 1" in stderr, stderr[-3000:]
    assert "policy_version 1 goes to a new weight-update group of 2 engine ranks" in stderr, stderr[-3000:]
    assert (f"engine {engine} restarted as {engine}-restart1" in stderr
            and "it joined the new weight-update group and receives policy_version 1 with the others" in stderr), \
        stderr[-3000:]
    if survivor == "leaves":
        assert stderr.count("restarted as") == 1, "the survivor did not give the broken broadcast up: replaced too"
    else:
        assert "injected: trainer rank 0 leaves rolloutpipe_weights-1 open" in outputs["trainer"][1]
        other = "engine1" if engine == "engine0" else "engine0"
        assert (f"engine {other} failed during the broadcast of policy_version 1 (it did not give up the broken "
                f"broadcast of policy_version 1 within 30s: stuck)" in stderr
                and f"engine {other} restarted as {other}-restart1" in stderr), stderr[-3000:]
    ours, theirs = samples(run_dir), samples(sync_run)
    assert len(ours) == 2 * 16 and ours == theirs
    assert max_weight_diff(run_dir, sync_run) < 1e-5


def test_dynamic_sampling_aborts_the_groups_it_no_longer_needs_on_sglang(model_dir, tmp_path):
    """Two groups over-sampled; once the step's groups are complete, SGLang aborts the requests still running."""
    from rolloutpipe.observe.metrics import read_spans

    run_dir = tmp_path / "run"
    finish(launch(run_dir, *workload(model_dir), "pipeline.mode=cgp", "rollout.admission=fgd",
                  "rollout.filter_zero_variance=true", "rollout.over_sampling_groups=2", "reward.name=sometimes_flat",
                  "reward.import_modules=[tests.fixtures.dense_rewards]"))
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1]
    assert sum(m["rollout/num_aborted_samples"] for m in metrics) > 0, metrics
    came_back_aborted = [s for s in read_spans(run_dir) if s.name == "rollout/request" and s.attrs.get("aborted")]
    assert came_back_aborted, "with 2 requests in flight, one of an over-sampled group runs when the step is full"
    for row in read_samples(run_dir):  # what was trained is complete: no aborted sample among them
        assert row["finish_reason"] != FinishReason.ABORT.value


def test_sglang_serves_multiturn_episodes_token_in_and_token_out(model_dir, tmp_path):
    """Three-turn episodes of the scripted environment on the real SGLang server (/generate with input_ids, the
    conversation so far): each sample's model tokens are what SGLang returned for its turns (their count, from its
    request spans), and between them stand the environment's turns, tokenized once, masked out."""
    from rolloutpipe.observe.metrics import read_spans
    from rolloutpipe.rollout.environments.chat import TurnTemplate

    run_dir = tmp_path / "run"
    finish(launch(run_dir, *[o for o in workload(model_dir) if not o.startswith("rollout_max_response_len=")],
                  "pipeline.mode=cgp", "rollout.admission=fgd", "environment.name=scripted",
                  "environment.import_modules=[tests.fixtures.environments]", "environment.max_turn_tokens=6",
                  "rollout_max_response_len=80", "data.apply_chat_template=true", "eval.interval=0"))
    tokenizer = build_tiny_tokenizer()
    replies = [TurnTemplate(tokenizer, [tokenizer.eos_token_id]).ids([{"role": "user", "content": f"turn {t}"}])
               for t in (1, 2)]
    turns: dict[tuple[int, int, int], int] = {}
    for span in read_spans(run_dir):
        if span.name == "rollout/request":
            key = (span.step, span.attrs["group"], span.attrs["sample"])
            turns[key] = turns.get(key, 0) + span.attrs["num_tokens"]
    rows = read_samples(run_dir)
    assert len(rows) == 2 * 16
    for row in rows:
        step, group, sample = (int(part.split("=")[1]) for part in row["id"].split("/"))
        assert (row["num_turns"], row["episode_end"]) == (3, "done"), row
        mask, ids = row["response_mask"], row["response_ids"]
        assert sum(mask) == turns[(step, group, sample)]
        assert [t for t, m in zip(ids, mask) if m == 0] == replies[0] + replies[1]


def test_an_attached_sglang_server_that_dies_stops_the_run_saying_it_cannot_be_restarted(model_dir, tmp_path):
    attached = start_sglang("attached", model_dir, tmp_path / "engines")
    key_file = tmp_path / "engine.key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *workload(model_dir), "num_rollout=50", f"rollout.engine_urls=[{attached.url}]",
                  f"rollout.engine_api_key_file={key_file}")
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), "step 0 to finish", running=[proc], timeout_s=600)
        attached.kill()
        _, stderr = proc.communicate(timeout=300)
    finally:
        attached.stop()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "attached through rollout.engine_urls; RolloutPipe did not start it and cannot restart it" in stderr, \
        stderr[-3000:]
