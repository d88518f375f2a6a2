"""trainer.exact_accumulation (trainer/exact_sum.py) and bit-exact resume: the update as bits, whatever the order."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from rolloutpipe.control.checkpoint import latest_checkpoint, load_optimizer, save_checkpoint
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.backend import PolicyBackend, trainer_class
from rolloutpipe.trainer.config import GRPOConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.exact_sum import RANGE_BITS, ExactGradientSum, fraction_bits
from rolloutpipe.trainer.fsdp_backend import FSDPTrainer
from rolloutpipe.trainer.grpo_trainer import TrainSample
from rolloutpipe.trainer.torch_backend import PolicyTrainer
from tests.conftest import needs_extra


def micro_batch_gradients(count: int, *, seed: int = 0) -> list[torch.Tensor]:
    """float32 gradients spread over nine decades, so that float sums round differently in other orders."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(257, generator=g) * 10.0 ** torch.randint(-6, 3, (257,), generator=g) for _ in range(count)]


def exact_sum(grads: list[torch.Tensor], order: list[int], *, num_ranks: int = 1) -> torch.Tensor:
    """The sum over ``num_ranks`` ranks, micro-batch i on rank i % num_ranks in ``order``, reduced as integers."""
    param = torch.zeros(257, requires_grad=True)
    ranks = [ExactGradientSum([param], num_samples_per_batch=len(grads)) for _ in range(num_ranks)]
    for position, i in enumerate(order):
        param.grad = grads[i].clone()
        ranks[position % num_ranks].add()
        assert param.grad is None
    for rank in ranks:  # every rank all-reduces: each sees the integer sum of all
        rank.reduce(lambda flat: flat.copy_(sum(r._sums[0] for r in ranks)))
    return ranks[0].take(torch.float32, scale=1.0)[0]


def test_the_exact_sum_is_the_same_bits_in_any_order_and_rank_split_where_a_float_sum_is_not():
    grads = micro_batch_gradients(6)
    orders = [list(p) for p in itertools.islice(itertools.permutations(range(6)), 0, 720, 97)]
    results = {exact_sum(grads, order, num_ranks=ranks).numpy().tobytes()
               for order in orders for ranks in (1, 2, 3)}
    assert len(results) == 1
    float_sums = {sum((grads[i] for i in order), torch.zeros(257)).numpy().tobytes() for order in orders}
    assert len(float_sums) > 1, "the workload must be one where the float sum depends on the order"
    reference = sum((g.double() for g in grads), torch.zeros(257, dtype=torch.float64))
    grid = len(grads) * 2.0 ** -fraction_bits(len(grads))
    exact = exact_sum(grads, list(range(6))).double()
    assert ((exact - reference).abs() <= grid + reference.abs() * 2.0**-24).all()  # the grid, then float32's rounding


def test_a_micro_batch_gradient_out_of_range_or_not_finite_is_an_error_that_names_the_setting():
    param = torch.zeros(3, requires_grad=True)
    total = ExactGradientSum([param], num_samples_per_batch=8)
    for bad in (2.0**RANGE_BITS, float("nan"), float("inf")):
        param.grad = torch.tensor([1.0, bad, 0.0])
        with pytest.raises(FloatingPointError, match="trainer.exact_accumulation=false"):
            total.add()


def trainer(dtype: DType, *, exact: bool, backend: TrainerBackend = TrainerBackend.torch,
            max_grad_norm: float = 1.0) -> PolicyBackend:
    """A trainer of the tiny model alone; FSDP and Megatron on a world of one rank of their own (``close`` ends
    it)."""
    model = load_model(ModelConfig(dtype=dtype), len(build_tiny_tokenizer()))
    cls = trainer_class(backend)
    policy = cls(model=model, cfg=TrainerConfig(backend=backend, exact_accumulation=exact,
                                                max_grad_norm=max_grad_norm),
                 grpo=GRPOConfig(), temperature=1.0, pad_id=0, multi_step=False, process_group_active=False,
                 old_logprobs=OldLogprobSource.trainer)
    if exact:
        policy.sum_exactly(16)
    return policy


def groups(seed: int = 0) -> list[list[TrainSample]]:
    g = torch.Generator().manual_seed(seed)
    return [[TrainSample(prompt_ids=torch.randint(5, 30, (6,), generator=g).tolist(),
                         response_ids=torch.randint(5, 30, (int(torch.randint(1, 9, (1,), generator=g)),),
                                                    generator=g).tolist(),
                         engine_logprobs=[], advantage=float(torch.randn((), generator=g))) for _ in range(4)]
            for _ in range(4)]


