"""Megatron's optimizers through the project's checkpoint, on one CPU rank (trainer/megatron/cpu.py redirects their
CUDA calls): the replicated optimizer (float32 and bfloat16, whose float32 masters Megatron keeps beside torch's
state) and the distributed one, each wrapping torch's AdamW (a step count in every parameter's state: what Megatron
takes without Apex or Transformer Engine, as on the H200 of issue 43) or a FusedAdam (one step count per parameter
group: Apex's and Transformer Engine's). The distributed optimizer's checkpoint is sharded (each rank's own ranges,
nothing gathered). A trainer resumed from the checkpoint holds what Megatron-core itself hands out for the saved one
(its state dict, and the distributed optimizer's shards as Megatron gathers them) and takes its next step to the same
bits as the uninterrupted trainer. Two ranks and a whole run: tests/multiprocess/test_resume.py."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from rolloutpipe.control.checkpoint import ShardedState, latest_checkpoint, load_optimizer, optimizer_groups
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.backend import trainer_class
from rolloutpipe.trainer.config import GRPOConfig, MegatronConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.grpo_trainer import TrainSample
from rolloutpipe.trainer.restore import RestorePoint
from tests.conftest import needs_extra

pytestmark = needs_extra("megatron", "megatron.core")


class FusedAdam(torch.optim.Optimizer):
    """Apex's and Transformer Engine's FusedAdam as Megatron sees it (its constructor's arguments, and its state:
    ``exp_avg`` and ``exp_avg_sq`` per parameter, the step count in each parameter group), in plain torch."""

    def __init__(self, params, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                 adam_w_mode: bool = True) -> None:
        assert adam_w_mode, "the trainer asks for decoupled weight decay"
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), step = group["betas"], group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))


@pytest.fixture(params=["torch-adamw", "fused-adam"])
def adam(request, monkeypatch) -> str:
    """Which Adam Megatron wraps: torch's (what it imports here), or a FusedAdam as if Transformer Engine were
    installed (the names Megatron-core 0.16.1 decides by at import)."""
    if request.param == "fused-adam":
        import megatron.core.optimizer as megatron_optimizer
        from megatron.core.optimizer import distrib_optimizer

        monkeypatch.setattr(megatron_optimizer, "Adam", FusedAdam)
        monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
        monkeypatch.setattr(distrib_optimizer, "Adam", FusedAdam)
        monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
        monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    return request.param


def megatron_trainer(dtype: DType, *, distributed: bool, model_path: str | None = None):
    """A Megatron trainer of the tiny model on a world of one rank of its own (``close`` ends it)."""
    model = load_model(ModelConfig(dtype=dtype, path=model_path), len(build_tiny_tokenizer()))
    cfg = TrainerConfig(backend=TrainerBackend.megatron, max_grad_norm=0.5, lr=1e-2,
                        megatron=MegatronConfig(distributed_optimizer=distributed))
    return trainer_class(TrainerBackend.megatron)(
        model=model, cfg=cfg, grpo=GRPOConfig(), temperature=1.0, pad_id=0, multi_step=False,
        process_group_active=False, old_logprobs=OldLogprobSource.trainer)


def batch(seed: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    return [TrainSample(prompt_ids=torch.randint(5, 30, (5,), generator=g).tolist(),
                        response_ids=torch.randint(5, 30, (3 + i,), generator=g).tolist(),
                        engine_logprobs=[], advantage=(-1.0) ** i) for i in range(4)]


def train(trainer, seed: int) -> None:
    trainer.forward_backward(batch(seed), first_batch_of_step=True)
    trainer.finish_batch()


def megatrons_view(trainer) -> dict:
    """What Megatron-core hands out of the optimizer's state: its state dict (without the parameters' order), and
    for the distributed optimizer the shards gathered on data-parallel rank 0 (get_parameter_state_dp_zero)."""
    (sub,) = trainer.megatron_optimizer.chained_optimizers
    state = sub.state_dict()
    inner = state.get("optimizer", state)  # (the float32 replicated optimizer's state dict is torch's)
    view = {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]}
    if trainer.distributed_optimizer:
        gathered = sub.get_parameter_state_dp_zero()
        view["shards"] = {(index, name): tensor.clone() for index, buffers in gathered.items()
                          if index != "buckets_coalesced" for world in buffers.values()
                          for name, tensor in world.items() if name != "numel_unpadded"}
    else:
        view["state"] = {(index, name): value.clone() for index, tensors in inner["state"].items()
                         for name, value in tensors.items()}
        view["masters"] = [m.clone() for group in state.get("fp32_from_fp16_params", []) for m in group]
    return view


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b or (isinstance(a, float) and math.isclose(a, b, rel_tol=0, abs_tol=0))


@pytest.mark.parametrize("dtype,distributed", [
    (DType.float32, False), (DType.bfloat16, False), (DType.float32, True), (DType.bfloat16, True),
], ids=["replicated-float32", "replicated-bfloat16", "distributed-float32", "distributed-bfloat16"])
def test_a_resumed_megatron_optimizer_holds_megatrons_own_state_and_steps_to_the_same_bits(
        tmp_path, adam, dtype, distributed):
    tokenizer = build_tiny_tokenizer()
    first = megatron_trainer(dtype, distributed=distributed)
    try:
        assert type(first.megatron_optimizer.chained_optimizers[0].optimizer).__name__ == (
            "FusedAdam" if adam == "fused-adam" else "AdamW")
        train(first, seed=0)
        train(first, seed=1)  # two steps: a step count of 2 tells the per-parameter counts from their sum
        saved = megatrons_view(first)
        point = RestorePoint(run_dir=tmp_path, tokenizer=tokenizer, config_yaml="", keep_last=1, on_disk=-1)
        if first.sharded_checkpoint:  # as the trainer node does (trainer/node.py end_step)
            point.capture_shards(1, first.training_shards())
        with first.writer_reads():
            point.capture(1, model=first.hf_model(), optimizer=first.optimizer, source_state={})
        point.write()
        train(first, seed=2)
        expected = first.hf_state()
    finally:
        first.close()

    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.sharded == distributed  # the distributed optimizer: each rank's file, no gathered state
    resumed = megatron_trainer(dtype, distributed=distributed, model_path=str(checkpoint.directory))
    try:
        if checkpoint.sharded:
            with ShardedState(checkpoint.directory / "optimizer") as state:
                resumed.load_training_shards(state, optimizer_groups(checkpoint))
        else:
            load_optimizer(resumed.optimizer, checkpoint)
        loaded = megatrons_view(resumed)
        assert same(loaded, saved), "the resumed optimizer must hold the state Megatron handed out for the saved one"
        train(resumed, seed=2)
        again = resumed.hf_state()
    finally:
        resumed.close()
    assert next(iter(again.values())).dtype == dtype.torch
    assert all(torch.equal(again[k], v) for k, v in expected.items()), "the resumed step must be the same bits"


def test_closing_a_megatron_trainer_frees_its_training_state_without_waiting_for_the_garbage_collector():
    """Megatron's DDP hooks and optimizer refer back to the parameters: reference cycles. A GPU would hold the weights,
    gradient buffers and Adam's moments until Python's next full collection (issue 43's check measured later trainers
    with the first one's state still allocated); ``close`` frees them itself."""
    trainer = megatron_trainer(DType.bfloat16, distributed=True)
    train(trainer, seed=0)
    (sub,) = trainer.megatron_optimizer.chained_optimizers
    state = [weakref.ref(next(trainer.gpt.parameters())), weakref.ref(trainer.ddp.buffers[0].grad_data),
             weakref.ref(next(iter(sub.optimizer.state.values()))["exp_avg"])]
    del sub
    gc.collect()
    gc.disable()
    try:
        trainer.close()
        del trainer
        assert [ref() is None for ref in state] == [True, True, True]
    finally:
        gc.enable()
