"""The trainer's consume loop (trainer/batching.py) as pure logic: which samples each micro-batch holds, on which
rank, and when it is emitted, with micro_batch_size or a token budget. Handles arrive in random publish orders,
later batches' handles early; a sample is (group, index, tokens)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import pytest

from rolloutpipe.config import Config
from rolloutpipe.observe.metrics import RolloutStats, TrainStats, reduce_step
from rolloutpipe.trainer import batching
from rolloutpipe.trainer.batching import BatchConsumer, MicroBatch, OptimizerStep

NUM_BATCHES, GROUPS_PER_BATCH, GROUP_SIZE = 3, 4, 4


@dataclass
class Handle:
    group: int
    batch: int
    lengths: list[int]


def samples(handle: Handle) -> list[tuple[int, int, int]]:
    return [(handle.group, i, n) for i, n in enumerate(handle.lengths)]


def tokens(sample: tuple[int, int, int]) -> int:
    return sample[2]


def workload(seed: int, *, shortest: int = 3, longest: int = 30) -> list[Handle]:
    """A step's handles in a random publish order; group g is in batch g // GROUPS_PER_BATCH."""
    rng = random.Random(seed)
    handles = [Handle(group=g, batch=g // GROUPS_PER_BATCH,
                      lengths=[rng.randint(shortest, longest) for _ in range(GROUP_SIZE)])
               for g in range(NUM_BATCHES * GROUPS_PER_BATCH)]
    rng.shuffle(handles)
    return handles


def consume(handles: list[Handle], *, rank: int | None, world_size: int, budget: int = 0,
            micro_batch_size: int = 3) -> list[tuple[int, MicroBatch | OptimizerStep]]:
    """Every piece of work, with the number of handles that had arrived when it was emitted."""
    consumer = BatchConsumer(num_batches=NUM_BATCHES, groups_per_batch=GROUPS_PER_BATCH,
                             micro_batch_size=micro_batch_size, length=tokens, max_tokens_per_micro_batch=budget,
                             rank=rank, world_size=world_size)
    work = [(i + 1, w) for i, h in enumerate(handles) for w in consumer.arrive(h, samples)]
    assert consumer.done()
    return work


def micro_batches(work) -> list[MicroBatch]:
    return [w for _, w in work if isinstance(w, MicroBatch)]


SETTINGS = [(world, budget) for world in (1, 2, 3) for budget in (0, 40, 64, 100)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("world_size,budget", SETTINGS)
def test_every_sample_of_the_step_is_trained_exactly_once(seed, world_size, budget):
    handles = workload(seed)
    trained = [s for r in range(world_size) for m in micro_batches(consume(handles, rank=r, world_size=world_size,
                                                                           budget=budget)) for s in m.samples]
    assert sorted(trained) == sorted(s for h in handles for s in samples(h))
    every_rank = micro_batches(consume(handles, rank=None, world_size=world_size, budget=budget))
    assert sorted(s for m in every_rank for s in m.samples) == sorted(trained)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [40, 64, 100])
def test_token_micro_batches_stay_within_the_budget_unless_one_sample_exceeds_it(seed, budget):
    handles = workload(seed, longest=60)  # some samples alone exceed a budget of 40 or 64 (padded to 2 x 60)
    batches = micro_batches(consume(handles, rank=None, world_size=2, budget=budget))
    for m in batches:
        longest = max(tokens(s) for s in m.samples)
        assert m.num_padded_tokens == len(m.samples) * longest
        assert m.num_padded_tokens <= budget or len(m.samples) == 1, m
    assert any(len(m.samples) > 1 for m in batches), "the budget must pack several samples together"


