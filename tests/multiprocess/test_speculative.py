"""Speculative next-step rollout (rollout.speculative): the same samples and the same weights as without it."""

from __future__ import annotations

import hashlib

import pytest

from tests.conftest import read_metrics, read_samples, run_job
from tests.helpers.parity import EXACT, weights_digests

QUIET = ["wandb.mode=disabled", "run.draw_timeline=false"]
"""No W&B run and no timeline.png: neither changes what a run trains, and each costs a small run a second or two."""
RUN = ["num_rollout=5", "model.dtype=float64", "run.save_samples=true", "trainer.exact_accumulation=true",
       "pipeline.mode=cgp", "rollout.admission=fgd", "rollout.filter_zero_variance=true",
       "rollout.over_sampling_groups=2", *QUIET]
"""The default run in float64, with FGD and dynamic sampling (drafts of over-sampled groups too); exact accumulation
so that the groups' other arrival order cannot change the weights' bits (trainer/exact_sum.py)."""


def test_speculative_rollout_makes_exactly_the_samples_and_weights_of_the_run_without_it(job_dir):
    runs = {}
    for speculative in ("false", "true"):
        runs[speculative] = job_dir(f"speculative-{speculative}")
        result = run_job(runs[speculative], *RUN, f"rollout.speculative={speculative}")
        assert result.returncode == 0, result.stderr[-3000:]
    # every sample: its tokens, reward, advantage and batch (the weights below hold the rest)
    assert read_samples(runs["true"]) == read_samples(runs["false"])
    files = {k: hashlib.sha256((d / "checkpoints" / "final" / "model.safetensors").read_bytes()).hexdigest()
             for k, d in runs.items()}
    assert files["true"] == files["false"]
    metrics = read_metrics(runs["true"])
    drafted = [m["rollout/num_draft_tokens"] for m in metrics]
    assert drafted[0] == 0 and all(n > 0 for n in drafted[1:]), drafted  # step 0 has no tail before it
    kept = [m["rollout/draft_kept_ratio"] for m in metrics[1:]]
    assert all(0 < r < 1 for r in kept), kept  # drafts were kept, and some rejected: verification ran both ways
    assert all(m["rollout/num_draft_tokens"] == 0 for m in read_metrics(runs["false"]))


@pytest.mark.parametrize("setting", [
    ["model.dtype=float32", "grpo.rollout_correction=token_tis"],
    ["model.dtype=bfloat16", "rollout_top_p=0.9", "trainer.old_logprobs=engine"],
], ids=["float32-token_tis", "bfloat16-top_p-engine_logprobs"])  # (bfloat16 at top_p 1 also passed with the
# verify this test guards against: no near-tie in its 10 steps)
def test_cgp_fgd_with_speculation_trains_the_bits_of_sync_in_float32_and_bfloat16(job_dir, setting):
    """10 steps of sync against cgp+fgd with speculation, batch invariant with exact accumulation (the same bits in any
    order): the same samples (tokens, rewards, advantages) and the same weights at every step, which the engine's
    log-probs enter through TIS and old_logprobs=engine. A draft's positions attend as decode steps
    (engines/verify.py); with one causal attention over prompt + draft instead, float32 with TIS trains other weights
    (other engine log-probs) and bfloat16 at top_p 0.9 samples other tokens."""
    common = ["num_rollout=10", "run.save_samples=true", *EXACT, *setting, *QUIET]
    runs = {"sync": job_dir("sync"), "spec": job_dir("spec")}
    for name, mode in (("sync", ["pipeline.mode=sync"]),
                       ("spec", ["pipeline.mode=cgp", "rollout.admission=fgd", "rollout.speculative=true"])):
        result = run_job(runs[name], *common, *mode)
        assert result.returncode == 0, result.stderr[-3000:]
    assert read_samples(runs["spec"]) == read_samples(runs["sync"])
    assert weights_digests(runs["spec"]) == weights_digests(runs["sync"])
    kept = [m["rollout/draft_kept_ratio"] for m in read_metrics(runs["spec"])[1:]]
    assert all(r > 0 for r in kept), kept  # drafts were verified and kept
