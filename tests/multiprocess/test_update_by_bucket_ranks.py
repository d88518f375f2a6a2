"""The step's last update by bucket on several trainer ranks (grpo_trainer.py, lead.py): what trainer rank 0 sends,
and what every rank holds afterwards, are the bits of the update applied whole, also when rank 0's reader stops
after two buckets (a broadcast broken by a dead engine) and reads the policy again. The other ranks wait in the
gathers rank 0 leads (FSDP's, Megatron's all-gathers of the distributed optimizer's bucket groups and of the
tensor-parallel shards): a reader that stops early must not leave them waiting."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rolloutpipe.control.env import free_port
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.backend import trainer_class
from rolloutpipe.trainer.config import GRPOConfig, MegatronConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from tests.unit.test_exact_sum import groups
from tests.unit.test_update_by_bucket import _bits, held

pytestmark = pytest.mark.multiprocess
HANG_S = 180
"""A rank still running after this long waits in a gather nobody else makes."""

# (backend, ranks, tensor-parallel size)
CASES = [("fsdp", 2, 1), ("megatron-distributed", 2, 1), ("megatron-distributed", 4, 2)]
IDS = ["fsdp-2-ranks", "megatron-distributed-dp2", "megatron-distributed-dp2-tp2"]


def build(backend: str, ranks: int, tp: int):
    model = load_model(ModelConfig(dtype=DType.float32), len(build_tiny_tokenizer()))
    if backend == "fsdp":
        cfg = TrainerConfig(backend=TrainerBackend.fsdp, num_ranks=ranks)
    else:
        cfg = TrainerConfig(backend=TrainerBackend.megatron, num_ranks=ranks, megatron=MegatronConfig(
            distributed_optimizer=True, ddp_bucket_size=4000, tensor_parallel_size=tp))
    return trainer_class(cfg.backend)(model=model, cfg=cfg, grpo=GRPOConfig(), temperature=1.0, pad_id=0,
                                      multi_step=False, process_group_active=True,
                                      old_logprobs=OldLogprobSource.trainer)


def _rank(rank: int, ranks: int, port: int, backend: str, tp: int, deferred: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        policy = build(backend, ranks, tp)
        policy.bucket_bytes = 2048
        data_parallel = policy.data_parallel_size
        for group in groups()[policy.data_parallel_rank::data_parallel]:
            policy.forward_backward(group, first_batch_of_step=True)
        policy.finish_batch(defer_update=deferred)
        with policy.writer_reads():
            if rank == 0 and deferred:
                buckets, tensors = policy.hf_buckets()
                next(tensors), next(tensors)
                tensors.close()  # the broadcast broke: the policy goes again, whole
                buckets, tensors = policy.hf_buckets()
                assert len(buckets) >= 8
                out["sent"] = {name: _bits(t) for bucket in tensors for name, t in bucket.items()}
            elif rank == 0:
                out["sent"] = {name: _bits(t) for name, t in policy.hf_state().items()}
        policy.apply_deferred_update()
        out[rank] = held(policy)
        policy.close()
    finally:
        dist.destroy_process_group()


def run(backend: str, ranks: int, tp: int, *, deferred: bool) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        context = mp.start_processes(_rank, args=(ranks, free_port(), backend, tp, deferred, out), nprocs=ranks,
                                     join=False, start_method="spawn")
        waited = 0
        while not context.join(timeout=5):
            waited += 5
            if waited >= HANG_S:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{backend} on {ranks} ranks hung for {HANG_S} s: a rank waits in a gather rank 0 "
                            "did not make")
        return dict(out)


@pytest.mark.parametrize("backend,ranks,tp", CASES, ids=IDS)
def test_a_deferred_update_read_again_after_an_early_stop_is_the_whole_update_on_every_rank(backend, ranks, tp):
    whole, deferred = run(backend, ranks, tp, deferred=False), run(backend, ranks, tp, deferred=True)
    assert deferred["sent"].keys() == whole["sent"].keys()
    assert [name for name in whole["sent"] if deferred["sent"][name] != whole["sent"][name]] == []
    for rank in range(ranks):
        assert deferred[rank] == whole[rank], f"rank {rank} holds another update"