def test_a_sample_over_the_budget_trains_alone_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(batching, "_warned_oversized", False)
    handles = [Handle(group=g, batch=g // GROUPS_PER_BATCH, lengths=[5, 50, 5, 5])
               for g in range(NUM_BATCHES * GROUPS_PER_BATCH)]
    with caplog.at_level(logging.WARNING, logger=batching.__name__):
        batches = micro_batches(consume(handles, rank=None, world_size=1, budget=20))
    assert [len(m.samples) for m in batches if m.num_padded_tokens > 20] == [1] * len(handles)
    assert [r.getMessage() for r in caplog.records] == [
        "a sample of 50 tokens (prompt + response) exceeds max_tokens_per_micro_batch=20; it is trained in a "
        "micro-batch of its own (said once; raise the budget if memory allows)."]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("world_size,budget", SETTINGS)
def test_micro_batches_never_mix_training_batches_and_precede_their_optimizer_step(seed, world_size, budget):
    work = consume(workload(seed), rank=None, world_size=world_size, budget=budget)
    steps = [w.batch for _, w in work if isinstance(w, OptimizerStep)]
    assert steps == list(range(NUM_BATCHES))
    batch_of_step = 0
    for _, w in work:
        if isinstance(w, OptimizerStep):
            batch_of_step += 1
            continue
        assert {s[0] // GROUPS_PER_BATCH for s in w.samples} == {w.batch} and w.batch == batch_of_step


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("world_size,budget", SETTINGS)
def test_groups_are_dealt_round_robin_in_arrival_order_whatever_the_packing(seed, world_size, budget):
    """Group i of a batch, in arrival order, is trained by rank i % world_size (and the one-rank consumers agree
    with the every-rank one)."""
    handles = workload(seed)
    arrival = {b: [h.group for h in handles if h.batch == b] for b in range(NUM_BATCHES)}
    expected = {g: order.index(g) % world_size for order in arrival.values() for g in order}
    every_rank = micro_batches(consume(handles, rank=None, world_size=world_size, budget=budget))
    assert {s[0]: m.rank for m in every_rank for s in m.samples} == expected
    for r in range(world_size):
        mine = micro_batches(consume(handles, rank=r, world_size=world_size, budget=budget))
        assert {m.rank for m in mine} <= {r}
        assert [m.samples for m in mine] == [m.samples for m in every_rank if m.rank == r]


def test_a_token_micro_batch_is_emitted_as_soon_as_no_sample_can_join_it():
    """Budget 40: two samples of 20 tokens fill a micro-batch (a third pads to >= 60), so it goes out with the
    group that completes it, not at the end of the batch; two rows of 13, with room for a third, wait for it."""
    handles = [Handle(group=0, batch=0, lengths=[20, 20, 13, 13]), Handle(group=1, batch=0, lengths=[13, 3, 3, 3]),
               *(Handle(group=g, batch=g // GROUPS_PER_BATCH, lengths=[3] * 4)
                 for g in range(2, NUM_BATCHES * GROUPS_PER_BATCH))]
    work = consume(handles, rank=0, world_size=1, budget=40)
    first = [(arrived, [s[2] for s in w.samples]) for arrived, w in work if isinstance(w, MicroBatch)][:2]
    assert first == [(1, [20, 20]), (2, [13, 13, 13])]


def test_fixed_micro_batches_cut_each_rank_s_samples_in_arrival_order():
    handles = workload(0)
    work = consume(handles, rank=None, world_size=1, budget=0, micro_batch_size=3)
    batch0 = [s for h in handles if h.batch == 0 for s in samples(h)]
    assert [m.samples for m in micro_batches(work) if m.batch == 0] == [batch0[i:i + 3] for i in range(0, 16, 3)]


def test_padding_ratio_is_padding_over_all_token_slots_of_the_step():
    handles = workload(1)
    batches = micro_batches(consume(handles, rank=None, world_size=2, budget=0, micro_batch_size=4))
    padding = sum(max(tokens(s) for s in m.samples) - tokens(s) for m in batches for s in m.samples)
    slots = sum(len(m.samples) * max(tokens(s) for s in m.samples) for m in batches)
    assert (sum(m.num_padding_tokens for m in batches), sum(m.num_padded_tokens for m in batches)) == (padding, slots)
    rollout = RolloutStats(step=0, policy_version=0, start_s=0.0, first_group_s=1.0, last_group_s=2.0,
                           weight_load_s=0.0, num_groups=1, num_samples=1, num_tokens=1, num_truncated=0,
                           num_reward_errors=0, num_filtered_groups=0, num_timeout_dropped_groups=0,
                           num_returned_prompts=0, num_aborted_samples=0, reward_mean=0.0, reward_std=0.0,
                           response_len_mean=1.0, policy_lag=0)
    train = TrainStats(step=0, end_s=3.0, compute_s=1.0, tail_compute_s=0.5, wait_s=0.0, first_forward_s=1.0,
                       num_padded_tokens=slots, num_padding_tokens=padding)
    record = reduce_step(rollout, train, mean_compute_s=1.0, mean_tail_compute_s=0.5, lr=1e-3)
    assert record["perf/padding_ratio"] == padding / slots > 0


def test_a_negative_token_budget_is_refused_with_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=-1 must be >= 0: 0 for micro-batches of "
                                         r"micro_batch_size samples"):
        Config(max_tokens_per_micro_batch=-1)
