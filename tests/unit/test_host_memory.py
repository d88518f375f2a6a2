"""The host memory plan (launch/host_memory.py): its terms on known shapes, the node's moments, and the warning
against launcher.<group>.mem_gb. Its figures against RSS measured on the CPU: bench/host_memory.py."""

from __future__ import annotations

import logging

from rolloutpipe.config import compose_config, load_config
from rolloutpipe.launch import host_memory
from rolloutpipe.launch.host_memory import GPU_PROCESS_BYTES, plan, trainer_processes
from rolloutpipe.launch.memory_plan import QWEN3_SHAPES
from rolloutpipe.launch.preflight import warn_memory
from tests.conftest import REPO

QWEN3_8B = QWEN3_SHAPES["qwen3-8b"]
P = QWEN3_8B.num_params()


def terms(process) -> dict[str, int]:
    return {t.name: t.num_bytes for t in process.terms if t.name != "process"}


def math_8b(*overrides: str):
    """FSDP over one node's 8 GPUs, Qwen3-8B in bfloat16 (conf/experiment/math_8b.yaml)."""
    return compose_config(["+experiment=math_8b", "model.path=null", "data.path=null", *overrides], REPO / "conf")


def test_the_restore_point_costs_12_bytes_a_parameter_in_float32_and_14_in_bfloat16():
    """The torch backend's copy on rank 0: the policy, Adam's two float32 moments and a 16-bit model's masters
    (bench/restore_point.py measures 12 and 14; bench/host_memory.py the RSS)."""
    for dtype, per_param in (("float32", 12), ("bfloat16", 14)):
        rank_0 = terms(trainer_processes(load_config({"model": {"dtype": dtype}}), QWEN3_8B, rank_0=True))
        assert rank_0["restore point: policy"] + rank_0["restore point: state"] == per_param * P
        assert rank_0["resume: optimizer file"] == rank_0["restore point: state"]  # read whole on every rank
        others = terms(trainer_processes(load_config({"model": {"dtype": dtype}}), QWEN3_8B, rank_0=False))
        assert "restore point: state" not in others and "restore point: policy" not in others


