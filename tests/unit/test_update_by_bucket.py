"""The step's last update applied bucket by bucket as weight sync takes the buckets (grpo_trainer.py): what is sent,
and what the trainer holds afterwards, are the bits of the update applied whole."""

from __future__ import annotations

import pytest
import torch

from rolloutpipe.model import DType
from rolloutpipe.trainer.config import TrainerBackend
from rolloutpipe.trainer.fsdp_backend import FSDPTrainer
from tests.unit.test_exact_sum import groups, trainer

CASES = [(TrainerBackend.torch, DType.float32), (TrainerBackend.torch, DType.bfloat16),
         (TrainerBackend.fsdp, DType.float32), (TrainerBackend.fsdp, DType.bfloat16)]
IDS = ["torch-float32", "torch-bfloat16-masters", "fsdp-float32", "fsdp-bfloat16"]


def held(policy) -> dict[str, bytes]:
    """Everything the update writes: the tensors AdamW steps (float32 masters, FSDP's shards), its state (moments,
    step counts), and the model's own weights."""
    optimizer = policy.optimizer.optimizer if isinstance(policy, FSDPTrainer) else policy.optimizer
    out = {}
    for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        out[f"{i}"] = _bits(param)
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value is not param:
                out[f"{i}.{key}"] = _bits(value)
    for name, param in policy._policy().named_parameters():
        out[name] = _bits(param)
    return out


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
