"""The step's last update applied bucket by bucket as weight sync takes the buckets (grpo_trainer.py): what is sent,
and what the trainer holds afterwards, are the bits of the update applied whole."""

from __future__ import annotations

import threading

import pytest
import torch

from rolloutpipe.control.weights.buckets import packed
from rolloutpipe.model import DType
from rolloutpipe.trainer import torch_backend
from rolloutpipe.trainer.config import MegatronConfig, TrainerBackend
from rolloutpipe.trainer.fsdp_backend import FSDPTrainer
from rolloutpipe.trainer.megatron.trainer import MegatronTrainer
from tests.unit.test_exact_sum import groups
from tests.unit.test_exact_sum import trainer as exact_sum_trainer

DISTRIBUTED = "megatron-distributed"
"""Megatron's distributed optimizer, with DDP buckets of 4000 parameters (several bucket groups)."""
CASES = [(TrainerBackend.torch, DType.float32), (TrainerBackend.torch, DType.bfloat16),
         (TrainerBackend.fsdp, DType.float32), (TrainerBackend.fsdp, DType.bfloat16),
         (TrainerBackend.megatron, DType.float32), (TrainerBackend.megatron, DType.bfloat16),
         (DISTRIBUTED, DType.float32), (DISTRIBUTED, DType.bfloat16)]
IDS = ["torch-float32", "torch-bfloat16-masters", "fsdp-float32", "fsdp-bfloat16", "megatron-float32",
       "megatron-bfloat16-masters", "megatron-distributed-float32", "megatron-distributed-bfloat16-masters"]


def trainer(dtype: DType, *, exact: bool, backend=TrainerBackend.torch):
    if backend != DISTRIBUTED:
        return exact_sum_trainer(dtype, exact=exact, backend=backend)
    return exact_sum_trainer(dtype, exact=exact, backend=TrainerBackend.megatron,
                             megatron=MegatronConfig(distributed_optimizer=True, ddp_bucket_size=4000))


def stepped_by(policy) -> torch.optim.Optimizer:
    """The torch optimizer that steps the policy's tensors (Megatron's: inside its replicated optimizer)."""
    if isinstance(policy, FSDPTrainer):
        return policy.optimizer.optimizer
    if isinstance(policy, MegatronTrainer):
        (megatron,) = policy.megatron_optimizer.chained_optimizers
        return megatron.optimizer
    return policy.optimizer


def held(policy) -> dict[str, bytes]:
    """Everything the update writes: the tensors AdamW steps (float32 masters, FSDP's shards), its state (moments,
    step counts), and the model's own weights."""
    optimizer = stepped_by(policy)
    out = {}
    for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        out[f"{i}"] = _bits(param)
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value is not param:
                out[f"{i}.{key}"] = _bits(value)
    for name, param in policy._policy().named_parameters():
        out[name] = _bits(param)
    return out


def ahead_taken(policy) -> threading.Event:
    """Set once the weights-ahead thread has taken the second bucket, so it then waits for room and leaves the policy
    alone: a read of ``held`` while that thread updates the bucket ahead would race it (its optimizer state grows)."""
    taken, plan = threading.Event(), policy._hf_buckets

    def counted():
        buckets, tensors = plan()

        def each():
            for i, bucket in enumerate(tensors):
                if i == 1:
                    taken.set()
                yield bucket
        return buckets, each()

    policy._hf_buckets = counted
    return taken


def _bits(tensor: torch.Tensor) -> bytes:
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def train(policy, *, defer: bool):
    for group in groups():
        policy.forward_backward(group, first_batch_of_step=True)
    return policy.finish_batch(defer_update=defer)


def run(backend, dtype, *, defer: bool) -> dict:
    """One trainer (FSDP's each in a world of its own, so one at a time): a batch, its update (deferred: taken by
    2 KiB buckets, each copied out as it arrives, as a sender copies it), what it holds; a second batch."""
    policy = trainer(dtype, exact=False, backend=backend)
    try:
        out = {"grad_norm": train(policy, defer=defer).grad_norm}
        if defer:
            policy.bucket_bytes = 2048
            with policy.writer_reads():
                buckets, tensors = policy.hf_buckets()
                out["sent"] = {name: _bits(t) for bucket in tensors for name, t in bucket.items()}
            out["num_buckets"] = len(buckets)
        else:
            out["sent"] = {name: _bits(t) for name, t in policy.hf_state().items()}
        out["held"] = held(policy)
        train(policy, defer=False)
        out["held after a second batch"] = held(policy)
        return out
    finally:
        policy.close()


