"""The whole job as real processes: rollout and trainer node groups talking through a real TCPStore."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.observe.metrics import read_spans

from .conftest import DENSE_REWARD, SMALL, read_metrics, read_samples, run_job

pytestmark = pytest.mark.multiprocess

# float64 on both node groups: the only difference between schedules is the order of floating-point
# additions (micro-batch composition, rank split, all-reduce), ~1e-16 relative per operation. The per-step loss
# and gradient norm (before the optimizer, clipping off) then agree to ~1e-13, while a real difference in the
# update (another sample, another normaliser, stale log-probs) moves them by far more than 1e-9; so do the
# weights after Adam (~lr = 1e-3 for a real difference).
PARITY = [*SMALL, "reward.name=letter_fraction_jittered", "reward.import_modules=[tests.fixtures.dense_rewards]",
          "model.dtype=float64", "micro_batch_size=3", "run.save_samples=true", "rollout.concurrency=6",
          "rollout.num_engines=2", "reward.num_workers=8", "trainer.max_grad_norm=1e9", "rollout_max_response_len=12"]
"""Two engines, eight reward workers and seeded reward delays: each mode's groups complete in another order;
responses of up to 12 tokens, so some end early and micro-batches differ in their token counts."""


def final_weights(run_dir):
    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


def publish_order(run_dir) -> list[tuple[int, int]]:
    return [(s.step, s.attrs["group"]) for s in sorted(read_spans(run_dir), key=lambda s: s.start_s)
            if s.name == "dispatch/publish"]


# Two optimizer steps per rollout (batches of 2 groups), with dynamic sampling dropping about a quarter of
# the groups (reward constant for labels starting with 'a') and replacing them; FGD admission.
MULTI_STEP_FILTERED = ["global_batch_size=8", "reward.name=sometimes_flat", "rollout.filter_zero_variance=true",
                       "rollout.over_sampling_groups=1", "rollout.admission=fgd"]


@pytest.mark.parametrize("num_ranks,extra", [(1, []), (2, []), (2, ["grpo.loss_agg=seq_mean_token_mean"]),
                                             (1, MULTI_STEP_FILTERED)],
                         ids=["1-rank", "2-ranks", "2-ranks-seq-mean", "2-optimizer-steps-per-rollout-filtered"])
def test_pipelined_update_equals_synchronous_update(job_dir, num_ranks, extra):
    runs = {}
    for mode, jitter in (("sync", "1"), ("cgp", "2")):
        run_dir = job_dir(f"{mode}-{num_ranks}")
        result = run_job(run_dir, *PARITY, f"pipeline.mode={mode}", f"trainer.num_ranks={num_ranks}", *extra,
                         environ={"RP_TEST_REWARD_JITTER": jitter})
        assert result.returncode == 0, result.stderr[-3000:]
        runs[mode] = run_dir

    sync_samples, cgp_samples = read_samples(runs["sync"]), read_samples(runs["cgp"])
    assert len(sync_samples) == 2 * 4 * 4
    assert [(s["id"], s["batch"], s["response_ids"], s["reward"]) for s in sync_samples] == [
        (s["id"], s["batch"], s["response_ids"], s["reward"]) for s in cgp_samples
    ], "same seed must give the same samples in the same batches in both modes"
    if not extra:  # (FGD and filtering fix much of the order; the plain runs must show a different one)
        assert publish_order(runs["sync"]) != publish_order(runs["cgp"]), "the groups must arrive in other orders"
    if MULTI_STEP_FILTERED == extra:
        metrics = read_metrics(runs["cgp"])
        assert sum(m["rollout/num_filtered_groups"] for m in metrics) > 0, "the workload must exercise filtering"
        assert {s["batch"] for s in cgp_samples} == {0, 1}

    sync_m, cgp_m = read_metrics(runs["sync"]), read_metrics(runs["cgp"])
    assert [m["train/num_tokens"] for m in sync_m] == [m["train/num_tokens"] for m in cgp_m]
    for key in ("train/loss", "train/grad_norm"):
        assert [m[key] for m in cgp_m] == pytest.approx([m[key] for m in sync_m], rel=1e-9, abs=1e-12), key
    sync_w, cgp_w = final_weights(runs["sync"]), final_weights(runs["cgp"])
    difference = max((sync_w[k] - cgp_w[k]).abs().max().item() for k in sync_w)
    assert difference < 1e-9, f"sync and cgp parameters differ by {difference}"
    init = load_model(ModelConfig(dtype=DType.float64), len(build_tiny_tokenizer())).state_dict()
    moved = max((sync_w[k] - init[k]).abs().max().item() for k in sync_w)
    assert moved > 1e-5, "training must have changed the weights"
    assert [m["step"] for m in cgp_m] == [0, 1]


@pytest.mark.parametrize("mode", ["sync", "cgp"])
def test_bfloat16_trains_on_exactly_the_response_tokens_of_its_samples(job_dir, mode):
    """Micro-batches of 16 responses of up to 40 tokens: counts above 256, where bfloat16 steps by 2 or 4, so a
    count summed in the model's dtype would be rounded (and differ with the micro-batch split)."""
    run_dir = job_dir(mode)
    result = run_job(run_dir, *SMALL, *DENSE_REWARD, "model.dtype=bfloat16", "rollout_max_response_len=40",
                     "micro_batch_size=16", "run.save_samples=true", f"pipeline.mode={mode}")
    assert result.returncode == 0, result.stderr[-3000:]
    lengths: dict[int, int] = {}
    for s in read_samples(run_dir):
        step = int(s["id"].split("/")[0].removeprefix("step="))
        lengths[step] = lengths.get(step, 0) + len(s["response_ids"])
    assert [m["train/num_tokens"] for m in read_metrics(run_dir)] == [lengths[0], lengths[1]]
    assert min(lengths.values()) > 256