def test_fsdp_rank_0_keeps_the_policy_twice_and_every_rank_its_shard():
    """Qwen3-8B on one 8-GPU node: rank 0's CPU model and its copy (2 x 2 B/param) beside every rank's 12 B/param / 8:
    the issue's 131 GB, plus what each process and a step's samples take. At start every rank holds the float32
    conversion of the whole model (4 B/param of its own): the node's largest moment."""
    node, _ = plan(math_8b(), QWEN3_8B)
    rank_0, others = node.processes
    assert others.count == 7
    kept = {name: v for name, v in terms(rank_0).items() if name.startswith(("restore point", "rank 0's CPU model"))}
    assert kept == {"restore point: state": 12 * P // 8, "restore point: policy": 2 * P, "rank 0's CPU model": 2 * P}
    assert terms(rank_0)["step end"] == 512 << 20  # one pipeline.weight_sync_bucket_mb bucket
    assert terms(others)["restore point: state"] == 12 * P // 8 and "restore point: policy" not in terms(others)
    assert round((sum(kept.values()) + 7 * 12 * P // 8) / 1e9) == 131
    assert node.peak_bytes == node.moment_bytes(0) == 8 * (GPU_PROCESS_BYTES + 4 * P)


def test_megatrons_distributed_optimizer_keeps_each_ranks_shard_and_the_replicated_one_the_whole_state_on_rank_0():
    distributed = math_8b("trainer.backend=megatron", "trainer.megatron.tensor_parallel_size=2")
    piece = QWEN3_8B.num_params(tp=2)
    for rank_0 in (True, False):  # 12 B/param / 4 data-parallel ranks of each rank's tensor-parallel piece
        assert terms(trainer_processes(distributed, QWEN3_8B, rank_0=rank_0))["restore point: state"] == 12 * piece // 4
    assert terms(trainer_processes(distributed, QWEN3_8B, rank_0=True))["rank 0's CPU model"] == 2 * P
    assert "rank 0's CPU model" not in terms(trainer_processes(distributed, QWEN3_8B, rank_0=False))
    replicated = math_8b("trainer.backend=megatron", "trainer.megatron.distributed_optimizer=false")
    assert terms(trainer_processes(replicated, QWEN3_8B, rank_0=True))["restore point: state"] == 12 * P
    assert "restore point: state" not in terms(trainer_processes(replicated, QWEN3_8B, rank_0=False))


def test_megatron_rank_0_keeps_no_copy_of_its_parameters():
    """It maps them where they lie into the HF model and three reused bucket buffers (four when the replicated
    optimizer steps by bucket): no step-end transient. With tensor parallelism its group gathers them a bucket at a
    time."""
    rank_0 = terms(trainer_processes(math_8b("trainer.backend=megatron", "trainer.megatron.tensor_parallel_size=1"),
                                     QWEN3_8B, rank_0=True))
    assert rank_0["rank 0's CPU model"] == 2 * P and "step end" not in rank_0
    embedding = QWEN3_8B.vocab_size * QWEN3_8B.hidden_size * 2  # 1.2 GB: a bucket of its own, the largest
    assert embedding > 512 << 20 and rank_0["rank 0's bucket buffers"] == 3 * embedding
    gathered = terms(trainer_processes(math_8b("trainer.backend=megatron", "trainer.megatron.tensor_parallel_size=2",
                                               "pipeline.weight_sync_bucket_mb=2048"), QWEN3_8B, rank_0=True))
    assert gathered["rank 0's CPU model"] == 2 * P and gathered["rank 0's bucket buffers"] == 3 * (2048 << 20)
    assert gathered["step end"] == (2048 << 20) + embedding  # a bucket, and gloo's copy of the largest tensor
    replicated = terms(trainer_processes(math_8b("trainer.backend=megatron", "trainer.megatron.distributed_optimizer"
                                                 "=false"), QWEN3_8B, rank_0=True))
    assert replicated["rank 0's bucket buffers"] == 4 * embedding  # and one the update by buckets maps ahead into


def test_the_model_files_pages_count_once_a_node_and_fsdps_float32_conversion_once_a_rank():
    """from_pretrained maps the file: eight ranks reading it share the page cache's one copy. FSDP's float32
    conversion of a 16-bit model is each rank's own."""
    torch_node, _ = plan(math_8b("trainer.backend=torch"), QWEN3_8B)
    assert torch_node.moment_bytes(0) == 8 * GPU_PROCESS_BYTES + 2 * P
    fsdp_node, _ = plan(math_8b(), QWEN3_8B)
    assert fsdp_node.moment_bytes(0) == 8 * (GPU_PROCESS_BYTES + 4 * P)


def test_preflight_warns_when_a_node_exceeds_its_mem_gb_and_never_without_one(caplog):
    def host_lines(*overrides):
        cfg = math_8b(*overrides)
        return [line for line in host_memory.warnings(plan(cfg, QWEN3_8B)) if line.startswith("host memory plan")]

    assert host_lines() == []  # launcher.*.mem_gb null: not checked
    assert host_lines("launcher.trainer.mem_gb=2000", "launcher.rollout.mem_gb=2000") == []
    (line,) = host_lines("launcher.trainer.mem_gb=200")
    assert "trainer node 0 (8 ranks)" in line and "launcher.trainer.mem_gb=200" in line
    assert "as its ranks load the model" in line and "model load 30.5 GiB x 7" in line
    (line,) = host_lines("launcher.rollout.mem_gb=8")
    assert "rollout node 0" in line and "SGLang server" in line
    tiny = load_config({"launcher": {"trainer": {"mem_gb": 0.5}}})  # a trainer process alone takes more
    with caplog.at_level(logging.WARNING, logger="rolloutpipe.launch.preflight"):
        lines = warn_memory(tiny)
    assert [line for line in lines if "launcher.trainer.mem_gb=0.5" in line]
    assert any(r.getMessage().startswith("host memory plan") for r in caplog.records)


def test_distributed_weight_sync_holds_two_buckets_on_the_gpu_to_gpu_engines_and_on_the_host_to_cpu_ones():
    """Trainer rank 0 packs each bucket into one of two flat send buffers (control/weights/distributed.py): on its GPU
    when the engines are SGLang on GPUs (NCCL), in host memory when they are CPU servers (gloo); none with disk sync."""
    from rolloutpipe.config import WeightSync
    from rolloutpipe.launch.memory_plan import trainer_estimate

    def gpu_terms(cfg) -> dict[str, int]:
        return {t.name: t.num_bytes for t in trainer_estimate(cfg, QWEN3_8B, capacity_bytes=0).terms}

    nccl = math_8b()  # pipeline.weight_sync null: the broadcast, to its SGLang engines
    assert nccl.pipeline.weight_sync is WeightSync.distributed
    assert gpu_terms(nccl)["weight-sync buffers"] == 2 * nccl.weight_sync().bucket_bytes
    assert "weight-sync buffers" not in terms(trainer_processes(nccl, QWEN3_8B, rank_0=True))
    gloo = load_config({"rollout": {"engine": "embedded_http"}, "pipeline": {"weight_sync": "distributed"}})
    assert terms(trainer_processes(gloo, QWEN3_8B, rank_0=True))["weight-sync buffers"] == \
        2 * gloo.weight_sync().bucket_bytes
    assert "weight-sync buffers" not in gpu_terms(gloo)
    disk = math_8b("pipeline.weight_sync=disk")
    assert "weight-sync buffers" not in gpu_terms(disk)
    assert "weight-sync buffers" not in terms(trainer_processes(disk, QWEN3_8B, rank_0=True))