@pytest.mark.parametrize("backend,dtype", CASES, ids=IDS)
def test_the_last_update_sent_bucket_by_bucket_is_the_whole_update_to_the_bit(backend, dtype):
    """Every bucket sent holds the weights of the whole update; the trainer then holds what the whole update leaves
    (weights, masters, AdamW's moments and step counts), and a second batch goes on from there alike."""
    whole, deferred = run(backend, dtype, defer=False), run(backend, dtype, defer=True)
    assert deferred.pop("num_buckets") >= 4
    assert deferred["sent"].keys() == whole["sent"].keys()
    assert [name for name in whole["sent"] if deferred["sent"][name] != whole["sent"][name]] == []
    assert deferred == whole


@pytest.mark.parametrize("backend,dtype", CASES[::2], ids=IDS[::2])
def test_a_deferred_update_not_taken_by_buckets_is_applied_whole(backend, dtype):
    """Nothing read the buckets: ``apply_deferred_update`` applies the update, once."""
    policy = trainer(dtype, exact=False, backend=backend)
    try:
        before = held(policy)
        train(policy, defer=True)
        assert held(policy) == before  # deferred: not applied yet
        policy.apply_deferred_update()
        policy.apply_deferred_update()
        applied = held(policy)
    finally:
        policy.close()
    whole = run(backend, dtype, defer=False)
    assert applied == whole["held"]


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
def test_the_torch_backends_buckets_are_ranges_of_its_parameters_and_the_layout_changes_no_bit(dtype, monkeypatch):
    """``lay_out_flat``: the parameters lie in one tensor in HF order, so each bucket weight sync takes is one range
    of that memory, which the broadcast sends uncopied (buckets.py ``packed``); training on it gives the same bits
    as on parameters each in memory of its own."""
    policy = trainer(dtype, exact=False)
    try:
        storage = policy.model.get_input_embeddings().weight.untyped_storage()
        assert {p.untyped_storage().data_ptr() for p in policy.model.parameters()} == {storage.data_ptr()}
        train(policy, defer=True)
        policy.bucket_bytes = 2048
        buckets, tensors = policy.hf_buckets()
        for bucket, state in zip(buckets, tensors, strict=True):
            flat = packed(bucket, state)
            assert flat is not None and flat.untyped_storage().data_ptr() == storage.data_ptr()
        assert len(buckets) >= 4
    finally:
        policy.close()
    flat_layout = run(TrainerBackend.torch, dtype, defer=True)
    monkeypatch.setattr(torch_backend, "lay_out_flat", lambda model, names: None)
    assert run(TrainerBackend.torch, dtype, defer=True) == flat_layout


def test_fsdp_rank_0_gathers_each_bucket_into_one_range_of_four_reused_buffers():
    """FSDP's rank 0 copies each gathered tensor into one buffer per bucket (the broadcast sends it as it lies), four
    buffers in turn (the reader's three and the one the update by bucket gathers ahead), kept from one policy to the
    next: a fresh buffer's pages would be faulted in on every step."""
    policy = trainer(DType.bfloat16, exact=False, backend=TrainerBackend.fsdp)
    try:
        policy.bucket_bytes = 2048
        memory = []
        for _ in range(3):
            with policy.writer_reads():
                buckets, tensors = policy.hf_buckets()
                flats = [packed(bucket, state) for bucket, state in zip(buckets, tensors, strict=True)]
            assert all(flat is not None for flat in flats)
            memory.append([flat.untyped_storage().data_ptr() for flat in flats])
    finally:
        policy.close()
    assert len(buckets) > 4
    assert len(set(memory[1])) == 4 and memory[1] == memory[2]  # (the first policy grows the buffers)


@pytest.mark.parametrize("backend,dtype", CASES[::2], ids=IDS[::2])
def test_the_first_bucket_leaves_before_the_last_parameters_are_updated(backend, dtype):
    """The point of the update by bucket: when weight sync has the first bucket, part of the policy is updated (its
    parameters, and those one bucket ahead) and the rest is not yet; all of it is once the last bucket is taken."""
    policy = trainer(dtype, exact=False, backend=backend)
    ahead = ahead_taken(policy)
    try:
        before = held(policy)
        train(policy, defer=True)
        policy.bucket_bytes = 2048
        with policy.writer_reads():
            buckets, tensors = policy.hf_buckets()
            next(tensors)
            assert ahead.wait(timeout=120), "the bucket ahead was never taken"
            midway = held(policy)
            for _ in tensors:
                pass
        after = held(policy)
    finally:
        policy.close()
    assert len(buckets) >= 8
    assert [k for k in before if midway[k] != before[k]], "nothing was updated for the first bucket"
    assert [k for k in before if midway[k] == before[k] != after[k]], "all was updated before the first bucket left"
    assert [k for k in before if after[k] == before[k]] == []
