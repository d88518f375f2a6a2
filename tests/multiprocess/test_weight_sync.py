"""Distributed weight sync: trainer rank 0 broadcasts, engines behind SGLang's HTTP API receive
(control/weights/distributed.py).

Two embedded-engine servers (float64) join a gloo group with this test process as rank 0, the role trainer rank 0
plays in a run; the rollout node's side (EngineSupervisor -> SGLangEngine -> sglang_api) drives them.
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.control.env import free_port
from rolloutpipe.control.weights.buckets import GROUP_NAME, WeightGroup, plan_buckets
from rolloutpipe.control.weights.digest import tensor_bytes
from rolloutpipe.control.weights.distributed import bucket_mac, mac_record
from rolloutpipe.control.weights.group import BroadcastBroken, Broadcaster, weight_sync_backend
from rolloutpipe.control.weights.mac import weights_key
from rolloutpipe.model import DType, ModelConfig, load_model
from rolloutpipe.observe.metrics import read_spans
from rolloutpipe.rollout.engines import server_process, sglang_api
from rolloutpipe.rollout.engines.http_client import SGLangEngine
from rolloutpipe.rollout.engines.supervisor import EngineFailed, EngineSupervisor
from tests.conftest import DENSE_REWARD, SMALL, read_samples, run_job
from tests.helpers.http_engine import API_KEY, MODEL, VOCAB_SIZE, Results, in_process, request
from tests.helpers.parity import assert_digests_tell_identical_from_different

NUM_SERVERS = 2
KEY = weights_key(b"the attempt's key")


def macs_of(state, buckets):
    """Each bucket's MAC as trainer rank 0 seals it and the rollout node hands it to the engines."""
    records = [mac_record([tensor_bytes(state[name]) for name in bucket.names], KEY) for bucket in buckets]
    return lambda index: bucket_mac(records[index], KEY)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("engines")
    model_yaml = log_dir / "model.yaml"
    model_yaml.write_text(OmegaConf.to_yaml(OmegaConf.structured(MODEL)))
    procs = [server_process.embedded_server(name=f"engine{i}", model_config_yaml=model_yaml, concurrency=4,
                                            log_dir=log_dir, num_threads=1, api_key=API_KEY).start()
             for i in range(NUM_SERVERS)]
    for proc in procs:
        proc.wait_ready(timeout_s=120)
    yield procs
    for proc in procs:
        proc.stop()


def test_buckets_keep_the_state_order_and_respect_the_size():
    state = {"a": torch.zeros(10, dtype=torch.float64), "b": torch.zeros(3, 2, dtype=torch.bfloat16),
             "c": torch.zeros(100, dtype=torch.float32), "d": torch.zeros(1)}
    buckets = plan_buckets(state, bucket_bytes=100)
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d"]]  # c (400 bytes) alone: larger than a bucket
    assert buckets[0].dtypes == ["float64", "bfloat16"] and buckets[0].shapes == [[10], [3, 2]]


def test_a_cpu_trainer_broadcasts_over_gloo_even_to_sglang_engines():
    """nccl cannot send CPU tensors; gloo fills SGLang's CUDA buffers through host memory."""
    assert weight_sync_backend(True, on_gpu=False) == "gloo"
    assert weight_sync_backend(False, on_gpu=False) == "gloo"
    assert weight_sync_backend(True, on_gpu=True) == "nccl"
    assert weight_sync_backend(False, on_gpu=True) == "gloo"


def test_distributed_weight_sync_needs_http_engines_and_says_so():
    with pytest.raises(ConfigError, match="rollout.engine=embedded_http"):
        load_config({"pipeline": {"weight_sync": "distributed"}})
    with pytest.raises(ConfigError, match="async_one_step"):
        load_config({"pipeline": {"weight_sync": "distributed", "mode": "async_one_step"},
                     "rollout": {"engine": "embedded_http"}})


@contextmanager
def in_a_group(servers, group_name: str):
    """The servers' engines under a supervisor, joined to a new weight-update group whose rank 0 is this process (the
    role trainer rank 0 plays in a run): (engines, supervisor, rank 0's Broadcaster)."""
    results = Results()
    engines = [SGLangEngine(name=p.name, endpoint=p.endpoint, concurrency=4, on_result=results) for p in servers]
    supervisor = EngineSupervisor(engines=engines, restart=None, where_to_look=lambda e: e.url, max_failures=0,
                                  request_timeout_s=None, spans=None)
    try:
        group = WeightGroup(master_address="127.0.0.1", master_port=free_port(), world_size=1 + NUM_SERVERS,
                            group_name=group_name)
        rank0: dict[str, Broadcaster] = {}
        joining = threading.Thread(target=lambda: rank0.update(b=Broadcaster(group=group, bucket_bytes=40_000,
                                                                             timeout_s=60, check=lambda what: None)))
        joining.start()
        supervisor.join_weight_group(group, ranks_per_engine=1)
        joining.join()
        yield engines, supervisor, rank0["b"]
    finally:
        for engine in engines:
            engine.shutdown()


