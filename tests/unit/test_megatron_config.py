"""``trainer.megatron.distributed_optimizer``: how null resolves, where an explicit true is refused (float64), the
Megatron configs it turns into, and which checkpoints its state refuses (a fake stands for Megatron's optimizer there:
the refusals come before Megatron is called; tests/unit/test_megatron_checkpoint.py runs the real optimizers through
a checkpoint)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.control.checkpoint import latest_checkpoint, load_optimizer
from rolloutpipe.launch.preflight import check_model
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.config import GRPOConfig, MegatronConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.megatron.optimizer import (
    DistributedParameterState,
    ReplicatedState,
    resolve_distributed_optimizer,
)
from rolloutpipe.trainer.restore import RestorePoint
from tests.conftest import needs_extra

BUFFER_KEY = (torch.bfloat16, torch.float32)
"""Megatron's key of a gradient buffer's ranges: (parameter dtype, gradient dtype)."""


@pytest.mark.parametrize("cuda,dtype,expected", [
    (False, "float32", False), (False, "float64", False),
    (True, "bfloat16", True), (True, "float32", True),
    (True, "float64", False),  # Megatron's distributed optimizer takes no float64 parameters
])
def test_null_means_the_distributed_optimizer_exactly_where_it_runs(cuda, dtype, expected):
    assert resolve_distributed_optimizer(None, cuda=cuda, dtype=dtype) is expected
    assert resolve_distributed_optimizer(False, cuda=cuda, dtype=dtype) is False


def test_an_explicit_true_runs_anywhere_but_with_float64():
    """On the CPU too (cpu.py redirects Megatron's CUDA calls); Megatron takes no float64 parameters."""
    assert resolve_distributed_optimizer(True, cuda=True, dtype="bfloat16") is True
    assert resolve_distributed_optimizer(True, cuda=False, dtype="float32") is True
    with pytest.raises(ValueError, match=r"float64.*model.dtype=float32"):
        resolve_distributed_optimizer(True, cuda=True, dtype="float64")


def megatron_run(**launch) -> object:
    return load_config({"trainer": {"backend": "megatron", "megatron": {"distributed_optimizer": True}}, **launch})


def test_an_explicit_true_with_float64_stops_the_launch_at_preflight():
    check_model(megatron_run())
    with pytest.raises(ConfigError, match="float64"):
        check_model(megatron_run(model={"dtype": "float64"}))


@needs_extra("slurm", "torchx")
def test_the_torchx_component_refuses_float64_before_anything_is_queued(monkeypatch, tmp_path):
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("torchx_components", REPO / "launchers" / "components.py")
    components = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(components)
    monkeypatch.setenv("RP_RUN_SECRET", "")  # grpo() sets it in this process; monkeypatch puts it back
    explicit = ["trainer.backend=megatron", "trainer.megatron.distributed_optimizer=true"]
    app = components.grpo(*explicit, f"run.dir={tmp_path / 'gpu'}", trainer_gpus=1)
    assert [role.resource.gpu for role in app.roles] == [0, 1]
    assert (tmp_path / "gpu" / "config.yaml").exists()
    with pytest.raises(ConfigError, match="float64"):
        components.grpo(*explicit, "model.dtype=float64", f"run.dir={tmp_path / 'f64'}", trainer_gpus=1)
    assert not (tmp_path / "f64" / "config.yaml").exists()


@needs_extra("megatron", "megatron.core")
def test_an_explicit_true_with_float64_stops_the_trainer_before_it_builds_anything(monkeypatch):
    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.megatron import trainer as megatron_trainer

    built = []  # Megatron's process groups are the first thing the trainer builds
    monkeypatch.setattr(megatron_trainer, "init_parallel_state", lambda **kwargs: built.append(kwargs) or False)
    cfg = TrainerConfig(backend=TrainerBackend.megatron, megatron=MegatronConfig(distributed_optimizer=True))
    with pytest.raises(ValueError, match="float64"):
        trainer_class(TrainerBackend.megatron)(
            model=load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer())), cfg=cfg,
            grpo=GRPOConfig(), temperature=1.0, pad_id=0, multi_step=False, process_group_active=False,
            old_logprobs=OldLogprobSource.trainer)
    assert not built


@needs_extra("megatron", "megatron.core")
@pytest.mark.parametrize("distributed", [True, False])
def test_the_megatron_configs_carry_the_resolved_key(distributed):
    from rolloutpipe.trainer.megatron.optimizer import megatron_optimizer_configs

    cfg = TrainerConfig(backend=TrainerBackend.megatron, lr=3e-6, max_grad_norm=0.5)
    ddp, optimizer = megatron_optimizer_configs(cfg, dtype=torch.bfloat16, distributed=distributed)
    assert ddp.use_distributed_optimizer is distributed
    assert optimizer.use_distributed_optimizer is distributed
    # the batch's one reduce runs in finalize_model_grads: nothing may start during a micro-batch's backward
    assert not ddp.overlap_grad_reduce and not ddp.overlap_param_gather
    assert ddp.grad_reduce_in_fp32 and optimizer.bf16 and optimizer.params_dtype is torch.bfloat16
    assert (optimizer.lr, optimizer.clip_grad, optimizer.optimizer) == (3e-6, 0.5, "adam")


