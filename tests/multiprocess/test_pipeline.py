"""The whole job as real processes: rollout and trainer node groups talking through a real TCPStore."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rolloutpipe.model import DType, ModelConfig, build_tiny_tokenizer, load_model
from rolloutpipe.observe.metrics import read_spans
from rolloutpipe.trainer.config import TrainerConfig
from tests.conftest import DENSE_REWARD, SMALL, needs_extra, read_metrics, read_samples, run_job
from tests.helpers.parity import (
    EXACT,
    assert_digests_tell_identical_from_different,
    hold_first_group,
    publish_order,
    weights_digests,
)

pytestmark = pytest.mark.multiprocess

# Sync and cgp train the same samples in the same batches with the same normaliser; only the order of
# floating-point accumulation differs (micro-batch composition, rank split, all-reduce). How far that may move
# the results depends on the dtype.
# float64: ~1e-16 relative per operation. The per-step loss and gradient norm (before the optimizer, clipping
# off) then agree to ~1e-13, while a real difference in the update (another sample, another normaliser, stale
# log-probs) moves them by far more than 1e-9; so do the weights after Adam (~lr = 1e-3 for a real difference).
# float32 and bfloat16: see low_precision_bounds.
PARITY = [*SMALL, "reward.name=letter_fraction_jittered", "reward.import_modules=[tests.fixtures.dense_rewards]",
          "micro_batch_size=3", "run.save_samples=true", "rollout.concurrency=6", "rollout.num_engines=2",
          "reward.num_workers=8", "trainer.max_grad_norm=1e9", "rollout_max_response_len=12"]
"""Two engines, eight reward workers and seeded reward delays: each mode's groups complete in another order;
responses of up to 12 tokens, so some end early and micro-batches differ in their token counts."""
CGP_JITTER = "5"
"""The cgp runs' delays: step 0's groups 0-3 wait 0.50, 0.32, 0.26 and 0.13 s, so group 1's rewards end before
group 0's whatever the engines do (FIFO puts groups 0 and 2 on one engine, 1 and 3 on the other, and the first
two groups' samples take the eight reward workers first), and cgp publishes out of group order. (With "2", 0.25,
0.31, 0.21, 0.41 s, the reward workers' queue put the groups back in order once FIFO kept each group on one engine.)
On a loaded machine generation can outlast these gaps: run_sync_then_cgp makes the orders differ by construction."""
CLIPPED = 1e-3
"""A trainer.max_grad_norm every step's gradient exceeds."""

ONE_STEP = ["num_rollout=1"]
"""bfloat16 on the float path compares one RL step of one optimizer step (16 samples, 6 micro-batches on one rank). The
step's sync and cgp weights differ by roundings (bfloat16: a sign flip or an ulp in ~0.2% of them), and step 1's engines
sample other tokens from other weights (measured in bfloat16): only policy 0's samples are common to both modes."""
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8}


