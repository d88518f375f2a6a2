"""``trainer.megatron.distributed_optimizer``: how null resolves, where an explicit true is refused (float64), the
Megatron configs it turns into, and which checkpoints its state refuses (a fake stands for Megatron's optimizer there:
the refusals come before Megatron is called; tests/unit/test_megatron_checkpoint.py runs the real optimizers through
a checkpoint)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rolloutpipe.config import ConfigError, load_config
from rolloutpipe.control.checkpoint import Shard, ShardedState, latest_checkpoint, load_optimizer, optimizer_groups
from rolloutpipe.launch.preflight import check_model
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.config import GRPOConfig, MegatronConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.megatron.optimizer import (
    FORMAT,
    DistributedShards,
    ReplicatedState,
    resolve_distributed_optimizer,
)
from rolloutpipe.trainer.restore import RestorePoint
from tests.conftest import needs_extra


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
    # the batch's one reduce runs in finalize_model_grads: nothing may start during a micro-batch's backward (the
    # distributed optimizer's DDP is built with overlap_grad_reduce for its buckets, then switched off: below)
    assert ddp.overlap_grad_reduce is distributed and not ddp.overlap_param_gather
    assert ddp.grad_reduce_in_fp32 and optimizer.bf16 and optimizer.params_dtype is torch.bfloat16
    assert (optimizer.lr, optimizer.clip_grad, optimizer.optimizer) == (3e-6, 0.5, "adam")


@needs_extra("megatron", "megatron.core")
def test_the_distributed_optimizers_ddp_has_buckets_of_the_size_asked_and_reduces_only_when_the_batch_is_done():
    """trainer.megatron.ddp_bucket_size: Megatron's DDP makes buckets only with overlap_grad_reduce, which the trainer
    switches off once DDP is built (Megatron reads it at every backward and reduce)."""
    from tests.unit.test_exact_sum import trainer as tiny_trainer

    trainer = tiny_trainer(DType.float32, exact=False, backend=TrainerBackend.megatron,
                           megatron=MegatronConfig(distributed_optimizer=True, ddp_bucket_size=4000))
    try:
        num_params = sum(p.numel() for p in trainer.gpt.parameters())
        assert len(trainer.ddp.bucket_groups) >= num_params // 8000
        assert not trainer.ddp.ddp_config.overlap_grad_reduce
        assert all(not group.ddp_config.overlap_grad_reduce for group in trainer.ddp.bucket_groups)
    finally:
        trainer.close()


def test_a_ddp_bucket_size_below_one_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer.megatron.ddp_bucket_size=0 must be >= 1"):
        TrainerConfig(backend=TrainerBackend.megatron, megatron=MegatronConfig(ddp_bucket_size=0))


class FakeDistributedOptimizer:
    """Megatron's DistributedOptimizer as far as a refused checkpoint reaches: its hyper-parameters."""

    def __init__(self, seed: int) -> None:
        self.hyper = {"optimizer": {"param_groups": [{"lr": 1e-3 * (seed + 1), "step": seed}]}}
        self.chained_optimizers = [self]

    def state_dict(self) -> dict:
        return self.hyper


def distributed(seed: int, *, tensor_parallel_size: int = 1) -> DistributedShards:
    return DistributedShards(FakeDistributedOptimizer(seed), params=[], tp_rank=0, data_parallel_size=2,
                             tensor_parallel_size=tensor_parallel_size)


def replicated(adam: torch.optim.Optimizer) -> ReplicatedState:
    """Megatron's float32 replicated optimizer as the checkpoint sees it: one chained optimizer with torch's state."""
    return ReplicatedState(SimpleNamespace(chained_optimizers=[adam]))


def written(tmp_path, optimizer, shards: dict | None = None) -> object:
    """``optimizer``'s state through trainer rank 0's restore point into a checkpoint on disk, as a run writes it
    (``shards``: rank 0's of a sharded one, on one rank)."""
    tokenizer = build_tiny_tokenizer()
    point = RestorePoint(run_dir=tmp_path, tokenizer=tokenizer, config_yaml="", keep_last=2, on_disk=-1)
    if shards is not None:
        point.capture_shards(0, shards)
    point.capture(0, model=load_model(ModelConfig(), len(tokenizer)), optimizer=optimizer, source_state={})
    point.write()
    return latest_checkpoint(tmp_path)


def test_resuming_on_another_tensor_parallel_size_or_optimizer_is_refused_not_misread(tmp_path):
    shards = {f"0.{name}": Shard(torch.ones(4), 0, 4) for name in ("param", "exp_avg", "exp_avg_sq")}
    checkpoint = written(tmp_path, distributed(seed=0), shards)
    assert checkpoint.sharded and optimizer_groups(checkpoint)[0]["format"] == FORMAT
    resumed = distributed(seed=1, tensor_parallel_size=2)
    refusal = "written at tensor-parallel size 1; this run has 2. Resume with the same trainer.megatron.tensor_parallel"
    with pytest.raises(ValueError, match=refusal), ShardedState(checkpoint.directory / "optimizer") as state:
        resumed.load_shards(state, optimizer_groups(checkpoint))
    assert resumed.megatron.hyper["optimizer"]["param_groups"][0]["step"] == 1  # untouched
    with pytest.raises(ValueError, match="written with trainer.megatron.distributed_optimizer=true.*set "
                                         "trainer.megatron.distributed_optimizer=true to resume"):
        load_optimizer(replicated(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])), checkpoint)


def test_a_replicated_or_gathered_checkpoint_is_refused_by_the_distributed_optimizer(tmp_path):
    param = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    adam.step()
    checkpoint = written(tmp_path / "replicated", replicated(adam))
    with pytest.raises(ValueError, match="set trainer.megatron.distributed_optimizer=false to resume"):
        load_optimizer(distributed(seed=1), checkpoint)
    load_optimizer(replicated(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])), checkpoint)
    # the one file gathered on rank 0 that earlier versions wrote: said, not misread
    gathered = {"state": {0: {"param": torch.zeros(4), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}},
                "param_groups": [{"format": FORMAT, "data_parallel_size": 2, "tensor_parallel_size": 1,
                                  "optimizers": []}]}
    checkpoint = written(tmp_path / "gathered", SimpleNamespace(state_dict=lambda: gathered))
    with pytest.raises(ValueError, match="earlier versions wrote; this version reads each rank's own shards"):
        load_optimizer(distributed(seed=1), checkpoint)


@pytest.mark.parametrize("cuda,kernels,fused", [(True, True, True), (True, False, False), (False, True, False)])
def test_megatrons_fused_softmax_only_where_its_kernels_import(monkeypatch, cuda, kernels, fused):
    """Asked for without Apex's compiled kernels, Megatron imports them for attention of up to 4096 keys and stops;
    the H200 image of issue 43 has none."""
    import importlib.util

    from rolloutpipe.trainer.megatron.model import fused_softmax_kernels

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: (
        (object() if kernels else None) if name.endswith("softmax_cuda") else find_spec(name)))
    assert fused_softmax_kernels() is fused