def test_clip_fraction_counts_the_clipped_tokens_of_every_rank(job_dir):
    """Two optimizer steps per rollout at a high learning rate, so the second batch's ratios leave the clip range;
    the same samples on 1 and 2 data-parallel ranks must report the same fraction (float64)."""
    fractions = {}
    for num_ranks in (1, 2):
        run_dir = job_dir(f"{num_ranks}-ranks")
        result = run_job(run_dir, *SMALL, *DENSE_REWARD, "model.dtype=float64", "global_batch_size=8",
                         "trainer.lr=0.05", f"trainer.num_ranks={num_ranks}")
        assert result.returncode == 0, result.stderr[-3000:]
        fractions[num_ranks] = [m["train/clip_fraction"] for m in read_metrics(run_dir)]
    assert min(fractions[1]) > 0.05, "the workload must clip"
    assert fractions[2] == pytest.approx(fractions[1], abs=1e-12)


def test_cgp_trains_before_the_rollout_ends_and_sync_does_not(job_dir):
    """Sync trains only after the last group, by construction (the dispatcher holds every group until then). For
    cgp the rollout is slow by construction, not by luck: one reward worker and rewards that take 0.1 s, so the
    step's six groups complete at least 0.4 s apart and its last about 2 s after its first, while the trainer needs
    milliseconds to start on a group; no machine load reverses that."""
    workload = [*SMALL, "rollout_batch_size=6", "global_batch_size=24", "rollout.concurrency=4",
                "rollout_max_response_len=12", "reward.name=letter_fraction_slow",
                "reward.import_modules=[tests.fixtures.dense_rewards]", "reward.num_workers=1"]
    for mode, overlaps in (("cgp", True), ("sync", False)):
        run_dir = job_dir(mode)
        result = run_job(run_dir, *workload, f"pipeline.mode={mode}")
        assert result.returncode == 0, result.stderr[-3000:]
        spans = read_spans(run_dir)
        for step in (0, 1):
            first_fb = min(s.start_s for s in spans if s.name == "train/forward_backward" and s.step == step)
            last_group = max(s.end_s for s in spans if s.name == "rollout/group_complete" and s.step == step)
            assert (first_fb < last_group) == overlaps, (mode, step, first_fb - last_group)
        metrics = read_metrics(run_dir)
        for m in metrics:
            assert 0.0 <= m["perf/trainer_wait_ratio"] <= 1.0
            assert m["perf/rollout_to_train_end_s"] >= m["perf/rollout_s"] > 0
