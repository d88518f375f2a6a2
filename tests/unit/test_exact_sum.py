"""trainer.exact_accumulation (trainer/exact_sum.py) and bit-exact resume: the update as bits, whatever the order."""

from __future__ import annotations

import json
import math
import random
import threading

import pytest
import torch

from rolloutpipe.control.checkpoint import latest_checkpoint, load_optimizer, save_checkpoint
from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.trainer.backend import PolicyBackend, trainer_class
from rolloutpipe.trainer.config import GRPOConfig, MegatronConfig, OldLogprobSource, TrainerBackend, TrainerConfig
from rolloutpipe.trainer.exact_sum import BYTES_PER_ELEMENT, ExactGradientSum
from rolloutpipe.trainer.fsdp_backend import FSDPTrainer
from rolloutpipe.trainer.grpo_trainer import TrainSample
from rolloutpipe.trainer.torch_backend import PolicyTrainer
from tests.conftest import needs_extra

NUM_MICRO_BATCHES = 7
SPANS = {  # log2 of |value|: each column's micro-batch values lie in one span (the spread one element may have)
    torch.float32: [(-40, 27), (-149, -100), (100, 128)],  # 1e-12..1e8, float32's subnormals, up to its largest
    torch.bfloat16: [(-40, 27), (-133, -100), (100, 128)],
    torch.float16: [(-24, 16)],  # its subnormals to its largest
}
ROUNDING_COLUMNS = [  # float64 ties and near-ties of the rounding from the integer sum: (values, then zeros)
    [1.0, 2.0**-53], [1.0, 2.0**-53, 2.0**-80], [1.0 + 2.0**-23, 2.0**-52, 2.0**-53], [-1.0, -(2.0**-53), -(2.0**-80)],
    [2.0**100, -(2.0**100), 2.0**-30], [3.0e38, 1.0e9], [-(2.0**-149), 2.0**-149, 2.0**-149],
]


def micro_batch_gradients(dtype: torch.dtype, *, columns: int = 200, seed: int = 0) -> list[torch.Tensor]:
    """NUM_MICRO_BATCHES gradients in ``dtype``: for each span of SPANS, ``columns`` elements whose values have random
    signs and magnitudes across the span (float sums of them round differently in other orders); then (float32)
    ROUNDING_COLUMNS."""
    g = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(NUM_MICRO_BATCHES):
        parts = []
        for lo, hi in SPANS[dtype]:
            exponent = torch.randint(lo, hi, (columns,), generator=g).double()
            mantissa = 1.0 + torch.rand(columns, generator=g, dtype=torch.float64)
            sign = torch.randint(0, 2, (columns,), generator=g).double() * 2 - 1
            parts.append((sign * mantissa * 2.0**exponent).to(dtype))  # (rounded: within the dtype's range)
        grads.append(torch.cat(parts))
    if dtype is torch.float32:
        rows = [[column[i] if i < len(column) else 0.0 for column in ROUNDING_COLUMNS]
                for i in range(NUM_MICRO_BATCHES)]
        grads = [torch.cat([grad, torch.tensor(row, dtype=dtype)]) for grad, row in zip(grads, rows)]
    return grads


def reference(grads: list[torch.Tensor]) -> torch.Tensor:
    """The exact sum of each element rounded once to float64 (math.fsum)."""
    columns = torch.stack(grads).double().T.tolist()
    return torch.tensor([math.fsum(column) for column in columns], dtype=torch.float64)


