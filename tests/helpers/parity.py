"""What the parity tests share: overrides that make any order give the same bits, and per-step weight digests."""

from __future__ import annotations

from pathlib import Path

import torch

from rolloutpipe.control.weights.digest import file_weights_digest, short
from rolloutpipe.observe.metrics import read_spans
from rolloutpipe.types import sample_id
from tests.conftest import read_metrics, read_samples

EXACT = ["trainer.exact_accumulation=true", "rollout.batch_invariant=true"]
"""The same bits in any order: the trainer sums gradients as integers (trainer/exact_sum.py) and the engine's rows do
not depend on their batch-mates (rollout/engines/row_attention.py)."""


def weights_digests(run_dir) -> list[str]:
    """Each step's train/weights_digest: a new one every step, the last one the final checkpoint's (its file is written
    by save_pretrained, apart from weight sync, in another header order)."""
    digests = [m["train/weights_digest"] for m in read_metrics(run_dir)]
    assert digests[-1] == short(file_weights_digest(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert len(set(digests)) == len(digests), digests
    return digests


def assert_digests_tell_identical_from_different(runs: dict, final: dict) -> None:
    """Two runs' digests agree at the last step exactly when their final weights are bit-identical, and then at every
    step (a digest names the bits, whatever made them: mode, rank split, weight-sync way)."""
    (a, b), (wa, wb) = runs.values(), final.values()
    identical = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    da, db = weights_digests(a), weights_digests(b)
    assert (da[-1] == db[-1]) == identical, (identical, da, db)
    if identical:
        assert da == db


def publish_order(run_dir) -> list[tuple[int, int]]:
    """(step, group) of each group the run's dispatcher published, in the order it published them."""
    return [(s.step, s.attrs["group"]) for s in sorted(read_spans(run_dir), key=lambda s: s.start_s)
            if s.name == "dispatch/publish"]


def hold_first_group(sync_run: Path, directory: Path, group_size: int = 4) -> tuple[tuple[int, int], dict[str, str]]:
    """The group ``sync_run`` published first, and the variables under which another run's rewards
    (tests/fixtures/dense_rewards.py ``letter_fraction_jittered``, on the reversal task) hold that group until another
    group of ``group_size`` samples is scored: that run then publishes in another order by construction, where seeded
    reward delays alone leave it to the machine's load (in CI a sync and a cgp run once published in the same order).
    ``directory``: made here, for that run's reward workers; give the run a reward.timeout_s that outlasts the wait."""
    first = publish_order(sync_run)[0]
    prompt = next(s["prompt"] for s in read_samples(sync_run) if s["id"] == sample_id(*first, 0))
    assert prompt.endswith("="), prompt  # (the reversal task: "abd=" is labelled "dba")
    directory.mkdir()
    return first, {"RP_TEST_REWARD_HOLD": str(directory), "RP_TEST_REWARD_HOLD_LABEL": prompt[:-1][::-1],
                   "RP_TEST_REWARD_HOLD_AFTER": str(group_size)}
