"""Speculative next-step rollout (rollout.speculative): the same samples and the same weights as without it."""

from __future__ import annotations

import hashlib

from tests.conftest import read_metrics, read_samples, run_job

RUN = ["num_rollout=5", "model.dtype=float64", "run.save_samples=true", "trainer.exact_accumulation=true",
       "pipeline.mode=cgp", "rollout.admission=fgd", "rollout.filter_zero_variance=true",
       "rollout.over_sampling_groups=2"]
"""The default run in float64, with FGD and dynamic sampling (drafts of over-sampled groups too); exact accumulation
so that the groups' other arrival order cannot change the weights' bits (trainer/exact_sum.py)."""


def test_speculative_rollout_makes_exactly_the_samples_and_weights_of_the_run_without_it(job_dir):
    runs = {}
    for speculative in ("false", "true"):
        runs[speculative] = job_dir(f"speculative-{speculative}")
        result = run_job(runs[speculative], *RUN, f"rollout.speculative={speculative}")
        assert result.returncode == 0, result.stderr[-3000:]
    # every sample: its tokens, log-probs, reward, batch and policy version
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