def low_precision_bounds(dtype: str, *, longest_row: int, lr: float) -> dict[str, float]:
    """What the order of accumulation can change in one float32/bfloat16 optimizer step from common weights.

    u: unit roundoff of the parameter and gradient dtype (2^-24, 2^-8); log-probs and the loss are float32 in both
    (u32 = 2^-24). K = 6 micro-batches of 3 (1 rank; 2 ranks have 3 each), rows of at most ``longest_row`` tokens.
    - loss: the old log-probs are the current ones detached, so every ratio is exp(0) = 1 exactly and the loss is
      -sum_i A_i len_i / N (seq_mean: -sum_i A_i / M) whatever the weights. A micro-batch sums n = 3 x longest_row
      float32 terms (fewer for seq_mean), each |A| <= 1.5 (groups of 4, std-normalised: (4 - 1) / sqrt(4)); the
      micro-batch sums add in float64. Worst-case recursive summation, both orders: |difference| <= 2 n u32 1.5.
    - grad_norm: an element's gradient sums the batch's n_tok <= 16 x longest_row token positions (float32 inside
      the kernels: n_tok u32) as K micro-batch gradients, each rounded to the gradient dtype once when computed and
      once when added to p.grad (2K u): relative difference <= 2K u + n_tok u32, if the micro-batch gradients do
      not cancel much (bfloat16 5e-2, float32 2e-5). The norm averages the elements' independent errors, so it
      moves far less (measured 3e-4 and 0).
    - weights: AdamW's first step is lr g / (|g| + eps) per element (bias-corrected, no weight decay), below lr
      whatever the gradient's scale. Two orders disagree by < 2 lr where the rounding noise flips g's sign (|g|
      under the noise) and by < lr dg / (4|g|) elsewhere; bfloat16 stores the float32 masters rounded, one ulp
      (<= 2^-7 |w|) more: elementwise |dw| < 2 lr + 2^-7 |w| (float32: 2 lr). In aggregate: with |g| / (its noise
      scale) spread evenly near 0, a fraction f <= 2K u of the elements flips, so ||dw_sync - dw_cgp|| <= 2 sqrt(f)
      ||dw_sync||, times 1.25 in bfloat16 for the rounding of flipped weights (ulp <= 5e-4 next to a 2 lr flip:
      |w| < 0.1, except the norm weights, which lr does not move in bfloat16): 0.54 and 1.7e-3 (measured 0.06 and
      1e-4); a step more or less makes it ~1. A per-micro-batch normaliser moves the loss by ~50% in both dtypes;
      in float32 also the gradient norm (10%) and that ratio (0.5); in bfloat16 the gradient norm by 0.8% (bound
      5%) and that ratio to 0.57 (bound 0.54): there the loss, exact in structure, is the check that tells.
    """
    u, u32, num_micro_batches = UNIT_ROUNDOFF[dtype], 2.0**-24, 6
    rounding = 1.25 if dtype == "bfloat16" else 1.0
    return {
        "loss_abs": 2 * (3 * longest_row) * u32 * 1.5,
        "grad_norm_rel": 2 * num_micro_batches * u + 16 * longest_row * u32,
        "weight_abs": 2 * lr,
        "weight_ulp": 2.0**-7 if dtype == "bfloat16" else 0.0,
        "update_rel": 2 * math.sqrt(2 * num_micro_batches * u) * rounding,
    }


def final_weights(run_dir):
    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


