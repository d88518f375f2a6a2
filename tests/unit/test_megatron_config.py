"""``trainer.megatron.distributed_optimizer`` on the CPU: how null resolves, where an explicit true that cannot run
is refused, the Megatron configs it turns into, and the distributed optimizer's state through a real checkpoint
(a fake stands for Megatron's optimizer, which needs CUDA; tools/gpu_check.py runs the real one)."""

from __future__ import annotations

import pytest
import torch

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.control.checkpoint import latest_checkpoint, load_optimizer
from rolloutpipe.launch.preflight import check_model
from rolloutpipe.model import ModelConfig, build_tiny_tokenizer, load_model
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


def test_an_explicit_true_without_cuda_is_refused_with_the_reason_and_the_key():
    assert resolve_distributed_optimizer(True, cuda=True, dtype="bfloat16") is True
    with pytest.raises(ValueError, match=r"needs a GPU.*no CUDA.*distributed_optimizer=false"):
        resolve_distributed_optimizer(True, cuda=False, dtype="float32")
    with pytest.raises(ValueError, match=r"float64.*model.dtype=float32"):
        resolve_distributed_optimizer(True, cuda=True, dtype="float64")


def megatron_run(**launch) -> object:
    return load_config({"trainer": {"backend": "megatron", "megatron": {"distributed_optimizer": True}}, **launch})


def test_an_explicit_true_stops_a_cpu_launch_at_preflight(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.megatron.distributed_optimizer=true needs a GPU"):
        check_model(megatron_run())  # the local launcher: the trainer ranks run here, on no GPU
    check_model(megatron_run(launcher={"kind": "slurm"}))  # the trainer ranks run on the GPU nodes
    with pytest.raises(ConfigError, match="float64"):
        check_model(megatron_run(launcher={"kind": "slurm"}, model={"dtype": "float64"}))


@needs_extra("slurm", "torchx")
def test_the_torchx_component_judges_cuda_by_the_trainer_gpus_it_asks_for_not_this_machine(monkeypatch, tmp_path):
    """A CPU login node submitting GPU trainer replicas (trainer_gpus > 0) keeps an explicit true; without trainer
    GPUs it is refused before anything is queued, and float64 is refused either way."""
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("torchx_components", REPO / "launchers" / "components.py")
    components = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(components)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine: no CUDA
    monkeypatch.setenv("RP_RUN_SECRET", "")  # grpo() sets it in this process; monkeypatch puts it back
    explicit = ["trainer.backend=megatron", "trainer.megatron.distributed_optimizer=true"]
    app = components.grpo(*explicit, f"run.dir={tmp_path / 'gpu'}", trainer_gpus=1)
    assert [role.resource.gpu for role in app.roles] == [0, 1]
    assert (tmp_path / "gpu" / "config.yaml").exists()
    with pytest.raises(ConfigError, match="distributed_optimizer=true needs a GPU"):
        components.grpo(*explicit, f"run.dir={tmp_path / 'cpu'}", trainer_gpus=0)
    with pytest.raises(ConfigError, match="float64"):
        components.grpo(*explicit, "model.dtype=float64", f"run.dir={tmp_path / 'f64'}", trainer_gpus=1)
    assert not (tmp_path / "cpu" / "config.yaml").exists() and not (tmp_path / "f64" / "config.yaml").exists()


@needs_extra("megatron", "megatron.core")
def test_an_explicit_true_stops_the_trainer_before_it_builds_anything(monkeypatch):
    from rolloutpipe.trainer.backend import trainer_class
    from rolloutpipe.trainer.megatron import trainer as megatron_trainer

    built = []  # Megatron's process groups are the first thing the trainer builds
    monkeypatch.setattr(megatron_trainer, "init_parallel_state", lambda **kwargs: built.append(kwargs) or False)
    cfg = TrainerConfig(backend=TrainerBackend.megatron, megatron=MegatronConfig(distributed_optimizer=True))
    with pytest.raises(ValueError, match="needs a GPU"):
        trainer_class(TrainerBackend.megatron)(
            model=load_model(ModelConfig(), len(build_tiny_tokenizer())), cfg=cfg, grpo=GRPOConfig(),
            temperature=1.0, pad_id=0, multi_step=False, process_group_active=False,
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


def written(tmp_path, optimizer) -> object:
    """``optimizer``'s state through trainer rank 0's restore point into a checkpoint on disk, as a run writes it."""
    tokenizer = build_tiny_tokenizer()
    point = RestorePoint(run_dir=tmp_path, tokenizer=tokenizer, config_yaml="", keep_last=2, on_disk=-1)
    point.capture(0, model=load_model(ModelConfig(), len(tokenizer)), optimizer=optimizer, source_state={})
    point.write()
    return latest_checkpoint(tmp_path)


def test_the_distributed_optimizer_state_survives_a_checkpoint(tmp_path):
    saved = FakeDistributedOptimizer(16, seed=0)
    checkpoint = written(tmp_path, DistributedParameterState(saved, data_parallel_size=2, tensor_parallel_size=1))
    resumed = FakeDistributedOptimizer(16, seed=1)
    load_optimizer(DistributedParameterState(resumed, data_parallel_size=2, tensor_parallel_size=1), checkpoint)
    assert all(torch.equal(resumed.world[k], saved.world[k]) for k in saved.world)
    group, = resumed.hyper["optimizer"]["param_groups"]
    assert group == {**saved.hyper["optimizer"]["param_groups"][0], "betas": [0.9, 0.99]}  # JSON keeps lists


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
        load_optimizer(ReplicatedState(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])), checkpoint)


def test_a_replicated_checkpoint_is_refused_by_the_distributed_optimizer(tmp_path):
    param = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    adam.step()
    checkpoint = written(tmp_path, ReplicatedState(adam))
    with pytest.raises(ValueError, match="set trainer.megatron.distributed_optimizer=false to resume"):
        load_optimizer(DistributedParameterState(FakeDistributedOptimizer(16, seed=1), data_parallel_size=1,
                                                 tensor_parallel_size=1), checkpoint)
    load_optimizer(ReplicatedState(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])), checkpoint)