def policy(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = load_model(cfg, VOCAB_SIZE).state_dict()
    state.pop("lm_head.weight")  # tied, as the trainer sends it
    return state


def broadcast(rank0: Broadcaster, supervisor: EngineSupervisor, state, buckets, version: int, *, sent=None) -> None:
    """Rank 0 broadcasts ``sent`` (``state`` unless given) while the engines receive it with ``state``'s MACs."""
    sending = threading.Thread(target=rank0.send, args=(state if sent is None else sent, buckets, version))
    sending.start()
    try:
        supervisor.load_weights_distributed(buckets, version, macs_of(state, buckets))
    finally:
        sending.join()


def test_engines_serve_the_broadcast_weights_and_report_their_version(servers):
    outside = sglang_api.update_weights_from_distributed_body(plan_buckets({"x": torch.zeros(1)}, 8)[0], "nope", 9)
    with pytest.raises(sglang_api.SGLangError, match="HTTP 400"):  # outside a session, as 0.5.23 refuses
        sglang_api.call(servers[0].endpoint, sglang_api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, outside)

    with in_a_group(servers, GROUP_NAME) as (engines, supervisor, rank0):
        new_cfg = ModelConfig(dtype=DType.float64, init_seed=1)
        state = policy(new_cfg)
        buckets = rank0.plan(state)
        assert len(buckets) > 2
        broadcast(rank0, supervisor, state, buckets, 1)

        requests = [request(i, stop_token_ids=[1]) for i in range(3)]
        local = in_process(new_cfg, requests, policy_version=1)
        for engine, proc in zip(engines, servers):
            assert engine.policy_version == 1
            assert sglang_api.served_weight_version(sglang_api.call(proc.endpoint, sglang_api.MODEL_INFO)) == "1"
            for r in requests:
                got = sglang_api.generate(proc.endpoint, r, timeout_s=30)
                assert got.weight_version == "1"
                assert got.output_ids == local[r.request_id].output_ids
                torch.testing.assert_close(torch.tensor(got.output_logprobs),
                                           torch.tensor(local[r.request_id].output_logprobs), rtol=0, atol=1e-10)


def test_a_bucket_changed_on_the_wire_is_refused_and_the_engine_serves_nothing_until_a_whole_policy_loads(servers):
    """An outsider who reaches the group (its store takes no seal; gloo relays) changes a byte of the last bucket:
    both engines refuse that bucket, the rollout node stops with the cause, and /generate answers 503 rather than
    sample from half-new weights. A genuine policy then loads whole, and the engines serve it exactly."""
    with in_a_group(servers, "tampered") as (_, supervisor, rank0):
        new_cfg = ModelConfig(dtype=DType.float64, init_seed=2)
        state = policy(new_cfg)
        buckets = rank0.plan(state)
        changed = buckets[-1].names[-1]
        tampered = {**state, changed: state[changed].clone()}
        tampered[changed].view(-1)[0] += 2.0**-20
        with pytest.raises(EngineFailed, match="does not match its MAC"):
            broadcast(rank0, supervisor, state, buckets, 5, sent=tampered)
        for proc in servers:
            assert sglang_api.served_weight_version(sglang_api.call(proc.endpoint, sglang_api.MODEL_INFO)) != "5"
            with pytest.raises(sglang_api.SGLangError, match="MAC") as refused:
                sglang_api.generate(proc.endpoint, request(0), timeout_s=30)
            assert refused.value.status == 503

        broadcast(rank0, supervisor, state, buckets, 6)
        requests = [request(i, stop_token_ids=[1]) for i in range(3)]
        local = in_process(new_cfg, requests, policy_version=6)
        for proc in servers:
            for r in requests:
                got = sglang_api.generate(proc.endpoint, r, timeout_s=30)
                assert got.weight_version == "6" and got.output_ids == local[r.request_id].output_ids


def test_an_engine_told_to_leave_gives_up_the_broadcast_at_once_and_serves_nothing_until_a_whole_policy_loads(
        servers):
    """A member died during the broadcast (here: rank 0 never sends), so the collective would wait until the group's
    timeout; /destroy_weights_update_group ends the receive in progress at once, and the engine then answers
    /generate with 503 rather than sample from part of a policy. A whole policy broadcast to a new group loads."""
    with in_a_group(servers, "left") as (_, _, rank0):
        state = policy(ModelConfig(dtype=DType.float64, init_seed=3))
        buckets = rank0.plan(state)
        failure: list[BaseException] = []

        def receive() -> None:
            try:
                sglang_api.update_weights_from_distributed(servers[0].endpoint, buckets, "left", 7,
                                                           macs=macs_of(state, buckets), timeout_s=60)
            except sglang_api.SGLangError as err:
                failure.append(err)

        receiving = threading.Thread(target=receive)
        receiving.start()
        time.sleep(1.0)  # (setup: the receive has started)
        assert receiving.is_alive(), "the receive waits for rank 0"
        sglang_api.destroy_weights_update_group(servers[0].endpoint, "left")
        receiving.join()
        [err] = failure  # given up on being told, not ended by the group's timeout ("Timed out waiting")
        assert err.status == 400 and "the broadcast on left broke (the broadcast was given up" in str(err)
        with pytest.raises(sglang_api.SGLangError, match="broke") as refused:
            sglang_api.generate(servers[0].endpoint, request(0), timeout_s=30)
        assert refused.value.status == 503
    with in_a_group(servers, "after-left") as (_, supervisor, rank0):
        broadcast(rank0, supervisor, state, buckets, 8)
        got = sglang_api.generate(servers[0].endpoint, request(0), timeout_s=30)
        assert got.weight_version == "8"


def test_rank_0_gives_up_its_broadcast_once_the_rollout_node_says_a_member_died(servers):
    """Rank 0's own broadcast may not fail when a member dies (the dead peer need not be one it sends to): it stops
    waiting once the rollout node's outcome record says the broadcast broke (``broken``), and leaves the group."""
    with in_a_group(servers, "said-broken") as (_, _, rank0):
        state = {"w": torch.ones(8 << 20, dtype=torch.float32)}  # 32 MiB: more than the sockets buffer
        checks = itertools.count()

        def broken() -> None:  # the rollout node's record appears at rank 0's third check
            if next(checks) == 2:
                raise BroadcastBroken("the rollout node says an engine died during the broadcast")

        with pytest.raises(BroadcastBroken, match="says an engine died"):
            rank0.stream([(bucket, state) for bucket in plan_buckets(state, 4 << 20)], 3, broken)  # no one receives
        in_flight = [sent[0] for sent in rank0._in_flight if sent is not None]
        rank0.leave()  # without waiting for the group's timeout to end the broadcast in flight
        assert in_flight and not all(work.is_completed() for work in in_flight), "leave waited for the broadcast"
        rank0.leave()  # once left, leaving again does nothing (a new attempt's group replaces it)


PARITY = [*SMALL, *DENSE_REWARD, "model.dtype=float64", "run.save_samples=true", "rollout.concurrency=6",
          "run.checkpoint_every=0"]


def test_distributed_weight_sync_trains_the_same_policy_as_disk_sync(job_dir):
    runs = {}
    for name, overrides in (("disk", ["pipeline.weight_sync=disk"]),
                            ("distributed", ["rollout.engine=embedded_http", "pipeline.weight_sync=distributed",
                                             "pipeline.weight_sync_bucket_mb=0.1"])):
        run_dir = job_dir(name)
        result = run_job(run_dir, *PARITY, *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = run_dir

    assert not list((runs["distributed"] / "weights").glob("*.safetensors")), "distributed sync writes no file"
    versions = {(s.step, s.attrs["policy_version"]) for s in read_spans(runs["distributed"])
                if s.name == "rollout/request"}
    assert versions == {(0, 0), (1, 1)}  # step 1 was generated by the broadcast policy
    disk, distributed = read_samples(runs["disk"]), read_samples(runs["distributed"])
    assert [(s["id"], s["response_ids"]) for s in disk] == [(s["id"], s["response_ids"]) for s in distributed]
    disk_w, dist_w = (load_file(str(r / "checkpoints" / "final" / "model.safetensors")) for r in runs.values())
    # the digest of the file each step wrote (disk) and of the tensors each step broadcast (distributed, and the final
    # policy, which is not broadcast) name the same bits the same way
    assert_digests_tell_identical_from_different(runs, {"disk": disk_w, "distributed": dist_w})
    difference = max((disk_w[k] - dist_w[k]).abs().max().item() for k in disk_w)
    assert difference < 1e-9, f"disk and distributed weight sync trained policies that differ by {difference}"