class FakeDistributedOptimizer:
    """Megatron's DistributedOptimizer as the checkpoint sees it: one gradient buffer, gathered whole on rank 0."""

    def __init__(self, numel: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gbuf_ranges = [{BUFFER_KEY: [{"param_map": {}}]}]
        self.world = {name: torch.randn(numel, generator=gen) for name in ("param", "exp_avg", "exp_avg_sq")}
        self.hyper = {"optimizer": {"param_groups": [{"lr": 1e-3 * (seed + 1), "betas": (0.9, 0.99), "step": seed,
                                                      "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
                                                      "is_decoupled_lr": False}]}}
        self.chained_optimizers = [self]

    def get_parameter_state_dp_zero(self) -> dict:
        return {"buckets_coalesced": True, 0: {BUFFER_KEY: {**self.world, "numel_unpadded": 16}}}

    def state_dict(self) -> dict:
        return self.hyper

    def load_state_dict(self, state: dict) -> None:
        self.hyper = state

    def load_parameter_state_from_dp_zero(self, state: dict) -> None:
        assert state[0][BUFFER_KEY]["numel_unpadded"] == 16
        self.world = {k: v for k, v in state[0][BUFFER_KEY].items() if k != "numel_unpadded"}


def replicated(adam: torch.optim.Optimizer) -> ReplicatedState:
    """Megatron's float32 replicated optimizer as the checkpoint sees it: one chained optimizer with torch's state."""
    return ReplicatedState(SimpleNamespace(chained_optimizers=[adam]))


def written(tmp_path, optimizer) -> object:
    """``optimizer``'s state through trainer rank 0's restore point into a checkpoint on disk, as a run writes it."""
    tokenizer = build_tiny_tokenizer()
    point = RestorePoint(run_dir=tmp_path, tokenizer=tokenizer, config_yaml="", keep_last=2, on_disk=-1)
    point.capture(0, model=load_model(ModelConfig(), len(tokenizer)), optimizer=optimizer, source_state={})
    point.write()
    return latest_checkpoint(tmp_path)


def test_resuming_on_another_layout_or_optimizer_is_refused_not_misread(tmp_path):
    saved = FakeDistributedOptimizer(16, seed=0)
    checkpoint = written(tmp_path, DistributedParameterState(saved, data_parallel_size=2, tensor_parallel_size=1))
    for dp, tp in ((4, 1), (1, 2)):
        resumed = FakeDistributedOptimizer(16, seed=1)
        with pytest.raises(ValueError, match=f"data-parallel size 2 and tensor-parallel size 1; this run has {dp} "
                                             f"and {tp}. Resume with the same trainer.num_ranks"):
            load_optimizer(DistributedParameterState(resumed, data_parallel_size=dp, tensor_parallel_size=tp),
                           checkpoint)
        assert resumed.hyper["optimizer"]["param_groups"][0]["step"] == 1  # untouched
    with pytest.raises(ValueError, match="written with trainer.megatron.distributed_optimizer=true.*set "
                                         "trainer.megatron.distributed_optimizer=true to resume"):
        load_optimizer(replicated(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])), checkpoint)


def test_a_replicated_checkpoint_is_refused_by_the_distributed_optimizer(tmp_path):
    param = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    adam.step()
    checkpoint = written(tmp_path, replicated(adam))
    with pytest.raises(ValueError, match="set trainer.megatron.distributed_optimizer=false to resume"):
        load_optimizer(DistributedParameterState(FakeDistributedOptimizer(16, seed=1), data_parallel_size=1,
                                                 tensor_parallel_size=1), checkpoint)
    load_optimizer(replicated(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])), checkpoint)


@pytest.mark.parametrize("cuda,kernels,fused", [(True, True, True), (True, False, False), (False, True, False)])
def test_megatrons_fused_softmax_only_where_its_kernels_import(monkeypatch, cuda, kernels, fused):
    """Asked for without Apex's compiled kernels, Megatron imports them for attention of up to 4096 keys and stops;
    the H200 image of issue 43 has none."""
    import importlib.util

    from rolloutpipe.trainer.megatron.model import fused_softmax_kernels

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: (object() if kernels else None) if name.endswith("softmax_cuda") else find_spec(name))
    assert fused_softmax_kernels() is fused