class SimulatedRanks:
    """``num_ranks`` ranks as threads, and an all-reduce among them (sum or max, what dist.all_reduce computes)."""

    def __init__(self, num_ranks: int) -> None:
        self.barrier = threading.Barrier(num_ranks)
        self.inputs: list[torch.Tensor | None] = [None] * num_ranks

    def all_reduce(self, rank: int):
        def reduce(flat: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> None:
            self.inputs[rank] = flat.clone()
            self.barrier.wait()
            stacked = torch.stack(self.inputs)
            result = stacked.sum(0) if op == torch.distributed.ReduceOp.SUM else stacked.amax(0)
            self.barrier.wait()
            flat.copy_(result)

        return reduce


def exact_sums(grads: list[torch.Tensor], order: list[int], *, num_ranks: int = 1,
               dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, int]:
    """The sum (in ``dtype``) and the count of elements that lost bits, over ``num_ranks`` ranks: micro-batch
    ``order[k]`` on rank k % num_ranks, reduced as the trainer reduces them (``SimulatedRanks``)."""
    params = [torch.zeros(grads[0].shape, dtype=grads[0].dtype, requires_grad=True) for _ in range(num_ranks)]
    sums = [ExactGradientSum([p], num_samples_per_batch=len(grads)) for p in params]
    for k, i in enumerate(order):
        params[k % num_ranks].grad = grads[i].clone()
        sums[k % num_ranks].add()
        assert params[k % num_ranks].grad is None
    if num_ranks > 1:
        ranks = SimulatedRanks(num_ranks)
        threads = [threading.Thread(target=s.reduce, args=(ranks.all_reduce(r),)) for r, s in enumerate(sums)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    taken = [s.take(dtype, scale=1.0)[0] for s in sums]
    assert all(torch.equal(t.view(torch.uint8), taken[0].view(torch.uint8)) for t in taken), "every rank alike"
    assert len({s.num_unrepresented for s in sums}) == 1
    return taken[0], sums[0].num_unrepresented


def shuffled(count: int, seed: int) -> list[int]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_exact_sum_is_the_exact_sum_rounded_once_in_any_order_and_rank_split(dtype):
    """100 orders x 1, 2 and 3 ranks: one set of bits, the exact sum rounded once to float64 (then to ``dtype``),
    from float32's subnormals to its largest values, where a float sum depends on the order."""
    grads = micro_batch_gradients(dtype)
    orders = [shuffled(NUM_MICRO_BATCHES, seed) for seed in range(100)]
    results = set()
    for k, order in enumerate(orders):
        total, num_unrepresented = exact_sums(grads, order, num_ranks=1 + k % 3)
        assert num_unrepresented == 0
        results.add(total.numpy().tobytes())
    assert len(results) == 1
    expected = reference(grads)
    assert torch.equal(total, expected)
    in_dtype, _ = exact_sums(grads, orders[0], num_ranks=2, dtype=dtype)
    assert torch.equal(in_dtype.view(torch.uint8), expected.to(dtype).view(torch.uint8))
    float_sums = {sum((grads[i].float() for i in order), torch.zeros_like(grads[0], dtype=torch.float32))
                  .numpy().tobytes() for order in orders[:10]}
    assert len(float_sums) > 1, "the workload must be one where the float sum depends on the order"


def test_values_far_below_their_elements_largest_are_dropped_alike_in_any_order_and_counted():
    """1e38 and 1e-40 in one element: the window keeps 110+ bits below the top bin's, so the 1e-40 is dropped; the
    same bits in any order and rank split, and the element counted, alone."""
    grads = micro_batch_gradients(torch.float32, columns=20)
    for grad in grads:
        grad[:2] = 0.0
    grads[0][0], grads[3][0], grads[4][0] = 1e38, -1e38, 1e-40  # the exact sum is the 1e-40, which is dropped
    grads[5][1], grads[6][1] = 3e38, 1e-3  # the 1e-3 loses its lowest bits (below 2^-31, at 7 micro-batches)
    results = set()
    for k in range(30):
        total, num_unrepresented = exact_sums(grads, shuffled(NUM_MICRO_BATCHES, k), num_ranks=1 + k % 3)
        results.add(total.numpy().tobytes())
        assert num_unrepresented == 2
    assert len(results) == 1
    expected = reference(grads)
    assert torch.equal(total[1:], expected[1:]), "(element 1: what is dropped is below float64's rounding here)"
    assert total[0] == 0.0 and expected[0] != 0.0


def test_a_huge_finite_gradient_is_summed_not_an_error():
    """What the fixed-point grid refused (|g| >= 2^24), and what a resume would hit again."""
    grads = [torch.tensor([1e9, 3e38, -3e38, 1e-40]), torch.tensor([2e9, 0.0, 1e38, 1e-45])]
    total, num_unrepresented = exact_sums(grads, [0, 1], dtype=torch.float32)
    assert num_unrepresented == 0
    assert torch.equal(total, reference(grads).float())


def test_a_parameter_summed_by_chunks_gives_the_bits_of_one_chunk(monkeypatch):
    """``fold`` and ``take`` bound their temporaries by working on CHUNK_ELEMENTS at a time: ragged chunks of 7."""
    grads = [grad[:64].view(8, 8) for grad in micro_batch_gradients(torch.float32, columns=20)]
    whole, _ = exact_sums(grads, list(range(NUM_MICRO_BATCHES)), num_ranks=2)
    monkeypatch.setattr("rolloutpipe.trainer.exact_sum.CHUNK_ELEMENTS", 7)
    chunked, _ = exact_sums(grads, list(range(NUM_MICRO_BATCHES)), num_ranks=2)
    assert torch.equal(whole, chunked) and torch.equal(whole.view(-1), reference([g.view(-1) for g in grads]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_gradient_that_is_not_finite_is_an_error_that_names_the_batch_and_micro_batch(bad):
    param = torch.zeros(3, requires_grad=True)
    total = ExactGradientSum([param], num_samples_per_batch=8)
    param.grad = torch.ones(3)
    total.add()
    total.take(torch.float32, scale=1.0)
    for _ in range(2):
        param.grad = torch.ones(3)
        total.add()
    param.grad = torch.tensor([1.0, bad, 0.0])
    with pytest.raises(FloatingPointError, match="micro-batch 2 of training batch 1 .* 1 of the 3 elements"):
        total.add()


def trainer(dtype: DType, *, exact: bool, backend: TrainerBackend = TrainerBackend.torch,
            max_grad_norm: float = 1.0, megatron: MegatronConfig | None = None) -> PolicyBackend:
    """A trainer of the tiny model alone; FSDP and Megatron on a world of one rank of their own (``close`` ends
    it)."""
    model = load_model(ModelConfig(dtype=dtype), len(build_tiny_tokenizer()))
    cls = trainer_class(backend)
    policy = cls(model=model, cfg=TrainerConfig(backend=backend, exact_accumulation=exact,
                                                max_grad_norm=max_grad_norm, megatron=megatron or MegatronConfig()),
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


def test_the_memory_plan_counts_the_exact_sums_bytes_and_micro_batches_of_one_group():
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
    assert plans[True][1]["exact gradient sum"] == BYTES_PER_ELEMENT * shape.num_params()