def update(dtype: DType, order: list[int] | None, *, exact: bool, backend: TrainerBackend = TrainerBackend.torch,
           max_grad_norm: float = 1.0, as_bytes: bool = True) -> bytes | torch.Tensor:
    """The weights after one batch of ``groups()`` in ``order`` (None: no step), as bytes or flat float64. FSDP:
    its float32 master shards."""
    policy, batch = trainer(dtype, exact=exact, backend=backend, max_grad_norm=max_grad_norm), groups()
    try:
        if order is not None:
            for i in order:
                policy.forward_backward(batch[i], first_batch_of_step=True)
            policy.finish_batch()
        weights = ([p.to_local().detach() for p in policy.root.parameters()] if isinstance(policy, FSDPTrainer)
                   else list(policy.hf_state().values()))
        if as_bytes:
            return b"".join(v.view(torch.uint8).numpy().tobytes() for v in weights)
        return torch.cat([v.double().reshape(-1) for v in weights])
    finally:
        policy.close()


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
def test_exact_accumulation_makes_the_update_the_same_bits_in_any_group_order(dtype):
    orders = [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]]
    assert len({update(dtype, order, exact=True) for order in orders}) == 1
    assert len({update(dtype, order, exact=False) for order in orders}) > 1, "float accumulation must tell orders apart"


@pytest.mark.parametrize("backend,dtype", [
    (TrainerBackend.fsdp, DType.float32), (TrainerBackend.fsdp, DType.bfloat16),
    pytest.param(TrainerBackend.megatron, DType.float32, marks=needs_extra("megatron", "megatron.core")),
], ids=["fsdp-float32", "fsdp-bfloat16", "megatron-float32"])
def test_exact_accumulation_on_a_sharded_or_megatron_backend_makes_the_update_the_same_bits_in_any_group_order(
        backend, dtype):
    """FSDP2 on one rank (no reduce-scatter: the parameters' hooks round the gradients); Megatron on one rank (the
    gradients come from DDP's buffers, main_grad, and the sums go back there before finalize_model_grads; bfloat16
    needs CUDA there). Two ranks run in tests/multiprocess/test_pipeline.py. Clipped (max_grad_norm 1e-3), FSDP's
    norm is taken from whole gradients."""
    orders = [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]]
    for max_grad_norm in (1.0, 1e-3):
        exact = {update(dtype, order, exact=True, backend=backend, max_grad_norm=max_grad_norm) for order in orders}
        assert len(exact) == 1, f"max_grad_norm={max_grad_norm}"
        init, float_update, exact_update = (
            update(dtype, order, exact=summed_exactly, backend=backend, max_grad_norm=max_grad_norm, as_bytes=False)
            for order, summed_exactly in ((None, False), (orders[0], False), (orders[0], True)))
        assert (exact_update - float_update).norm() <= 1e-3 * (float_update - init).norm(), (
            "the exact update must be the float one up to rounding")
    if dtype is DType.float32:  # (bfloat16 gradients, 8 bits, add up exactly in FSDP's float32 shards here)
        floats = {update(dtype, order, exact=False, backend=backend) for order in orders}
        assert len(floats) > 1, "float accumulation must tell orders apart"


def test_a_bfloat16_torch_policy_resumes_from_its_float32_master_weights_to_the_same_bits(tmp_path):
    """A step, its checkpoint (the real writer and reader), a second step; a trainer resumed from the checkpoint
    takes the second step to the same bits. From the bfloat16 policy alone the master weights would be rounded and
    the second step would land elsewhere."""
    tokenizer, batch = build_tiny_tokenizer(), groups()
    first = trainer(DType.bfloat16, exact=False)
    first.forward_backward(batch[0], first_batch_of_step=True)
    first.finish_batch()
    save_checkpoint(run_dir=tmp_path, step=0, model=first.hf_model(), model_state=first.hf_state(),
                    tokenizer=tokenizer, optimizer_state=first.optimizer.state_dict(), source_state={},
                    config_yaml="", keep_last=2)
    first.forward_backward(batch[1], first_batch_of_step=True)
    first.finish_batch()
    expected = first.hf_state()

    checkpoint = latest_checkpoint(tmp_path)
    model = load_model(ModelConfig(path=str(checkpoint.directory), dtype=DType.bfloat16), len(tokenizer))
    resumed = PolicyTrainer(model=model, cfg=TrainerConfig(), grpo=GRPOConfig(), temperature=1.0, pad_id=0,
                            multi_step=False, process_group_active=False, old_logprobs=OldLogprobSource.trainer)
    load_optimizer(resumed.optimizer, checkpoint)
    resumed.forward_backward(batch[1], first_batch_of_step=True)
    resumed.finish_batch()
    again = resumed.hf_state()
    assert next(iter(again.values())).dtype == torch.bfloat16
    assert all(torch.equal(again[k], v) for k, v in expected.items())
    assert json.loads((checkpoint.directory / "state.json").read_text())["step"] == 0


def test_the_memory_plan_counts_the_int64_sum_and_micro_batches_of_one_group():
    from rolloutpipe.config import load_config
    from rolloutpipe.launch.memory_plan import ModelShape, micro_batch_rows, trainer_estimate

    shape = ModelShape(hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=4,
                       head_dim=64, vocab_size=32768, tied_embeddings=True)
    plans = {}
    for exact in (False, True):
        cfg = load_config({"micro_batch_size": 32, "n_samples_per_prompt": 8, "trainer": {"exact_accumulation": exact}})
        terms = trainer_estimate(cfg, shape, capacity_bytes=0).terms
        plans[exact] = (micro_batch_rows(cfg), {t.name: t.num_bytes for t in terms})
    assert (plans[False][0], plans[True][0]) == (32, 8)
    assert "exact gradient sum" not in plans[False][1]
    assert plans[True][1]["exact gradient sum"] == 8 * shape.num_params()