def run_sync_then_cgp(runs: dict[str, Path], common: list[str], per_mode: dict[str, list[str]], *,
                      hold: bool = True) -> None:
    """The sync run, then the cgp run with ``common`` and each its ``per_mode`` overrides, and (``hold``) the groups
    published in other orders by construction: in the cgp run, the rewards of the group that sync published first hold
    it until another group is scored (tests/helpers/parity.py ``hold_first_group``), so it is not first. No ``hold``
    for another reward (MULTI_STEP_FILTERED's), whose runs check filtering instead of the order."""
    result = run_job(runs["sync"], *common, "pipeline.mode=sync", *per_mode.get("sync", []),
                     environ={"RP_TEST_REWARD_JITTER": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    environ = {"RP_TEST_REWARD_JITTER": CGP_JITTER}
    if hold:
        first, held = hold_first_group(runs["sync"], runs["cgp"].parent / f"{runs['cgp'].name}-held")
        environ |= held
    result = run_job(runs["cgp"], *common, "pipeline.mode=cgp", "reward.timeout_s=60", *per_mode.get("cgp", []),
                     environ=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not hold or publish_order(runs["cgp"])[0] != first, "the held group must not be published first"


# Two optimizer steps per rollout (batches of 2 groups), with dynamic sampling dropping about a quarter of
# the groups (reward constant for labels starting with 'a') and replacing them; FGD admission.
MULTI_STEP_FILTERED = ["global_batch_size=8", "reward.name=sometimes_flat", "rollout.filter_zero_variance=true",
                       "rollout.over_sampling_groups=1", "rollout.admission=fgd"]


# Responses of up to 32 tokens (rows of 5 to 36), and cgp packs them by a budget of 80 padded tokens (1 to 3 rows a
# micro-batch, first fit, each rank on its own groups) where sync cuts 3 samples a micro-batch.
TOKEN_BUDGET = 80
LONG_RESPONSES = ["rollout_max_response_len=32"]


# The loss variants of grpo.py ride on the float64 cases (each also varies the split, the order or the rank count);
# float64-1-rank stays plain GRPO.
GSPO = ["grpo.policy_loss=gspo"]
TIS_AND_KL = ["grpo.rollout_correction=token_tis", "grpo.kl_loss_coef=0.1", "grpo.kl_loss_type=low_var_kl"]
"""Two optimizer steps per rollout: the second batch's policy is not the reference, so the KL term moves it."""
CISPO_MIS_ENTROPY = ["grpo.policy_loss=cispo", "grpo.rollout_correction=token_mis", "grpo.tis_clip=1.5",
                     "grpo.tis_clip_low=0.5", "grpo.entropy_coef=0.01"]
"""MIS's normaliser (the loss tokens) is the batch-level term: taken per micro-batch, the token budget's other
micro-batches would move the update."""
EVAL_IN_THE_TAIL = {"sync": ["eval.interval=0"], "cgp": ["eval.interval=1"]}
"""Sync without evaluation against cgp evaluating the held-out split in the tail of every step: eval requests take
the engines' free slots and run beside training requests, so if they changed anything trained (a sample, a batch,
a reward, the loss) the two runs would differ."""


@pytest.mark.parametrize("dtype,num_ranks,extra,mode_extra", [
    ("float64", 1, [], EVAL_IN_THE_TAIL),
    ("float64", 2, ["grpo.loss_agg=seq_mean_token_mean", *GSPO], {}),
    ("float64", 1, [*MULTI_STEP_FILTERED, *TIS_AND_KL], {}),
    ("float64", 2, [*LONG_RESPONSES, *CISPO_MIS_ENTROPY], {"cgp": [f"max_tokens_per_micro_batch={TOKEN_BUDGET}"]}),
    ("bfloat16", 2, [*ONE_STEP, "grpo.loss_agg=seq_mean_token_mean"], {}),
], ids=["float64-1-rank-eval-in-the-tail", "float64-2-ranks-seq-mean-gspo",
        "float64-2-optimizer-steps-per-rollout-filtered-tis-kl",
        "float64-2-ranks-token-budget-micro-batches-cispo-mis-entropy", "bfloat16-2-ranks-seq-mean"])
def test_pipelined_update_equals_synchronous_update(job_dir, dtype, num_ranks, extra, mode_extra):
    """``mode_extra`` applies to one mode's run only (sync keeps micro_batch_size micro-batches)."""
    cgp_extra = mode_extra.get("cgp", [])
    filtered = set(MULTI_STEP_FILTERED) <= set(extra)
    runs = {mode: job_dir(f"{mode}-{num_ranks}") for mode in ("sync", "cgp")}
    run_sync_then_cgp(runs, [*PARITY, f"model.dtype={dtype}", f"trainer.num_ranks={num_ranks}", *extra], mode_extra,
                      hold=not filtered)
    num_steps = 1 if dtype != "float64" else 2

    sync_samples, cgp_samples = read_samples(runs["sync"]), read_samples(runs["cgp"])
    assert len(sync_samples) == num_steps * 4 * 4
    assert [(s["id"], s["batch"], s["response_ids"], s["reward"]) for s in sync_samples] == [
        (s["id"], s["batch"], s["response_ids"], s["reward"]) for s in cgp_samples
    ], "same seed must give the same samples in the same batches in both modes"
    if filtered:  # (FGD and filtering fix much of the order)
        metrics = read_metrics(runs["cgp"])
        assert sum(m["rollout/num_filtered_groups"] for m in metrics) > 0, "the workload must exercise filtering"
        assert {s["batch"] for s in cgp_samples} == {0, 1}
    else:
        assert publish_order(runs["sync"]) != publish_order(runs["cgp"]), "the groups must arrive in other orders"
    if f"max_tokens_per_micro_batch={TOKEN_BUDGET}" in cgp_extra:
        packed = [(s.attrs["num_samples"], s.attrs["num_padded_tokens"]) for s in read_spans(runs["cgp"])
                  if s.name == "train/forward_backward"]
        assert all(padded <= TOKEN_BUDGET or rows == 1 for rows, padded in packed), packed
        assert {rows for rows, _ in packed} - {3}, "the budget must compose other micro-batches than sync's"
        assert all(0 < m["perf/padding_ratio"] < 1 for m in read_metrics(runs["cgp"]))

    sync_m, cgp_m = read_metrics(runs["sync"]), read_metrics(runs["cgp"])
    assert [m["train/num_tokens"] for m in sync_m] == [m["train/num_tokens"] for m in cgp_m]  # every dtype
    sync_w, cgp_w = final_weights(runs["sync"]), final_weights(runs["cgp"])
    assert_digests_tell_identical_from_different(runs, {"sync": sync_w, "cgp": cgp_w})
    init = load_model(ModelConfig(dtype=DType(dtype)), len(build_tiny_tokenizer())).state_dict()
    if dtype == "float64":
        keys = ["train/loss", "train/grad_norm", "train/entropy"]
        # (with dynamic sampling, the rollout's statistics count every completed group, filtered ones too, and which
        # over-sampled groups complete before the step ends is a matter of timing)
        if not filtered:
            keys.append("rollout/reward_mean")
        if TIS_AND_KL[0] in extra or CISPO_MIS_ENTROPY[1] in extra:  # the engine/trainer gap and TIS statistics
            keys += ["train/tis_mean", "train/tis_max", "train/tis_clipfrac", "train/engine_trainer_logprob_gap"]
            assert all(abs(m["train/tis_mean"] - 1) < 1e-9 and m["train/engine_trainer_logprob_gap"] < 1e-9
                       for m in cgp_m), "float64 engine and trainer log-probs agree"
        if TIS_AND_KL[1] in extra:
            keys.append("train/kl")
            assert max(m["train/kl"] for m in cgp_m) > 0, "the KL term must be exercised"
        for key in keys:
            assert [m[key] for m in cgp_m] == pytest.approx([m[key] for m in sync_m], rel=1e-9, abs=1e-12), key
        assert all(m["train/entropy"] > 0 for m in cgp_m)
        difference = max((sync_w[k] - cgp_w[k]).abs().max().item() for k in sync_w)
        assert difference < 1e-9, f"sync and cgp parameters differ by {difference}"
    else:
        bound = low_precision_bounds(dtype, lr=TrainerConfig().lr, longest_row=max(
            len(s["prompt"]) + len(s["response_ids"]) for s in sync_samples))  # (one token a character)
        for step, (s, c) in enumerate(zip(sync_m, cgp_m)):
            loss_difference = abs(s["train/loss"] - c["train/loss"])
            assert loss_difference <= bound["loss_abs"], (
                f"step {step}: train/loss {s['train/loss']} (sync), {c['train/loss']} (cgp): {loss_difference:.3g} "
                f"apart, more than {bound['loss_abs']:.3g}")
            norm_difference = abs(s["train/grad_norm"] - c["train/grad_norm"]) / s["train/grad_norm"]
            assert norm_difference <= bound["grad_norm_rel"], (
                f"step {step}: train/grad_norm {s['train/grad_norm']} (sync), {c['train/grad_norm']} (cgp): "
                f"{norm_difference:.3g} relative, more than {bound['grad_norm_rel']:.3g}")
        sync_w, cgp_w, init = ({k: v.double() for k, v in w.items()} for w in (sync_w, cgp_w, init))
        for k in sync_w:  # elementwise: < 2 lr where the sign flipped, plus bfloat16's rounding
            excess = (sync_w[k] - cgp_w[k]).abs() - bound["weight_abs"] \
                - bound["weight_ulp"] * torch.maximum(sync_w[k].abs(), cgp_w[k].abs())
            assert excess.max() < 0, f"{k}: sync and cgp differ by {excess.max().item()} more than the bound"
        update_difference = math.sqrt(sum((sync_w[k] - cgp_w[k]).square().sum().item() for k in sync_w))
        update = math.sqrt(sum((sync_w[k] - init[k]).square().sum().item() for k in sync_w))
        assert update_difference <= bound["update_rel"] * update, (
            f"||w_sync - w_cgp|| is {update_difference / update:.3g} of the update ||w_sync - w_0||, more than "
            f"{bound['update_rel']:.3g}")
    moved = max((sync_w[k] - init[k]).abs().max().item() for k in sync_w)
    assert moved > 1e-5, "training must have changed the weights"
    assert [m["step"] for m in cgp_m] == list(range(num_steps))
    if not filtered:
        assert [m["rollout/num_samples"] for m in cgp_m] == [m["rollout/num_samples"] for m in sync_m]
    if mode_extra is EVAL_IN_THE_TAIL:
        assert not any(k.startswith("eval/") for m in sync_m for k in m)
        assert [m["eval/reversal_heldout/policy_version"] for m in cgp_m] == [0, 1]
        assert all(m["eval/reversal_heldout/num_samples"] > 0 for m in cgp_m)


@pytest.mark.parametrize("dtype,extra", [
    ("float32", [*MULTI_STEP_FILTERED, *TIS_AND_KL, *LONG_RESPONSES, f"max_tokens_per_micro_batch={TOKEN_BUDGET}"]),
    ("bfloat16", ["rollout.admission=fgd"]),
    ("float32", ["rollout.admission=fgd", "trainer.backend=fsdp", f"trainer.max_grad_norm={CLIPPED}"]),
    pytest.param("float32", ["rollout.admission=fgd", "trainer.backend=megatron", f"trainer.max_grad_norm={CLIPPED}"],
                 marks=needs_extra("megatron", "megatron.core")),
], ids=["float32-2-optimizer-steps-per-rollout-filtered-tis-kl-token-budget", "bfloat16", "fsdp-clipped",
        "megatron-clipped"])
def test_exact_accumulation_makes_sync_and_cgp_with_fgd_on_two_ranks_the_same_bits(job_dir, dtype, extra):
    """Where the float path is only within derived bounds of sync (test_pipelined_update_equals_synchronous_update),
    exact accumulation makes every step's weights the same bits: sync on one rank, cgp with FGD on two ranks, the
    groups arriving in other orders and split over the ranks. FSDP: the ranks reduce-scatter integers, and every
    step clips (its norm from whole gradients: shards would sum it differently on one rank and on two). FSDP in
    float32 only: at this size bfloat16 gradients add up exactly in FSDP's float32 shards, so the float path would
    pass too (tests/unit/test_exact_sum.py runs FSDP's exact path in bfloat16). Megatron: data parallel over the two
    ranks, the sums put back into DDP's buffers on data-parallel rank 0; float32 (bfloat16 needs CUDA there)."""
    filtered = set(MULTI_STEP_FILTERED) <= set(extra)
    runs = {mode: job_dir(mode) for mode in ("sync", "cgp")}
    run_sync_then_cgp(runs, [*PARITY, *EXACT, f"model.dtype={dtype}", *extra],
                      {"sync": ["trainer.num_ranks=1"], "cgp": ["trainer.num_ranks=2"]}, hold=not filtered)
    assert [(s["id"], s["batch"], s["response_ids"]) for s in read_samples(runs["sync"])] == [
        (s["id"], s["batch"], s["response_ids"]) for s in read_samples(runs["cgp"])]
    if filtered:  # (FGD and filtering fix much of the order; the ranks still split it)
        assert sum(m["rollout/num_filtered_groups"] for m in read_metrics(runs["cgp"])) > 0
    else:
        assert publish_order(runs["sync"]) != publish_order(runs["cgp"]), "the groups must arrive in other orders"
    if f"trainer.max_grad_norm={CLIPPED}" in extra:
        assert all(m["train/grad_norm"] > CLIPPED for m in read_metrics(runs["cgp"])), "every step must clip"
    digests = {mode: weights_digests(run_dir) for mode, run_dir in runs.items()}
    assert len(digests["sync"]) == 2 and digests["sync"] == digests["cgp"], digests
    files = {mode: hashlib.sha256((run_dir / "checkpoints" / "final" / "model.safetensors").read_bytes()).hexdigest()
             for mode, run_dir in runs.items()}
    assert files["sync"] == files["cgp"]


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
                         "trainer.lr=0.1", f"trainer.num_ranks={num_ranks}")
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
